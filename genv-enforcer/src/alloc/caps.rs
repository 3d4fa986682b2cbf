//! `--memory-at-alloc`: what the libcuda probes' maps should hold, from genv's state and
//! NVML (pure, tested without a kernel): each environment's cap, its measured usage per
//! GPU, each process's CUDA device numbering; and the line an allocation past a cap
//! prints.

use std::collections::HashMap;

use genv_ebpf_common::alloc::{EnvGpu, MAX_ORDINALS, NO_GPU, Ordinals};
use genv_ebpf_common::{env_id_hash, policy};

use super::started_cap::StartedWith;
use crate::backends::nvml::GpuInfo;
use crate::intake::{AllocOutcome, OverCap};
use crate::snapshot::GpuProcess;
use crate::state::memory::format_megabytes;
use crate::state::{Env, MemorySpec};

/// What an allocation that takes an environment past its `gpu_memory` meets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MemoryAtAlloc {
    /// No probes: the memory rule acts after the fact, at the memory poll.
    #[default]
    Off,
    /// A line, and the allocation goes on (the memory rule still acts).
    Report,
    /// SIGKILL in the call, before the driver hands anything out.
    Kill,
    /// The call returns CUDA_ERROR_OUT_OF_MEMORY without running, and the program lives
    /// (on kernels that let a uprobe program set registers; elsewhere as kill, said at
    /// start and in status).
    Refuse,
}

impl MemoryAtAlloc {
    /// As the flag takes it.
    pub fn name(self) -> &'static str {
        match self {
            MemoryAtAlloc::Off => "off",
            MemoryAtAlloc::Report => "report",
            MemoryAtAlloc::Kill => "kill",
            MemoryAtAlloc::Refuse => "refuse",
        }
    }

    /// Its `POLICY` flag.
    pub fn policy_flags(self) -> u32 {
        match self {
            MemoryAtAlloc::Off => 0,
            MemoryAtAlloc::Report => policy::MEMORY_REPORT,
            MemoryAtAlloc::Kill => policy::MEMORY_KILL,
            // A call the program cannot move is killed instead.
            MemoryAtAlloc::Refuse => policy::MEMORY_REFUSE | policy::MEMORY_KILL,
        }
    }
}

/// The environments with a cap, by identity: the cap in bytes for the kernel, and the
/// id and cap as genv writes them for the line.
#[derive(Debug, Default)]
pub struct Caps {
    pub by_identity: HashMap<u64, (String, MemorySpec)>,
}

impl Caps {
    pub fn of(envs: &[Env]) -> Self {
        let by_identity = envs
            .iter()
            .filter(|env| !env.key_lost)
            .filter_map(|env| {
                let cap = env.config.gpu_memory.clone()?;
                Some((env_id_hash(env.eid.as_bytes()), (env.eid.clone(), cap)))
            })
            .collect();
        Self { by_identity }
    }

    /// Whether processes of the environment `identity` are held to a cap.
    pub fn holds(&self, identity: u64) -> bool {
        self.by_identity.contains_key(&identity)
    }

    /// What the kernel's `ENV_MEMORY` map should hold.
    pub fn kernel_entries(&self) -> HashMap<u64, u64> {
        self.by_identity
            .iter()
            .map(|(identity, (_, cap))| (*identity, cap.bytes().min(i64::MAX as u64)))
            .collect()
    }

    /// genv's wording, for what the kernel decided: `Environment E would use Nm on
    /// device I which is Mm over its capacity of C; killed process P at the
    /// allocation`.
    /// `started`: the cap the process was started with, which it is held to where it
    /// allows more than the environment's (see [`super::started_cap`]).
    pub fn line(&self, over: &OverCap, started: Option<&StartedWith>) -> String {
        let (eid, cap, excess) = match self.by_identity.get(&over.env) {
            Some((eid, cap)) => match started.filter(|s| s.exceeds(cap)) {
                Some(StartedWith::Cap(own)) => (
                    eid.clone(),
                    format!(
                        "{own}, which process {} was started with (envs.json says {cap})",
                        over.pid
                    ),
                    over.would_use.saturating_sub(own.bytes()),
                ),
                _ => (
                    eid.clone(),
                    format!("its capacity of {cap}"),
                    over.would_use.saturating_sub(cap.bytes()),
                ),
            },
            None => (format!("{:016x}", over.env), "its cap".to_owned(), 0),
        };
        let outcome = match over.outcome {
            AllocOutcome::Killed => format!("killed process {} at the allocation", over.pid),
            AllocOutcome::Reported => format!(
                "process {} allocated past it (--memory-at-alloc report)",
                over.pid
            ),
            AllocOutcome::KillFailed => format!(
                "could NOT kill process {} at the allocation (the memory rule acts at its next poll)",
                over.pid
            ),
            AllocOutcome::Refused => format!(
                "refused an allocation of {} by process {} (CUDA_ERROR_OUT_OF_MEMORY)",
                format_megabytes(over.size),
                over.pid
            ),
        };
        format!(
            "Environment {eid} would use {} on device {} which is {} over {cap}; {outcome}",
            format_megabytes(over.would_use),
            over.index,
            format_megabytes(excess)
        )
    }
}

