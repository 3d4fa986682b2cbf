//! GPU processes, each with the environment it counts as being in: contexts grouped by
//! process in genv's order, and each process's claim (`GENV_ENVIRONMENT_ID`) checked
//! against the active environments and its real uid. What was read of a program image
//! is kept across cycles until the process execs or exits.

use crate::warn_once::WarnOnce;
use std::collections::HashMap;

use super::inspect::{ProcessInspector, handle_budget, read_stats};
use super::order::python_set_order;
use super::orphans::{DroppedEnvs, Orphan, OrphanPolicy};
use super::unreadable::Unreadable;
use super::{GpuProcess, Usage, Warning};
use crate::backends::nvml::ComputeContext;
use crate::backends::proc_events::{Changes, ProcEvents};
use crate::backends::procfs::{EnvironError, ProcStat, StatFile};
use crate::state::Env;
use claims::{orphan_of, resolve_env};
use read_ahead::{ReadAhead, claim_of};
use unread::Unread;

/// How far a process's `GENV_ENVIRONMENT_ID` is believed. genv believes it always; by
/// default the enforcer believes it only for an active environment of the process's own
/// user (or for root), since anyone can set the variable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnvPolicy {
    /// genv's behaviour: an id naming no active environment still counts as "in an
    /// environment" (which no rule then looks at).
    pub trust_unknown_env_ids: bool,
    /// genv's behaviour: any user's process may claim any environment.
    pub trust_foreign_env_ids: bool,
    /// Processes of an environment genv dropped (`--orphans`).
    pub orphans: OrphanPolicy,
}

/// What was read of a process's program image: its claimed environment and real uid.
/// Both change only through `execve` (a new environment block; a set-uid program), so
/// they are read once per image, and the image is recognised by the start time and
/// exec fingerprint of `/proc/<pid>/stat`, which every cycle still reads.
struct Known {
    start_time: u64,
    exec_fingerprint: [u64; 3],
    claimed: Option<String>,
    uid: Option<u32>,
    /// Said to be an orphan (once per process).
    orphan_said: WarnOnce,
}

/// Known processes, kept across cycles; only GPU processes of the last cycle stay.
#[derive(Default)]
pub(crate) struct ProcessTable {
    known: HashMap<u32, Known>,
    stat_files: HashMap<u32, Option<StatFile>>,
    /// The kernel's exec, exit and uid events, where it gives them: a known process
    /// with none since it was read is the same image, and its `stat` is not re-read.
    feed: Feed,
    /// Environments genv dropped, as they last were.
    pub(crate) dropped: DroppedEnvs,
    /// The last assembly's orphans.
    pub(crate) orphans: Vec<Orphan>,
    /// Claims read before genv's lock was taken, for the assembly under it.
    ahead: HashMap<u32, ReadAhead>,
    /// The start time of every GPU process as it was read ahead: the GPU contexts were
    /// listed then, and a pid that names another process now is not that context's.
    ahead_started: HashMap<u32, u64>,
    /// The next assembly reads no environment block: [`ProcessTable::read_claims_ahead`]
    /// read them.
    claims_read_ahead: bool,
    /// GPU processes whose blocks do not answer, and since when.
    pub(crate) unreadable: Unreadable,
}

#[derive(Debug, Default)]
enum Feed {
    #[default]
    Untried,
    Live(ProcEvents),
    /// Not to be had (no connector, not in the initial network namespace, an inspector
    /// of made-up processes): every process's `stat` is read each cycle.
    Off,
}

impl ProcessTable {
    /// What was read of `pid` no longer holds (it exec'd or exited).
    pub(crate) fn forget(&mut self, pid: u32) {
        self.known.remove(&pid);
        self.stat_files.remove(&pid);
    }

    /// Reads what the processes in `pids` not known yet claim, before genv's lock is
    /// taken (see `SnapshotBuilder::read_ahead`): the next assembly reads no block.
    pub(crate) fn read_claims_ahead(&mut self, pids: &[u32], inspector: &dyn ProcessInspector) {
        read_ahead::read_claims_ahead(self, pids, inspector);
    }

    /// An assembly begins: the unreadable processes gone are forgotten.
    fn begin(&mut self, inspector: &dyn ProcessInspector) {
        self.unreadable
            .retain(|pid, started| inspector.stat(pid).is_ok_and(|s| s.start_time == started));
    }

    /// Whether `pid`, started at `start_time`, is the process read ahead (always, where
    /// nothing was).
    fn same_as_ahead(&self, pid: u32, start_time: u64) -> bool {
        !self.claims_read_ahead || self.ahead_started.get(&pid) == Some(&start_time)
    }

