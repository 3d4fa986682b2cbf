//! Taking a snapshot: GPU contexts from NVML (or, without NVML, GPU nodes held open in
//! `/proc`), each process's environment (see [`super::process_table`]), and genv's state.
//!
//! genv takes its whole snapshot under its global lock. Here only the state files are
//! read under it: the processes' claims come from their environment blocks, which their
//! owners can keep from answering (see `crate::backends::address_space`), so they are
//! read first, without the lock ([`SnapshotBuilder::read_ahead`]). A claim is fixed at
//! the process's exec, so reading it earlier changes nothing that the lock protects.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::Path;

use super::unreadable::Kept;

use super::inspect::{ProcessInspector, Procfs};
use super::orphans::OrphanPolicy;
use super::owners::StateGuard;
use super::process_table::{EnvPolicy, ProcessTable, assemble_processes};
use super::{Snapshot, Warning};
use crate::backends::devmap::{DeviceMap, NodeOverride};
use crate::backends::nvml::{ComputeContext, GpuBackend, GpuInfo, NvmlBackend};
use crate::backends::procfs;
use crate::state::{Device, Env, StateDir, memory::format_mebibytes};
use crate::warn_once::WarnOnce;

/// Where GPU facts come from right now.
enum Gpus {
    Nvml(Box<dyn GpuBackend>),
    /// NVML could not be loaded; it is tried again every cycle.
    Unloaded,
}

pub struct SnapshotBuilder {
    /// NVML calls that failed (a library that would not load, a query that failed),
    /// for the metrics.
    pub nvml_errors: u64,
    state: StateDir,
    nvml_library: OsString,
    gpus: Gpus,
    inspector: Box<dyn ProcessInspector + Send>,
    policy: EnvPolicy,
    last_devices: Vec<GpuInfo>,
    /// `--gpu-node` overrides.
    gpu_nodes: Vec<NodeOverride>,
    device_map: DeviceMap,
    table: ProcessTable,
    /// What is believed of genv's world-writable state, across cycles.
    guard: StateGuard,
    /// NVML could not be loaded, said until it loads.
    nvml_missing: WarnOnce,
    /// The device map is guessed, said once.
    minor_guess: WarnOnce,
    /// Processes the kernel saw start CUDA outside any environment, each with the GPU
    /// it counts on: computing before NVML lists them (see [`Self::prove_computing`]).
    /// Keyed by pid, with the start time it had: a pid reused after a lost exit event
    /// is not the process proven.
    proven: HashMap<u32, (u32, u64)>,
    /// What [`Self::read_ahead`] read for the next snapshot.
    ahead: Option<Ahead>,
}

/// The half of a snapshot read before genv's lock is taken.
struct Ahead {
    among: Option<Vec<u32>>,
    contexts: Vec<ComputeContext>,
    memory_known: bool,
    warnings: Vec<Warning>,
}

impl SnapshotBuilder {
    pub fn new(state: StateDir, nvml_library: OsString, policy: EnvPolicy) -> Self {
        Self {
            nvml_errors: 0,
            state,
            nvml_library,
            gpus: Gpus::Unloaded,
            inspector: Box::new(Procfs::default()),
            policy,
            last_devices: Vec::new(),
            gpu_nodes: Vec::new(),
            device_map: DeviceMap::default(),
            table: ProcessTable::default(),
            guard: StateGuard::default(),
            nvml_missing: WarnOnce::default(),
            minor_guess: WarnOnce::default(),
            proven: HashMap::new(),
            ahead: None,
        }
    }

    /// Adds `--gpu-node MAJOR:MINOR=INDEX` entries to the device map.
    pub fn with_gpu_nodes(mut self, overrides: Vec<NodeOverride>) -> Self {
        self.gpu_nodes = overrides;
        self
    }

    pub fn set_inspector(&mut self, inspector: Box<dyn ProcessInspector + Send>) {
        self.inspector = inspector;
        self.table = ProcessTable::default(); // what the old one read
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
        self.table.forget(pid);
        self.proven.remove(&pid);
    }

    /// The kernel saw `pid` start CUDA (a libcuda probe): it is a GPU process on GPU
    /// `index` from now until its exec or exit, whether or not NVML lists it yet.
    pub fn prove_computing(&mut self, pid: u32, index: u32) {
        if let Ok(stat) = procfs::stat(pid) {
            self.proven.insert(pid, (index, stat.start_time));
        }
    }

