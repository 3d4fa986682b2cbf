//! `--memory-at-alloc` in the daemon: the libcuda probes attached to every libcuda
//! found (ldconfig's, the one beside NVML once it loads, `--cuda-lib`, and any copy a
//! process that opens a GPU node maps), and their maps
//! kept true: caps from genv's state at each full cycle, NVML's baselines at each
//! memory poll, each CUDA process's device numbering when it starts CUDA, its charges
//! taken off when it exits. The kernel decides; this prints what it decided.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use genv_ebpf_common::alloc::EnvGpu;

use super::event_driven::Settings;
use crate::backends::procfs;
use crate::bpf::KernelPrograms;
use crate::intake::OverCap;
use crate::prevention::alloc::{Caps, ordinals};
use crate::state::Env;

/// How many libraries first seen in processes are read, in the daemon's life.
const MAX_READ: usize = 64;

pub(super) struct AllocSide {
    caps: Caps,
    /// Libraries the probes are attached to, or that were refused, by device and inode:
    /// each file is read once.
    known: HashSet<(u64, u64)>,
    /// Whether any library is attached.
    attached_any: bool,
    /// Processes whose mappings were looked at for libcuda copies (until they exec or
    /// exit).
    scanned: HashSet<u32>,
    /// Libraries first seen in a process that were read: a libcuda is tens of MB to
    /// parse, and a user could map file after file, so there is a bound.
    read: usize,
    /// Processes seen starting CUDA: only their exits have charges to take off.
    cuda_pids: HashSet<u32>,
    verbose: bool,
}

impl AllocSide {
    /// Attaches the probes to the libraries found now; none is a warning (NVML's
    /// directory is looked in again once it loads).
    pub(super) fn start(programs: &mut KernelPrograms, settings: &Settings) -> Self {
        let mut side = Self {
            caps: Caps::default(),
            known: HashSet::new(),
            attached_any: false,
            scanned: HashSet::new(),
            read: 0,
            cuda_pids: HashSet::new(),
            verbose: settings.verbose,
        };
        for lib in &settings.cuda_libs {
            if !lib.exists() {
                eprintln!("[ERROR] --cuda-lib {}: no such file", lib.display());
            }
        }
        side.attach_found(programs, &settings.cuda_libs, None);
        if !side.attached_any {
            eprintln!(
                "[WARNING] --memory-at-alloc: no libcuda found (ldconfig -p lists no libcuda.so.1; give one with --cuda-lib); looking beside NVML once it loads"
            );
        }
        side
    }

    /// Attaches to each library not attached yet.
    pub(super) fn attach_found(
        &mut self,
        programs: &mut KernelPrograms,
        given: &[PathBuf],
        beside_nvml: Option<&Path>,
    ) {
        for lib in crate::bpf::cuda::libraries(given, beside_nvml) {
            let Ok(meta) = std::fs::metadata(&lib) else {
                continue;
            };
            if !self.known.insert((meta.dev(), meta.ino())) {
                continue;
            }
            match programs.attach_cuda(&lib) {
                Ok(attachment) => {
                    let missing = match attachment.missing.is_empty() {
                        true => String::new(),
                        false => format!(" (it has no {})", attachment.missing.join(", ")),
                    };
                    eprintln!(
                        "[INFO] --memory-at-alloc: allocations through {} are held to their environment's gpu_memory{missing}",
                        lib.display()
                    );
                    self.attached_any = true;
                }
                Err(e) => eprintln!(
                    "[WARNING] --memory-at-alloc: not probing {}: {e}",
                    lib.display()
                ),
            }
        }
    }

    /// After a full cycle that read genv's state: the caps follow it (`None`:
    /// unreadable, the kernel keeps the last).
    pub(super) fn follow_state(
        &mut self,
        programs: &mut KernelPrograms,
        envs: Option<&[Env]>,
        gpus: u32,
    ) {
        let Some(envs) = envs else {
            return;
        };
        let caps = Caps::of(envs);
        let Some(maps) = programs.alloc_mut() else {
            return;
        };
        if let Err(e) = maps.set_gpus(gpus) {
            eprintln!("[ERROR] Cannot tell the kernel the node's GPU count: {e}");
        }
        if let Err(e) = maps.sync_caps(caps.kernel_entries()) {
            eprintln!("[ERROR] Cannot update the environments' memory caps in the kernel: {e}");
            return;
        }
        if caps.kernel_entries() != self.caps.kernel_entries() {
            eprintln!("[INFO] --memory-at-alloc: caps held at the allocation: {caps}");
        }
        self.caps = caps;
    }

