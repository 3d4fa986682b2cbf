//! Taking a snapshot: GPU contexts from NVML (or, without NVML, GPU nodes held open in
//! `/proc`), each process's environment from `/proc/<pid>/environ`, and genv's state.
//!
//! Called with genv's global lock held, as genv takes its snapshot.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::io;
use std::path::PathBuf;

use super::order::python_set_order;
use super::{GpuProcess, Snapshot, Usage};
use crate::backends::nvml::{ComputeContext, GpuBackend, GpuInfo, NvmlBackend};
use crate::backends::procfs::{self, EnvironError, ProcStat, StatFile};
use crate::state::{Device, Env, StateDir, memory::format_mebibytes};

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
}

/// What the snapshot reads of processes; a trait so assembly can be tested on made-up
/// processes.
pub trait ProcessInspector: Sync {
    fn stat(&self, pid: u32) -> io::Result<ProcStat>;
    /// `stat`, through a handle kept between cycles where the inspector has one.
    fn stat_cached(&self, pid: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
        let _ = handle;
        self.stat(pid)
    }
    fn environment_id(&self, pid: u32) -> Result<Option<String>, EnvironError>;
    fn real_uid(&self, pid: u32) -> io::Result<u32>;
    fn gpu_node_holders(&self) -> io::Result<Vec<(u32, Vec<u32>)>>;
}

/// The real `/proc`.
pub struct Procfs {
    pub root: PathBuf,
}

impl Default for Procfs {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/proc"),
        }
    }
}

impl ProcessInspector for Procfs {
    fn stat(&self, pid: u32) -> io::Result<ProcStat> {
        procfs::stat(pid)
    }
    fn stat_cached(&self, pid: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
        if let Some(stat) = handle.as_ref().and_then(|h| h.read().ok()) {
            return Ok(stat);
        }
        // First sight, or the process the handle named is gone (its pid may now name
        // another): open afresh.
        let file = StatFile::open(pid)?;
        let stat = file.read();
        *handle = Some(file);
        stat
    }
    fn environment_id(&self, pid: u32) -> Result<Option<String>, EnvironError> {
        procfs::environment_id(pid)
    }
    fn real_uid(&self, pid: u32) -> io::Result<u32> {
        procfs::real_uid(pid)
    }
    fn gpu_node_holders(&self) -> io::Result<Vec<(u32, Vec<u32>)>> {
        procfs::gpu_node_holders(&self.root)
    }
}

/// Something the operator should know about this cycle; printed on stderr as
/// `[WARNING] ...`, as genv prints its warnings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning(pub String);

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[WARNING] {}", self.0)
    }
}

macro_rules! warning {
    ($($arg:tt)*) => { Warning(format!($($arg)*)) };
}

/// Where GPU facts come from right now.
enum Gpus {
    Nvml(Box<dyn GpuBackend>),
    /// NVML could not be loaded; it is tried again every cycle.
    Unloaded,
}

pub struct SnapshotBuilder {
    state: StateDir,
    nvml_library: OsString,
    gpus: Gpus,
    inspector: Box<dyn ProcessInspector + Send>,
    policy: EnvPolicy,
    /// minor → index, from the last NVML device list, for `/proc` scans.
    minor_to_index: Option<HashMap<u32, u32>>,
    last_devices: Vec<GpuInfo>,
    table: ProcessTable,
    said_nvml_missing: bool,
    said_minor_guess: bool,
}

impl SnapshotBuilder {
    pub fn new(state: StateDir, nvml_library: OsString, policy: EnvPolicy) -> Self {
        Self {
            state,
            nvml_library,
            gpus: Gpus::Unloaded,
            inspector: Box::new(Procfs::default()),
            policy,
            minor_to_index: None,
            last_devices: Vec::new(),
            table: ProcessTable::default(),
            said_nvml_missing: false,
            said_minor_guess: false,
        }
    }

    /// Replaces the GPU backend (tests, benchmarks).
    pub fn with_gpu_backend(mut self, backend: Box<dyn GpuBackend>) -> Self {
        self.gpus = Gpus::Nvml(backend);
        self
    }

    pub fn with_inspector(mut self, inspector: Box<dyn ProcessInspector + Send>) -> Self {
        self.inspector = inspector;
        self
    }

    pub fn state(&self) -> &StateDir {
        &self.state
    }

    /// The devices NVML listed at the last snapshot (empty before one, or without NVML).
    pub fn devices(&self) -> &[GpuInfo] {
        &self.last_devices
    }