    /// Loads NVML if it is not loaded; says once that it is missing, and once that it is
    /// back.
    fn ensure_nvml(&mut self, warnings: &mut Vec<Warning>) {
        if matches!(self.gpus, Gpus::Nvml(_)) {
            return;
        }
        match NvmlBackend::load(&self.nvml_library) {
            Ok(nvml) => {
                if self.nvml_missing.clear() {
                    warnings.push(warning!(
                        "NVML loaded from {}: the memory rule is enforced again",
                        self.nvml_library.to_string_lossy()
                    ));
                }
                self.gpus = Gpus::Nvml(Box::new(nvml));
            }
            Err(e) if self.nvml_missing.first(()) => {
                self.nvml_errors += 1;
                warnings.push(warning!(
                    "cannot load NVML from {} ({e}); enforcing the device rules from GPU device nodes held open in /proc, and skipping the memory rule until it loads",
                    self.nvml_library.to_string_lossy()
                ));
            }
            Err(_) => self.nvml_errors += 1,
        }
    }

    /// GPU contexts, from NVML or else from `/proc`, and whether memory figures are known.
    /// Without NVML, `among` (when given) names the only processes whose descriptors are
    /// read: a check of just-opened processes then costs their descriptors, not every
    /// process's on the machine.
    fn gpu_contexts(
        &mut self,
        among: Option<&[u32]>,
        warnings: &mut Vec<Warning>,
    ) -> (Vec<ComputeContext>, bool) {
        self.ensure_nvml(warnings);
        if let Gpus::Nvml(nvml) = &self.gpus {
            match nvml.query() {
                Ok(view) => {
                    let changed = view.devices != self.last_devices;
                    self.last_devices = view.devices;
                    if changed || self.device_map == DeviceMap::default() {
                        self.refresh_device_map(warnings);
                    }
                    return (view.contexts, true);
                }
                Err(e) => {
                    self.nvml_errors += 1;
                    warnings.push(warning!(
                        "{e}; this cycle enforces the device rules from /proc and skips the memory rule"
                    ))
                }
            }
        }
        (self.scan_proc(among, warnings), false)
    }

    fn scan_proc(
        &mut self,
        among: Option<&[u32]>,
        warnings: &mut Vec<Warning>,
    ) -> Vec<ComputeContext> {
        let holders = match among {
            // The map as the last full scan (or cycle) built it, once there is one.
            Some(pids) if self.device_map != DeviceMap::default() => self
                .inspector
                .gpu_node_holders_among(&self.device_map, pids),
            Some(pids) => {
                self.refresh_device_map(warnings);
                self.inspector
                    .gpu_node_holders_among(&self.device_map, pids)
            }
            None => {
                self.refresh_device_map(warnings);
                match self.inspector.gpu_node_holders(&self.device_map) {
                    Ok(holders) => holders,
                    Err(e) => {
                        warnings.push(warning!("cannot scan /proc for GPU device nodes: {e}"));
                        return Vec::new();
                    }
                }
            }
        };
        let mut contexts: Vec<ComputeContext> = holders
            .into_iter()
            .flat_map(|(pid, indices)| {
                indices.into_iter().map(move |index| ComputeContext {
                    pid,
                    index,
                    used_memory: None,
                })
            })
            .collect();
        // NVML lists contexts device by device.
        contexts.sort_by_key(|c| (c.index, c.pid));
        contexts
    }

    /// Which node is which GPU: NVML's minor numbers (its last device list), else the
    /// driver's PCI order, else a guess; `/proc/devices` for the major; and the
    /// `--gpu-node` overrides. The kernel programs and the `/proc` scan both use it.
    fn refresh_device_map(&mut self, warnings: &mut Vec<Warning>) {
        let proc_devices = std::fs::read_to_string("/proc/devices").ok();
        self.device_map = DeviceMap::build(
            &self.last_devices,
            procfs::driver_minors_in_pci_order(),
            proc_devices.as_deref(),
            &self.gpu_nodes,
        );
        if self.device_map.is_guessed() && self.minor_guess.first(()) {
            warnings.push(warning!(
                "no NVML and no /proc/driver/nvidia: assuming /dev/nvidiaN is GPU index N"
            ));
        }
    }

    /// The device map the last snapshot used.
    pub fn device_map(&self) -> &DeviceMap {
        &self.device_map
    }

    /// Takes a snapshot. The caller holds genv's global lock, taken after
    /// [`Self::read_ahead`].
    pub fn take(&mut self) -> (Snapshot, Vec<Warning>) {
        self.take_among(None)
    }

    /// What a snapshot for `among` reads of the processes, read before the caller takes
    /// genv's lock: the GPU contexts and, for each process not known yet, what it
    /// claims (its environment block, within a deadline). The snapshot taken next under
    /// the lock reads no environment block: a process it finds unread is left out of it,
    /// and read ahead of the next.
    pub fn read_ahead(&mut self, among: Option<&[u32]>) {
        let mut warnings = Vec::new();
        let (contexts, memory_known) = self.gpu_contexts_with_proven(among, &mut warnings);
        let pids: Vec<u32> = contexts.iter().map(|c| c.pid).collect();
        self.table.read_claims_ahead(&pids, self.inspector.as_ref());
        self.ahead = Some(Ahead {
            among: among.map(<[u32]>::to_vec),
            contexts,
            memory_known,
            warnings,
        });
    }

