//! The event-driven mode's settings: what `cli::config` validated, as the daemon reads
//! it.

use std::path::PathBuf;
use std::time::Duration;

use crate::bpf::TierChoice;
use crate::prevention::alloc::MemoryAtAlloc;

/// The event-driven mode's settings, validated (see `cli::config`).
#[derive(Debug)]
pub struct Settings {
    pub interval: Duration,
    pub memory_interval: Duration,
    pub tier: TierChoice,
    pub ring_bytes: Option<u32>,
    pub run_dir: PathBuf,
    pub verbose: bool,
    /// `--deny`: refuse (lsm, fmod_ret) or kill in the syscall (other tiers) outside
    /// processes.
    pub deny: bool,
    /// `--allow-exe`, beyond the defaults.
    pub allow_exes: Vec<PathBuf>,
    /// `--deny-root`: root's processes outside environments are denied too.
    pub deny_root: bool,
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
    /// `--config`: read again on SIGHUP.
    pub reload: Option<super::reload::Reloader>,
    /// `--metrics-addr`.
    pub metrics_addr: Option<std::net::SocketAddr>,
}