    /// The kernel reported that `pid` exec'd or exited: what was read of it no longer
    /// holds. (Each snapshot also re-validates by start time and exec fingerprint; the
    /// events make that a formality.)
    pub fn forget(&mut self, pid: u32) {
        self.table.known.remove(&pid);
        self.table.stat_files.remove(&pid);
    }

    /// Loads NVML if it is not loaded; says once that it is missing, and once that it is
    /// back.
    fn ensure_nvml(&mut self, warnings: &mut Vec<Warning>) {
        if matches!(self.gpus, Gpus::Nvml(_)) {
            return;
        }
        match NvmlBackend::load(&self.nvml_library) {
            Ok(nvml) => {
                if self.said_nvml_missing {
                    warnings.push(warning!(
                        "NVML loaded from {}: the memory rule is enforced again",
                        self.nvml_library.to_string_lossy()
                    ));
                    self.said_nvml_missing = false;
                }
                self.gpus = Gpus::Nvml(Box::new(nvml));
            }
            Err(e) if !self.said_nvml_missing => {
                self.said_nvml_missing = true;
                warnings.push(warning!(
                    "cannot load NVML from {} ({e}); enforcing the device rules from GPU device nodes held open in /proc, and skipping the memory rule until it loads",
                    self.nvml_library.to_string_lossy()
                ));
            }
            Err(_) => {}
        }
    }

    /// GPU contexts, from NVML or else from `/proc`, and whether memory figures are known.
    fn gpu_contexts(&mut self, warnings: &mut Vec<Warning>) -> (Vec<ComputeContext>, bool) {
        self.ensure_nvml(warnings);
        if let Gpus::Nvml(nvml) = &self.gpus {
            match nvml.query() {
                Ok(view) => {
                    self.minor_to_index = Some(
                        view.devices
                            .iter()
                            .filter_map(|d| Some((d.minor?, d.index)))
                            .collect(),
                    );
                    self.last_devices = view.devices;
                    return (view.contexts, true);
                }
                Err(e) => warnings.push(warning!(
                    "{e}; this cycle enforces the device rules from /proc and skips the memory rule"
                )),
            }
        }
        (self.scan_proc(warnings), false)
    }

    fn scan_proc(&mut self, warnings: &mut Vec<Warning>) -> Vec<ComputeContext> {
        let holders = match self.inspector.gpu_node_holders() {
            Ok(holders) => holders,
            Err(e) => {
                warnings.push(warning!("cannot scan /proc for GPU device nodes: {e}"));
                return Vec::new();
            }
        };
        let map = self.minor_map(warnings);
        let mut contexts: Vec<ComputeContext> = holders
            .into_iter()
            .flat_map(|(pid, minors)| {
                let map = &map;
                minors.into_iter().map(move |minor| ComputeContext {
                    pid,
                    index: map.get(&minor).copied().unwrap_or(minor),
                    used_memory: None,
                })
            })
            .collect();
        // NVML lists contexts device by device.
        contexts.sort_by_key(|c| (c.index, c.pid));
        contexts
    }

    /// minor → NVML index: from NVML when it was last seen, else from the driver's
    /// `/proc/driver/nvidia/gpus` (PCI order is NVML's order), else minor = index.
    fn minor_map(&mut self, warnings: &mut Vec<Warning>) -> HashMap<u32, u32> {
        if let Some(map) = &self.minor_to_index {
            return map.clone();
        }
        if let Some(minors) = procfs::driver_minors_in_pci_order() {
            return minors.into_iter().zip(0..).collect();
        }
        if !self.said_minor_guess {
            self.said_minor_guess = true;
            warnings.push(warning!(
                "no NVML and no /proc/driver/nvidia: assuming /dev/nvidiaN is GPU index N"
            ));
        }
        HashMap::new()
    }

    /// Takes a snapshot. The caller holds genv's global lock.
    pub fn take(&mut self) -> (Snapshot, Vec<Warning>) {
        let mut warnings = Vec::new();
        let (contexts, memory_known) = self.gpu_contexts(&mut warnings);

        let envs = self
            .state
            .load_envs()
            .map_err(|e| {
                warnings.push(warning!(
                    "{e}; rules that need environments are skipped this cycle"
                ))
            })
            .ok();
        let devices = envs.as_ref().and_then(|envs| {
            match self.state.load_devices(envs) {
                Ok(Some(devices)) => Some(devices),
                // genv would create the file with nothing attached.
                Ok(None) => Some(self.unattached_devices()),
                Err(e) => {
                    warnings.push(warning!(
                        "{e}; rules that need devices are skipped this cycle"
                    ));
                    None
                }
            }
        });

        let processes = assemble_processes(
            &contexts,
            envs.as_deref(),
            self.inspector.as_ref(),
            self.policy,
            &mut self.table,
            &mut warnings,
        );
        let snapshot = Snapshot {
            processes,
            envs,
            devices,
            memory_known,
        };
        (snapshot, warnings)
    }

