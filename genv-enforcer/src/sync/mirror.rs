//! The mirror: the one owner of the maps the programs decide from (watched nodes,
//! identities, genv's environments, the allow-list, `--deny`, the exemption). Seeded at
//! start-up, brought in step after each full cycle, asked by the reactions to resolve an
//! identity the exec hook could not read, and released when the daemon exits.

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::{KernelSettings, allowlist, environments, identity};
use crate::alloc::MemoryAtAlloc;
use crate::backends::devmap::DeviceMap;
use crate::backends::{nvml, procfs};
use crate::intake::decision_log::EnvNames;
use crate::kernel::policy_maps::{IdentityReader, PolicyMaps};
use crate::kernel::{Tier, pins, tier::guarantee};
use crate::service::status::Status;
use crate::snapshot::DroppedEnv;
use crate::state::{Device, Env};

/// What the mirror is told of the programs it keeps the maps of, at start-up.
pub struct ProgramFacts {
    pub tier: Tier,
    /// The identity map's capacity.
    pub capacity: u32,
    /// This run's pin directory (`--keep-pinned`).
    pub pin_generation: Option<PathBuf>,
    /// `--bpf-log`: the names the decision log puts on identities.
    pub env_names: Option<EnvNames>,
}

pub struct Mirror {
    policy: PolicyMaps,
    /// The open tier loaded, for the guarantee said once armed.
    tier: Tier,
    /// How many processes the identity map holds.
    capacity: u32,
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
}

impl Mirror {
    /// Takes the policy maps, exempts this daemon (in an earlier run's pins too),
    /// installs the allow-list (said in `status`) and seeds the identities of the
    /// processes already running.
    pub fn start(
        policy: PolicyMaps,
        facts: ProgramFacts,
        settings: &KernelSettings,
        status: &mut Status,
    ) -> Result<Self> {
        let ProgramFacts {
            tier,
            capacity,
            pin_generation,
            env_names,
        } = facts;
        let mut mirror = Self {
            policy,
            tier,
            capacity,
            device_map: None,
            armed: false,
            pin_generation,
            tools_beside: None,
            env_names,
        };
        mirror.exempt_self(settings)?;
        status.allowed = mirror.install_allow_list(settings, None)?;
        let seeded = identity::seed_identities(&mut mirror.policy);
        tracing::info!(
            "Environment identities of {} running processes recorded in the kernel",
            seeded.seeded
        );
        seeded.say_unresolved();
        Ok(mirror)
    }

    /// The daemon opens GPU nodes itself (NVML): its process is exempt, by id, in its
    /// own maps and in those of an earlier run still pinned, whose programs decide until
    /// this run takes over.
    fn exempt_self(&mut self, settings: &KernelSettings) -> Result<()> {
        let pid = std::process::id();
        let start_time = procfs::stat(pid)?.start_time;
        self.policy.exempt(pid, start_time)?;
        let own = self.pin_generation.as_deref();
        let exe = allowlist::exe_key(Path::new("/proc/self/exe"))?;
        for old in pins::other_generations(&settings.pin_dir, own) {
            if let Err(e) = pins::exempt_in_generation(&old, pid, start_time, exe) {
                tracing::warn!(
                    "Cannot exempt this daemon in the pinned programs under {}: {e}; their --deny may stop its NVML calls until it takes over",
                    old.display()
                );
            }
        }
        Ok(())
    }

    /// A reader of the identities the kernel recorded, for the snapshot and `alloc`.
    pub fn identity_reader(&self) -> Result<IdentityReader> {
        Ok(self.policy.identity_reader()?)
    }

    /// A process whose environment block the exec hook could not read in full.
    pub fn resolve_identity(&mut self, pid: u32, verbose: bool) {
        identity::resolve_identity(&mut self.policy, pid, verbose);
    }

    /// Whether the kernel recorded, at `pid`'s exec, that it has no environment id at
    /// all: not one still being resolved, not one naming an environment not mirrored yet.
    pub fn definitely_outside(&self, pid: u32) -> bool {
        self.policy.identity(pid) == Some(genv_ebpf_common::identity::NO_ENV)
    }

    /// The maps and the watched nodes, for the sweep of a killed opener's GPUs; `None`
    /// before the first full cycle gave the nodes.
    pub fn holders_view(&self) -> Option<(&PolicyMaps, &DeviceMap)> {
        Some((&self.policy, self.device_map.as_ref()?))
    }

