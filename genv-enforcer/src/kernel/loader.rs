//! Loading the kernel programs: offsets into the object, lifecycle tracepoints attached,
//! then the best open tier the kernel accepts (or the one forced). What loading gives is
//! split by owner at once ([`Loaded`]): the programs themselves (their lifetime and
//! counters), the event maps (read by the intake), the policy maps (kept by the mirror)
//! and `--memory-at-alloc`'s maps and probes (kept by `alloc`). Dropping
//! [`KernelPrograms`] detaches and unloads everything: nothing outlives the daemon
//! (unless pinned).

use aya::Ebpf;
use aya::maps::{MapData, PerCpuArray, RingBuf};
use genv_ebpf_common::{EVENTS_MAP, LOST_MAP, OFFSETS_GLOBAL, PROC_ENV_MAP};

use super::attached::Attached;
use super::btf::Btf;
use super::cuda::{self, CudaKernel};
use super::ebpf_loader;
use super::error::{LoadError, chain, take_map};
use super::lifecycle::{self, EnvScan};
use super::object::{self, OBJECT};
use super::offsets::{self, OffsetsError};
use super::open_tiers;
use super::pins;
use super::policy_maps::PolicyMaps;
use super::skipped_runs::SkippedRuns;
use super::tier::{Tier, TierChoice};
use super::tracefs;
use super::trampoline::{self, Targets};

pub struct LoadOptions {
    pub choice: TierChoice,
    /// Ring buffer size in bytes (a power-of-two number of pages); `None` keeps the
    /// object's 256 KiB.
    pub ring_bytes: Option<u32>,
    /// Pin links and maps here (`--keep-pinned`).
    pub pin_dir: Option<std::path::PathBuf>,
    /// On the tracepoint tier, watch 32-bit opens too: a program run on every syscall
    /// exit of the machine (about 0.1 µs each), worth it where `--deny` must hold.
    pub compat_opens: bool,
    /// `--bpf-log`: the open programs log each decision (aya-log's `AYA_LOG_LEVEL` at
    /// info). Off, the level is 0 in read-only data, and the verifier removes the
    /// logging code as dead: nothing of it runs, or is even loaded.
    pub log_decisions: bool,
    /// `--memory-at-alloc`: load the libcuda probes (attached per library, by
    /// [`cuda::Probes::attach`]), refusing ones where asked and loaded, and take their
    /// accounting maps.
    pub memory_at_alloc: cuda::AllocProbes,
}

/// aya-log's level global in the object, and the level `--bpf-log` sets (`info`).
/// How the programs that decide GPU opens are named in the object (`open_lsm`,
/// `open_fentry`, `open_exit_at`, ...).
const OPEN_PROGRAMS: &str = "open_";
const LOG_LEVEL_GLOBAL: &str = "AYA_LOG_LEVEL";
const LOG_LEVEL_INFO: u8 = 3;

/// Where the programs' events come out: the ring buffer, and the per-CPU count of
/// events it had no room for.
pub struct EventMaps {
    pub ring: RingBuf<MapData>,
    pub lost: PerCpuArray<MapData, u64>,
}

/// What loading gives, split by owner: nothing of it is reached through another's.
pub struct Loaded {
    /// The programs: kept by the daemon for its life, for their counters and the log.
    pub programs: KernelPrograms,
    /// Where their events come out: the intake's.
    pub events: EventMaps,
    /// What they decide from: the mirror's.
    pub policy: PolicyMaps,
    /// `--memory-at-alloc`'s maps and probes: `alloc`'s.
    pub cuda: Option<CudaKernel>,
}

/// The loaded programs and the open tier in use.
pub struct KernelPrograms {
    /// Owns the programs and their links.
    ebpf: Ebpf,
    tier: Tier,
    /// Why each better tier was not used.
    refused: Vec<(Tier, String)>,
    /// Loaded and attached programs.
    programs: Vec<Attached>,
    env_scan: EnvScan,
    /// `PROC_ENV`'s capacity.
    processes: u32,
}

/// One program's counters, as the kernel keeps them while `kernel.bpf_stats_enabled`
/// is 1 (off by default: it costs a clock read per run), and what verifying it took.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProgramStats {
    pub name: String,
    pub id: u32,
    pub runs: u64,
    pub run_time_ns: u64,
    /// Instructions the verifier processed to accept it (0: not reported, before 5.16).
    #[serde(default)]
    pub verified_insns: u32,
    /// The program as the verifier left it (dead code removed), in bytes: what
    /// `--bpf-log` off saves shows here.
    #[serde(default)]
    pub translated_bytes: u32,
    /// Runs the kernel skipped, finding the program already running on that CPU
    /// ([`super::skipped_runs`]); counted whatever `kernel.bpf_stats_enabled` says.
    #[serde(default)]
    pub recursion_misses: u64,
}

impl KernelPrograms {
    /// Loads everything; `options.choice` must not be `None`.
    pub fn load(options: &LoadOptions) -> Result<Loaded, LoadError> {
        with_object(options, |ebpf, object, processes| {
            Self::attach(ebpf, object, options, processes)
        })
    }

