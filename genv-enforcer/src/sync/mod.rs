//! The daemon's hold on the kernel programs: loading them as `--bpf-tier` asks, then
//! keeping what they decide from (watched nodes, genv's environments, the allow-list,
//! `--deny`) in step with each full cycle, and taking over from an earlier run's pins.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use genv_ebpf_common::alloc::{Delta, EnvGpu};

pub mod allowlist;
pub mod holders;
pub mod identity;
pub mod mirror;
mod settings;

pub use settings::KernelSettings;

use crate::alloc::{AllocSide, MemoryAtAlloc};
use crate::backends::devmap::DeviceMap;
use crate::backends::{nvml, procfs};
use crate::cycle::CycleSummary;
use crate::intake::EventIntake;
use crate::intake::OverCap;
use crate::intake::decision_log::{self, EnvNames, Printer};
use crate::intake::decisions::guarantee;
use crate::kernel::alloc_maps::DeltasAround;
use crate::kernel::lifecycle::EnvScan;
use crate::kernel::policy_maps::DenyPolicy;
use crate::kernel::{KernelPrograms, LoadError, LoadOptions, TierChoice, pins};
use crate::service::status::Status;
use crate::snapshot::DroppedEnv;
use crate::state::{Device, Env};

/// The programs report the host's pids: in a pid namespace of its own, the daemon would
/// look up, and signal, other processes than the ones the kernel named.
fn refuse_nested_pid_namespace() -> Result<()> {
    if let Some(namespace) = procfs::nested_pid_namespace() {
        bail!(
            "--event-driven needs the host's pid namespace: the kernel programs report \
             the host's pids, and this daemon runs in a pid namespace of its own \
             ({namespace}); run it in the host's (docker --pid=host, Kubernetes \
             hostPID: true), or with --bpf-tier none"
        );
    }
    Ok(())
}

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

/// `--bpf-log`: the programs' decision log, printed on a thread of its own; the names
/// it puts on identities follow the mirror.
fn start_decision_log(programs: &mut KernelPrograms) -> Result<EnvNames> {
    let names = EnvNames::default();
    let printer = Printer {
        names: names.clone(),
    };
    let logger = programs.decision_logger(printer).context("--bpf-log")?;
    decision_log::spawn(logger).context("--bpf-log: starting its reader")?;
    tracing::info!("--bpf-log: the kernel's decisions on GPU opens follow as [BPF] lines");
    Ok(names)
}

/// What starting gives: the kernel side and its events, or neither (full cycle alone).
pub type Started = Option<(KernelSide, EventIntake)>;

impl KernelSide {
    /// Loads the programs: a forced tier the kernel refuses is an error; under `auto`,
    /// no tier at all leaves the full cycle alone, said loudly. Then installs the
    /// allow-list and seeds the identities of the processes already running.
    pub fn start(
        settings: &KernelSettings,
        full_every: Duration,
        status: &mut Status,
    ) -> Result<Started> {
        let every = full_every.as_secs_f64();
        if settings.tier == TierChoice::None {
            status.sees = format!("no BPF (--bpf-tier none): the full cycle alone, every {every}s");
            status.guarantee = guarantee(None, DenyPolicy::default());
            tracing::info!(
                "--bpf-tier none: no kernel programs; enforcing with the full cycle alone every {every}s"
            );
            return Ok(None);
        }
        refuse_nested_pid_namespace()?;
        let pin_generation = match settings.keep_pinned {
            true => Some(pins::prepare_generation(&settings.pin_dir).map_err(|e| {
                anyhow::anyhow!(
                    "--keep-pinned: preparing {}: {e}",
                    settings.pin_dir.display()
                )
            })?),
            false => None,
        };
        let options = LoadOptions {
            choice: settings.tier,
            ring_bytes: settings.ring_bytes,
            pin_dir: pin_generation.clone(),
            compat_opens: settings.deny,
            log_decisions: settings.bpf_log,
            memory_at_alloc: settings.memory_at_alloc != MemoryAtAlloc::Off,
        };
        let (mut programs, events) = match KernelPrograms::load(&options) {
            Ok(loaded) => loaded,
            Err(e @ LoadError::MemoryAtAlloc(_)) => bail!("--memory-at-alloc: {e}"),
            Err(e) if settings.tier != TierChoice::Auto => {
                bail!("--bpf-tier {}: {e}", settings.tier.name())
            }
            Err(e) => return Ok(no_programs(settings, full_every, status, &e)),
        };
        describe_tier(&programs, status);
        if programs.env_scan() == EnvScan::Whole {
            tracing::info!(
                "The exec hook reads whole environment blocks (bpf_loop); identity map for {} processes",
                programs.process_capacity()
            );
        }
        let intake = EventIntake::new(events.ring, events.lost)
            .map_err(|e| anyhow::anyhow!("reading the kernel's events: {e}"))?;
        let env_names = match settings.bpf_log {
            true => Some(start_decision_log(&mut programs)?),
            false => None,
        };
        let mut side = Self {
            programs,
            device_map: None,
            armed: false,
            pin_generation,
            tools_beside: None,
            env_names,
            alloc: None,
        };
        if settings.memory_at_alloc != MemoryAtAlloc::Off {
            side.alloc = Some(AllocSide::start(
                &mut side.programs,
                &settings.cuda_libs,
                settings.verbose,
            ));
        }
        side.exempt_self(settings)?;
        status.allowed = side.install_allow_list(settings, None)?;
        let seeded = identity::seed_identities(side.programs.policy_mut());
        tracing::info!(
            "Environment identities of {seeded} running processes recorded in the kernel"
        );
        Ok(Some((side, intake)))
    }

