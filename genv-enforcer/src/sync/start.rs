//! Starting the kernel side: the programs loaded as `--bpf-tier` asks (or none, said
//! loudly), their events handed to the intake, this daemon exempt from them (and from
//! an earlier run's pinned ones), the allow-list installed and the identities of the
//! processes already running seeded.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::{KernelSettings, KernelSide, Started, allowlist, identity};
use crate::alloc::{AllocSide, MemoryAtAlloc};
use crate::backends::procfs;
use crate::intake::EventIntake;
use crate::intake::decision_log::{self, EnvNames, Printer};
use crate::intake::decisions::guarantee;
use crate::kernel::lifecycle::EnvScan;
use crate::kernel::{EventMaps, KernelPrograms, LoadError, LoadOptions, TierChoice, pins};
use crate::service::status::Status;

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
            status.guarantee = guarantee(None, settings.deny);
            tracing::info!(
                "--bpf-tier none: no kernel programs; enforcing with the full cycle alone every {every}s"
            );
            return Ok(None);
        }
        let Some((mut programs, events, pin_generation)) = load(settings, full_every, status)?
        else {
            return Ok(None);
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
            "Environment identities of {} running processes recorded in the kernel",
            seeded.seeded
        );
        seeded.say_unresolved();
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
}

/// The programs loaded as `--bpf-tier` asks, with their events and this run's pin
/// directory; `None` where `auto` found no tier (said loudly).
fn load(
    settings: &KernelSettings,
    full_every: Duration,
    status: &mut Status,
) -> Result<Option<(KernelPrograms, EventMaps, Option<PathBuf>)>> {
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
        compat_opens: settings.deny.deny,
        log_decisions: settings.bpf_log,
        memory_at_alloc: settings.memory_at_alloc != MemoryAtAlloc::Off,
    };
    let (programs, events) = match KernelPrograms::load(&options) {
        Ok(loaded) => loaded,
        Err(e @ LoadError::MemoryAtAlloc(_)) => bail!("--memory-at-alloc: {e}"),
        Err(e) if settings.tier != TierChoice::Auto => {
            bail!("--bpf-tier {}: {e}", settings.tier.name())
        }
        Err(e) => {
            no_programs(settings, full_every, status, &e);
            return Ok(None);
        }
    };
    Ok(Some((programs, events, pin_generation)))
}

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

/// Under `--bpf-tier auto`, no tier loaded: the full cycle alone, said loudly.
fn no_programs(
    settings: &KernelSettings,
    full_every: Duration,
    status: &mut Status,
    e: &LoadError,
) {
    let every = full_every.as_secs_f64();
    tracing::warn!(
        "No BPF tier could be loaded ({e}); enforcing with the full cycle alone every {every}s, as genv does"
    );
    status.sees = format!("no BPF ({e}): the full cycle alone, every {every}s");
    status.guarantee = guarantee(None, settings.deny);
    if settings.deny.deny {
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