    fn unattached_devices(&self) -> Vec<Device> {
        self.last_devices
            .iter()
            .map(|d| Device {
                index: d.index,
                total_memory: format_mebibytes(d.total_memory),
                attachments: Vec::new(),
            })
            .collect()
    }
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
}

/// Known processes, kept across cycles; only GPU processes of the last cycle stay.
#[derive(Default)]
pub(crate) struct ProcessTable {
    known: HashMap<u32, Known>,
    stat_files: HashMap<u32, Option<StatFile>>,
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
    table.known.retain(|pid, _| usage.contains_key(pid));
    table.stat_files.retain(|pid, _| usage.contains_key(pid));
    let stats = read_stats(&order, inspector, &mut table.stat_files, handle_budget());
    let mut processes = Vec::with_capacity(order.len());
    for (pid, stat) in order.into_iter().zip(stats) {
        let Ok(stat) = stat else {
            table.known.remove(&pid);
            table.stat_files.remove(&pid);
            continue; // gone since NVML listed it
        };
        if stat.is_kernel_thread() {
            continue;
        }
        let same_image = table.known.get(&pid).is_some_and(|k| {
            k.start_time == stat.start_time && k.exec_fingerprint == stat.exec_fingerprint
        });
        if !same_image {
            table.known.remove(&pid);
            let claimed = match inspector.environment_id(pid) {
                Ok(claimed) => claimed,
                Err(EnvironError::Gone(_)) => continue,
                Err(e) => {
                    warnings.push(warning!(
                        "{e}: cannot tell its environment, leaving process {pid} alone"
                    ));
                    continue;
                }
            };
            table.known.insert(
                pid,
                Known {
                    start_time: stat.start_time,
                    exec_fingerprint: stat.exec_fingerprint,
                    claimed,
                    uid: None,
                },
            );
        }
        let known = table.known.get_mut(&pid).expect("just checked or inserted");
        let mut uid = || match known.uid {
            Some(uid) => Ok(uid),
            None => inspector
                .real_uid(pid)
                .inspect(|uid| known.uid = Some(*uid)),
        };
        let claimed = known.claimed.clone();
        let Some(eid) = resolve_env(pid, claimed, envs, &mut uid, policy, warnings) else {
            continue;
        };
        processes.push(GpuProcess {
            pid,
            start_time: Some(stat.start_time),
            used_gpu_memory: usage.remove(&pid).unwrap_or_default(),
            eid,
        });
    }
    processes
}

/// Below this many processes one thread reads every `stat`; above it the reads (each a
/// few microseconds of kernel formatting) are spread over the machine's cores.
const PARALLEL_STATS: usize = 256;

/// How many `stat` handles the table may keep: half the soft descriptor limit, so that
/// reading past the budget (by path, which opens and closes) always finds a descriptor.
fn handle_budget() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    limit.current.map_or(usize::MAX, |n| (n / 2) as usize)
}

/// `/proc/<pid>/stat` of every pid, in order: through the handles kept between cycles,
/// and new ones while `budget` allows; beyond it, by path.
fn read_stats(
    pids: &[u32],
    inspector: &dyn ProcessInspector,
    files: &mut HashMap<u32, Option<StatFile>>,
    budget: usize,
) -> Vec<io::Result<ProcStat>> {
    let mut spare = budget.saturating_sub(files.values().filter(|f| f.is_some()).count());
    // (pid, its handle, whether it may keep one)
    let mut work: Vec<(u32, Option<StatFile>, bool)> = pids
        .iter()
        .map(|pid| {
            let handle = files.remove(pid).flatten();
            let keep = handle.is_some() || spare > 0;
            if handle.is_none() && keep {
                spare -= 1;
            }
            (*pid, handle, keep)
        })
        .collect();
    let read = |chunk: &mut [(u32, Option<StatFile>, bool)]| -> Vec<io::Result<ProcStat>> {
        chunk
            .iter_mut()
            .map(|(pid, handle, keep)| match keep {
                true => inspector.stat_cached(*pid, handle),
                false => inspector.stat(*pid),
            })
            .collect()
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let stats = if pids.len() < PARALLEL_STATS || threads == 1 {
        read(&mut work)
    } else {
        let chunk = work.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let handles: Vec<_> = work
                .chunks_mut(chunk)
                .map(|part| scope.spawn(move || read(part)))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a stat reader panicked"))
                .collect()
        })
    };
    files.extend(work.into_iter().map(|(pid, handle, _)| (pid, handle)));
    stats
}

