//! The daemon's hold on the kernel programs: loading them as `--bpf-tier` asks, then
//! keeping what they decide from (watched nodes, genv's environments, the allow-list,
//! `--deny`) in step with each full cycle, and taking over from an earlier run's pins.
//!
//! Stage by stage: [`start`] loads the programs and seeds what they need;
//! [`follow`] keeps their maps in step after each full cycle, through the writers of
//! each: [`mirror`] (genv's environments), [`identity`] (each process's claim),
//! [`allowlist`]; `--memory-at-alloc`'s maps through [`crate::alloc`]. [`holders`]
//! finishes a kill in the kernel that missed processes sharing the opener's files.

pub mod allowlist;
mod follow;
pub mod holders;
pub mod identity;
pub mod mirror;
mod settings;
mod start;

pub use settings::KernelSettings;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use anyhow::Result;
use genv_ebpf_common::alloc::{Delta, EnvGpu};

use crate::alloc::AllocSide;
use crate::backends::devmap::DeviceMap;
use crate::backends::nvml;
use crate::intake::decision_log::EnvNames;
use crate::intake::{EventIntake, OverCap};
use crate::kernel::KernelPrograms;
use crate::kernel::alloc_maps::DeltasAround;
use crate::service::status::Status;

pub struct KernelSide {
    programs: KernelPrograms,
    device_map: Option<DeviceMap>,
    /// The environments were mirrored into the kernel once and the policy (`--deny` or
    /// not) put in force and announced.
    armed: bool,
    /// This run's pin directory (`--keep-pinned`).
    pin_generation: Option<PathBuf>,
    /// The NVML library's directory the allow-list was last looked for beside.
    tools_beside: Option<PathBuf>,
    /// `--bpf-log`: the environments' names by identity, for the `[BPF]` lines.
    env_names: Option<EnvNames>,
    /// `--memory-at-alloc`.
    alloc: Option<AllocSide>,
}

/// What starting gives: the kernel side and its events, or neither (full cycle alone).
pub type Started = Option<(KernelSide, EventIntake)>;

impl KernelSide {
    /// A reader of the identities the kernel recorded, for the snapshot.
    pub fn identity_reader(&self) -> Result<crate::kernel::policy_maps::IdentityReader> {
        Ok(self.programs.policy().identity_reader()?)
    }

    /// A process whose environment block the exec hook could not read in full.
    pub fn resolve_identity(&mut self, pid: u32, verbose: bool) {
        identity::resolve_identity(self.programs.policy_mut(), pid, verbose);
    }

    /// `--memory-at-alloc`: the accounting deltas, read before NVML is asked.
    pub fn alloc_deltas(&mut self) -> Option<HashMap<EnvGpu, Delta>> {
        self.alloc.as_ref()?;
        AllocSide::deltas(&mut self.programs)
    }

    /// `--memory-at-alloc`: NVML's answer (the memory poll's) becomes the baselines;
    /// `deltas`: the accounting read before NVML was asked and after it answered.
    pub fn rebase(
        &mut self,
        deltas: DeltasAround<'_>,
        measured: &HashMap<EnvGpu, u64>,
        listed: &HashSet<u32>,
    ) {
        AllocSide::rebase(&mut self.programs, deltas, measured, listed);
    }

    /// A process started CUDA; `gpus`: NVML's devices, which its `CUDA_VISIBLE_DEVICES`
    /// may name by UUID.
    pub fn cuda_started(&mut self, pid: u32, gpus: &[nvml::GpuInfo]) {
        if let Some(alloc) = &mut self.alloc {
            alloc.cuda_started(&mut self.programs, pid, gpus);
        }
    }

    /// Whether the kernel recorded, at `pid`'s exec, that it has no environment id at
    /// all: not one still being resolved, not one naming an environment not mirrored yet.
    pub fn definitely_outside(&self, pid: u32) -> bool {
        self.programs.policy().identity(pid) == Some(genv_ebpf_common::identity::NO_ENV)
    }

