//! The event-driven daemon. Triggers, and what each runs:
//! - a GPU open reported by the kernel → the process is watched, and checked (non-env and
//!   env-devices rules, memory for its environment) at once and at growing intervals
//!   while its window lasts ([`super::watchlist`]);
//! - a write to `envs.json` or `devices.json` → a full cycle at once;
//! - every `--memory-interval` → the memory rule;
//! - every `--interval`, and whenever the kernel lost events → a full cycle;
//! - exec and exit events keep the process table current;
//! - with `--deny`, the kernel refuses or kills at the open itself; its decisions arrive
//!   as open events and are reported ([`crate::prevention`]).

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Result;

mod checks;
mod events;
mod reload;
use super::schedule::Schedule;
use super::settings::Settings;
use super::state_watch::{StateWatch, Target};
use super::watchlist::Watchlist;
use crate::cycle::Enforcer;
use crate::intake::decisions::LineLimiter;
use crate::intake::{BadRecord, EventIntake, KernelEvent, Verdict};
use crate::kernel::inspector::KernelInspector;
use crate::service::instance::Instance;
use crate::service::metrics::{self, Metrics};
use crate::service::signals::{Hangup, StopSignals, notify};
use crate::service::status::Status;
use crate::sync::KernelSide;

/// How long a process terminated by a narrow check is left out of the next ones.
const SETTLE: Duration = Duration::from_secs(2);
/// How often the daemon wakes at least, to read lifecycle events (which do not wake it),
/// while they come; with none since the last look the period doubles up to
/// [`DRAIN_IDLE`]. Nothing waits on them: a GPU open wakes the daemon at once and the
/// events before it are read first, and a half-full ring buffer wakes it too.
const DRAIN_EVERY: Duration = Duration::from_millis(100);
/// The longest period between looks at the ring buffer, on an idle node.
const DRAIN_IDLE: Duration = Duration::from_secs(1);

