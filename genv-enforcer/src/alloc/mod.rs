//! `--memory-at-alloc` in the daemon: the libcuda probes attached to every libcuda
//! found (ldconfig's, the one beside NVML once it loads, `--cuda-lib`, and any copy a
//! process that opens a GPU node maps, see [`copies`]), and their maps
//! kept true: caps from genv's state at each full cycle, NVML's baselines at each
//! memory poll, each CUDA process's device numbering when it starts CUDA, its charges
//! taken off when it exits. The kernel decides; this prints what it decided.

mod budget;
mod capped;
pub mod caps;
mod copies;
mod exiting;
mod looks;
pub mod started_cap;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use genv_ebpf_common::alloc::{Delta, EnvGpu};

use crate::backends::nvml::GpuInfo;
use crate::backends::procfs;
use crate::intake::OverCap;
use crate::kernel::alloc_maps::{AllocMaps, DeltasAround};
use crate::kernel::cuda::{CudaKernel, Library, Probes};
use crate::kernel::policy_maps::IdentityReader;
use caps::{Caps, names_a_uuid, ordinals};
use exiting::Exiting;
use started_cap::{GPU_MEMORY_VAR, SHELL_VAR, StartedWith};

use crate::state::{Device, Env};
pub use caps::MemoryAtAlloc;

/// The `alloc` stage: owns `--memory-at-alloc`'s maps and probes, and reads the
/// identities the kernel recorded through a hold of its own.
pub struct AllocSide {
    maps: AllocMaps,
    probes: Probes,
    identities: IdentityReader,
    caps: Caps,
    /// The copies probed, and the libraries given or found (not looked into again).
    copies: copies::Copies,
    /// Whether any library is attached.
    attached_any: bool,
    /// The NVML library's directory the libcuda beside it was last looked for in.
    beside_nvml: Option<PathBuf>,
    /// The caps processes that started CUDA were started with, for the line.
    started_caps: HashMap<u32, StartedWith>,
    /// Processes seen starting CUDA (only their exits have charges to take off), with
    /// their start times: a pid reused after a lost exit is another process.
    cuda_pids: HashMap<u32, u64>,
    /// Processes that began exiting but are not gone yet.
    exiting: Exiting,
    /// Processes that named a GPU by UUID before NVML listed any device, with their
    /// start times: read again once it does (until then, those GPUs are charged nothing).
    unresolved: HashMap<u32, u64>,
    verbose: bool,
    /// The processes of capped environments whose CUDA numbering was read.
    capped: capped::Capped,
    /// When each process's environment was last read (CLOCK_MONOTONIC ns), for its exec.
    environ_read: HashMap<u32, u64>,
}

impl AllocSide {
    /// Attaches the probes to the libraries found now; none is a warning (NVML's
    /// directory is looked in again once it loads).
    pub fn start(
        kernel: CudaKernel,
        identities: IdentityReader,
        given: &[PathBuf],
        verbose: bool,
    ) -> Self {
        let mut side = Self {
            maps: kernel.maps,
            probes: kernel.probes,
            identities,
            caps: Caps::default(),
            copies: copies::Copies::default(),
            attached_any: false,
            beside_nvml: None,
            started_caps: HashMap::new(),
            cuda_pids: HashMap::new(),
            exiting: Exiting::default(),
            unresolved: HashMap::new(),
            verbose,
            capped: capped::Capped::default(),
            environ_read: HashMap::new(),
        };
        // A given library that cannot be opened is said by name (never looked at by
        // path first: on a FUSE mount even a `stat` could wait for ever).
        side.attach_found(given, None);
        // Registered on a thread of their own; waited for here, within a bound, so that
        // the probes are in place once the daemon says it enforces.
        if !side.probes.settle(std::time::Duration::from_secs(5)) {
            tracing::warn!(
                "--memory-at-alloc: the libcuda probes are not registered after 5 s; the daemon goes on, and says when they are"
            );
        }
        if !side.attached_any {
            tracing::warn!(
                "--memory-at-alloc: no libcuda found (ldconfig -p lists no libcuda.so.1; give one with --cuda-lib); looking beside NVML once it loads"
            );
        }
        side
    }

