//! Enforcement checks. The full cycle is genv's: snapshot under the global lock, all
//! rules, then one execution phase under the lock again. The event-driven daemon also
//! runs narrower checks of the same snapshot (see [`Scope`]).

use std::collections::HashSet;
use std::time::Duration;

use crate::actions::Executor;
use crate::genv_lines;
use crate::report::Report;
use crate::rules::{self, Finding, Rules, Survey};
use crate::snapshot::{DroppedEnv, GpuProcess, Orphan, Snapshot, SnapshotBuilder};
use crate::state::{Device, Env, GlobalLock, LockError, LockErrorKind, StateDir};

pub struct Enforcer {
    pub builder: SnapshotBuilder,
    pub rules: Rules,
    pub executor: Executor,
    pub lock: LockPolicy,
}

/// How long a check waits for genv's global lock. genv holds it for milliseconds; any
/// user can hold it for ever (`flock genv.lock sleep inf`), or put something there that
/// is refused as a lock (a link, a FIFO, a mount), and neither a daemon nor the `usage
/// snapshot` and `usage execute` that remote enforcement runs on each host may stop
/// enforcing (or answering SIGTERM) for either.
#[derive(Clone, Copy, Debug, Default)]
pub struct LockPolicy {
    /// `None`: wait as genv does (`enforce --interval 0`). `Some(d)`: wait at most `d`, then read
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
    /// `usage snapshot` and `usage execute`'s: they run once per remote cycle, where a
    /// second costs nothing, and genv's own `usage snapshot` holds the lock while it asks
    /// `nvidia-smi`, which can take longer than a daemon's wait.
    pub const COMMAND_WAIT: Duration = Duration::from_secs(1);

    pub fn blocking() -> Self {
        Self::default()
    }

    pub fn bounded(wait: Duration) -> Self {
        Self {
            wait: Some(wait),
            contended: false,
        }
    }