    /// The daemon opens GPU nodes itself (NVML): its process is exempt, by id, in its
    /// own maps and in those of an earlier run still pinned, whose programs decide until
    /// this run takes over.
    fn exempt_self(&mut self, settings: &KernelSettings) -> Result<()> {
        let pid = std::process::id();
        let start_time = procfs::stat(pid)?.start_time;
        self.programs.policy_mut().exempt(pid, start_time)?;
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

    /// The tools allowed outside environments, looked for in `PATH`, beside the NVML
    /// library (once known) and in the usual places, and those given.
    fn install_allow_list(
        &mut self,
        settings: &KernelSettings,
        nvml_dir: Option<&Path>,
    ) -> Result<String> {
        let dirs = allowlist::tool_dirs(std::env::var_os("PATH"), nvml_dir);
        let allowed = allowlist::install(self.programs.policy_mut(), &dirs, &settings.allow_exes)?;
        tracing::info!("Allowed to open GPU nodes outside environments: {allowed}");
        Ok(allowed)
    }

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
            let gpus = state
                .as_ref()
                .map_or(0, |(_, devices)| devices.len() as u32);
            alloc.follow_state(&mut self.programs, envs, gpus);
        }
        self.mirror_state(settings, status, state, &summary.dropped_envs);
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
        if let Some(alloc) = &mut self.alloc {
            alloc.attach_found(&mut self.programs, &settings.cuda_libs, dir.as_deref());
        }
        match self.install_allow_list(settings, dir.as_deref()) {
            Ok(allowed) => status.allowed = allowed,
            Err(e) => tracing::warn!("Cannot update the allow-list: {e}"),
        }
        self.tools_beside = dir;
    }

    /// A reader of the identities the kernel recorded, for the snapshot.
    pub fn identity_reader(&self) -> Result<crate::kernel::policy_maps::IdentityReader> {
        Ok(self.programs.policy().identity_reader()?)
    }

    /// A process whose environment block the exec hook could not read in full.
    pub fn resolve_identity(&mut self, pid: u32, verbose: bool) {
        identity::resolve_identity(self.programs.policy_mut(), pid, verbose);
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
                "Identities resynchronised: {} read from /proc, {} recorded anew, {} of processes gone dropped",
                done.resolved,
                done.seeded,
                done.pruned
            );
        }
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

    /// A process exec'ed or (`exiting`) began exiting.
    pub fn exited(&mut self, pid: u32, exiting: bool) {
        if let Some(alloc) = &mut self.alloc {
            alloc.exited(&mut self.programs, pid, exiting);
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

    /// Before the daemon exits: its process id leaves the exemptions, which pinned maps
    /// would otherwise keep for whichever process gets that id next. (A daemon killed
    /// outright leaves it until the next daemon takes over and removes its pins.)
    pub fn release(mut self) {
        if let Err(e) = self.programs.policy_mut().unexempt(std::process::id()) {
            tracing::warn!("Cannot remove this daemon's exemption from the kernel: {e}");
        }
    }

    /// Kills the processes outside environments still holding `gpus`, which the kernel
    /// killed an opener of (see [`prevention::holders`]).
    pub fn sweep_holders(
        &self,
        settings: &KernelSettings,
        gpus: &HashSet<u32>,
    ) -> Vec<holders::Killed> {
        let Some(map) = &self.device_map else {
            return Vec::new();
        };
        holders::sweep(self.programs.policy(), map, gpus, settings.deny_root)
    }

    /// The programs' run statistics and the kernel's own decision counts; whether the
    /// kernel could not record identities since the last resynchronisation (which then
    /// is due at once).
    pub fn report(&self, status: &mut Status) -> bool {
        status.programs = self.programs.stats();
        let decided = self.programs.policy().decisions();
        status.counts.refused_in_kernel = decided.refused;
        status.counts.killed_in_kernel = decided.killed;
        status.counts.kill_failed_in_kernel = decided.kill_failed;
        decided.identity_lost > status.counts.identity_lost_in_kernel
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
        let deny = DenyPolicy {
            deny: settings.deny,
            root: settings.deny_root,
        };
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

/// Under `--bpf-tier auto`, no tier loaded: the full cycle alone, said loudly.
fn no_programs(
    settings: &KernelSettings,
    full_every: Duration,
    status: &mut Status,
    e: &LoadError,
) -> Started {
    let every = full_every.as_secs_f64();
    tracing::warn!(
        "No BPF tier could be loaded ({e}); enforcing with the full cycle alone every {every}s, as genv does"
    );
    status.sees = format!("no BPF ({e}): the full cycle alone, every {every}s");
    let deny = DenyPolicy {
        deny: settings.deny,
        root: settings.deny_root,
    };
    status.guarantee = guarantee(None, deny);
    if settings.deny {
        tracing::warn!(
            "--deny cannot be kept without kernel programs: GPU opens outside any environment are {}",
            status.guarantee
        );
    }
    if settings.memory_at_alloc != MemoryAtAlloc::Off {
        tracing::warn!(
            "--memory-at-alloc cannot be kept without kernel programs: the memory rule acts at each memory poll"
        );
    }
    None
}

/// Says which tier runs, and why better ones did not.
fn describe_tier(programs: &KernelPrograms, status: &mut Status) {
    for (tier, why) in programs.refused() {
        tracing::info!("The kernel refused the {tier} tier: {why}");
        status.refused.push(format!("{tier}: {why}"));
    }
    let tier = programs.tier();
    tracing::info!("Event-driven on the {tier} tier: it sees {}", tier.sees());
    status.tier = Some(tier.to_string());
    status.sees = tier.sees().to_owned();
    status.programs = programs.stats();
}