    /// Loads the record of unreadable processes kept in `run_dir` by earlier runs (a
    /// one-shot snapshot's grace, see [`super::unreadable`]); its path, for
    /// [`Self::save_unreadable`] (see `Unreadable::in_run_dir`).
    pub fn remember_unreadable(&mut self, run_dir: &Path) -> Option<Kept> {
        let (record, kept) = super::unreadable::Unreadable::in_run_dir(run_dir)?;
        self.table.unreadable = record;
        Some(kept)
    }

    /// Saves the record [`Self::remember_unreadable`] loaded, as it is now.
    pub fn save_unreadable(&self, kept: &Kept) -> std::io::Result<()> {
        self.table.unreadable.save_to(kept)
    }

    /// The GPU contexts, with the processes the kernel proved to be computing.
    fn gpu_contexts_with_proven(
        &mut self,
        among: Option<&[u32]>,
        warnings: &mut Vec<Warning>,
    ) -> (Vec<ComputeContext>, bool) {
        let (mut contexts, memory_known) = self.gpu_contexts(among, warnings);
        self.proven
            .retain(|&pid, (_, started)| procfs::stat(pid).is_ok_and(|s| s.start_time == *started));
        for (&pid, &(index, _)) in &self.proven {
            if !contexts.iter().any(|c| c.pid == pid) {
                let used_memory = memory_known.then_some(0);
                contexts.push(ComputeContext {
                    pid,
                    index,
                    used_memory,
                });
            }
        }
        (contexts, memory_known)
    }

    /// Takes a snapshot for a check of `among` alone (all processes when `None`): where
    /// GPU use comes from `/proc` (no NVML), only their descriptors are read, and the
    /// snapshot lists no other GPU process. The caller holds genv's global lock; what
    /// [`Self::read_ahead`] read for the same `among` is used, else it is read now.
    pub fn take_among(&mut self, among: Option<&[u32]>) -> (Snapshot, Vec<Warning>) {
        let ahead = self
            .ahead
            .take()
            .filter(|ahead| ahead.among.as_deref() == among);
        let (contexts, memory_known, mut warnings) = match ahead {
            Some(ahead) => (ahead.contexts, ahead.memory_known, ahead.warnings),
            None => {
                self.table.read_claims_now();
                let mut warnings = Vec::new();
                let (contexts, known) = self.gpu_contexts_with_proven(among, &mut warnings);
                (contexts, known, warnings)
            }
        };

        if among.is_none() {
            let pids: Vec<u32> = contexts.iter().map(|c| c.pid).collect();
            self.table.unreadable.keep_only(&pids);
        }
        let (envs, devices) = self.guarded_state(&mut warnings);

        if let Some(envs) = &envs {
            self.table.dropped.update(envs, devices.as_deref());
        }
        let processes = assemble_processes(
            &contexts,
            envs.as_deref(),
            self.inspector.as_ref(),
            self.policy,
            &mut self.table,
            &mut warnings,
        );
        let leave = self.policy.orphans == OrphanPolicy::Leave;
        let snapshot = Snapshot {
            processes,
            envs,
            devices,
            memory_known,
            orphans: std::mem::take(&mut self.table.orphans),
            dropped_envs: match leave {
                true => self.table.dropped.all_dropped(),
                false => Vec::new(),
            },
        };
        (snapshot, warnings)
    }

    /// genv's environments and devices, read through what is believed of them
    /// ([`StateGuard`]). The caller holds genv's global lock.
    fn guarded_state(
        &mut self,
        warnings: &mut Vec<Warning>,
    ) -> (Option<Vec<Env>>, Option<Vec<Device>>) {
        let envs = self.guard.envs(self.state.load_envs(), warnings);
        let devices = envs.as_ref().and_then(|envs| {
            let read = self.state.load_devices(envs);
            match self.guard.devices(read, envs, warnings) {
                Ok(Some(devices)) => Some(devices),
                // genv would create the file with nothing attached.
                Ok(None) => Some(self.unattached_devices()),
                Err(()) => None,
            }
        });
        (envs, devices)
    }

    /// genv's environments and devices as they are now, read again as a snapshot reads
    /// them (the caller holds genv's global lock): after the caller's own write to them
    /// (a detach). `None` when either cannot be read. Its warnings were the snapshot's
    /// just taken, and are not said twice.
    pub fn state_now(&mut self) -> Option<(Vec<Env>, Vec<Device>)> {
        let (envs, devices) = self.guarded_state(&mut Vec::new());
        envs.zip(devices)
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