    /// genv's lock in `state`, as this policy says: `None` when the caller goes on
    /// without it (the wait ran out, or what is at `genv.lock` is refused as a lock).
    /// Said once when that starts, and once when the lock is free again.
    pub fn take(&mut self, state: &StateDir) -> Result<Option<GlobalLock>, LockError> {
        let Some(wait) = self.wait else {
            return state.lock().map(Some);
        };
        let wait = if self.contended { Duration::ZERO } else { wait };
        match state.lock_within(wait) {
            Ok(lock) => {
                if self.contended {
                    tracing::info!("genv's lock is free again");
                    self.contended = false;
                }
                Ok(Some(lock))
            }
            // Held past the wait, or refused (a link, a FIFO, a mount where genv.lock
            // or its directory should be): any user can do either, and neither may
            // switch enforcement off. Blocking runs report a refusal instead.
            Err(e) if matches!(e.kind, LockErrorKind::Held { .. }) => {
                if !self.contended {
                    tracing::warn!(
                        "{e}: enforcing from the state files read without it until it is free"
                    );
                    self.contended = true;
                }
                Ok(None)
            }
            Err(e) if matches!(e.kind, LockErrorKind::Refused(_)) => {
                if !self.contended {
                    tracing::warn!(
                        "Cannot take genv's lock: {e}; enforcing from the state files read without it, and detaching nothing, until it can be taken"
                    );
                    self.contended = true;
                }
                Ok(None)
            }
            Err(e) => Err(e),
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
        self.snapshot_among(None)
    }

    /// [`Self::snapshot`] for a check of `among` alone (see
    /// [`SnapshotBuilder::take_among`]).
    fn snapshot_among(&mut self, among: Option<&[u32]>) -> Result<Snapshot, LockError> {
        // The processes' environment blocks first, without the lock: their owners can
        // keep them from answering, and every user's genv waits for the lock.
        self.builder.read_ahead(among);
        let lock = self.lock.take(self.builder.state())?;
        let (snapshot, warnings) = self.builder.take_among(among);
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
        // An open check judges the processes that opened (the memory rule, which looks
        // at their environments' other processes, needs NVML, which lists every one).
        let among: Option<Vec<u32>> = match scope {
            Scope::Opened(pids) => Some(pids.iter().copied().collect()),
            Scope::Full | Scope::Memory => None,
        };
        let snapshot = match self.snapshot_among(among.as_deref()) {
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
            genv_lines::print(&finding.line(&[None]));
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
        summary.state = match report.detach.is_empty() {
            true => snapshot.envs.zip(snapshot.devices),
            // The detaches just carried out rewrote devices.json: what the daemon
            // mirrors into the kernel is the state after them, not the snapshot's from
            // before (which only the inotify event of its own write would correct).
            false => self.state_now(),
        };
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

    /// genv's state read again, under its lock as this policy takes it (`None`: the
    /// lock or a file could not be had; the daemon then keeps the last mirrored).
    fn state_now(&mut self) -> Option<(Vec<Env>, Vec<Device>)> {
        let lock = match self.lock.take(self.builder.state()) {
            Ok(lock) => lock,
            Err(e) => {
                tracing::warn!("Cannot read genv's state again after detaching: {e}");
                return None;
            }
        };
        let state = self.builder.state_now();
        drop(lock);
        state
    }

    /// Carries out a report under genv's global lock, as [`execute_report`] does.
    pub fn execute(&mut self, report: &Report) {
        let state = self.builder.state().clone();
        if let Err(e) = execute_report(&mut self.lock, &mut self.executor, report, &state) {
            tracing::error!(
                "Cannot take genv's lock in {}: {e}; nothing was executed",
                state.root().display()
            );
        }
    }
}

/// Carries out a report under genv's global lock, taken as `lock` says. Without it
/// (held by someone else past the wait, or refused), terminations go ahead, since they
/// write nothing, and detaches, which rewrite `devices.json`, are each named and left
/// for a later check that gets the lock: the violation is still there for it to find.
/// Any other failure to take the lock executes nothing.
pub fn execute_report(
    lock: &mut LockPolicy,
    executor: &mut Executor,
    report: &Report,
    state: &StateDir,
) -> Result<(), LockError> {
    match lock.take(state)? {
        Some(_lock) => executor.execute(report, state),
        None => {
            for detach in &report.detach {
                for env in &detach.envs {
                    tracing::warn!(
                        "Not detaching environment {} of user {} from device {} without genv's lock: a later check that gets it will, if it is still due",
                        env.eid,
                        env.username.as_deref().unwrap_or("N/A"),
                        detach.index
                    );
                }
            }
            let terminations = Report {
                terminate: report.terminate.clone(),
                detach: Vec::new(),
                // Without the detach, its processes are stopped for the rule alone.
                why: report
                    .why
                    .iter()
                    .map(|(pid, why)| {
                        let why = crate::report::Why {
                            detached: false,
                            ..why.clone()
                        };
                        (*pid, why)
                    })
                    .collect(),
            };
            executor.execute(&terminations, state);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::actions::ExecutorConfig;
    use crate::report::Detach;
    use crate::snapshot::Usage;

    /// A state directory where environment `e` (alive: its shell is this process) is
    /// attached to device 0.
    fn state(name: &str) -> (StateDir, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("genv-cycle-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let env = serde_json::json!({"eid": "e", "uid": 0, "username": "root",
            "creation": "01/01/2026 00:00:00", "config": {}, "pids": [std::process::id()],
            "kernel_ids": []});
        std::fs::write(
            dir.join("envs.json"),
            serde_json::json!({ "envs": [env] }).to_string(),
        )
        .unwrap();
        let attachment =
            serde_json::json!({"eid": "e", "gpu_memory": null, "time": "01/01/2026 00:00:00"});
        let device =
            serde_json::json!({"index": 0, "total_memory": "16g", "attachments": [attachment]});
        std::fs::write(
            dir.join("devices.json"),
            serde_json::json!({ "devices": [device] }).to_string(),
        )
        .unwrap();
        (StateDir::new(&dir), dir)
    }

    fn attached(dir: &Path) -> bool {
        std::fs::read_to_string(dir.join("devices.json"))
            .unwrap()
            .contains("\"e\"")
    }

    /// Terminate a child of this test, and detach `e` from device 0.
    fn report(state: &StateDir, pid: u32) -> Report {
        let env = state.load_envs().unwrap().remove(0);
        let process = GpuProcess {
            pid,
            start_time: None,
            used_gpu_memory: vec![Usage {
                index: 0,
                bytes: Some(1),
            }],
            eid: Some("e".into()),
        };
        Report {
            terminate: vec![process],
            detach: vec![Detach {
                index: 0,
                envs: vec![env],
            }],
            why: Default::default(),
        }
    }

    fn executor() -> Executor {
        Executor::new(ExecutorConfig {
            dry_run: false,
            signals: true,
            kill_after: None,
        })
    }

    /// The state a check returns (which the daemon mirrors into the kernel) is genv's
    /// after the check's own detaches, not the snapshot's from before them.
    #[test]
    fn a_check_that_detached_returns_the_state_after_it() {
        let (state, dir) = state("after");
        let devices = std::fs::read_to_string(dir.join("devices.json")).unwrap();
        let mut devices: serde_json::Value = serde_json::from_str(&devices).unwrap();
        let mut second = devices["devices"][0].clone();
        second["index"] = 1.into();
        devices["devices"].as_array_mut().unwrap().push(second);
        std::fs::write(dir.join("devices.json"), devices.to_string()).unwrap();
        let nvml = std::ffi::OsString::from("/nonexistent/libnvidia-ml.so.1");
        let mut enforcer = Enforcer {
            builder: SnapshotBuilder::new(state, nvml, Default::default()),
            rules: Rules {
                non_env_processes: false,
                env_devices: false,
                env_memory: false,
                max_devices_per_user: Some(crate::rules::DeviceLimit {
                    default: 1,
                    per_user: Default::default(),
                }),
            },
            executor: executor(),
            lock: LockPolicy::blocking(),
        };
        let summary = enforcer.cycle();
        assert_eq!(summary.detached, 1);
        let (_, devices) = summary.state.expect("the state, read again");
        let holding: Vec<u32> = devices
            .iter()
            .filter(|d| d.attachments.iter().any(|a| a.eid == "e"))
            .map(|d| d.index)
            .collect();
        assert_eq!(holding.len(), 1, "e is still attached to {holding:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// The real `/proc`, but GPU holders made up (`holder` holds GPU 0) and each scan
    /// of them recorded: `None` for a sweep of every process, else the pids asked.
    struct Holders {
        procfs: crate::snapshot::Procfs,
        holder: u32,
        scans: std::sync::Arc<std::sync::Mutex<Vec<Option<Vec<u32>>>>>,
    }

    impl crate::snapshot::ProcessInspector for Holders {
        fn stat(&self, pid: u32) -> std::io::Result<crate::backends::procfs::ProcStat> {
            self.procfs.stat(pid)
        }
        fn environment_id(
            &self,
            pid: u32,
        ) -> Result<Option<String>, crate::backends::procfs::EnvironError> {
            self.procfs.environment_id(pid)
        }
        fn real_uid(&self, pid: u32) -> std::io::Result<u32> {
            self.procfs.real_uid(pid)
        }
        fn gpu_node_holders(
            &self,
            _: &crate::backends::devmap::DeviceMap,
        ) -> std::io::Result<Vec<(u32, Vec<u32>)>> {
            self.scans.lock().unwrap().push(None);
            Ok(vec![(self.holder, vec![0])])
        }
        fn gpu_node_holders_among(
            &self,
            _: &crate::backends::devmap::DeviceMap,
            pids: &[u32],
        ) -> Vec<(u32, Vec<u32>)> {
            self.scans.lock().unwrap().push(Some(pids.to_vec()));
            match pids.contains(&self.holder) {
                true => vec![(self.holder, vec![0])],
                false => Vec::new(),
            }
        }
    }

    /// Without NVML, a check of a process that just opened a GPU reads that process's
    /// descriptors, not every process's (the sweep was most of the reaction's time),
    /// and still finds it; a full cycle still sweeps.
    #[test]
    fn an_open_check_without_nvml_reads_only_the_opened_processes_descriptors() {
        let (state, dir) = state("among");
        let mut outsider = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let scans = std::sync::Arc::default();
        let nvml = std::ffi::OsString::from("/nonexistent/libnvidia-ml.so.1");
        let mut builder = SnapshotBuilder::new(state, nvml, Default::default());
        builder.set_inspector(Box::new(Holders {
            procfs: Default::default(),
            holder: outsider.id(),
            scans: std::sync::Arc::clone(&scans),
        }));
        let mut enforcer = Enforcer {
            builder,
            rules: Rules {
                non_env_processes: true,
                ..Rules::default()
            },
            executor: Executor::new(ExecutorConfig {
                dry_run: true,
                signals: false,
                kill_after: None,
            }),
            lock: LockPolicy::blocking(),
        };
        let opened = HashSet::from([outsider.id()]);
        let summary = enforcer.check(Scope::Opened(&opened), &HashSet::new());
        assert_eq!(summary.terminated, [outsider.id()], "the opener is found");
        assert_eq!(*scans.lock().unwrap(), [Some(vec![outsider.id()])]);
        scans.lock().unwrap().clear();
        assert_eq!(enforcer.cycle().terminated, [outsider.id()]);
        assert_eq!(*scans.lock().unwrap(), [None], "a full cycle sweeps");
        let _ = outsider.kill();
        let _ = outsider.wait();
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn without_the_lock_terminations_go_ahead_and_detaches_wait() {
        let (state, dir) = state("held");
        let held = state.lock().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let mut lock = LockPolicy::bounded(Duration::from_millis(10));
        execute_report(
            &mut lock,
            &mut executor(),
            &report(&state, child.id()),
            &state,
        )
        .unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
        assert!(attached(&dir), "detached without the lock");
        drop(held);
        execute_report(
            &mut lock,
            &mut executor(),
            &report(&state, child.id()),
            &state,
        )
        .unwrap();
        assert!(!attached(&dir), "not detached once the lock was free");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_refused_lock_counts_as_held_unless_the_policy_blocks() {
        let (state, dir) = state("fifo");
        let fifo =
            std::ffi::CString::new(dir.join("genv.lock").into_os_string().into_encoded_bytes())
                .unwrap();
        // SAFETY: `fifo` is a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0);
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let report = report(&state, child.id());
        let error = execute_report(
            &mut LockPolicy::blocking(),
            &mut executor(),
            &report,
            &state,
        )
        .unwrap_err();
        assert!(matches!(error.kind, LockErrorKind::Refused(_)), "{error}");
        let mut lock = LockPolicy::bounded(Duration::from_millis(10));
        execute_report(&mut lock, &mut executor(), &report, &state).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
        assert!(attached(&dir), "detached without the lock");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