    /// Attaches to each library not attached yet.
    fn attach_found(&mut self, given: &[PathBuf], beside_nvml: Option<&Path>) {
        for path in crate::kernel::cuda::libraries(given, beside_nvml) {
            let name = path.display().to_string();
            match Library::open(&path, name.clone(), "/proc/thread-self/mountinfo") {
                Ok(library) => self.attach(&library),
                Err(e) => tracing::warn!("--memory-at-alloc: not probing {e}"),
            }
        }
    }

    /// Probes `library` (given, or found by ldconfig or beside NVML) unless it is
    /// already, by its device and inode.
    fn attach(&mut self, library: &Library) {
        let Some(version) = library.version() else {
            return;
        };
        if self.copies.is_probed(version.id()) {
            return;
        }
        let name = library.name.clone();
        let line = move |missing: &[&str]| {
            let missing = match missing.is_empty() {
                true => String::new(),
                false => format!(" (it has no {})", missing.join(", ")),
            };
            format!(
                "--memory-at-alloc: allocations through {name} are held to their environment's gpu_memory{missing}"
            )
        };
        let attached = library
            .exports()
            .and_then(|exports| self.probes.attach(library, &exports, line));
        match attached {
            Ok(_) => {
                self.copies.given(version);
                self.attached_any = true;
            }
            Err(e) => tracing::warn!("--memory-at-alloc: not probing {e}"),
        }
    }

    /// After a full cycle: the processes that named a GPU by UUID before NVML listed
    /// any are read again, the caps follow the state it read (`None`: unreadable, the
    /// kernel keeps the last), and once NVML is loaded the libcuda beside it is probed.
    /// `gpus`: NVML's devices; `given`: `--cuda-lib`.
    pub fn follow_cycle(
        &mut self,
        state: Option<&(Vec<Env>, Vec<Device>)>,
        gpus: &[GpuInfo],
        given: &[PathBuf],
    ) {
        self.devices_known(gpus);
        let envs = state.map(|(envs, _)| envs.as_slice());
        let count = state.map_or(0, |(_, devices)| devices.len() as u32);
        self.follow_state(envs, (count, gpus));
        let dir = crate::backends::nvml::loaded_library()
            .and_then(|lib| lib.parent().map(Path::to_path_buf));
        if dir.is_some() && dir != self.beside_nvml {
            self.attach_found(given, dir.as_deref());
            self.beside_nvml = dir;
        }
    }

    /// After a full cycle that read genv's state: the caps follow it (`None`:
    /// unreadable, the kernel keeps the last).
    /// `gpus`: genv's device count, and NVML's devices (for the processes made to carry
    /// the probes now, whose numbering is read).
    fn follow_state(&mut self, envs: Option<&[Env]>, (count, gpus): (u32, &[GpuInfo])) {
        let Some(envs) = envs else {
            return;
        };
        let caps = Caps::of(envs);
        let maps = &mut self.maps;
        if let Err(e) = maps.set_gpus(count) {
            tracing::error!("Cannot tell the kernel the node's GPU count: {e}");
        }
        if let Err(e) = maps.sync_caps(caps.kernel_entries()) {
            tracing::error!("Cannot update the environments' memory caps in the kernel: {e}");
            return;
        }
        let changed = caps.kernel_entries() != self.caps.kernel_entries();
        self.caps = caps;
        // The processes of capped environments are read before the caps are said to be
        // held. Caught up at every full cycle, not only when the caps change: one whose
        // exec the kernel's ring buffer lost, or whose identity was settled since.
        for process in self.capped.caught_up(&self.identities, &self.caps) {
            self.read_devices(process, gpus, "is held at its allocations");
        }
        if changed {
            tracing::info!(
                "--memory-at-alloc: caps held at the allocation: {}",
                self.caps
            );
        }
    }