pub async fn run(mut enforcer: Enforcer, settings: Settings) -> Result<ExitCode> {
    let mut stop = StopSignals::install()?;
    let mut hangup = Hangup::install()?;
    let instance = Instance::claim(&settings.run_dir)?;
    let mut status = Status {
        pid: std::process::id(),
        started: unix_now(),
        interval_s: settings.interval.as_secs_f64(),
        memory_interval_s: settings.memory_interval.as_secs_f64(),
        ..Status::default()
    };
    let metrics = settings.metrics_addr.map(metrics::serve).transpose()?;
    let (kernel, mut intake) =
        KernelSide::start(&settings.kernel, settings.interval, &mut status)?.unzip();
    if let Some(kernel) = &kernel {
        read_identities_from(kernel, &mut enforcer);
    }
    instance.publish(&status);
    release_startup_memory();

    let mut schedule = Schedule::new(Instant::now(), settings.interval, settings.memory_interval);
    let mut daemon = Daemon {
        enforcer,
        settings,
        status,
        kernel,
        state_watch: None,
        said_watch: None,
        watchlist: Watchlist::default(),
        settled: HashMap::new(),
        said_unknown: false,
        to_sweep: HashSet::new(),
        decision_lines: Default::default(),
        drain_every: DRAIN_EVERY,
        memory_capped: true,
        metrics,
    };
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
    if let Some(kernel) = daemon.kernel.take() {
        kernel.release();
    }
    drop(daemon);
    drop(instance);
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
    // SAFETY: malloc_trim only returns free memory to the kernel.
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
    said_watch: Option<String>,
    watchlist: Watchlist,
    /// Processes a narrow check terminated, and when.
    settled: HashMap<u32, Instant>,
    /// An undecodable event was reported once already.
    said_unknown: bool,
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
    /// Runs whatever is due: the full cycle, the checks of newly opened GPUs, the
    /// memory poll, SIGKILL escalations, and the status file.
    fn run_due(&mut self, schedule: &mut Schedule, instance: &Instance) {
        if schedule.full_due(Instant::now()) {
            // Watch first: a state change during the cycle then triggers another one,
            // where watching after it would miss a change made while it ran.
            if self.state_watch.as_ref().is_none_or(StateWatch::is_lost) {
                self.state_watch = watch_state(&self.enforcer, &mut self.said_watch);
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
            self.status.updated = unix_now();
            if let Some(kernel) = &self.kernel {
                if kernel.report(&mut self.status) {
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
            instance.publish(&self.status);
            if let Some(metrics) = &self.metrics {
                let tier = self.status.tier.as_deref();
                metrics.follow(&self.status.counts, tier, self.enforcer.builder.nvml_errors);
            }
            schedule.status_done(Instant::now());
        }
    }

    /// Handles what the intake holds: every event, then any undecodable record or loss,
    /// either of which means the daemon's view may be stale, so a full cycle resyncs it.
    fn take_in(&mut self, intake: &mut EventIntake, batch: &mut Batch, schedule: &mut Schedule) {
        let now = Instant::now();
        intake.drain_now(&mut batch.events, &mut batch.unknown);
        self.drain_every = if batch.events.is_empty() {
            (self.drain_every * 2).min(DRAIN_IDLE)
        } else {
            DRAIN_EVERY
        };
        for event in batch.events.drain(..) {
            self.on_event(event, now);
        }
        // Exits waiting for their processes to be gone: looked at again soon.
        if self.kernel.as_mut().is_some_and(KernelSide::settle_exits) {
            self.drain_every = DRAIN_EVERY;
        }
        if let Some(kernel) = self.kernel.as_mut() {
            kernel.run_due_looks(self.enforcer.builder.devices());
        }
        self.sweep_holders();
        if let Some(first) = batch.unknown.first() {
            if !self.said_unknown {
                tracing::warn!("{first}; treating it as a lost event");
                self.said_unknown = true;
            }
            batch.unknown.clear();
            schedule.full_now(now);
        }
        let lost = intake.newly_lost();
        if lost > 0 {
            self.status.counts.lost_events += lost;
            if let Some(metrics) = &self.metrics {
                metrics.resynced();
            }
            tracing::warn!(
                "The kernel lost {lost} events (its ring buffer was full); running a full cycle to resynchronise"
            );
            schedule.full_now(now);
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
                self.said_watch = Some(e.to_string());
                self.state_watch = None;
                schedule.full_now(Instant::now());
            }
        }
    }

    fn on_event(&mut self, event: KernelEvent, now: Instant) {
        let counts = &mut self.status.counts;
        match event {
            KernelEvent::Exec { pid, unresolved } => {
                counts.exec_events += 1;
                self.enforcer.builder.forget(pid);
                // A new image: the old one's GPU memory went with its address space.
                if let Some(kernel) = self.kernel.as_mut() {
                    kernel.exited(pid, false);
                }
                if let (true, Some(kernel)) = (unresolved, self.kernel.as_mut()) {
                    kernel.resolve_identity(pid, self.settings.kernel.verbose);
                }
            }
            KernelEvent::Fork {
                child, unresolved, ..
            } => {
                counts.fork_events += 1;
                if let (true, Some(kernel)) = (unresolved, self.kernel.as_mut()) {
                    kernel.resolve_identity(child, self.settings.kernel.verbose);
                }
            }
            KernelEvent::Exit { pid } => {
                counts.exit_events += 1;
                if let Some(kernel) = self.kernel.as_mut() {
                    kernel.exited(pid, true);
                }
                self.enforcer.builder.forget(pid);
                self.watchlist.remove(pid);
                self.settled.remove(&pid);
            }
            KernelEvent::CudaStart(start) => self.on_cuda_start(start, now),
            KernelEvent::Alloc(over) => self.on_over_cap(&over, now),
            KernelEvent::Open(open) => {
                counts.open_events += 1;
                if let Some(kernel) = self.kernel.as_mut() {
                    kernel.opened(open.pid, open.uid, self.enforcer.builder.devices());
                }
                let counts = &mut self.status.counts;
                if self.settings.kernel.verbose {
                    tracing::info!(
                        target: "event", "Process {} (thread {}) {} GPU {} (node {}:{}) [{}; {}]",
                        open.pid,
                        open.tid,
                        open.tier.open_verb(),
                        open.index,
                        open.major,
                        open.minor,
                        open.tier,
                        open.verdict.describe()
                    );
                }
                if let Some(line) = self.decision_lines.line(&open, now) {
                    println!("{line}");
                }
                match open.verdict {
                    Verdict::Refused => counts.refused += 1,
                    Verdict::Killed => {
                        counts.killed += 1;
                        self.to_sweep.insert(open.index);
                    }
                    Verdict::KillFailed => {
                        self.to_sweep.insert(open.index);
                        tracing::error!(
                            "The kernel could not kill process {} when it opened GPU {}: the open returned; the daemon kills the holders now",
                            open.pid,
                            open.index
                        );
                        self.watchlist.add(open, now);
                    }
                    // Let through: watched, and checked against genv's rules.
                    _ => self.watchlist.add(open, now),
                }
            }
        }
    }

    /// After the kernel killed openers: whoever still holds those GPUs outside any
    /// environment (a process sharing the opener's file table) is killed too. One sweep
    /// of `/proc` per batch of events, however many kills it held.
    fn sweep_holders(&mut self) {
        if self.to_sweep.is_empty() {
            return;
        }
        let gpus = std::mem::take(&mut self.to_sweep);
        let Some(kernel) = &self.kernel else {
            return;
        };
        for killed in kernel.sweep_holders(&self.settings.kernel, &gpus) {
            println!("{}", killed.line());
            self.status.counts.killed_holders += 1;
        }
    }
}

/// The state directory's watch; a failure is warned about once per distinct reason
/// (the daemon tries again at every full cycle).
fn watch_state(enforcer: &Enforcer, said: &mut Option<String>) -> Option<StateWatch> {
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
            *said = None;
            Some(watch)
        }
        Err(e) => {
            let why = e.to_string();
            if said.as_ref() != Some(&why) {
                tracing::warn!(
                    "Cannot watch {} ({why}); state changes wait for the full cycle",
                    state.root().display()
                );
                *said = Some(why);
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