impl std::fmt::Display for Caps {
    /// `E cap, …` in id order, or `none`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut caps: Vec<_> = self.by_identity.values().collect();
        caps.sort_by(|a, b| a.0.cmp(&b.0));
        if caps.is_empty() {
            return f.write_str("none");
        }
        let caps: Vec<String> = caps
            .iter()
            .map(|(eid, cap)| format!("{eid} {cap}"))
            .collect();
        f.write_str(&caps.join(", "))
    }
}

/// NVML's usage of each environment on each GPU (its processes' memory summed).
pub fn measured(processes: &[GpuProcess]) -> HashMap<EnvGpu, u64> {
    let mut usage = HashMap::new();
    for process in processes {
        let Some(eid) = &process.eid else {
            continue;
        };
        let env = env_id_hash(eid.as_bytes());
        for index in process.indices() {
            let key = EnvGpu {
                env,
                gpu: index,
                _pad: 0,
            };
            *usage.entry(key).or_insert(0) += process.bytes_on(index);
        }
    }
    usage
}

/// A process's CUDA device numbers from its `CUDA_VISIBLE_DEVICES` (`None`: unset, and
/// CUDA numbers devices as NVML does), as CUDA reads it: comma-separated, up to the
/// first entry it cannot use. An entry is a device number, read as `strtoul` reads one
/// (`1gpu` is 1), or a GPU's UUID (`GPU-…`, whole or a prefix only one of `gpus` has),
/// resolved through NVML's list. One that names no GPU of it (a MIG instance, an
/// unknown UUID) ends the list there, so that nothing is charged to a wrong GPU. Where
/// CUDA's reading is stricter (a list mixing numbers and UUIDs, a number given twice),
/// this one still maps: CUDA then has no such device, and nothing lands there, whereas
/// a device CUDA has and this reading lacked would take allocations uncharged.
pub fn ordinals(visible: Option<&str>, gpus: &[GpuInfo]) -> Option<Ordinals> {
    let visible = visible?;
    let mut map = Ordinals {
        index: [NO_GPU; MAX_ORDINALS],
    };
    let entries = visible.split(',').map(str::trim);
    for (slot, entry) in map.index.iter_mut().zip(entries) {
        match visible_device(entry, gpus).and_then(|i| u8::try_from(i).ok()) {
            Some(index) if index != NO_GPU => *slot = index,
            _ => break,
        }
    }
    Some(map)
}

/// Whether `visible` names a GPU by UUID, which only NVML's device list resolves.
pub fn names_a_uuid(visible: &str) -> bool {
    visible
        .split(',')
        .any(|entry| uuid_prefix(entry.trim()).is_some())
}

/// The NVML index one entry of `CUDA_VISIBLE_DEVICES` names.
fn visible_device(entry: &str, gpus: &[GpuInfo]) -> Option<u32> {
    if let Some(index) = leading_number(entry) {
        return Some(index);
    }
    let entry = uuid_prefix(entry)?;
    let mut named = gpus.iter().filter(|gpu| {
        gpu.uuid
            .get(..entry.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(entry))
    });
    match (named.next(), named.next()) {
        (Some(gpu), None) => Some(gpu.index),
        _ => None, // none, or a prefix two GPUs share, which CUDA refuses
    }
}

/// The number an entry starts with, as `strtoul` reads it (an optional `+`, then
/// digits); `None` for none, or a minus (which ends CUDA's list).
fn leading_number(entry: &str) -> Option<u32> {
    let digits = entry.strip_prefix('+').unwrap_or(entry);
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    digits[..end].parse().ok()
}