    /// The next assembly reads what it needs itself (nothing was read ahead of it).
    pub(crate) fn read_claims_now(&mut self) {
        self.ahead.clear();
        self.ahead_started.clear();
        self.claims_read_ahead = false;
    }

    /// Forgets what changed since the last assembly; `true` when the events say that
    /// nothing else did, so that what is known may be used without reading `stat`.
    /// Subscribes first, before any `stat` read that the events are to vouch for.
    fn apply_changes(&mut self, inspector: &dyn ProcessInspector) -> bool {
        if matches!(self.feed, Feed::Untried) {
            self.feed = inspector.process_events().map_or(Feed::Off, Feed::Live);
            return false;
        }
        let Feed::Live(events) = &mut self.feed else {
            return false;
        };
        match events.drain() {
            Changes::Pids(pids) => {
                for pid in pids {
                    self.forget(pid);
                }
                true
            }
            Changes::Unknown => false,
        }
    }
}

/// Groups contexts by process in genv's order, and decides each process's environment.
/// Processes that are gone, kernel threads, and processes whose environment cannot be
/// determined are left out: no rule may act on them.
pub(crate) fn assemble_processes(
    contexts: &[ComputeContext],
    envs: Option<&[Env]>,
    inspector: &dyn ProcessInspector,
    policy: EnvPolicy,
    table: &mut ProcessTable,
    warnings: &mut Vec<Warning>,
) -> Vec<GpuProcess> {
    let mut usage: HashMap<u32, Vec<Usage>> = HashMap::new();
    for c in contexts {
        usage.entry(c.pid).or_default().push(Usage {
            index: c.index,
            bytes: c.used_memory,
        });
    }
    let order = python_set_order(contexts.iter().map(|c| c.pid));
    table.begin(inspector);
    table.known.retain(|pid, _| usage.contains_key(pid));
    table.orphans.clear();
    table.stat_files.retain(|pid, _| usage.contains_key(pid));
    let unchanged = table.apply_changes(inspector);
    let to_read: Vec<u32> = order
        .iter()
        .copied()
        .filter(|pid| !(unchanged && table.known.contains_key(pid)))
        .collect();
    let stats = read_stats(&to_read, inspector, &mut table.stat_files, handle_budget());
    let mut read = to_read.into_iter().zip(stats).peekable();
    let mut processes = Vec::with_capacity(order.len());
    let mut unread = Unread::default();
    for pid in order {
        let start_time = match read.next_if(|(p, _)| *p == pid) {
            None => table.known[&pid].start_time, // no event since it was read
            Some((_, Err(e))) => {
                unread.note(pid, &e);
                table.forget(pid); // read afresh next cycle
                continue;
            }
            Some((_, Ok(stat))) if stat.is_kernel_thread() => continue,
            Some((_, Ok(stat))) if !table.same_as_ahead(pid, stat.start_time) => continue,
            Some((_, Ok(stat))) => {
                if !refresh_known(table, pid, &stat, inspector, envs, warnings) {
                    continue;
                }
                stat.start_time
            }
        };
        let gpus = usage.remove(&pid).unwrap_or_default();
        let place = Place {
            pid,
            start_time,
            envs,
            policy,
        };
        processes.extend(place.judge(table, gpus, inspector, warnings));
    }
    warnings.extend(unread.warning());
    table.read_claims_now();
    processes
}

/// One GPU process of this assembly, its image known.
struct Place<'a> {
    pid: u32,
    start_time: u64,
    envs: Option<&'a [Env]>,
    policy: EnvPolicy,
}

impl Place<'_> {
    /// The process with the environment it counts as being in (an orphan's own, noted
    /// in the table); `None` when that cannot be told.
    fn judge(
        self,
        table: &mut ProcessTable,
        gpus: Vec<Usage>,
        inspector: &dyn ProcessInspector,
        warnings: &mut Vec<Warning>,
    ) -> Option<GpuProcess> {
        let Self {
            pid,
            start_time,
            envs,
            policy,
        } = self;
        let known = table
            .known
            .get_mut(&pid)
            .expect("read this cycle or before");
        let mut uid = || match known.uid {
            Some(uid) => Ok(uid),
            None => inspector
                .real_uid(pid)
                .inspect(|uid| known.uid = Some(*uid)),
        };
        let claimed = known.claimed.clone();
        let orphan = match (policy.orphans, claimed.as_deref(), envs) {
            (OrphanPolicy::Leave, Some(eid), Some(envs)) if !envs.iter().any(|e| e.eid == eid) => {
                orphan_of(&table.dropped, eid, &gpus, &mut uid)
            }
            _ => None,
        };
        let eid = match orphan {
            Some(orphan) => {
                if known.orphan_said.first(()) {
                    warnings.push(warning!(
                        "Process {pid} of uid {} runs in environment {}, which genv dropped when its shells exited: left running on the GPUs it had (--orphans terminate to stop such processes)",
                        orphan.uid, orphan.eid
                    ));
                }
                table.orphans.push(Orphan { pid, ..orphan });
                claimed
            }
            None => resolve_env(pid, claimed, envs, &mut uid, policy, warnings)?,
        };
        Some(GpuProcess {
            pid,
            start_time: Some(start_time),
            used_gpu_memory: gpus,
            eid,
        })
    }
}

