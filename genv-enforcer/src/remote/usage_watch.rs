//! `genv-enforcer usage watch`: genv's usage snapshot, as one line of JSON, at start and
//! again whenever it changes: what a remote enforcer streams over SSH instead of asking
//! every `--interval`.
//!
//! Driven by the same machinery as the event-driven daemon where it can load: a write
//! to genv's state files (inotify), a GPU open reported by the kernel programs (looked
//! at again as the process makes its context), the exit of a process the last snapshot
//! listed. A poll every `--poll-interval` catches what no event announces (memory
//! growth), and is all there is where the programs cannot load. It acts on nothing.
//!
//! It ends when stdout is closed, on SIGINT or SIGTERM, and, when its stdin is a pipe or
//! socket (as under ssh), when that reaches its end: a stream whose reader went away
//! does not stay behind on the host.

use std::collections::HashSet;
use std::io::Write;
use std::os::fd::AsFd;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use tokio::sync::oneshot;
use tokio::time::{Instant, sleep_until};

use crate::cycle::LockPolicy;
use crate::daemon::state_watch::StateWatch;
use crate::intake::KernelEvent;
use crate::kernel::TierChoice;
use crate::kernel::policy_maps::PolicyMaps;
use crate::service::StopSignals;
use crate::snapshot::{Snapshot, SnapshotBuilder};
use pacer::Pacer;
use watch_programs::{WatchPrograms, load_programs, next_events};

mod pacer;
mod watch_programs;

/// After a GPU open, when to look again: the process makes its compute context (and
/// appears in NVML's list) some time after it opens the device.
const AFTER_OPEN: [Duration; 4] = [
    Duration::from_millis(50),
    Duration::from_millis(200),
    Duration::from_secs(1),
    Duration::from_secs(3),
];
/// After the exit of a listed process, when to look again: the event comes as the
/// process begins to exit, and NVML lists its context until its descriptors are
/// closed, later in that exit (the snapshot the event itself calls for can be early).
const AFTER_EXIT: [Duration; 2] = [Duration::from_millis(100), Duration::from_secs(1)];

/// The shortest poll: `--poll-interval` takes any positive number of seconds, and a
/// poll due at once, again and again, would spin.
const MIN_POLL: Duration = Duration::from_millis(10);

pub struct WatchSettings {
    pub poll: Duration,
    /// `--heartbeat`: a `{}` line after this long without one.
    pub heartbeat: Option<Duration>,
    pub tier: TierChoice,
}

/// The heartbeat line: an empty JSON object, which no snapshot is (one always has its
/// `processes`, `envs` and `devices`).
pub const HEARTBEAT_LINE: &str = "{}";

pub async fn run(mut builder: SnapshotBuilder, settings: WatchSettings) -> Result<ExitCode> {
    let mut stop = StopSignals::install()?;
    let mut hangup = stdin_hangup();
    let mut kernel = load_programs(settings.tier);
    let mut state_watch = watch_state(&builder);
    let mut watcher = Watcher::new();
    let mut rechecks: Vec<Instant> = Vec::new();
    let mut pacer = Pacer::default();
    pacer.look(Instant::now().into_std());
    let mut next_poll = Instant::now();
    loop {
        let now = Instant::now();
        if pacer.take(now.into_std()) {
            if !watcher.emit(&mut builder, kernel.as_mut().map(|w| &mut w.policy)) {
                return Ok(ExitCode::SUCCESS);
            }
            next_poll = Instant::now() + settings.poll.max(MIN_POLL);
        }
        rechecks.retain(|at| *at > now);
        let recheck = rechecks.iter().min().copied();
        let wake = pacer.wake_at().map(Instant::from_std);
        // Only once a snapshot is out: a reader that has none knows nothing yet.
        let beat = settings
            .heartbeat
            .zip(watcher.printed_at)
            .map(|(b, at)| at + b);
        let mut events = Vec::new();
        tokio::select! {
            _ = stop.recv() => return Ok(ExitCode::SUCCESS),
            _ = sleep_until(beat.unwrap_or(now)), if beat.is_some() => {
                if !watcher.beat() {
                    return Ok(ExitCode::SUCCESS);
                }
            }
            _ = &mut hangup => return Ok(ExitCode::SUCCESS),
            _ = sleep_until(wake.unwrap_or(now)), if wake.is_some() => {}
            _ = sleep_until(next_poll) => {
                pacer.look(Instant::now().into_std());
                // The look itself waits for the looks' bucket, should it be empty.
                next_poll = Instant::now() + settings.poll.max(MIN_POLL);
            }
            _ = sleep_until(recheck.unwrap_or(now)), if recheck.is_some() => {
                pacer.look(Instant::now().into_std());
            }
            changed = watch_changed(&mut state_watch) => {
                if changed {
                    pacer.changed(Instant::now().into_std());
                }
            }
            _ = next_events(&mut kernel, &mut events) => {}
        }
        if let Some(WatchPrograms { intake, .. }) = &mut kernel {
            intake.drain_now(&mut events, &mut Vec::new());
        }
        if recheck_after(watcher.relevant(&events), &mut rechecks) {
            pacer.look(Instant::now().into_std());
        }
    }
}