    /// After a full cycle: the watched nodes follow the snapshot's device map, and the
    /// kernel's environments follow the state the cycle read (`None`: unreadable, keep
    /// the last); every identity is made whole, and the allow-list follows NVML.
    pub fn follow_cycle(
        &mut self,
        settings: &KernelSettings,
        status: &mut Status,
        device_map: &DeviceMap,
        state: Option<(Vec<Env>, Vec<Device>)>,
        dropped: &[DroppedEnv],
    ) {
        self.watch_nodes(status, device_map);
        self.mirror_state(settings, status, state, dropped);
        self.resync_identities(settings, status);
        self.follow_nvml(settings, status);
    }

    /// Once NVML is loaded, its tools may sit beside it (`/usr/local/nvidia/lib64` and
    /// `bin`): the allow-list is looked for again there.
    fn follow_nvml(&mut self, settings: &KernelSettings, status: &mut Status) {
        let dir = nvml::loaded_library().and_then(|lib| lib.parent().map(Path::to_path_buf));
        if dir.is_none() || dir == self.tools_beside {
            return;
        }
        match self.install_allow_list(settings, dir.as_deref()) {
            Ok(allowed) => status.allowed = allowed,
            Err(e) => tracing::warn!("Cannot update the allow-list: {e}"),
        }
        self.tools_beside = dir;
    }

    /// The tools allowed outside environments, looked for in `PATH`, beside the NVML
    /// library (once known) and in the usual places, and those given.
    fn install_allow_list(
        &mut self,
        settings: &KernelSettings,
        nvml_dir: Option<&Path>,
    ) -> Result<String> {
        let dirs = allowlist::tool_dirs(std::env::var_os("PATH"), nvml_dir);
        let allowed = allowlist::install(&mut self.policy, &dirs, &settings.allow_exes)?;
        tracing::info!("Allowed to open GPU nodes outside environments: {allowed}");
        Ok(allowed)
    }

    /// Every full cycle (and so after every loss of events): no identity stays
    /// unresolved or missing. When the kernel could not record some (its map was full),
    /// the identities of processes gone unseen are dropped first.
    fn resync_identities(&mut self, settings: &KernelSettings, status: &mut Status) {
        let lost = self.policy.decisions().identity_lost;
        let prune = lost > status.counts.identity_lost_in_kernel;
        if prune {
            tracing::warn!(
                "The kernel could not record {} process identities (its map of {} is full); dropping those of processes gone and recording them again",
                lost - status.counts.identity_lost_in_kernel,
                self.capacity
            );
            status.counts.identity_lost_in_kernel = lost;
        }
        let done = identity::resync_identities(&mut self.policy, prune, settings.verbose);
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
        match self.policy.watch_nodes(map) {
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
        let current = environments::sync_environments(&mut self.policy, state, dropped);
        if !current || self.armed {
            return;
        }
        let deny = settings.deny;
        let memory = settings.memory_at_alloc.policy_flags();
        if deny.deny || memory != 0 {
            if let Err(e) = self.policy.set_policy(deny, memory) {
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
            MemoryAtAlloc::Refuse => tracing::info!(
                "Allocations past an environment's gpu_memory return CUDA_ERROR_OUT_OF_MEMORY without running, and their process lives (--memory-at-alloc refuse)"
            ),
        }
        let guarantee = guarantee(Some(self.tier), deny);
        tracing::info!("GPU opens outside any environment are {guarantee}");
        status.guarantee = guarantee;
        status.deny_in_force = deny.deny;
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

    /// The kernel's own decision counts, into `status`.
    pub fn report(&self, status: &mut Status) {
        let decided = self.policy.decisions();
        status.counts.refused_in_kernel = decided.refused;
        status.counts.killed_in_kernel = decided.killed;
        status.counts.kill_failed_in_kernel = decided.kill_failed;
        status.counts.refused_at_alloc = decided.refused_at_alloc;
    }

    /// Whether the kernel could not record identities (its map was full) since the last
    /// resynchronisation, which `status` counts: one is then due at once.
    pub fn identities_lost(&self, status: &Status) -> bool {
        let lost = self.policy.decisions().identity_lost;
        lost > status.counts.identity_lost_in_kernel
    }

    /// Before the daemon exits: its process id leaves the exemptions, which pinned maps
    /// would otherwise keep for whichever process gets that id next. (A daemon killed
    /// outright leaves it until the next daemon takes over and removes its pins.)
    pub fn release(mut self) {
        if let Err(e) = self.policy.unexempt(std::process::id()) {
            tracing::warn!("Cannot remove this daemon's exemption from the kernel: {e}");
        }
    }
}
