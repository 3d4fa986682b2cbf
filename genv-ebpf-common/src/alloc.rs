//! GPU memory at allocation time (`--memory-at-alloc`): what the libcuda uprobes and
//! the daemon share.
//!
//! An environment's usage on a GPU, as the probes judge it, is
//! `baseline.nvml_bytes + (delta - baseline.delta_at)`: NVML's figure at the daemon's
//! last memory poll, plus what the probes saw allocated and freed since. `delta` only
//! ever moves by atomic adds in the probes; the daemon writes baselines alone (a process's
//! exit comes off through `delta_at`). It reads the deltas before asking NVML and after
//! the answer: an account that did not move in between pairs NVML's figure with the
//! delta read before; one that moved (an allocation or free in flight, which NVML's
//! answer may or may not hold) keeps its baseline, so that nothing is counted twice, for
//! a few polls in a row at most (then NVML's figure is taken with the delta read after).

/// Environment ([`crate::env_id_hash`]) → its `gpu_memory` cap in bytes, for
/// environments that have one.
pub const ENV_MEMORY_MAP: &str = "ENV_MEMORY";
/// [`EnvGpu`] → [`Delta`]: bytes allocated minus bytes freed, as the probes saw them.
pub const ALLOC_DELTA_MAP: &str = "ALLOC_DELTA";
/// [`EnvGpu`] → [`Baseline`], written by the daemon at each memory poll.
pub const ALLOC_BASE_MAP: &str = "ALLOC_BASE";
/// [`ProcGpu`] → [`Charge`]: what each process holds per GPU by the probes' count, so
/// that the daemon can take it off its environment's delta when the process exits (the
/// driver frees it then).
pub const PROC_CHARGE_MAP: &str = "PROC_CHARGE";
/// One `u32`: the node's GPU count, written by the daemon. A GPU number at or past it
/// is no GPU: nothing is charged there (a made-up device number cannot fill the maps).
pub const CUDA_GPUS_MAP: &str = "CUDA_GPUS";
/// Process (tgid) → [`Ordinals`]: its CUDA device numbers to NVML indices, from its
/// `CUDA_VISIBLE_DEVICES`, written by the daemon when the process starts CUDA.
pub const PROC_ORDINALS_MAP: &str = "PROC_ORDINALS";
/// Process (tgid) → the `gpu_memory` in bytes it was started with (`GENV_GPU_MEMORY`,
/// which genv sets from the owner's own configuration; `u64::MAX` for a program genv's
/// shell started with none): it is never killed at the allocation below this, whatever
/// `envs.json` says since. Written by the daemon when the process starts CUDA.
pub const PROC_CAP_MAP: &str = "PROC_CAP";

/// Every map of the probes, the kernel side's own included: sized down to one entry
/// when `--memory-at-alloc` is off, so that they cost no kernel memory.
pub const ALL_MAPS: [&str; 13] = [
    ENV_MEMORY_MAP,
    ALLOC_DELTA_MAP,
    ALLOC_BASE_MAP,
    PROC_CHARGE_MAP,
    PROC_ORDINALS_MAP,
    PROC_CAP_MAP,
    "ALLOCS",
    "CTX_DEVICE",
    "THREAD_CTX",
    "PENDING",
    "SWITCHES",
    "ANNOUNCED",
    "REFUSAL_PACE",
];

/// A process's refusals are reported at most this often (`--memory-at-alloc refuse`);
/// those in between are counted, and the next report carries the count.
pub const REFUSAL_PACE_NS: u64 = 1_000_000_000;

/// When a process's last refusal was reported, and how many it had since (moved by
/// atomic adds: threads of one process refuse at once).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefusalPace {
    pub reported_ns: u64,
    pub held_back: u64,
}

/// The largest allocation a call is charged for: 256 TiB, more than any GPU has, and
/// far enough from `i64::MAX` that no sum of charges wraps.
pub const MAX_CHARGE: u64 = 1 << 48;

/// Capacity of the per-environment maps (one entry per environment and GPU).
pub const MAX_ENV_GPUS: u32 = 16 * 1024;
/// Capacity of [`PROC_ORDINALS_MAP`]; [`PROC_CHARGE_MAP`] holds eight times as many
/// (a process on up to eight GPUs), least recently charged first out.
pub const MAX_CUDA_PROCESSES: u32 = 8 * 1024;
/// Live allocations tracked for their frees (an LRU map: an evicted one's free is not
/// subtracted, which over-counts until the next memory poll).
pub const MAX_ALLOCATIONS: u32 = 64 * 1024;
/// CUDA device numbers a process can see that are mapped to NVML indices.
pub const MAX_ORDINALS: usize = 16;
/// [`Ordinals::index`] of an ordinal `CUDA_VISIBLE_DEVICES` does not give.
pub const NO_GPU: u8 = u8::MAX;

/// One environment on one GPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EnvGpu {
    pub env: u64,
    pub gpu: u32,
    pub _pad: u32,
}

/// An environment's account on a GPU as the probes keep it, by atomic adds only.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Delta {
    /// Bytes allocated minus bytes freed.
    pub bytes: i64,
    /// How many times `bytes` moved: an allocation and a free of the same size leave
    /// `bytes` as it was, not this.
    pub moves: u64,
}

/// NVML's figure for an environment on a GPU, and the delta when it was asked.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Baseline {
    pub nvml_bytes: u64,
    pub delta_at: i64,
}

/// One process on one GPU.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ProcGpu {
    pub tgid: u32,
    pub gpu: u32,
}

/// Bytes charged to an environment on a GPU: a live allocation's, or all of one
/// process's (`bytes` is moved by atomic adds, so it stays at offset 8).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Charge {
    pub env: u64,
    pub bytes: i64,
    pub gpu: u32,
    pub _pad: u32,
}

impl Charge {
    /// The account (environment and GPU) it is charged to.
    pub fn account(&self) -> EnvGpu {
        EnvGpu {
            env: self.env,
            gpu: self.gpu,
            _pad: 0,
        }
    }
}

/// A process's CUDA device numbers: `index[ordinal]` is the NVML index, or [`NO_GPU`].
/// Without an entry, ordinal `n` is NVML index `n` (no `CUDA_VISIBLE_DEVICES`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ordinals {
    pub index: [u8; MAX_ORDINALS],
}

/// A thread's CUDA context stack (`cuCtxPushCurrent`/`cuCtxPopCurrent`); `ctx[0]` is
/// the current one. Deeper pushes than four keep the newest four.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtxStack {
    pub ctx: [u64; 4],
    pub depth: u32,
    pub _pad: u32,
}