/// Reads what a process claims once per program image (the kernel's exec-time record
/// where there is one, else `/proc`); `false` when it cannot be told (gone, or its
/// environment unreadable: said).
fn refresh_known(
    table: &mut ProcessTable,
    pid: u32,
    stat: &ProcStat,
    inspector: &dyn ProcessInspector,
    envs: Option<&[Env]>,
    warnings: &mut Vec<Warning>,
) -> bool {
    let same_image = table.known.get(&pid).is_some_and(|k| {
        k.start_time == stat.start_time && k.exec_fingerprint == stat.exec_fingerprint
    });
    if same_image {
        return true;
    }
    table.known.remove(&pid);
    let Some(claimed) = claim_of(table, pid, stat, inspector, envs) else {
        return false;
    };
    let claimed = match claimed {
        Ok(claimed) => {
            table.unreadable.answered(pid);
            claimed
        }
        Err(EnvironError::Gone(_)) => return false,
        Err(e) if e.held_by_owner() => {
            if !table
                .unreadable
                .past_grace(pid, stat.start_time, &e, warnings)
            {
                return false;
            }
            None
        }
        Err(e) => {
            warnings.push(warning!(
                "{e}: cannot tell its environment, leaving process {pid} alone"
            ));
            return false;
        }
    };
    table.known.insert(
        pid,
        Known {
            start_time: stat.start_time,
            exec_fingerprint: stat.exec_fingerprint,
            claimed,
            uid: None,
            orphan_said: WarnOnce::default(),
        },
    );
    true
}

mod claims;
mod read_ahead;
mod unread;

#[cfg(test)]
mod event_tests;

#[cfg(test)]
mod tests {
    use super::claims::{KernelClaim, claim_of_identity};
    use super::*;
    use crate::backends::procfs::ProcStat;
    use std::io;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

    /// A made-up process: (uid, environ as read or `Err` if unreadable, kernel thread).
    type FakeProc = (u32, Result<Option<String>, ()>, bool);

    #[derive(Default)]
    struct FakeProcs {
        procs: HashMap<u32, FakeProc>,
        uid_reads: AtomicU32,
        environ_reads: AtomicU32,
        /// Changes when a process "execs".
        image: AtomicU64,
        /// A process whose `stat` finds no descriptor to open (EMFILE).
        short_of_descriptors: Option<u32>,
    }

    impl ProcessInspector for FakeProcs {
        fn stat(&self, pid: u32) -> io::Result<ProcStat> {
            if self.short_of_descriptors == Some(pid) {
                return Err(io::Error::from_raw_os_error(libc::EMFILE));
            }
            let (_, _, kthread) = self.procs.get(&pid).ok_or(io::ErrorKind::NotFound)?;
            Ok(ProcStat {
                state: 'S',
                ppid: 1,
                flags: if *kthread { 0x0020_0000 } else { 0 },
                start_time: pid as u64 * 10,
                exec_fingerprint: [self.image.load(Relaxed), 0, 0],
                tty_nr: 0,
            })
        }
        fn environment_id(&self, pid: u32) -> Result<Option<String>, EnvironError> {
            self.environ_reads.fetch_add(1, Relaxed);
            match self.procs.get(&pid) {
                None => Err(EnvironError::Gone(pid)),
                Some((_, Err(()), _)) => Err(EnvironError::Unreadable(pid)),
                Some((_, Ok(eid), _)) => Ok(eid.clone()),
            }
        }
        fn real_uid(&self, pid: u32) -> io::Result<u32> {
            self.uid_reads.fetch_add(1, Relaxed);
            Ok(self.procs.get(&pid).ok_or(io::ErrorKind::NotFound)?.0)
        }
        fn gpu_node_holders(
            &self,
            _: &crate::backends::devmap::DeviceMap,
        ) -> io::Result<Vec<(u32, Vec<u32>)>> {
            Ok(Vec::new())
        }
    }