    /// The deltas, read before NVML is asked (see `set_baselines`).
    pub(super) fn deltas(programs: &mut KernelPrograms) -> Option<HashMap<EnvGpu, i64>> {
        programs.alloc_mut().map(|maps| maps.deltas())
    }

    /// NVML answered: its figures become the baselines.
    pub(super) fn rebase(
        programs: &mut KernelPrograms,
        before: &HashMap<EnvGpu, i64>,
        measured: &HashMap<EnvGpu, u64>,
        listed: &HashSet<u32>,
    ) {
        if let Some(maps) = programs.alloc_mut() {
            if let Err(e) = maps.set_baselines(before, measured, listed) {
                eprintln!("[ERROR] Cannot update the memory baselines in the kernel: {e}");
            }
        }
    }

    /// A process started CUDA: its device numbering, from its `CUDA_VISIBLE_DEVICES`.
    pub(super) fn cuda_started(&mut self, programs: &mut KernelPrograms, pid: u32) {
        let Some(maps) = programs.alloc_mut() else {
            return;
        };
        if !self.cuda_pids.insert(pid) {
            return; // read at its first CUDA call already
        }
        // CUDA reads it with getenv: the first assignment wins.
        let visible = match procfs::first_environment_var(pid, "CUDA_VISIBLE_DEVICES") {
            Ok(visible) => visible,
            Err(e) => {
                if self.verbose {
                    eprintln!(
                        "[EVENT] Process {pid} started CUDA; its devices are CUDA's own ({e})"
                    );
                }
                return;
            }
        };
        let map = ordinals(visible.as_deref());
        if let Err(e) = maps.set_ordinals(pid, map) {
            eprintln!("[WARNING] Cannot record process {pid}'s CUDA devices in the kernel: {e}");
        } else if self.verbose {
            eprintln!(
                "[EVENT] Process {pid} started CUDA with CUDA_VISIBLE_DEVICES={}",
                visible.as_deref().unwrap_or("(unset)")
            );
        }
    }

    /// A process opened a GPU node: a libcuda it maps from a file not probed yet (a
    /// container's, a user's copy) is probed from now on. CUDA opens the nodes in
    /// `cuInit`, after loading the library and before any allocation.
    pub(super) fn opened(&mut self, programs: &mut KernelPrograms, pid: u32) {
        if !self.scanned.insert(pid) || self.read >= MAX_READ {
            return;
        }
        let Ok(files) = procfs::mapped_files(pid, "libcuda.so") else {
            return;
        };
        for file in files {
            // Through the map_files link: the mapped file itself.
            let Ok(meta) = std::fs::metadata(&file) else {
                continue;
            };
            if !self.known.insert((meta.dev(), meta.ino())) || !meta.is_file() {
                continue;
            }
            self.read += 1;
            if self.read == MAX_READ {
                eprintln!(
                    "[WARNING] --memory-at-alloc: {MAX_READ} libcuda copies read; copies first seen from now on are not probed (give them with --cuda-lib)"
                );
            }
            match programs.attach_cuda(&file) {
                Ok(_) => eprintln!(
                    "[INFO] --memory-at-alloc: process {pid} maps a libcuda not probed yet (device {}, inode {}); allocations through it are held to their environment's gpu_memory",
                    meta.dev(),
                    meta.ino()
                ),
                Err(e) => eprintln!(
                    "[WARNING] --memory-at-alloc: not probing the libcuda process {pid} maps: {e}"
                ),
            }
        }
    }

    pub(super) fn exited(&mut self, programs: &mut KernelPrograms, pid: u32) {
        self.scanned.remove(&pid);
        if !self.cuda_pids.remove(&pid) {
            return;
        }
        if let Some(maps) = programs.alloc_mut() {
            maps.process_exited(pid);
        }
    }

    /// The line for what the kernel decided about an allocation.
    pub(super) fn line(&self, over: &OverCap) -> String {
        self.caps.line(over)
    }
}
