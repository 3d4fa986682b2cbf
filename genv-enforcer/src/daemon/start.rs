//! Starting the event-driven daemon: the kernel programs loaded as `--bpf-tier` asks (or
//! none, said loudly) and split among their owners (the intake, the mirror, `alloc`),
//! the snapshot reading identities from the kernel, `why`'s socket, the metrics
//! endpoint, and genv's state directory watched.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::alloc::{AllocSide, MemoryAtAlloc};
use crate::backends::procfs;
use crate::cycle::Enforcer;
use crate::intake::EventIntake;
use crate::intake::decision_log::{self, EnvNames, Printer};
use crate::kernel::cuda::{AllocProbes, CudaKernel, RefusalAtAlloc};
use crate::kernel::inspector::KernelInspector;
use crate::kernel::lifecycle::EnvScan;
use crate::kernel::loader::Loaded;
use crate::kernel::policy_maps::PolicyMaps;
use crate::kernel::tier::guarantee;
use crate::kernel::{KernelPrograms, LoadError, LoadOptions, TierChoice, pins};
use crate::service::metrics::{self, Metrics};
use crate::service::status::Status;
use crate::sync::mirror::ProgramFacts;
use crate::sync::{KernelSettings, Mirror};

use super::settings::Settings;
use super::state_watch::{StateWatch, Target};
use crate::warn_once::WarnOnce;

/// The event side's stages, each holding its own part of the kernel: the programs
/// themselves (kept for their life and counters), the mirror (the policy maps) and
/// `alloc` (`--memory-at-alloc`'s maps and probes). The events go to the intake.
pub struct EventSide {
    pub programs: KernelPrograms,
    pub mirror: Mirror,
    pub alloc: Option<AllocSide>,
}

/// Loads the programs and starts each stage on its part: a forced tier the kernel
/// refuses is an error; under `auto`, no tier at all leaves the full cycle alone, said
/// loudly. The snapshot then reads identities from the kernel.
pub fn event_side(
    settings: &KernelSettings,
    full_every: Duration,
    status: &mut Status,
    enforcer: &mut Enforcer,
) -> Result<Option<(EventSide, EventIntake)>> {
    let every = full_every.as_secs_f64();
    if settings.tier == TierChoice::None {
        status.sees = format!("no BPF (--bpf-tier none): the full cycle alone, every {every}s");
        status.guarantee = guarantee(None, settings.deny);
        tracing::info!(
            "--bpf-tier none: no kernel programs; enforcing with the full cycle alone every {every}s"
        );
        return Ok(None);
    }
    let Some((loaded, pin_generation)) = load(settings, full_every, status)? else {
        return Ok(None);
    };
    let Loaded {
        mut programs,
        events,
        policy,
        cuda,
    } = loaded;
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
    let refusal = cuda.as_ref().map(|c| c.refusal.clone());
    let settings = &as_loaded(settings, refusal, status);
    let alloc = match cuda {
        Some(cuda) => Some(start_alloc(cuda, &policy, settings)?),
        None => None,
    };
    let facts = ProgramFacts {
        tier: programs.tier(),
        capacity: programs.process_capacity(),
        pin_generation,
        env_names,
    };
    let mirror = Mirror::start(policy, facts, settings, status)?;
    read_identities_from(&mirror, enforcer);
    let side = EventSide {
        programs,
        mirror,
        alloc,
    };
    Ok(Some((side, intake)))
}

/// The settings as the kernel can keep them: `--memory-at-alloc refuse` is `kill` where
/// the kernel refused the refusing programs, said at start and in status with its
/// reason. `status.memory_at_alloc` says what allocations past a cap meet.
fn as_loaded(
    settings: &KernelSettings,
    refusal: Option<RefusalAtAlloc>,
    status: &mut Status,
) -> KernelSettings {
    let mut loaded = settings.clone();
    if let Some(RefusalAtAlloc::Refused(why)) = refusal {
        tracing::warn!(
            "--memory-at-alloc refuse: this kernel does not let a uprobe program set registers ({why}); an allocation past its environment's gpu_memory kills its process in the call instead, as with kill"
        );
        loaded.memory_at_alloc = MemoryAtAlloc::Kill;
        status.memory_at_alloc = Some(format!(
            "kill (refuse asked for; the kernel refused the refusing programs: {why})"
        ));
    } else if loaded.memory_at_alloc != MemoryAtAlloc::Off {
        status.memory_at_alloc = Some(loaded.memory_at_alloc.name().to_owned());
    }
    loaded
}