/// `GPU-` (in any case) and at least one character of the UUID after it.
fn uuid_prefix(entry: &str) -> Option<&str> {
    let head = entry.get(.."GPU-".len())?;
    (head.eq_ignore_ascii_case("GPU-") && entry.len() > head.len()).then_some(entry)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::Usage;

    #[test]
    fn visible_devices_map_cuda_numbers_to_nvml_indices_as_cuda_reads_them() {
        let gpu = |index, uuid: &str| GpuInfo {
            index,
            uuid: uuid.to_owned(),
            minor: Some(index),
            total_memory: 0,
        };
        let gpus = [
            gpu(0, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"),
            gpu(1, "GPU-89ab0000-0000-0000-0000-000000000000"),
            gpu(2, "GPU-c0d51234-0000-0000-0000-000000000000"),
        ];
        assert_eq!(ordinals(None, &gpus), None);
        let map = ordinals(Some("1,3"), &gpus).unwrap();
        assert_eq!(&map.index[..3], &[1, 3, NO_GPU]);
        // CUDA stops at the first entry it cannot use.
        let map = ordinals(Some("2,x,0"), &gpus).unwrap();
        assert_eq!(&map.index[..2], &[2, NO_GPU]);
        // UUIDs, whole or a prefix only one GPU has, in any case.
        let map = ordinals(
            Some("GPU-c0d5, GPU-8932F937-d72c-4106-c12f-20bd9faed9f6,0"),
            &gpus,
        )
        .unwrap();
        assert_eq!(&map.index[..4], &[2, 0, 0, NO_GPU]);
        // Numbers as strtoul reads them; a number given twice still maps.
        let map = ordinals(Some("1gpu2, +2ampere,1,x"), &gpus).unwrap();
        assert_eq!(&map.index[..4], &[1, 2, 1, NO_GPU]);
        let map = ordinals(Some("gpu-C0D5,GPU-8932f9"), &gpus).unwrap();
        assert_eq!(&map.index[..3], &[2, 0, NO_GPU]);
        // A prefix two GPUs share, an unknown UUID, a MIG instance, a bare "GPU-", a
        // minus, a number past 255.
        for visible in [
            "GPU-89,0",
            "GPU-1234,0",
            "MIG-8932f937,0",
            "GPU-,0",
            "-1,0",
            "256,0",
        ] {
            assert_eq!(
                ordinals(Some(visible), &gpus).unwrap().index[0],
                NO_GPU,
                "{visible}"
            );
        }
        // Without NVML's list, a UUID names nothing.
        assert_eq!(ordinals(Some("GPU-c0d5"), &[]).unwrap().index[0], NO_GPU);
        // Empty: no device at all.
        assert!(
            ordinals(Some(""), &gpus)
                .unwrap()
                .index
                .iter()
                .all(|i| *i == NO_GPU)
        );
    }

    #[test]
    fn usage_is_summed_per_environment_and_gpu() {
        let process = |pid, eid: Option<&str>, usage: &[(u32, u64)]| GpuProcess {
            pid,
            start_time: None,
            used_gpu_memory: usage
                .iter()
                .map(|&(index, bytes)| Usage {
                    index,
                    bytes: Some(bytes),
                })
                .collect(),
            eid: eid.map(str::to_owned),
        };
        let usage = measured(&[
            process(1, Some("a"), &[(0, 100), (1, 7)]),
            process(2, Some("a"), &[(0, 50)]),
            process(3, None, &[(0, 1000)]),
        ]);
        let key = |gpu| EnvGpu {
            env: env_id_hash(b"a"),
            gpu,
            _pad: 0,
        };
        assert_eq!(usage.get(&key(0)), Some(&150));
        assert_eq!(usage.get(&key(1)), Some(&7));
        assert_eq!(usage.len(), 2);
    }

    #[test]
    fn the_line_follows_genvs_wording() {
        let caps = Caps {
            by_identity: [(7, ("21364".to_owned(), MemorySpec::parse("1g").unwrap()))].into(),
        };
        let over = OverCap {
            pid: 42,
            uid: 0,
            env: 7,
            index: 0,
            would_use: 1_200_000_000,
            size: 600 << 20,
            held_back: 0,
            outcome: AllocOutcome::Killed,
            at_ns: 0,
            subject: Default::default(),
        };
        let line = "Environment 21364 would use 1200m on device 0 which is 200m over its capacity of 1g; killed process 42 at the allocation";
        assert_eq!(caps.line(&over, None), line);
        let started = |text: &str| StartedWith::Cap(MemorySpec::parse(text).unwrap());
        assert_eq!(caps.line(&over, Some(&started("500m"))), line, "the file's");
        assert_eq!(
            caps.line(&over, Some(&started("1100m"))),
            "Environment 21364 would use 1200m on device 0 which is 100m over 1100m, which process 42 was started with (envs.json says 1g); killed process 42 at the allocation"
        );
    }
}