    fn env(eid: &str, uid: u32) -> Env {
        serde_json::from_value(serde_json::json!({"eid": eid, "uid": uid, "pids": [1]})).unwrap()
    }

    fn ctx(pid: u32, index: u32) -> ComputeContext {
        ComputeContext {
            pid,
            index,
            used_memory: Some(1 << 20),
        }
    }

    fn fixture() -> (FakeProcs, Vec<ComputeContext>, Vec<Env>) {
        let mut procs = FakeProcs::default();
        procs
            .procs
            .insert(10, (1000, Ok(Some("mine".into())), false)); // member
        procs
            .procs
            .insert(11, (1001, Ok(Some("mine".into())), false)); // forged, other user
        procs.procs.insert(12, (0, Ok(Some("mine".into())), false)); // root in a user's env
        procs
            .procs
            .insert(13, (1000, Ok(Some("ghost".into())), false)); // made-up id
        procs.procs.insert(14, (1000, Err(()), false)); // unreadable environ
        procs.procs.insert(15, (0, Ok(None), true)); // kernel thread
        procs.procs.insert(16, (1000, Ok(None), false)); // outside
        let contexts = [10, 11, 12, 13, 14, 15, 16, 17].map(|p| ctx(p, 0)).to_vec(); // 17 is gone
        (procs, contexts, vec![env("mine", 1000)])
    }

    fn eids(processes: &[GpuProcess]) -> Vec<(u32, Option<&str>)> {
        processes
            .iter()
            .map(|p| (p.pid, p.eid.as_deref()))
            .collect()
    }

    /// One assembly of the fixture's processes with the default policy.
    fn assemble_by_default(procs: &FakeProcs) -> (Vec<GpuProcess>, Vec<Warning>) {
        let (_, contexts, envs) = fixture();
        let mut warnings = Vec::new();
        let processes = assemble_processes(
            &contexts,
            Some(&envs),
            procs,
            EnvPolicy::default(),
            &mut ProcessTable::default(),
            &mut warnings,
        );
        (processes, warnings)
    }

    #[test]
    fn checks_identity_by_default() {
        let (processes, warnings) = assemble_by_default(&fixture().0);
        assert_eq!(
            eids(&processes),
            [
                (10, Some("mine")),
                (11, None),
                (12, Some("mine")),
                (13, None),
                (16, None)
            ]
        );
        assert_eq!(warnings.len(), 3, "{warnings:?}"); // forged, ghost, unreadable
    }

    #[test]
    fn an_environment_genv_dropped_leaves_its_own_processes_on_its_own_gpus() {
        let mut procs = FakeProcs::default();
        procs
            .procs
            .insert(20, (1000, Ok(Some("gone".into())), false)); // the job, GPU 1
        procs
            .procs
            .insert(21, (1000, Ok(Some("gone".into())), false)); // on GPU 0 too
        procs
            .procs
            .insert(22, (1001, Ok(Some("gone".into())), false)); // another user
        let contexts = vec![ctx(20, 1), ctx(21, 0), ctx(21, 1), ctx(22, 1)];
        let devices = |eids: &[&str]| {
            let attachments = eids
                .iter()
                .map(|eid| crate::state::model::Attachment {
                    eid: (*eid).to_owned(),
                    gpu_memory: None,
                    time: String::new(),
                })
                .collect();
            let attached = crate::state::Device {
                index: 1,
                total_memory: "16384m".into(),
                attachments,
            };
            vec![attached]
        };
        let run = |orphans: OrphanPolicy| {
            let mut table = ProcessTable::default();
            table
                .dropped
                .update(&[env("gone", 1000)], Some(&devices(&["gone"])));
            table.dropped.update(&[], Some(&devices(&[])));
            let policy = EnvPolicy {
                orphans,
                ..EnvPolicy::default()
            };
            let mut warnings = Vec::new();
            let processes = assemble_processes(
                &contexts,
                Some(&[]),
                &procs,
                policy,
                &mut table,
                &mut warnings,
            );
            let listed: Vec<(u32, Option<String>)> =
                processes.iter().map(|p| (p.pid, p.eid.clone())).collect();
            (listed, table.orphans.clone(), warnings.len())
        };
        let (listed, orphans, warned) = run(OrphanPolicy::Leave);
        let gone = Some("gone".to_owned());
        assert_eq!(listed, vec![(20, gone.clone()), (21, None), (22, None)]);
        assert_eq!(
            orphans,
            vec![Orphan {
                pid: 20,
                uid: 1000,
                eid: "gone".into()
            }]
        );
        assert_eq!(warned, 3, "the orphan said once, the two outsiders");
        let (listed, orphans, _) = run(OrphanPolicy::Terminate);
        assert_eq!(listed, vec![(20, None), (21, None), (22, None)]);
        assert!(orphans.is_empty());
    }

