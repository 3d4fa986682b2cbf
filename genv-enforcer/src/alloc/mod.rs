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
mod looks;
pub mod started_cap;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use genv_ebpf_common::alloc::{Delta, EnvGpu};

use crate::backends::nvml::GpuInfo;
use crate::backends::procfs;
use crate::intake::OverCap;
use crate::kernel::KernelPrograms;
use crate::kernel::alloc_maps::DeltasAround;
use crate::kernel::cuda::Library;
use caps::{Caps, names_a_uuid, ordinals};
use started_cap::{GPU_MEMORY_VAR, SHELL_VAR, StartedWith};

use crate::state::Env;
pub use caps::MemoryAtAlloc;

pub struct AllocSide {
    caps: Caps,
    /// The libraries given (or found by ldconfig and beside NVML) are known here too,
    /// so that a process mapping one is not looked into for it.
    copies: copies::Copies,
    /// Whether any library is attached.
    attached_any: bool,
    /// The caps processes that started CUDA were started with, for the line.
    started_caps: HashMap<u32, StartedWith>,
    /// Processes seen starting CUDA: only their exits have charges to take off.
    /// With the start time each had: a pid reused after a lost exit is another process.
    cuda_pids: HashMap<u32, u64>,
    /// Processes that began exiting but are not gone yet, with their start times: the
    /// driver frees a process's GPU memory as its descriptors close, late in its exit,
    /// so its charges stay until then (taken off early, another process could be let
    /// through while the memory is still held).
    exiting: HashMap<u32, u64>,
    /// Processes that named a GPU by UUID before NVML listed any device, with their
    /// start times: read again once it does (until then, those GPUs are charged nothing).
    unresolved: HashMap<u32, u64>,
    verbose: bool,
    /// The processes of capped environments whose CUDA numbering was read.
    capped: capped::Capped,
}

