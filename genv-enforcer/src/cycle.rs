//! Enforcement checks. The full cycle is genv's: snapshot under the global lock, all
//! rules, then one execution phase under the lock again. The event-driven daemon also
//! runs narrower checks of the same snapshot (see [`Scope`]).

use std::collections::HashSet;
use std::time::Duration;

use crate::actions::Executor;
use crate::report::Report;
use crate::rules::{self, Finding, Rules, Survey};
use crate::snapshot::{DroppedEnv, GpuProcess, Orphan, Snapshot, SnapshotBuilder};
use crate::state::{Device, Env, GlobalLock, LockError, LockErrorKind};

pub struct Enforcer {
    pub builder: SnapshotBuilder,
    pub rules: Rules,
    pub executor: Executor,
    pub lock: LockPolicy,
}

/// How long a check waits for genv's global lock. genv holds it for milliseconds; any
/// user can hold it for ever (`flock genv.lock sleep inf`), or put something there that
/// is refused as a lock (a link, a FIFO, a mount), and a daemon must not stop enforcing,
/// or answering SIGTERM, for either.
#[derive(Clone, Copy, Debug, Default)]
pub struct LockPolicy {
    /// `None`: wait as genv does (one-shot runs). `Some(d)`: wait at most `d`, then read
    /// the state without the lock (a half-written file does not parse, and is never
    /// acted on) and leave detaches, which write, for a check that gets it.
    wait: Option<Duration>,
    /// The lock was held past `wait` (or refused) last time: until it is free again, it
    /// is tried without waiting, so that the event loop is never held up for long.
    contended: bool,
}

impl LockPolicy {
    /// A daemon's: at most 100 ms, once.
    pub const DAEMON_WAIT: Duration = Duration::from_millis(100);

    pub fn blocking() -> Self {
        Self::default()
    }

    pub fn bounded(wait: Duration) -> Self {
        Self {
            wait: Some(wait),
            contended: false,
        }
    }
}

/// Which rules look at which processes.
#[derive(Clone, Copy, Debug)]
pub enum Scope<'a> {
    /// genv's cycle: every enabled rule over every process.
    Full,
    /// After GPU opens: the non-env and env-devices rules for these processes, and the
    /// memory rule for the environments they are in.
    Opened(&'a HashSet<u32>),
    /// The memory poll: the memory rule alone.
    Memory,
}

/// What a check saw and did, for callers that count (tests, benchmarks, status).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CycleSummary {
    pub processes: usize,
    pub findings: usize,
    pub terminated: Vec<u32>,
    pub detached: usize,
    /// genv's environments and devices as this check read them, under the lock; `None`
    /// when either file could not be read (the daemon mirrors them into the kernel).
    pub state: Option<(Vec<Env>, Vec<Device>)>,
    /// The GPU processes the check saw (with a compute context), in scope.
    pub gpu_pids: Vec<u32>,
    /// Processes of environments genv dropped, left running (`--orphans leave`).
    pub orphans: Vec<Orphan>,
    /// The environments they run in (the kernel lets them open GPUs too).
    pub dropped_envs: Vec<DroppedEnv>,
    /// The snapshot's processes, when NVML gave their memory (`--memory-at-alloc`'s
    /// baselines).
    pub measured: Option<Vec<GpuProcess>>,
    /// (rule, action) of each action the findings asked for (metrics).
    pub decisions: Vec<(&'static str, &'static str)>,
}

impl Enforcer {
    /// Takes a snapshot under genv's global lock (or without it, see [`LockPolicy`])
    /// and prints its warnings.
    pub fn snapshot(&mut self) -> Result<Snapshot, LockError> {
        let lock = self.take_lock()?;
        let (snapshot, warnings) = self.builder.take();
        drop(lock);
        for warning in warnings {
            tracing::warn!("{}", warning.0);
        }
        Ok(snapshot)
    }

    /// Runs one full cycle.
    pub fn cycle(&mut self) -> CycleSummary {
        self.check(Scope::Full, &HashSet::new())
    }

