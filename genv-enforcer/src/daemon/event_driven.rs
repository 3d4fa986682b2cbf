//! The event-driven daemon. Triggers, and what each runs:
//! - a GPU open reported by the kernel → the process is watched, and checked (non-env and
//!   env-devices rules, memory for its environment) at once and at growing intervals
//!   while its window lasts ([`super::watchlist`]);
//! - a write to `envs.json` or `devices.json` → a full cycle at once;
//! - every `--memory-interval` → the memory rule;
//! - every `--interval`, and whenever the kernel lost events → a full cycle;
//! - exec and exit events keep the process table current;
//! - with `--deny`, the kernel refuses or kills at the open itself; its decisions arrive
//!   as open events and are reported ([`crate::intake::decisions`]).
//!
//! What each kernel event does is in [`events`]; the checks it leads to in [`checks`].
//! The maps the programs decide from follow each full cycle through [`crate::sync`].

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;

mod checks;
mod events;
mod told;

use super::schedule::Schedule;
use super::settings::Settings;
use super::state_watch::{StateWatch, Target};
use super::watchlist::Watchlist;
use crate::cycle::Enforcer;
use crate::intake::decisions::LineLimiter;
use crate::intake::{BadRecord, EventIntake, KernelEvent};
use crate::kernel::inspector::KernelInspector;
use crate::service::instance::Instance;
use crate::service::metrics::{self, Metrics};
use crate::service::reload::reload;
use crate::service::signals::{Hangup, StopSignals, notify};
use crate::service::status::Status;
use crate::sync::KernelSide;
use crate::warn_once::WarnOnce;

/// How long a process terminated by a narrow check is left out of the next ones.
const SETTLE: Duration = Duration::from_secs(2);
/// How often the daemon wakes at least, to read lifecycle events (which do not wake it),
/// while they come; with none since the last look the period doubles up to
/// [`DRAIN_IDLE`]. Nothing waits on them: a GPU open wakes the daemon at once and the
/// events before it are read first, and a half-full ring buffer wakes it too.
const DRAIN_EVERY: Duration = Duration::from_millis(100);
/// The longest period between looks at the ring buffer, on an idle node.
const DRAIN_IDLE: Duration = Duration::from_secs(1);

pub async fn run(enforcer: Enforcer, settings: Settings) -> Result<ExitCode> {
    let mut stop = StopSignals::install()?;
    let mut hangup = Hangup::install()?;
    let instance = Instance::claim(&settings.run_dir)?;
    let _why = serve_why(&enforcer, &settings.run_dir);
    let (mut daemon, mut intake) = Daemon::start(enforcer, settings)?;
    instance.publish(&daemon.status);
    release_startup_memory();

    let settings = &daemon.settings;
    let mut schedule = Schedule::new(Instant::now(), settings.interval, settings.memory_interval);
    let mut batch = Batch::default();
    let mut ready = false;
    loop {
        daemon.run_due(&mut schedule, &instance);
        if !std::mem::replace(&mut ready, true) {
            notify("READY=1");
        }
        let wake = schedule.next_wake([
            daemon.watchlist.next_wake(),
            daemon.enforcer.executor.next_deadline(),
            intake.as_ref().map(|_| Instant::now() + daemon.drain_every),
            daemon.kernel.as_ref().and_then(KernelSide::next_look),
        ]);
        tokio::select! {
            biased;
            () = stop.recv() => break,
            () = hangup.recv() => daemon.reload(&mut schedule),
            // Before kernel events: a stream of GPU opens must not keep genv's own
            // state changes waiting (they are rare, and cheap to read).
            changed = state_changed(daemon.state_watch.as_mut()) => {
                daemon.on_state_change(changed, &mut schedule);
            }
            read = next_batch(intake.as_mut(), &mut batch) => {
                if let Err(e) = read {
                    tracing::warn!("Cannot read kernel events: {e}; running a full cycle");
                    schedule.full_now(Instant::now());
                }
            }
            () = tokio::time::sleep_until(wake.into()) => {}
        }
        if let Some(intake) = intake.as_mut() {
            daemon.take_in(intake, &mut batch, &mut schedule);
        }
    }

    shut_down(intake, daemon, instance);
    Ok(ExitCode::SUCCESS)
}

/// Programs and maps go with the kernel side and the intake (pinned ones stay, without
/// this daemon's exemption); the status file with the instance.
fn shut_down<I>(intake: Option<I>, mut daemon: Daemon, instance: Instance) {
    drop(intake);
    // What users were told last reaches their terminals and the log.
    if let Some(notifier) = daemon.enforcer.executor.notifier() {
        notifier.flush();
    }
    if let Some(kernel) = daemon.kernel.take() {
        kernel.release();
    }
    drop(daemon);
    drop(instance);
}