/// genv's state directory watched, or polled where it cannot be.
fn watch_state(builder: &SnapshotBuilder) -> Option<StateWatch> {
    match StateWatch::new(builder.state()) {
        Ok(watch) => Some(watch),
        Err(e) => {
            tracing::warn!("Cannot watch genv's state directory ({e}); polling it");
            None
        }
    }
}

/// After a GPU open or an exit among the events, the looks that follow them; whether
/// one is due now.
fn recheck_after((opened, exited): (bool, bool), rechecks: &mut Vec<Instant>) -> bool {
    if opened {
        // The latest open's schedule replaces an earlier one's: bounded however many
        // opens come.
        let now = Instant::now();
        rechecks.retain(|at| *at <= now + AFTER_OPEN[0]);
        rechecks.extend(AFTER_OPEN.iter().map(|d| now + *d));
    }
    if exited {
        recheck_after_exit(rechecks, Instant::now());
    }
    opened || exited
}

/// Adds [`AFTER_EXIT`]'s looks, each unless one is due within the first of them after
/// it (then up to twice that late): however many exits come, at most one look per that
/// span is added.
fn recheck_after_exit(rechecks: &mut Vec<Instant>, now: Instant) {
    let span = AFTER_EXIT[0];
    for after in AFTER_EXIT {
        let at = now + after;
        if !rechecks.iter().any(|r| *r >= at && *r <= at + span) {
            rechecks.push(at + span);
        }
    }
}

#[derive(Default)]
struct Watcher {
    last: String,
    /// The last snapshot's warnings: each is said when it first appears, not at every
    /// snapshot (a stream's reader reprints them all).
    warned: HashSet<String>,
    /// The processes the last snapshot listed, and the environments' shells.
    known: HashSet<u32>,
    /// When a line was last printed (none before the first snapshot).
    printed_at: Option<Instant>,
    /// How a snapshot takes genv's lock.
    lock: LockPolicy,
}

impl Watcher {
    fn new() -> Self {
        Self {
            // The daemons' policy: a user holding genv's lock (or putting a FIFO there)
            // delays a snapshot by 100 ms once, then not at all until it is free.
            lock: LockPolicy::bounded(LockPolicy::DAEMON_WAIT),
            ..Self::default()
        }
    }

    /// Takes a snapshot and prints it if it changed; `false` once stdout is closed.
    fn emit(&mut self, builder: &mut SnapshotBuilder, policy: Option<&mut PolicyMaps>) -> bool {
        // Any other error taking it (the state directory unreadable) is the snapshot's
        // to report: it reads without the lock, as before.
        builder.read_ahead(None);
        let lock = self.lock.take(builder.state()).ok().flatten();
        let (mut snapshot, mut warnings) = builder.take();
        drop(lock);
        warnings.extend(crate::snapshot::name_confirmed_owners(
            &mut snapshot,
            crate::backends::users::name_for_snapshot,
        ));
        let warnings: HashSet<String> = warnings.iter().map(ToString::to_string).collect();
        for warning in warnings.difference(&self.warned) {
            tracing::warn!("{}", warning.trim_start_matches("[WARNING] "));
        }
        self.warned = warnings;
        if let Some(policy) = policy {
            if let Err(e) = policy.watch_nodes(builder.device_map()) {
                tracing::warn!("Cannot update the watched GPU nodes: {e}");
            }
        }
        // State files unreadable this time (mid-write without the lock, or broken):
        // nothing is printed until they read again.
        let Some(text) = one_line(&snapshot) else {
            return true;
        };
        self.known = known_pids(&snapshot);
        if text == self.last {
            return true;
        }
        let written = self.print(&text);
        self.last = text;
        written
    }