    /// A process exec'ed or was forked (its identity in the kernel is final by now: read
    /// at the exec, or inherited): if its environment has a cap, what CUDA will read of
    /// it is read now (the probes, system-wide, hold it from its first call).
    pub fn place_probes(&mut self, pid: u32, gpus: &[GpuInfo]) {
        if let Some(started) = self.capped.placed(&self.identities, &self.caps, pid) {
            self.read_devices((pid, started), gpus, "is held at its allocations");
        }
    }

    /// The deltas, read before NVML is asked (see `set_baselines`).
    pub fn deltas(&self) -> HashMap<EnvGpu, Delta> {
        self.maps.deltas()
    }

    /// NVML answered: its figures become the baselines, where no allocation or free
    /// was in flight meanwhile (see `AllocMaps::set_baselines`).
    pub fn rebase(
        &mut self,
        deltas: DeltasAround<'_>,
        measured: &HashMap<EnvGpu, u64>,
        listed: &HashSet<u32>,
    ) {
        if let Err(e) = self.maps.set_baselines(deltas, measured, listed) {
            tracing::error!("Cannot update the memory baselines in the kernel: {e}");
        }
    }

    /// A process started CUDA (or maps a copy just probed): its device numbering, from
    /// its `CUDA_VISIBLE_DEVICES`, and the cap it was started with (`GENV_GPU_MEMORY`),
    /// below which it is never killed at the allocation (see
    /// [`crate::alloc::started_cap`]).
    pub fn cuda_started(&mut self, pid: u32, gpus: &[GpuInfo]) {
        let Ok(started) = procfs::stat(pid).map(|s| s.start_time) else {
            return; // gone already
        };
        if self.cuda_pids.insert(pid, started) == Some(started) {
            return; // read at its first CUDA call already
        }
        self.read_devices((pid, started), gpus, "started CUDA");
    }

    /// What CUDA will read of `pid`'s environment, into the kernel: its device
    /// numbering, and the cap it was started with. Read at its CUDA start, and before,
    /// at its exec or fork into a capped environment (which may be too late for its
    /// `cuInit`).
    fn read_devices(&mut self, (pid, started): (u32, u64), gpus: &[GpuInfo], what: &str) {
        // Stamped before the read: an exec between the two counts as after it.
        self.environ_read.insert(pid, crate::clock::monotonic_ns());
        let maps = &mut self.maps;
        // CUDA reads it with getenv: the first assignment wins.
        let names = ["CUDA_VISIBLE_DEVICES", GPU_MEMORY_VAR, SHELL_VAR];
        let [visible, gpu_memory, shell] = match procfs::first_environment_vars(pid, names) {
            Ok(values) => values,
            Err(e) => {
                if self.verbose {
                    tracing::info!(
                        target: "event", "Process {pid} {what}; its devices are CUDA's own ({e})"
                    );
                }
                return;
            }
        };
        let own = StartedWith::of(gpu_memory.as_deref(), shell.as_deref());
        if let Err(e) = maps.set_started_cap(pid, own.as_ref().map(StartedWith::kernel_bytes)) {
            tracing::warn!("Cannot record the cap process {pid} was started with: {e}");
        }
        match own {
            Some(own) => self.started_caps.insert(pid, own),
            None => self.started_caps.remove(&pid),
        };
        if gpus.is_empty() && visible.as_deref().is_some_and(names_a_uuid) {
            self.unresolved.insert(pid, started);
        }
        let map = ordinals(visible.as_deref(), gpus);
        if let Err(e) = maps.set_ordinals(pid, map) {
            tracing::warn!("Cannot record process {pid}'s CUDA devices in the kernel: {e}");
        } else if self.verbose {
            tracing::info!(
                target: "event", "Process {pid} {what} with CUDA_VISIBLE_DEVICES={}",
                visible.as_deref().unwrap_or("(unset)")
            );
        }
    }

    /// After a full cycle, with NVML's devices as it listed them: the processes that
    /// named a GPU by UUID before any was listed are read again.
    fn devices_known(&mut self, gpus: &[GpuInfo]) {
        if gpus.is_empty() {
            return;
        }
        for (pid, started) in std::mem::take(&mut self.unresolved) {
            // The same process, still running CUDA (an exit or exec took it off).
            if self.cuda_pids.get(&pid) == Some(&started) {
                self.cuda_pids.remove(&pid);
                self.cuda_started(pid, gpus);
            }
        }
    }

