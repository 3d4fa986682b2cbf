//! The event-driven daemon. Triggers, and what each runs:
//! - a kernel event → [`crate::react`] says what it wants done, and [`super::checks`]
//!   does it (a GPU opener is watched, checked at once and at growing intervals while
//!   its window lasts; an exec or exit drops what the snapshot knew; a CUDA start
//!   outside any environment is judged at once);
//! - a write to `envs.json` or `devices.json` → a full cycle at once;
//! - every `--memory-interval` → the memory rule;
//! - every `--interval`, and whenever the kernel lost events or skipped a program's run
//!   (`skip_watch`) → a full cycle, after which
//!   the mirror ([`crate::sync`]) and `alloc` bring their maps in step;
//! - with `--deny`, the kernel refuses or kills at the open itself; its decisions arrive
//!   as open events and are reported by the reactions.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::checks::Checks;
use super::schedule::Schedule;
use super::settings::Settings;
use super::skip_watch::SkipWatch;
use super::start::{self, EventSide};
use super::state_watch::StateWatch;
use crate::clock::unix_now;
use crate::cycle::Enforcer;
use crate::intake::{BadRecord, EventIntake, KernelEvent};
use crate::react::{Around, Reactions, Wanted};
use crate::service::instance::Instance;
use crate::service::metrics::Metrics;
use crate::service::reload::reload;
use crate::service::signals::{Hangup, StopSignals, notify};
use crate::service::status::Status;
use crate::warn_once::WarnOnce;

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
    let _why = start::serve_why(&enforcer, &settings.run_dir);
    let (mut daemon, mut intake) = Daemon::start(enforcer, settings)?;
    instance.publish(&daemon.status);
    start::release_startup_memory();

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
            daemon.checks.next_wake(),
            daemon.checks.enforcer.executor.next_deadline(),
            intake.as_ref().map(|_| Instant::now() + daemon.drain_every),
            daemon.alloc().and_then(|alloc| alloc.next_due()),
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

/// Programs and maps go with the event side and the intake (pinned ones stay, without
/// this daemon's exemption); the status file with the instance.
fn shut_down<I>(intake: Option<I>, mut daemon: Daemon, instance: Instance) {
    drop(intake);
    // What users were told last reaches their terminals and the log.
    if let Some(notifier) = daemon.checks.enforcer.executor.notifier() {
        notifier.flush();
    }
    if let Some(side) = daemon.kernel.take() {
        side.mirror.release();
    }
    drop(daemon);
    drop(instance);
}

/// Events read from the ring buffer and not yet handled.
#[derive(Default)]
struct Batch {
    events: Vec<KernelEvent>,
    unknown: Vec<BadRecord>,
}

struct Daemon {
    /// The enforcer, and the checks it runs.
    checks: Checks,
    settings: Settings,
    status: Status,
    /// `None`: no kernel programs (full cycle alone).
    kernel: Option<EventSide>,
    reactions: Reactions,
    /// inotify on genv's state directory; `None` until it can be set up.
    state_watch: Option<StateWatch>,
    /// Why the state directory could not be watched, as last warned.
    unwatched: WarnOnce<String>,
    /// An undecodable event was reported (once for the daemon's life).
    undecodable: WarnOnce,
    /// The ring buffer's current look period ([`DRAIN_EVERY`] to [`DRAIN_IDLE`]).
    drain_every: Duration,
    /// `--metrics-addr`.
    metrics: Option<Arc<Metrics>>,
    /// The runs the kernel skipped, looked at; `None` without kernel programs.
    skips: Option<SkipWatch>,
}

impl Daemon {
    /// After a full cycle, the mirror and `alloc` bring their maps in step with what it
    /// read.
    fn full_cycle(&mut self) {
        let mut summary = self.checks.full_cycle(&mut self.status);
        if let Some(side) = self.kernel.as_mut() {
            let builder = &self.checks.enforcer.builder;
            let state = summary.state.take();
            if let Some(alloc) = side.alloc.as_mut() {
                let given = &self.settings.kernel.cuda_libs;
                alloc.follow_cycle(state.as_ref(), builder.devices(), given);
                self.status.probes_registration_stalled = alloc.registration_stalled();
            }
            let settings = &self.settings.kernel;
            let dropped = summary.dropped_envs.as_slice();
            let status = &mut self.status;
            let device_map = builder.device_map();
            side.mirror
                .follow_cycle(settings, status, device_map, state, dropped);
            status.address_spaces_held = crate::backends::address_space::held_now();
        }
        self.status.orphans = std::mem::take(&mut summary.orphans);
    }

    /// The event side started (or none, as `--bpf-tier` allows), the metrics endpoint
    /// listening.
    fn start(mut enforcer: Enforcer, settings: Settings) -> Result<(Self, Option<EventIntake>)> {
        let mut status = Status {
            pid: std::process::id(),
            started: unix_now(),
            interval_s: settings.interval.as_secs_f64(),
            memory_interval_s: settings.memory_interval.as_secs_f64(),
            ..Status::default()
        };
        let metrics = start::metrics(&settings)?;
        let kernel = &settings.kernel;
        let started = start::event_side(kernel, settings.interval, &mut status, &mut enforcer)?;
        let (kernel, intake) = started.unzip();
        let skips = (kernel.as_ref())
            .map(|side: &EventSide| SkipWatch::new(&side.programs, Instant::now()));
        let daemon = Self {
            reactions: Reactions::new(settings.kernel.verbose, settings.kernel.deny.root),
            checks: Checks::new(enforcer, metrics.clone()),
            settings,
            status,
            kernel,
            state_watch: None,
            unwatched: WarnOnce::default(),
            undecodable: WarnOnce::default(),
            drain_every: DRAIN_EVERY,
            metrics,
            skips,
        };
        Ok((daemon, intake))
    }

