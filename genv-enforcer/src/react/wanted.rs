//! What a reaction to a kernel event asks of the daemon, which owns the checks and the
//! snapshot: the reactions decide, the daemon acts, and nothing reaches back.

use crate::intake::GpuOpen;

/// One thing a reaction wants done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wanted {
    /// A GPU open let through (or one the kernel failed to kill): its process is to be
    /// checked against genv's rules at once, and again while its window lasts.
    Watch(GpuOpen),
    /// `pid` exec'd: what the snapshot knew of its old image goes.
    Forget(u32),
    /// `pid` exited: what the snapshot knew of it goes, and it is no longer left out of
    /// the narrow checks (its pid may be reused).
    Gone(u32),
    /// `pid`, known to the kernel to be outside any environment, made a CUDA context
    /// (`--memory-at-alloc`'s probes saw it, at `at_ns`, CLOCK_MONOTONIC): judged now as
    /// a GPU process on the GPU it opened, without waiting for NVML to list it.
    Judge { pid: u32, at_ns: u64 },
    /// The kernel killed `pid` (at an allocation): left out of the narrow checks for a
    /// while, as one they terminated.
    Settle(u32),
}