    /// A process opened a GPU node: a libcuda copy it maps that is not probed yet (a
    /// container's, a user's, whatever it is called) is probed from now on; every open
    /// counts ([`copies`]). Not for a process the kernel knows to be outside any
    /// environment (monitoring agents open GPU nodes all the time).
    pub fn opened(&mut self, pid_uid: (u32, u32), owner: impl FnOnce() -> u32, gpus: &[GpuInfo]) {
        let (pid, _) = pid_uid;
        if self.identities.get(pid) == Some(genv_ebpf_common::identity::NO_ENV) {
            return;
        }
        self.copies.opened(&mut self.probes, pid_uid, owner);
        self.probed(gpus);
    }

    /// The looks at processes owed by now (opens that came too soon after a look).
    pub fn run_due(&mut self, gpus: &[GpuInfo]) {
        self.copies.run_due(&mut self.probes);
        self.probed(gpus);
    }

    /// Processes a copy was just probed for have started CUDA, or are about to (the
    /// probes may have missed their `cuInit`): read as at their first CUDA call.
    fn probed(&mut self, gpus: &[GpuInfo]) {
        for pid in self.copies.take_probed() {
            self.cuda_started(pid, gpus);
        }
    }

    /// When the next owed look is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.copies.next_look()
    }

    /// A process exec'ed (at `at_ns`): its old image's charges come off now. What was
    /// read of it since (an open of the old image's, heard of late, read the new one)
    /// is the new image's and stays: forgotten, its copy went unprobed until a look.
    pub fn execed(&mut self, pid: u32, at_ns: u64) {
        self.copies.execed(&mut self.probes, pid, at_ns);
        // The old image's memory went with it (and a charge of the new one made before
        // this was heard of: NVML counts it at the next poll; kept, it could stop others).
        if self.cuda_pids.contains_key(&pid) {
            self.maps.take_off_charges(pid);
        }
        let read_since = self.environ_read.get(&pid).is_some_and(|at| *at > at_ns);
        if !read_since && self.forget_image(pid).is_some() {
            self.maps.forget_numbering(pid);
        }
    }

    /// A process began exiting: its charges come off once it is gone
    /// ([`Self::settle_exits`], which the daemon calls after every batch of events).
    pub fn exiting(&mut self, pid: u32) {
        self.capped.forget(pid);
        self.copies.gone(&mut self.probes, pid);
        if let Some(started) = self.forget_image(pid) {
            self.exiting.insert(pid, started);
        }
    }

    /// What was read of `pid`'s environment goes (numbering, started cap); the start
    /// time it had, if it ran CUDA (it then has charges to take off).
    fn forget_image(&mut self, pid: u32) -> Option<u64> {
        self.environ_read.remove(&pid);
        self.unresolved.remove(&pid);
        self.started_caps.remove(&pid);
        self.cuda_pids.remove(&pid)
    }

    /// The exiting processes now gone have their charges taken off; whether some are
    /// still exiting (the daemon looks again soon).
    pub fn settle_exits(&mut self) -> bool {
        self.exiting.settle(&mut self.maps)
    }

    /// Whether a registration of the probes has been waiting on the kernel for over a
    /// second (see `kernel::cuda::registrar`).
    pub fn registration_stalled(&self) -> bool {
        self.probes.stalled()
    }

    /// The line for what the kernel decided about an allocation.
    pub fn line(&self, over: &OverCap) -> String {
        self.caps.line(over, self.started_caps.get(&over.pid))
    }

    /// The environment an allocation was charged to and the cap it was held to (the
    /// one the process was started with, where that allows more), for its user.
    pub fn held_to(&self, over: &OverCap) -> Option<(String, String)> {
        let (eid, cap) = self.caps.by_identity.get(&over.env)?;
        let held = match self.started_caps.get(&over.pid) {
            Some(StartedWith::Cap(own)) if own.bytes() > cap.bytes() => own.to_string(),
            _ => cap.to_string(),
        };
        Some((eid.clone(), held))
    }
}