    #[test]
    fn the_kernels_record_names_active_environments_and_no_environment() {
        use genv_ebpf_common::{env_id_hash, identity};
        let envs = [env("E", 1000)];
        let claim = |id| claim_of_identity(id, Some(&envs));
        assert_eq!(claim(env_id_hash(b"E")), KernelClaim::In("E".to_owned()));
        assert_eq!(claim(identity::NO_ENV), KernelClaim::Outside);
        // Unresolved, or an environment not active: /proc spells it.
        assert_eq!(claim(identity::UNRESOLVED), KernelClaim::AskProc);
        assert_eq!(claim(env_id_hash(b"gone")), KernelClaim::AskProc);
        assert_eq!(
            claim_of_identity(env_id_hash(b"E"), None),
            KernelClaim::AskProc
        );
    }

    #[test]
    fn a_process_whose_stat_cannot_be_opened_is_said_not_passed_over_as_gone() {
        let mut procs = fixture().0;
        procs.short_of_descriptors = Some(16);
        let (processes, warnings) = assemble_by_default(&procs);
        assert!(!eids(&processes).contains(&(16, None)), "not judged unread");
        let said: Vec<String> = warnings.iter().map(ToString::to_string).collect();
        assert!(
            said.iter()
                .any(|w| w.contains("/proc/16/stat") && w.contains("left out of this cycle")),
            "{said:?}"
        );
        // The gone process (17) is not a warning: 3 as before, plus this one.
        assert_eq!(warnings.len(), 4, "{said:?}");
    }

    #[test]
    fn genv_behaviour_believes_every_claim() {
        let (procs, contexts, envs) = fixture();
        let policy = EnvPolicy {
            trust_unknown_env_ids: true,
            trust_foreign_env_ids: true,
            ..EnvPolicy::default()
        };
        let processes = assemble_processes(
            &contexts,
            Some(&envs),
            &procs,
            policy,
            &mut ProcessTable::default(),
            &mut Vec::new(),
        );
        assert_eq!(
            eids(&processes),
            [
                (10, Some("mine")),
                (11, Some("mine")),
                (12, Some("mine")),
                (13, Some("ghost")),
                (16, None)
            ]
        );
        assert_eq!(procs.uid_reads.load(Relaxed), 0);
    }

    #[test]
    fn without_envs_only_unclaimed_processes_are_judged() {
        let (procs, contexts, _) = fixture();
        let processes = assemble_processes(
            &contexts,
            None,
            &procs,
            EnvPolicy::default(),
            &mut ProcessTable::default(),
            &mut Vec::new(),
        );
        assert_eq!(eids(&processes), [(16, None)]);
    }

    #[test]
    fn groups_usage_per_process_in_nvml_order() {
        let mut procs = FakeProcs::default();
        procs.procs.insert(20, (0, Ok(None), false));
        let contexts = vec![ctx(20, 1), ctx(20, 0)];
        let processes = assemble_processes(
            &contexts,
            Some(&[]),
            &procs,
            EnvPolicy::default(),
            &mut ProcessTable::default(),
            &mut Vec::new(),
        );
        assert_eq!(processes[0].indices().collect::<Vec<_>>(), [1, 0]);
        assert_eq!(processes[0].start_time, Some(200));
    }

    #[test]
    fn reads_a_process_image_once_and_again_after_exec() {
        let mut procs = FakeProcs::default();
        procs
            .procs
            .insert(30, (1000, Ok(Some("mine".into())), false));
        let envs = vec![env("mine", 1000)];
        let contexts = vec![ctx(30, 0)];
        let mut table = ProcessTable::default();
        let mut cycle = |procs: &FakeProcs| {
            let processes = assemble_processes(
                &contexts,
                Some(&envs),
                procs,
                EnvPolicy::default(),
                &mut table,
                &mut Vec::new(),
            );
            processes[0].eid.clone()
        };
        assert_eq!(cycle(&procs).as_deref(), Some("mine"));
        assert_eq!(cycle(&procs).as_deref(), Some("mine"));
        assert_eq!(
            (
                procs.environ_reads.load(Relaxed),
                procs.uid_reads.load(Relaxed)
            ),
            (1, 1)
        );
        // The process execs with a forged id: the new image is read.
        procs
            .procs
            .insert(30, (1000, Ok(Some("forged".into())), false));
        procs.image.fetch_add(1, Relaxed);
        assert_eq!(cycle(&procs), None);
        assert_eq!(procs.environ_reads.load(Relaxed), 2);
    }
}