    /// A process opened a GPU node (`--memory-at-alloc`: a libcuda copy it maps is
    /// probed).
    pub fn opened(&mut self, pid: u32, uid: u32, gpus: &[nvml::GpuInfo]) {
        if let Some(alloc) = &mut self.alloc {
            alloc.opened(&mut self.programs, (pid, uid), gpus);
        }
    }

    /// `--memory-at-alloc`: the looks at GPU openers' libraries owed by now.
    pub fn run_due_looks(&mut self, gpus: &[nvml::GpuInfo]) {
        if let Some(alloc) = &mut self.alloc {
            alloc.run_due(&mut self.programs, gpus);
        }
    }

    /// When the next owed look is due.
    pub fn next_look(&self) -> Option<std::time::Instant> {
        self.alloc.as_ref().and_then(|alloc| alloc.next_due())
    }

    /// A process exec'ed: its old image's GPU memory went with its address space.
    pub fn execed(&mut self, pid: u32) {
        if let Some(alloc) = &mut self.alloc {
            alloc.execed(&mut self.programs, pid);
        }
    }

    /// A process exec'ed or was forked, its identity final in the kernel: it carries
    /// the libcuda probes if its environment has a cap (`--memory-at-alloc`).
    pub fn place_probes(&mut self, pid: u32, gpus: &[nvml::GpuInfo]) {
        if let Some(alloc) = &mut self.alloc {
            alloc.place_probes(&mut self.programs, pid, gpus);
        }
    }

    /// A process began exiting: its GPU memory goes once it is gone
    /// ([`Self::settle_exits`]).
    pub fn exiting(&mut self, pid: u32) {
        if let Some(alloc) = &mut self.alloc {
            alloc.exiting(&mut self.programs, pid);
        }
    }

    /// Exits waiting for their processes to be gone; whether some still wait.
    pub fn settle_exits(&mut self) -> bool {
        match &mut self.alloc {
            Some(alloc) => alloc.settle_exits(&mut self.programs),
            None => false,
        }
    }

    /// The line for an allocation the kernel found past its environment's cap.
    pub fn alloc_line(&self, over: &OverCap) -> Option<String> {
        self.alloc.as_ref().map(|alloc| alloc.line(over))
    }

    /// The environment and cap an allocation past its cap was held to.
    pub fn alloc_held_to(&self, over: &OverCap) -> Option<(String, String)> {
        self.alloc.as_ref().and_then(|alloc| alloc.held_to(over))
    }

    /// Before the daemon exits: its process id leaves the exemptions, which pinned maps
    /// would otherwise keep for whichever process gets that id next. (A daemon killed
    /// outright leaves it until the next daemon takes over and removes its pins.)
    pub fn release(mut self) {
        if let Err(e) = self.programs.policy_mut().unexempt(std::process::id()) {
            tracing::warn!("Cannot remove this daemon's exemption from the kernel: {e}");
        }
    }

    /// The programs' run statistics and the kernel's own decision counts, into `status`.
    pub fn report(&self, status: &mut Status) {
        status.programs = self.programs.stats();
        let decided = self.programs.policy().decisions();
        status.counts.refused_in_kernel = decided.refused;
        status.counts.killed_in_kernel = decided.killed;
        status.counts.kill_failed_in_kernel = decided.kill_failed;
    }

    /// Whether the kernel could not record identities (its map was full) since the last
    /// resynchronisation, which `status` counts: one is then due at once.
    pub fn identities_lost(&self, status: &Status) -> bool {
        let lost = self.programs.policy().decisions().identity_lost;
        lost > status.counts.identity_lost_in_kernel
    }

    /// Kills the processes outside environments still holding `gpus`, which the kernel
    /// killed an opener of (see [`holders`]).
    pub fn sweep_holders(
        &self,
        settings: &KernelSettings,
        gpus: &HashSet<u32>,
    ) -> Vec<holders::Killed> {
        let Some(map) = &self.device_map else {
            return Vec::new();
        };
        holders::sweep(self.programs.policy(), map, gpus, settings.deny.root)
    }
}