    fn alloc(&self) -> Option<&crate::alloc::AllocSide> {
        self.kernel.as_ref()?.alloc.as_ref()
    }

    /// Runs whatever is due: the full cycle, the checks of newly opened GPUs, the
    /// memory poll, SIGKILL escalations, and the status file.
    fn run_due(&mut self, schedule: &mut Schedule, instance: &Instance) {
        if schedule.full_due(Instant::now()) {
            // Watch first: a state change during the cycle then triggers another one,
            // where watching after it would miss a change made while it ran.
            if self.state_watch.as_ref().is_none_or(StateWatch::is_lost) {
                self.state_watch = start::watch_state(&self.checks.enforcer, &mut self.unwatched);
            }
            self.full_cycle();
            schedule.full_done(Instant::now());
        }
        self.checks.opened_if_due(&mut self.status);
        if schedule.memory_due(Instant::now()) {
            let watched = self.state_watch.as_ref().is_some_and(|w| !w.is_lost());
            let alloc = self.kernel.as_mut().and_then(|side| side.alloc.as_mut());
            self.checks.memory(&mut self.status, alloc, watched);
            schedule.memory_done(Instant::now());
        }
        self.checks.enforcer.executor.escalate(Instant::now());
        if schedule.status_due(Instant::now()) {
            self.publish(schedule, instance);
            schedule.status_done(Instant::now());
        }
    }

    /// The status file and the metrics brought up to date; a resynchronisation due at
    /// once where the kernel could not record identities since the last.
    fn publish(&mut self, schedule: &mut Schedule, instance: &Instance) {
        self.status.updated = unix_now();
        if let Some(side) = &self.kernel {
            self.status.programs = side.programs.stats();
            side.mirror.report(&mut self.status);
            if side.mirror.identities_lost(&self.status) {
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
            .map(|t| t.describe(self.checks.enforcer.builder.state().root()));
        if let Some(notifier) = self.checks.enforcer.executor.notifier() {
            self.status.told = notifier.counts();
        }
        instance.publish(&self.status);
        if let Some(metrics) = &self.metrics {
            metrics.follow(&self.status, self.checks.enforcer.builder.nvml_errors);
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
        let Some(new) = reload(self.settings.reload.as_mut(), &mut self.checks.enforcer) else {
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
            self.checks.enforcer.rules,
            new.interval
        );
    }

    /// Handles what the intake holds: every event, then any undecodable record or loss,
    /// either of which means the daemon's view may be stale, so a full cycle resyncs it.
    fn take_in(&mut self, intake: &mut EventIntake, batch: &mut Batch, schedule: &mut Schedule) {
        let now = Instant::now();
        intake.drain_now(&mut batch.events, &mut batch.unknown);
        self.drain_every = match batch.events.is_empty() {
            true => (self.drain_every * 2).min(DRAIN_IDLE),
            false => DRAIN_EVERY,
        };
        for event in batch.events.drain(..) {
            if let Some(wanted) = self.react(Some(event), now) {
                self.checks.act(wanted, now, &mut self.status);
            }
        }
        let devices = self.checks.enforcer.builder.devices();
        if let Some(alloc) = self.kernel.as_mut().and_then(|side| side.alloc.as_mut()) {
            // Exits waiting for their processes to be gone: looked at again soon.
            if alloc.settle_exits() {
                self.drain_every = DRAIN_EVERY;
            }
            alloc.run_due(devices);
        }
        self.look_at_skips(now, schedule);
        self.react(None, now);
        if let Some(first) = batch.unknown.first() {
            if self.undecodable.first(()) {
                tracing::warn!("{first}; treating it as a lost event");
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

    /// Runs the kernel skipped ([`SkipWatch`]): counted; with `--deny` every GPU node
    /// swept of outsiders after this batch; a full cycle, as for lost events.
    fn look_at_skips(&mut self, now: Instant, schedule: &mut Schedule) {
        let (Some(side), Some(watch)) = (&self.kernel, self.skips.as_mut()) else {
            return;
        };
        let Some(found) = watch.look(&side.programs, now) else {
            return;
        };
        self.status.counts.skipped_open_runs += found.new.open;
        self.status.counts.skipped_lifecycle_runs += found.new.lifecycle;
        if found.sweep && self.settings.kernel.deny.deny {
            self.reactions.undecided_open();
        }
        if found.resync {
            self.metrics.iter().for_each(|metrics| metrics.resynced());
            schedule.full_now(now);
        }
    }

    /// One event handed to the reactions, with the stages they may use (`None`: the
    /// batch is done).
    fn react(&mut self, event: Option<KernelEvent>, now: Instant) -> Option<Wanted> {
        let side = self.kernel.as_mut()?;
        let mut around = Around {
            mirror: &mut side.mirror,
            alloc: side.alloc.as_mut(),
            devices: self.checks.enforcer.builder.devices(),
            notifier: self.checks.enforcer.executor.notifier().map(Arc::as_ref),
            counts: &mut self.status.counts,
            non_env_rule: self.checks.enforcer.rules.non_env_processes,
        };
        match event {
            Some(event) => self.reactions.on(event, now, &mut around),
            None => {
                self.reactions.after_batch(&mut around);
                None
            }
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