    /// Runs one check. Processes in `settled` (already terminated by a recent check) are
    /// left out of the narrow scopes, so that a dying process is neither signalled twice
    /// nor counted against its environment's memory. Nothing here ends the daemon: a
    /// lock that cannot be taken is reported and the check skipped.
    pub fn check(&mut self, scope: Scope<'_>, settled: &HashSet<u32>) -> CycleSummary {
        let snapshot = match self.snapshot() {
            Ok(snapshot) => snapshot,
            Err(e) => {
                tracing::error!(
                    "Cannot take genv's lock in {}: {e}; skipping this cycle",
                    self.builder.state().root().display()
                );
                return CycleSummary::default();
            }
        };
        let findings = self.findings(&snapshot, scope, settled);
        let surveys = [Survey {
            hostname: None,
            snapshot: &snapshot,
        }];
        for finding in &findings {
            println!("{}", finding.line(&[None]));
        }
        let report = Report::build(&surveys, &findings).remove(0);
        let mut summary = CycleSummary {
            processes: snapshot.processes.len(),
            findings: findings.len(),
            terminated: report.terminate.iter().map(|p| p.pid).collect(),
            detached: report.detach.iter().map(|d| d.envs.len()).sum(),
            state: None,
            gpu_pids: Vec::new(),
            orphans: Vec::new(),
            dropped_envs: Vec::new(),
            measured: None,
            decisions: findings
                .iter()
                .flat_map(|f| f.actions.iter().map(|a| (f.kind.rule(), a.name())))
                .collect(),
        };
        if !report.is_empty() {
            self.execute(&report);
        }
        summary.gpu_pids = snapshot.processes.iter().map(|p| p.pid).collect();
        summary.measured = snapshot.memory_known.then_some(snapshot.processes);
        summary.state = snapshot.envs.zip(snapshot.devices);
        summary.orphans = snapshot.orphans;
        summary.dropped_envs = snapshot.dropped_envs;
        summary
    }

    fn findings(
        &self,
        snapshot: &Snapshot,
        scope: Scope<'_>,
        settled: &HashSet<u32>,
    ) -> Vec<Finding> {
        let run = |snapshot: &Snapshot, rules: &Rules| {
            rules::check(
                &[Survey {
                    hostname: None,
                    snapshot,
                }],
                rules,
            )
        };
        let only = |keep: &dyn Fn(&crate::snapshot::GpuProcess) -> bool| {
            let mut narrowed = snapshot.clone();
            narrowed
                .processes
                .retain(|p| !settled.contains(&p.pid) && keep(p));
            narrowed
        };
        let memory_rule = Rules {
            non_env_processes: false,
            env_devices: false,
            env_memory: self.rules.env_memory,
            max_devices_per_user: None,
        };
        match scope {
            Scope::Full => run(snapshot, &self.rules),
            Scope::Opened(pids) => {
                let opened = only(&|p| pids.contains(&p.pid));
                let process_rules = Rules {
                    env_memory: false,
                    max_devices_per_user: None,
                    ..self.rules.clone()
                };
                let mut findings = run(&opened, &process_rules);
                let envs: HashSet<&str> = opened
                    .processes
                    .iter()
                    .filter_map(|p| p.eid.as_deref())
                    .collect();
                if !envs.is_empty() {
                    let in_envs = only(&|p| p.eid.as_deref().is_some_and(|e| envs.contains(e)));
                    findings.extend(run(&in_envs, &memory_rule));
                }
                findings
            }
            Scope::Memory => run(&only(&|_| true), &memory_rule),
        }
    }

    /// Carries out a report under genv's global lock. Without it (held by someone
    /// else past the daemon's wait), terminations go ahead, since they write nothing,
    /// and detaches wait for a check that gets the lock.
    pub fn execute(&mut self, report: &Report) {
        let state = self.builder.state().clone();
        match self.take_lock() {
            Ok(Some(_lock)) => self.executor.execute(report, &state),
            Ok(None) => {
                if !report.detach.is_empty() {
                    tracing::warn!(
                        "Not detaching without genv's lock: a later check that gets it will"
                    );
                }
                let terminations = Report {
                    terminate: report.terminate.clone(),
                    detach: Vec::new(),
                };
                self.executor.execute(&terminations, &state);
            }
            Err(e) => tracing::error!(
                "Cannot take genv's lock in {}: {e}; nothing was executed",
                state.root().display()
            ),
        }
    }

    /// genv's lock as [`LockPolicy`] says: `None` when a daemon goes on without it.
    fn take_lock(&mut self) -> Result<Option<GlobalLock>, LockError> {
        let state = self.builder.state();
        let Some(wait) = self.lock.wait else {
            return state.lock().map(Some);
        };
        let wait = if self.lock.contended {
            Duration::ZERO
        } else {
            wait
        };
        match state.lock_within(wait) {
            Ok(lock) => {
                if self.lock.contended {
                    tracing::info!("genv's lock is free again");
                    self.lock.contended = false;
                }
                Ok(Some(lock))
            }
            // Held past the wait, or refused (a link, a FIFO, a mount where genv.lock
            // or its directory should be): any user can do either, and neither may
            // switch enforcement off. One-shot runs, which wait as genv does, report a
            // refusal instead.
            Err(e) if matches!(e.kind, LockErrorKind::Held { .. }) => {
                if !self.lock.contended {
                    tracing::warn!(
                        "{e}: enforcing from the state files read without it until it is free"
                    );
                    self.lock.contended = true;
                }
                Ok(None)
            }
            Err(e) if matches!(e.kind, LockErrorKind::Refused(_)) => {
                if !self.lock.contended {
                    tracing::warn!(
                        "Cannot take genv's lock: {e}; enforcing from the state files read without it, and detaching nothing, until it can be taken"
                    );
                    self.lock.contended = true;
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}