impl AllocSide {
    /// Attaches the probes to the libraries found now; none is a warning (NVML's
    /// directory is looked in again once it loads).
    pub fn start(programs: &mut KernelPrograms, given: &[PathBuf], verbose: bool) -> Self {
        let mut side = Self {
            caps: Caps::default(),
            copies: copies::Copies::default(),
            attached_any: false,
            started_caps: HashMap::new(),
            cuda_pids: HashMap::new(),
            exiting: HashMap::new(),
            unresolved: HashMap::new(),
            verbose,
            capped: capped::Capped::default(),
        };
        // A given library that cannot be opened is said by name (never looked at by
        // path first: on a FUSE mount even a `stat` could wait for ever).
        side.attach_found(programs, given, None);
        // Registered on a thread of their own; waited for here, within a bound, so that
        // the probes are in place once the daemon says it enforces.
        if !programs.cuda_settle(std::time::Duration::from_secs(5)) {
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
    pub fn attach_found(
        &mut self,
        programs: &mut KernelPrograms,
        given: &[PathBuf],
        beside_nvml: Option<&Path>,
    ) {
        for path in crate::kernel::cuda::libraries(given, beside_nvml) {
            let name = path.display().to_string();
            match Library::open(&path, name.clone(), "/proc/thread-self/mountinfo") {
                Ok(library) => self.attach(programs, &library),
                Err(e) => tracing::warn!("--memory-at-alloc: not probing {e}"),
            }
        }
    }

    /// Probes `library` (given, or found by ldconfig or beside NVML) unless it is
    /// already, by its device and inode.
    fn attach(&mut self, programs: &mut KernelPrograms, library: &Library) {
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
            .and_then(|exports| programs.attach_cuda(library, &exports, line));
        match attached {
            Ok(_) => {
                self.copies.given(version);
                self.attached_any = true;
            }
            Err(e) => tracing::warn!("--memory-at-alloc: not probing {e}"),
        }
    }

    /// After a full cycle that read genv's state: the caps follow it (`None`:
    /// unreadable, the kernel keeps the last).
    /// `gpus`: genv's device count, and NVML's devices (for the processes made to carry
    /// the probes now, whose numbering is read).
    pub fn follow_state(
        &mut self,
        programs: &mut KernelPrograms,
        envs: Option<&[Env]>,
        (count, gpus): (u32, &[GpuInfo]),
    ) {
        let Some(envs) = envs else {
            return;
        };
        let caps = Caps::of(envs);
        let Some(maps) = programs.alloc_mut() else {
            return;
        };
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
        for process in self.capped.caught_up(programs, &self.caps) {
            self.read_devices(programs, process, gpus, "is held at its allocations");
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
    pub fn place_probes(&mut self, programs: &mut KernelPrograms, pid: u32, gpus: &[GpuInfo]) {
        if let Some(started) = self.capped.placed(programs, &self.caps, pid) {
            self.read_devices(programs, (pid, started), gpus, "is held at its allocations");
        }
    }

    /// The deltas, read before NVML is asked (see `set_baselines`).
    pub fn deltas(programs: &mut KernelPrograms) -> Option<HashMap<EnvGpu, Delta>> {
        programs.alloc_mut().map(|maps| maps.deltas())
    }

    /// NVML answered: its figures become the baselines, where no allocation or free
    /// was in flight meanwhile (see `AllocMaps::set_baselines`).
    pub fn rebase(
        programs: &mut KernelPrograms,
        deltas: DeltasAround<'_>,
        measured: &HashMap<EnvGpu, u64>,
        listed: &HashSet<u32>,
    ) {
        if let Some(maps) = programs.alloc_mut() {
            if let Err(e) = maps.set_baselines(deltas, measured, listed) {
                tracing::error!("Cannot update the memory baselines in the kernel: {e}");
            }
        }
    }

    /// A process started CUDA (or maps a copy just probed): its device numbering, from
    /// its `CUDA_VISIBLE_DEVICES`, and the cap it was started with (`GENV_GPU_MEMORY`),
    /// below which it is never killed at the allocation (see
    /// [`crate::alloc::started_cap`]).
    pub fn cuda_started(&mut self, programs: &mut KernelPrograms, pid: u32, gpus: &[GpuInfo]) {
        if programs.alloc_mut().is_none() {
            return;
        }
        let Ok(started) = procfs::stat(pid).map(|s| s.start_time) else {
            return; // gone already
        };
        if self.cuda_pids.insert(pid, started) == Some(started) {
            return; // read at its first CUDA call already
        }
        self.read_devices(programs, (pid, started), gpus, "started CUDA");
    }

    /// What CUDA will read of `pid`'s environment, into the kernel: its device
    /// numbering, and the cap it was started with. Read at its CUDA start, and before,
    /// at its exec or fork into a capped environment (which may be too late for its
    /// `cuInit`).
    fn read_devices(
        &mut self,
        programs: &mut KernelPrograms,
        (pid, started): (u32, u64),
        gpus: &[GpuInfo],
        what: &str,
    ) {
        let Some(maps) = programs.alloc_mut() else {
            return;
        };
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
    pub fn devices_known(&mut self, programs: &mut KernelPrograms, gpus: &[GpuInfo]) {
        if gpus.is_empty() {
            return;
        }
        for (pid, started) in std::mem::take(&mut self.unresolved) {
            // The same process, still running CUDA (an exit or exec took it off).
            if self.cuda_pids.get(&pid) == Some(&started) {
                self.cuda_pids.remove(&pid);
                self.cuda_started(programs, pid, gpus);
            }
        }
    }

    /// A process opened a GPU node: a libcuda copy it maps that is not probed yet (a
    /// container's, a user's, whatever it is called) is probed from now on. CUDA opens
    /// the nodes in `cuInit` and at each context, after loading the library and before
    /// any allocation; NVML opens them too, maybe before, so every open counts (see
    /// [`copies`]). Not for a process the kernel knows to be outside any environment
    /// (monitoring agents open GPU nodes all the time): its allocations are charged to
    /// nobody.
    pub fn opened(
        &mut self,
        programs: &mut KernelPrograms,
        (pid, uid): (u32, u32),
        gpus: &[GpuInfo],
    ) {
        if programs.policy().identity(pid) == Some(genv_ebpf_common::identity::NO_ENV) {
            return;
        }
        self.copies.opened(programs, pid, uid);
        self.probed(programs, gpus);
    }

    /// The looks at processes owed by now (opens that came too soon after a look).
    pub fn run_due(&mut self, programs: &mut KernelPrograms, gpus: &[GpuInfo]) {
        self.copies.run_due(programs);
        self.probed(programs, gpus);
    }

    /// Processes a copy was just probed for have started CUDA, or are about to (the
    /// probes may have missed their `cuInit`): they are read as at their first CUDA
    /// call, and only then is the copy said to be probed.
    fn probed(&mut self, programs: &mut KernelPrograms, gpus: &[GpuInfo]) {
        for pid in self.copies.take_probed() {
            self.cuda_started(programs, pid, gpus);
        }
    }

    /// When the next owed look is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.copies.next_look()
    }

    /// A process exec'ed: its old image's memory is gone with its address space, and
    /// its charges come off now.
    pub fn execed(&mut self, programs: &mut KernelPrograms, pid: u32) {
        if self.forget(programs, pid).is_some() {
            if let Some(maps) = programs.alloc_mut() {
                maps.process_exited(pid);
            }
        }
    }

    /// A process began exiting: its charges come off once it is gone
    /// ([`Self::settle_exits`], which the daemon calls after every batch of events).
    pub fn exiting(&mut self, programs: &mut KernelPrograms, pid: u32) {
        self.capped.forget(pid);
        if let Some(started) = self.forget(programs, pid) {
            self.exiting.insert(pid, started);
        }
    }

    /// What is known of `pid`'s image goes (its mappings, numbering, started cap); the
    /// start time it had, if it ran CUDA (it then has charges to take off).
    fn forget(&mut self, programs: &mut KernelPrograms, pid: u32) -> Option<u64> {
        self.copies.gone(programs, pid);
        self.unresolved.remove(&pid);
        self.started_caps.remove(&pid);
        self.cuda_pids.remove(&pid)
    }

    /// The exiting processes now gone have their charges taken off; whether some are
    /// still exiting (the daemon looks again soon).
    pub fn settle_exits(&mut self, programs: &mut KernelPrograms) -> bool {
        self.exiting.retain(|&pid, &mut started| {
            let gone = !still_exiting(pid, started);
            if let (true, Some(maps)) = (gone, programs.alloc_mut()) {
                maps.process_exited(pid);
            }
            !gone
        });
        !self.exiting.is_empty()
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

/// Whether the process that started at `started` is still there with a thread that has
/// not finished exiting (its descriptors, the GPU's among them, are closed by then). Its
/// leader may be a zombie already: one that called `pthread_exit` exits first, and the
/// exit event comes from the group's last thread, before that thread closes anything.
fn still_exiting(pid: u32, started: u64) -> bool {
    use crate::backends::procfs;
    procfs::stat(pid).is_ok_and(|st| {
        st.start_time == started && (!st.is_zombie() || procfs::has_other_threads(pid))
    })
}

#[cfg(test)]
mod tests {
    use super::still_exiting;
    use crate::backends::procfs;

    /// Charges stay while any thread of the process may still hold the GPU's
    /// descriptors, a zombie leader notwithstanding; they come off once it is gone, and
    /// never for another process given its pid.
    #[test]
    fn a_process_is_exiting_until_its_last_thread_is_gone() {
        let mut child = procfs::leader_exited_first();
        let pid = child.id();
        let started = procfs::stat(pid).unwrap().start_time;
        assert!(
            still_exiting(pid, started),
            "a zombie leader with a live thread"
        );
        assert!(
            !still_exiting(pid, started + 1),
            "another process with that pid"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!still_exiting(pid, started));
    }
}
