//! What the kernel side is asked to do, as `cli::config` validated it: which tier, what
//! the programs decide (`--deny`, `--memory-at-alloc`), what they allow, where they pin.

use std::path::PathBuf;

use crate::alloc::MemoryAtAlloc;
use crate::kernel::TierChoice;
use crate::kernel::policy_maps::DenyPolicy;

#[derive(Clone, Debug)]
pub struct KernelSettings {
    pub tier: TierChoice,
    pub ring_bytes: Option<u32>,
    /// `--verbose`: every event and identity resolved is said.
    pub verbose: bool,
    /// `--deny` (refuse at the open on lsm and fmod_ret, kill in the syscall on the
    /// other tiers, processes outside environments) and `--deny-root` (root's too).
    pub deny: DenyPolicy,
    /// `--allow-exe`, beyond the defaults.
    pub allow_exes: Vec<PathBuf>,
    /// `--keep-pinned`: pin under a generation of `pin_dir`.
    pub keep_pinned: bool,
    /// Where pins go, and where an earlier run's are looked for.
    pub pin_dir: PathBuf,
    /// `--bpf-log`: the programs' decisions printed as `[BPF]` lines.
    pub bpf_log: bool,
    /// `--memory-at-alloc`: GPU memory caps held at the allocation.
    pub memory_at_alloc: MemoryAtAlloc,
    /// `--cuda-lib`: libcuda copies to probe beyond those found.
    pub cuda_libs: Vec<PathBuf>,
}