/// `genv-enforcer why`'s socket, in the run directory this daemon now holds alone.
fn serve_why(enforcer: &Enforcer, run_dir: &std::path::Path) -> Option<WhySocket> {
    let notifier = enforcer.executor.notifier()?;
    match notifier.serve_why(run_dir) {
        Ok(()) => Some(WhySocket(run_dir.join(crate::notify::server::SOCKET))),
        Err(e) => {
            tracing::warn!("genv-enforcer why will not be answered: {e:#}");
            None
        }
    }
}

/// The socket, removed when the daemon ends.
struct WhySocket(std::path::PathBuf);

impl Drop for WhySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Environments as the kernel read them at exec, not as /proc shows them now.
fn read_identities_from(kernel: &KernelSide, enforcer: &mut Enforcer) {
    match kernel.identity_reader() {
        Ok(reader) => enforcer
            .builder
            .set_inspector(Box::new(KernelInspector::new(reader))),
        Err(e) => tracing::warn!(
            "Cannot read the kernel's identities ({e}); environments are read from /proc, which setproctitle can overwrite"
        ),
    }
}

/// Loading parsed the kernel's BTF (tens of MB, dropped since); glibc keeps freed heap
/// mapped unless asked, and a daemon on every node should not carry it for its life
/// (41 MB resident idle without this, 7 MB with it).
fn release_startup_memory() {
    // SAFETY: malloc_trim only returns free memory to the kernel; it takes no pointer
    // and leaves every live allocation where it is.
    unsafe { libc::malloc_trim(0) };
}

/// Events read from the ring buffer and not yet handled.
#[derive(Default)]
struct Batch {
    events: Vec<KernelEvent>,
    unknown: Vec<BadRecord>,
}

struct Daemon {
    enforcer: Enforcer,
    settings: Settings,
    status: Status,
    /// `None`: no kernel programs (full cycle alone).
    kernel: Option<KernelSide>,
    /// inotify on genv's state directory; `None` until it can be set up.
    state_watch: Option<StateWatch>,
    /// Why the state directory could not be watched, as last warned.
    unwatched: WarnOnce<String>,
    watchlist: Watchlist,
    /// Processes a narrow check terminated, and when.
    settled: HashMap<u32, Instant>,
    /// An undecodable event was reported (once for the daemon's life).
    undecodable: WarnOnce,
    /// GPUs the kernel killed an opener of since the last sweep for other holders.
    to_sweep: HashSet<u32>,
    decision_lines: LineLimiter,
    /// The ring buffer's current look period ([`DRAIN_EVERY`] to [`DRAIN_IDLE`]).
    drain_every: Duration,
    /// Whether an environment had a memory cap at the last full cycle (or the state was
    /// unreadable).
    memory_capped: bool,
    /// `--metrics-addr`.
    metrics: Option<Arc<Metrics>>,
}

impl Daemon {
    /// The kernel side started (or none, as `--bpf-tier` allows), the snapshot reading
    /// identities from it, the metrics endpoint listening.
    fn start(mut enforcer: Enforcer, settings: Settings) -> Result<(Self, Option<EventIntake>)> {
        let mut status = Status {
            pid: std::process::id(),
            started: unix_now(),
            interval_s: settings.interval.as_secs_f64(),
            memory_interval_s: settings.memory_interval.as_secs_f64(),
            ..Status::default()
        };
        let metrics = settings.metrics_addr.map(metrics::serve).transpose()?;
        let started = KernelSide::start(&settings.kernel, settings.interval, &mut status)?;
        let (kernel, intake) = started.unzip();
        if let Some(kernel) = &kernel {
            read_identities_from(kernel, &mut enforcer);
        }
        let daemon = Self {
            enforcer,
            settings,
            status,
            kernel,
            state_watch: None,
            unwatched: WarnOnce::default(),
            watchlist: Watchlist::default(),
            settled: HashMap::new(),
            undecodable: WarnOnce::default(),
            to_sweep: HashSet::new(),
            decision_lines: LineLimiter::default(),
            drain_every: DRAIN_EVERY,
            memory_capped: true,
            metrics,
        };
        Ok((daemon, intake))
    }