/// `--memory-at-alloc`'s stage, on its maps and probes, reading identities through a
/// hold of its own on the policy maps' identity map.
fn start_alloc(
    cuda: CudaKernel,
    policy: &PolicyMaps,
    settings: &KernelSettings,
) -> Result<AllocSide> {
    let identities = policy.identity_reader()?;
    let given = &settings.cuda_libs;
    Ok(AllocSide::start(cuda, identities, given, settings.verbose))
}

/// Environments as the kernel read them at exec, not as /proc shows them now.
fn read_identities_from(mirror: &Mirror, enforcer: &mut Enforcer) {
    match mirror.identity_reader() {
        Ok(reader) => enforcer
            .builder
            .set_inspector(Box::new(KernelInspector::new(reader))),
        Err(e) => tracing::warn!(
            "Cannot read the kernel's identities ({e}); environments are read from /proc, which setproctitle can overwrite"
        ),
    }
}

/// `--metrics-addr`'s endpoint, told what was asked for (the tier and `--deny`), which
/// the alerts compare with what is in force.
pub fn metrics(settings: &Settings) -> Result<Option<Arc<Metrics>>> {
    let Some(addr) = settings.metrics_addr else {
        return Ok(None);
    };
    let metrics = metrics::serve(addr)?;
    metrics.configured(settings.kernel.tier, settings.kernel.deny.deny);
    Ok(Some(metrics))
}

/// `genv-enforcer why`'s socket, in the run directory this daemon now holds alone.
pub fn serve_why(enforcer: &Enforcer, run_dir: &Path) -> Option<WhySocket> {
    let notifier = enforcer.executor.notifier()?;
    match notifier.serve_why(run_dir) {
        Ok(()) => Some(WhySocket(run_dir.join(crate::notify::server::SOCKET))),
        Err(e) => {
            tracing::warn!("genv-enforcer why will not be answered: {e:#}");
            None
        }
    }
}

/// The socket, removed when the daemon ends.
pub struct WhySocket(PathBuf);

impl Drop for WhySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Loading parsed the kernel's BTF (tens of MB, dropped since); glibc keeps freed heap
/// mapped unless asked, and a daemon on every node should not carry it for its life
/// (41 MB resident idle without this, 7 MB with it).
pub fn release_startup_memory() {
    // SAFETY: malloc_trim only returns free memory to the kernel; it takes no pointer
    // and leaves every live allocation where it is.
    unsafe { libc::malloc_trim(0) };
}

/// The state directory's watch; a failure is warned about once per distinct reason
/// (the daemon tries again at every full cycle).
pub fn watch_state(enforcer: &Enforcer, unwatched: &mut WarnOnce<String>) -> Option<StateWatch> {
    let state = enforcer.builder.state();
    match StateWatch::new(state) {
        Ok(watch) => {
            if let Some(Target::Ancestor { dir, .. }) = watch.target() {
                tracing::info!(
                    "genv's state directory {} does not exist yet; watching {} for it",
                    state.root().display(),
                    dir.display()
                );
            }
            unwatched.clear();
            Some(watch)
        }
        Err(e) => {
            let why = e.to_string();
            if unwatched.first(why.clone()) {
                tracing::warn!(
                    "Cannot watch {} ({why}); state changes wait for the full cycle",
                    state.root().display()
                );
            }
            None
        }
    }
}

/// The programs loaded as `--bpf-tier` asks, with their events and this run's pin
/// directory; `None` where `auto` found no tier (said loudly).
fn load(
    settings: &KernelSettings,
    full_every: Duration,
    status: &mut Status,
) -> Result<Option<(Loaded, Option<PathBuf>)>> {
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
        memory_at_alloc: match settings.memory_at_alloc {
            MemoryAtAlloc::Off => AllocProbes::Off,
            MemoryAtAlloc::Report | MemoryAtAlloc::Kill => AllocProbes::Plain,
            MemoryAtAlloc::Refuse => AllocProbes::Refusing,
        },
    };
    let loaded = match KernelPrograms::load(&options) {
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
    Ok(Some((loaded, pin_generation)))
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