    /// Attaches the loaded programs (`object`: the bytes they were loaded from, and the
    /// trampoline tiers' targets): the lifecycle ones, the best open tier the kernel
    /// accepts, the libcuda probes' loading; pins them if asked; takes the maps.
    fn attach(
        mut ebpf: Ebpf,
        object: (&[u8], &Targets),
        options: &LoadOptions,
        processes: u32,
    ) -> Result<Loaded, LoadError> {
        let mut programs = Vec::new();
        let env_scan = lifecycle::attach(&mut ebpf, &mut programs)?;
        let (tier, refused) = open_tiers::attach_best(
            &mut ebpf,
            object,
            (options.choice, options.compat_opens),
            &mut programs,
        )?;
        let cuda = cuda::load_if(options.memory_at_alloc, &mut ebpf, &mut programs)?;
        if let Some(dir) = &options.pin_dir {
            pins::pin_all(&mut ebpf, &mut programs, dir)?;
        }
        let events = EventMaps {
            ring: take_map(&mut ebpf, EVENTS_MAP)?,
            lost: take_map(&mut ebpf, LOST_MAP)?,
        };
        let policy = PolicyMaps::take(&mut ebpf)?;
        let programs = Self {
            ebpf,
            tier,
            refused,
            programs,
            env_scan,
            processes,
        };
        Ok(Loaded {
            programs,
            events,
            policy,
            cuda,
        })
    }

    /// `--bpf-log`'s reader: the programs' log ring buffer, printed through `logger`.
    pub fn decision_logger<T: log::Log>(
        &mut self,
        logger: T,
    ) -> Result<aya_log::EbpfLogger<T>, LoadError> {
        aya_log::EbpfLogger::init_with_logger(&mut self.ebpf, logger)
            .map_err(|e| LoadError::Object(format!("the decision log: {}", chain(&e))))
    }

    pub fn env_scan(&self) -> EnvScan {
        self.env_scan
    }

    /// How many processes the identity map holds.
    pub fn process_capacity(&self) -> u32 {
        self.processes
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    pub fn refused(&self) -> &[(Tier, String)] {
        &self.refused
    }

    /// Each program's run count and time so far.
    pub fn stats(&self) -> Vec<ProgramStats> {
        self.programs
            .iter()
            .map(|&Attached { name, id, .. }| {
                let info = self.ebpf.program(name).and_then(|p| p.info().ok());
                let (runs, run_time_ns, verified_insns, translated_bytes) = match info {
                    Some(info) => (
                        info.run_count(),
                        info.run_time().as_nanos() as u64,
                        info.verified_instruction_count().unwrap_or(0),
                        info.size_translated().unwrap_or(0),
                    ),
                    // Loaded outside aya (the trampoline tiers): asked of the kernel by id.
                    None => trampoline::counters(id).unwrap_or_default(),
                };
                ProgramStats {
                    name: name.to_owned(),
                    id,
                    runs,
                    run_time_ns,
                    verified_insns,
                    translated_bytes,
                    recursion_misses: trampoline::recursion_misses(id).unwrap_or(0),
                }
            })
            .collect()
    }

    /// The runs the kernel skipped so far, of the programs that decide GPU opens and of
    /// the exec, fork and exit hooks.
    pub fn skipped_runs(&self) -> SkippedRuns {
        let mut skipped = SkippedRuns::default();
        for &Attached { name, id, .. } in &self.programs {
            let misses = trampoline::recursion_misses(id).unwrap_or(0);
            match name.starts_with(OPEN_PROGRAMS) {
                true => skipped.open += misses,
                false => skipped.lifecycle += misses,
            }
        }
        skipped
    }
}

/// The embedded object as `options` sizes it, its maps created and no program loaded
/// yet, handed to `then` with the bytes it was loaded from, the trampoline tiers'
/// targets and the identity map's capacity: the daemon attaches from there, `doctor`
/// only loads ([`super::tier_probe`]).
pub(super) fn with_object<T>(
    options: &LoadOptions,
    then: impl FnOnce(Ebpf, (&[u8], &Targets), u32) -> Result<T, LoadError>,
) -> Result<T, LoadError> {
    let tracefs_root = tracefs::ensure_mounted()?;
    // All the programs need of the kernel's BTF, read once and freed before aya
    // loads the object (aya itself is kept from reading it: `ebpf_loader`).
    let (offsets, targets) = {
        let btf = Btf::from_sys_fs().map_err(OffsetsError::from)?;
        let offsets = offsets::for_running_kernel(&btf, &tracefs_root)?;
        (offsets, Targets::find(&btf))
    };

    let mut loader = ebpf_loader::without_kernel_btf();
    loader.override_global(OFFSETS_GLOBAL, &offsets, true);
    let log_level: u8 = if options.log_decisions {
        LOG_LEVEL_INFO
    } else {
        0
    };
    loader.override_global(LOG_LEVEL_GLOBAL, &log_level, true);
    cuda::size_maps(
        &mut loader,
        options.memory_at_alloc != cuda::AllocProbes::Off,
    );
    if let Some(bytes) = options.ring_bytes {
        loader.map_max_entries(EVENTS_MAP, bytes);
    }
    // Sized for every process the machine can have, and allocated as processes come
    // where the kernel allows (6.1): preallocated, the capacity costs ~50 bytes a
    // process whether they exist or not, so there it stays bounded.
    let lazy = match object::lazy_maps_supported() {
        true => Some(object::with_lazy_map(OBJECT, PROC_ENV_MAP).map_err(LoadError::Object)?),
        false => None,
    };
    let processes = lifecycle::process_capacity(lazy.is_some());
    loader.map_max_entries(PROC_ENV_MAP, processes);
    let bytes = lazy.as_ref().map_or(OBJECT, |o| o.bytes());
    let ebpf = loader
        .load(bytes)
        .map_err(|e| LoadError::Object(chain(&e)))?;
    let done = then(ebpf, (bytes, &targets), processes);
    object::release_pages();
    done
}