    /// Runs whatever is due: the full cycle, the checks of newly opened GPUs, the
    /// memory poll, SIGKILL escalations, and the status file.
    fn run_due(&mut self, schedule: &mut Schedule, instance: &Instance) {
        if schedule.full_due(Instant::now()) {
            // Watch first: a state change during the cycle then triggers another one,
            // where watching after it would miss a change made while it ran.
            if self.state_watch.as_ref().is_none_or(StateWatch::is_lost) {
                self.state_watch = watch_state(&self.enforcer, &mut self.unwatched);
            }
            self.full_cycle();
            schedule.full_done(Instant::now());
        }
        if let Some(pids) = self.watchlist.due(Instant::now()) {
            self.opened_check(&pids);
        }
        if schedule.memory_due(Instant::now()) {
            self.memory_check();
            schedule.memory_done(Instant::now());
        }
        self.enforcer.executor.escalate(Instant::now());
        if schedule.status_due(Instant::now()) {
            self.publish(schedule, instance);
            schedule.status_done(Instant::now());
        }
    }

    /// The status file and the metrics brought up to date; a resynchronisation due at
    /// once where the kernel could not record identities since the last.
    fn publish(&mut self, schedule: &mut Schedule, instance: &Instance) {
        self.status.updated = unix_now();
        if let Some(kernel) = &self.kernel {
            kernel.report(&mut self.status);
            if kernel.identities_lost(&self.status) {
                schedule.full_now(Instant::now());
            }
        }
        // Looked for in /proc/self/maps until it loads; a loaded NVML stays.
        if self.status.nvml.is_none() {
            self.status.nvml =
                crate::backends::nvml::loaded_library().map(|p| p.display().to_string());
        }
        self.status.watching = self
            .state_watch
            .as_ref()
            .and_then(StateWatch::target)
            .map(|t| t.describe(self.enforcer.builder.state().root()));
        if let Some(notifier) = self.enforcer.executor.notifier() {
            self.status.told = notifier.counts();
        }
        instance.publish(&self.status);
        if let Some(metrics) = &self.metrics {
            let tier = self.status.tier.as_deref();
            metrics.follow(&self.status.counts, tier, self.enforcer.builder.nvml_errors);
        }
    }

    fn on_state_change(&mut self, changed: std::io::Result<bool>, schedule: &mut Schedule) {
        match changed {
            Ok(true) => {
                self.status.counts.state_changes += 1;
                schedule.full_now(Instant::now());
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(
                    "Watching genv's state directory failed ({e}); state changes wait for the full cycle"
                );
                self.unwatched.first(e.to_string());
                self.state_watch = None;
                schedule.full_now(Instant::now());
            }
        }
    }

    /// SIGHUP: the rules, intervals and execution settings read again and put in force,
    /// the kernel programs left attached (see [`crate::service::reload`]).
    fn reload(&mut self, schedule: &mut Schedule) {
        let Some(new) = reload(self.settings.reload.as_mut(), &mut self.enforcer) else {
            return;
        };
        let memory = new.memory_interval.unwrap_or(self.settings.memory_interval);
        self.settings.interval = new.interval;
        self.settings.memory_interval = memory;
        self.status.interval_s = new.interval.as_secs_f64();
        self.status.memory_interval_s = memory.as_secs_f64();
        // A full cycle at once, under the new rules.
        schedule.set_periods(Instant::now(), new.interval, memory);
        tracing::info!(
            "SIGHUP: settings read again and in force ({:?}, every {:?}); the kernel programs stay attached",
            self.enforcer.rules,
            new.interval
        );
    }
}

/// The state directory's watch; a failure is warned about once per distinct reason
/// (the daemon tries again at every full cycle).
fn watch_state(enforcer: &Enforcer, unwatched: &mut WarnOnce<String>) -> Option<StateWatch> {
    let state = enforcer.builder.state();
    match StateWatch::new(state) {
        Ok(watch) => {
            if let Some(Target::Ancestor { dir, .. }) = watch.target() {
                tracing::info!(
                    "genv's state directory {} does not exist yet; watching {} for it",
                    state.root().display(),
                    dir.display()
                );
            }
            unwatched.clear();
            Some(watch)
        }
        Err(e) => {
            let why = e.to_string();
            if unwatched.first(why.clone()) {
                tracing::warn!(
                    "Cannot watch {} ({why}); state changes wait for the full cycle",
                    state.root().display()
                );
            }
            None
        }
    }
}

async fn next_batch(intake: Option<&mut EventIntake>, batch: &mut Batch) -> std::io::Result<()> {
    match intake {
        Some(intake) => {
            intake
                .next_batch(&mut batch.events, &mut batch.unknown)
                .await
        }
        None => std::future::pending().await,
    }
}

async fn state_changed(watch: Option<&mut StateWatch>) -> std::io::Result<bool> {
    match watch {
        Some(watch) => watch.changed().await,
        None => std::future::pending().await,
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