    /// The heartbeat; `false` once stdout is closed.
    fn beat(&mut self) -> bool {
        self.print(HEARTBEAT_LINE)
    }

    fn print(&mut self, line: &str) -> bool {
        let mut out = std::io::stdout().lock();
        self.printed_at = Some(Instant::now());
        writeln!(out, "{line}").and_then(|()| out.flush()).is_ok()
    }

    /// Whether these events call for a look: a GPU open by another process, or the exit
    /// of one the last snapshot knew.
    fn relevant(&self, events: &[KernelEvent]) -> (bool, bool) {
        let own = std::process::id();
        let opened = events
            .iter()
            .any(|e| matches!(e, KernelEvent::Open(open) if open.pid != own));
        let exited = events
            .iter()
            .any(|e| matches!(e, KernelEvent::Exit { pid } if self.known.contains(pid)));
        (opened, exited)
    }
}

/// genv's snapshot document on one line (newline-delimited JSON); `None` when the
/// state could not be read.
fn one_line(snapshot: &Snapshot) -> Option<String> {
    serde_json::to_string(&snapshot.to_genv_value(None).ok()?).ok()
}

fn known_pids(snapshot: &Snapshot) -> HashSet<u32> {
    let shells = snapshot.envs.iter().flatten().flat_map(|e| e.pids.iter());
    snapshot
        .processes
        .iter()
        .map(|p| p.pid)
        .chain(shells.filter_map(|p| u32::try_from(*p).ok()))
        .collect()
}

async fn watch_changed(watch: &mut Option<StateWatch>) -> bool {
    match watch {
        Some(w) => match w.changed().await {
            Ok(changed) => changed,
            Err(e) => {
                tracing::warn!("Lost the watch on genv's state directory ({e}); polling it");
                *watch = None;
                false
            }
        },
        None => std::future::pending().await,
    }
}

/// Resolves when stdin, a pipe or socket, reaches its end. Read on a thread of its own
/// (not the runtime's blocking pool), which the process's exit does not wait for.
fn stdin_hangup() -> oneshot::Receiver<()> {
    let (tx, rx) = oneshot::channel();
    let watched = rustix::fs::fstat(std::io::stdin().as_fd()).is_ok_and(|st| {
        let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
        matches!(
            kind,
            rustix::fs::FileType::Fifo | rustix::fs::FileType::Socket
        )
    });
    if watched {
        std::thread::spawn(move || {
            let mut sink = [0u8; 4096];
            let mut stdin = std::io::stdin().lock();
            while matches!(std::io::Read::read(&mut stdin, &mut sink), Ok(n) if n > 0) {}
            let _ = tx.send(());
        });
    } else {
        // Never resolves: the sender lives for the whole run.
        std::mem::forget(tx);
    }
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exit is looked at again after it (NVML lists the context until the process's
    /// descriptors close), and a storm of exits adds a bounded number of looks.
    #[test]
    fn an_exit_is_looked_at_again_and_a_storm_of_them_stays_bounded() {
        let now = Instant::now();
        let mut rechecks = Vec::new();
        recheck_after_exit(&mut rechecks, now);
        let span = AFTER_EXIT[0];
        assert_eq!(
            rechecks,
            [now + AFTER_EXIT[0] + span, now + AFTER_EXIT[1] + span]
        );
        // A thousand exits within 10 ms of each other: no more looks than the span
        // they cover allows.
        for i in 0..1000 {
            recheck_after_exit(&mut rechecks, now + Duration::from_micros(10 * i));
        }
        assert!(rechecks.len() <= 4, "{}", rechecks.len());
    }
}
