//! After each full cycle, the maps follow what it read: the watched GPU nodes, genv's
//! environments (and, the first time, `--deny` and `--memory-at-alloc` put in force),
//! the caps and CUDA numberings of `--memory-at-alloc`, every process's identity, and
//! the allow-list once NVML's own directory is known.

use std::path::Path;

use anyhow::Result;

use super::{KernelSettings, KernelSide, allowlist, identity, mirror};
use crate::alloc::MemoryAtAlloc;
use crate::backends::devmap::DeviceMap;
use crate::backends::nvml;
use crate::cycle::CycleSummary;
use crate::intake::decisions::guarantee;
use crate::kernel::pins;
use crate::service::status::Status;
use crate::snapshot::DroppedEnv;
use crate::state::{Device, Env};

impl KernelSide {
    /// After a full cycle: the watched nodes follow the snapshot's device map, and the kernel's
    /// environments follow the state the cycle read (`None`: unreadable, keep the last);
    /// `gpus`: NVML's devices, for the CUDA numberings that named a GPU by UUID.
    pub fn follow_cycle(
        &mut self,
        settings: &KernelSettings,
        status: &mut Status,
        (device_map, gpus): (&DeviceMap, &[nvml::GpuInfo]),
        summary: &mut CycleSummary,
    ) {
        self.watch_nodes(status, device_map);
        let state = summary.state.take();
        if let Some(alloc) = &mut self.alloc {
            alloc.devices_known(&mut self.programs, gpus);
            let envs = state.as_ref().map(|(envs, _)| envs.as_slice());
            let count = state
                .as_ref()
                .map_or(0, |(_, devices)| devices.len() as u32);
            alloc.follow_state(&mut self.programs, envs, (count, gpus));
        }
        self.mirror_state(settings, status, state, &summary.dropped_envs);
        self.resync_identities(settings, status);
        self.follow_nvml(settings, status);
        status.address_spaces_held = crate::backends::address_space::held_now();
        status.probes_registration_stalled = self.programs.cuda_registration_stalled();
    }

    /// Once NVML is loaded, its tools may sit beside it (`/usr/local/nvidia/lib64` and
    /// `bin`): the allow-list is looked for again there.
    fn follow_nvml(&mut self, settings: &KernelSettings, status: &mut Status) {
        let dir = nvml::loaded_library().and_then(|lib| lib.parent().map(Path::to_path_buf));
        if dir.is_none() || dir == self.tools_beside {
            return;
        }
        if let Some(alloc) = &mut self.alloc {
            alloc.attach_found(&mut self.programs, &settings.cuda_libs, dir.as_deref());
        }
        match self.install_allow_list(settings, dir.as_deref()) {
            Ok(allowed) => status.allowed = allowed,
            Err(e) => tracing::warn!("Cannot update the allow-list: {e}"),
        }
        self.tools_beside = dir;
    }

    /// The tools allowed outside environments, looked for in `PATH`, beside the NVML
    /// library (once known) and in the usual places, and those given.
    pub(super) fn install_allow_list(
        &mut self,
        settings: &KernelSettings,
        nvml_dir: Option<&Path>,
    ) -> Result<String> {
        let dirs = allowlist::tool_dirs(std::env::var_os("PATH"), nvml_dir);
        let allowed = allowlist::install(self.programs.policy_mut(), &dirs, &settings.allow_exes)?;
        tracing::info!("Allowed to open GPU nodes outside environments: {allowed}");
        Ok(allowed)
    }