/// The environment a process counts as being in: `Some(None)` outside any,
/// `Some(Some(eid))` in `eid`, `None` when it cannot be told.
fn resolve_env(
    pid: u32,
    claimed: Option<String>,
    envs: Option<&[Env]>,
    uid: &mut dyn FnMut() -> io::Result<u32>,
    policy: EnvPolicy,
    warnings: &mut Vec<Warning>,
) -> Option<Option<String>> {
    let Some(eid) = claimed else {
        return Some(None);
    };
    if policy.trust_unknown_env_ids && policy.trust_foreign_env_ids {
        return Some(Some(eid));
    }
    let Some(envs) = envs else {
        warnings.push(warning!(
            "cannot check environment {eid} of process {pid} without envs.json: leaving it alone"
        ));
        return None;
    };
    let Some(env) = envs.iter().find(|e| e.eid == eid) else {
        if policy.trust_unknown_env_ids {
            return Some(Some(eid));
        }
        warnings.push(warning!(
            "process {pid} claims environment {eid}, which is not active: it counts as outside any environment"
        ));
        return Some(None);
    };
    if policy.trust_foreign_env_ids {
        return Some(Some(eid));
    }
    match uid() {
        Ok(uid) if uid == env.uid || uid == 0 => Some(Some(eid)),
        Ok(uid) => {
            warnings.push(warning!(
                "process {pid} of uid {uid} claims environment {eid} of uid {}: it counts as outside any environment",
                env.uid
            ));
            Some(None)
        }
        Err(e) => {
            warnings.push(warning!(
                "cannot read the uid of process {pid} ({e}): leaving it alone"
            ));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
    }

    impl ProcessInspector for FakeProcs {
        fn stat(&self, pid: u32) -> io::Result<ProcStat> {
            let (_, _, kthread) = self.procs.get(&pid).ok_or(io::ErrorKind::NotFound)?;
            Ok(ProcStat {
                state: 'S',
                ppid: 1,
                flags: if *kthread { 0x0020_0000 } else { 0 },
                start_time: pid as u64 * 10,
                exec_fingerprint: [self.image.load(Relaxed), 0, 0],
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
        fn gpu_node_holders(&self) -> io::Result<Vec<(u32, Vec<u32>)>> {
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

    #[test]
    fn checks_identity_by_default() {
        let (procs, contexts, envs) = fixture();
        let mut warnings = Vec::new();
        let processes = assemble_processes(
            &contexts,
            Some(&envs),
            &procs,
            EnvPolicy::default(),
            &mut ProcessTable::default(),
            &mut warnings,
        );
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
    fn genv_behaviour_believes_every_claim() {
        let (procs, contexts, envs) = fixture();
        let policy = EnvPolicy {
            trust_unknown_env_ids: true,
            trust_foreign_env_ids: true,
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

    /// Real handles (on this test's own `stat`), to see how many the table keeps.
    struct Handles;

    impl ProcessInspector for Handles {
        fn stat(&self, _: u32) -> io::Result<ProcStat> {
            procfs::stat(std::process::id())
        }
        fn stat_cached(&self, _: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
            let file = StatFile::open(std::process::id())?;
            let stat = file.read();
            *handle = Some(file);
            stat
        }
        fn environment_id(&self, _: u32) -> Result<Option<String>, EnvironError> {
            Ok(None)
        }
        fn real_uid(&self, _: u32) -> io::Result<u32> {
            Ok(0)
        }
        fn gpu_node_holders(&self) -> io::Result<Vec<(u32, Vec<u32>)>> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn keeps_stat_handles_within_the_budget_and_reads_the_rest_by_path() {
        let mut files = HashMap::new();
        let pids: Vec<u32> = (100..110).collect();
        let stats = read_stats(&pids, &Handles, &mut files, 4);
        assert!(stats.iter().all(Result::is_ok), "every process is read");
        assert_eq!(files.values().filter(|f| f.is_some()).count(), 4);
        // Next cycle: the four handles stay, no new ones are opened.
        let stats = read_stats(&pids, &Handles, &mut files, 4);
        assert!(stats.iter().all(Result::is_ok));
        assert_eq!(files.values().filter(|f| f.is_some()).count(), 4);
    }
}