    /// Every full cycle (and so after every loss of events): no identity stays
    /// unresolved or missing. When the kernel could not record some (its map was full),
    /// the identities of processes gone unseen are dropped first.
    fn resync_identities(&mut self, settings: &KernelSettings, status: &mut Status) {
        let lost = self.programs.policy().decisions().identity_lost;
        let prune = lost > status.counts.identity_lost_in_kernel;
        if prune {
            tracing::warn!(
                "The kernel could not record {} process identities (its map of {} is full); dropping those of processes gone and recording them again",
                lost - status.counts.identity_lost_in_kernel,
                self.programs.process_capacity()
            );
            status.counts.identity_lost_in_kernel = lost;
        }
        let done = identity::resync_identities(self.programs.policy_mut(), prune, settings.verbose);
        status.counts.identities_resolved += done.resolved as u64;
        status.counts.identities_seeded += done.seeded as u64;
        if done != Default::default() && settings.verbose {
            tracing::info!(
                "Identities resynchronised: {} read from /proc, {} recorded anew, {} of processes gone dropped, {} whose blocks did not answer in time",
                done.resolved,
                done.seeded,
                done.pruned,
                done.unresolved
            );
        }
    }

    fn watch_nodes(&mut self, status: &mut Status, map: &DeviceMap) {
        if self.device_map.as_ref() == Some(map) {
            return;
        }
        match self.programs.watch_nodes(map) {
            Ok(()) => {
                tracing::info!("Watching GPU nodes: {map}");
                status.gpu_nodes = map.to_string();
                self.device_map = Some(map.clone());
            }
            Err(e) => tracing::error!("Cannot update the watched GPU nodes: {e}"),
        }
    }

    /// Mirrors genv's environments into the kernel, and arms `--deny` the first time
    /// that succeeds: before it, every environment's processes would count as outside.
    fn mirror_state(
        &mut self,
        settings: &KernelSettings,
        status: &mut Status,
        state: Option<(Vec<Env>, Vec<Device>)>,
        dropped: &[DroppedEnv],
    ) {
        if let (Some(names), Some((envs, _))) = (&self.env_names, &state) {
            let mut names = names.lock().unwrap_or_else(|e| e.into_inner());
            names.clear();
            names.extend(
                envs.iter()
                    .map(|env| (identity::identity_of(Some(&env.eid)), env.eid.clone())),
            );
        }
        let current = mirror::sync_environments(self.programs.policy_mut(), state, dropped);
        if !current || self.armed {
            return;
        }
        let deny = settings.deny;
        let memory = settings.memory_at_alloc.policy_flags();
        if deny.deny || memory != 0 {
            if let Err(e) = self.programs.policy_mut().set_policy(deny, memory) {
                tracing::error!("Cannot turn on --deny or --memory-at-alloc in the kernel: {e}");
                return;
            }
        }
        match settings.memory_at_alloc {
            MemoryAtAlloc::Off => {}
            MemoryAtAlloc::Report => tracing::info!(
                "Allocations past an environment's gpu_memory are reported at the call (--memory-at-alloc report)"
            ),
            MemoryAtAlloc::Kill => tracing::info!(
                "Allocations past an environment's gpu_memory kill their process in the call (--memory-at-alloc kill)"
            ),
        }
        let guarantee = guarantee(Some(self.programs.tier()), deny);
        tracing::info!("GPU opens outside any environment are {guarantee}");
        status.guarantee = guarantee;
        self.armed = true;
        self.take_over_pins(settings);
    }

    /// Our programs decide now: an earlier run's pinned programs can go. With
    /// `--keep-pinned`, ours stay after we exit.
    fn take_over_pins(&mut self, settings: &KernelSettings) {
        let own = self.pin_generation.as_deref();
        for old in pins::other_generations(&settings.pin_dir, own) {
            match pins::remove_generation(&old) {
                Ok(removed) => tracing::info!(
                    "Took over from an earlier run's pinned programs: removed {} links and {} maps under {}",
                    removed.links,
                    removed.maps,
                    old.display()
                ),
                Err(e) => tracing::warn!("Cannot remove {}: {e}", old.display()),
            }
        }
        if let Some(own) = own {
            tracing::info!(
                "Programs and maps pinned under {}: they keep deciding after this daemon exits (genv-enforcer unpin removes them)",
                own.display()
            );
        }
    }
}
