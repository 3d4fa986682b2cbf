//! Which processes carry the libcuda probes: those whose environment has a cap, as the
//! kernel recorded their environment (at their exec, or inherited at their fork), and
//! no other. A process no capped environment needs has no breakpoint in its address
//! space, and pays nothing for `--memory-at-alloc` (see
//! `crate::kernel::cuda::uprobe_events` for how).
//!
//! The set follows the events (a process exec'ed, forked, exited) and, at every full
//! cycle, is caught up with the kernel's identities (a cap came or went, an exec was
//! lost, a follow failed). A process that
//! starts in a capped environment is followed when its exec reaches the daemon, well
//! before its CUDA start (loading the runtime and libcuda takes far longer than that):
//! its libcuda is then mapped with the breakpoints in. Followed late, for a cap set on an
//! environment already computing, it carries them from then on, its earlier contexts
//! counted as on device 0, as for a copy probed late.

use crate::backends::procfs;
use crate::kernel::KernelPrograms;
use crate::warn_once::WarnOnce;

use super::caps::Caps;

/// `pid` carries the probes if `caps` holds its environment, and not otherwise; its
/// start time if it began to carry them now.
pub(super) fn place(
    programs: &mut KernelPrograms,
    caps: &Caps,
    pid: u32,
    said: &mut WarnOnce,
) -> Option<u64> {
    let capped = programs
        .policy()
        .identity(pid)
        .is_some_and(|identity| caps.holds(identity));

    if capped {
        return follow(programs, pid, said);
    }
    programs.cuda_probes().unfollow(pid);
    None
}

/// The processes of the capped environments, as the kernel knows them, carry the
/// probes; the others no longer do. Those that began to carry them now, with their
/// start times.
pub(super) fn refollow(
    programs: &mut KernelPrograms,
    caps: &Caps,
    said: &mut WarnOnce,
) -> Vec<(u32, u64)> {
    let wanted: std::collections::HashSet<u32> = programs
        .policy()
        .identities()
        .into_iter()
        .filter(|&(_, identity)| caps.holds(identity))
        .map(|(pid, _)| pid)
        .collect();
    let probes = programs.cuda_probes();
    let followed: std::collections::HashSet<u32> = probes.followed().map(|(pid, _)| pid).collect();
    for &pid in followed.difference(&wanted) {
        probes.unfollow(pid);
    }
    // Those followed already are left as they are (their exits unfollow them).
    wanted
        .into_iter()
        .filter(|pid| !followed.contains(pid))
        .filter_map(|pid| Some((pid, follow(programs, pid, said)?)))
        .collect()
}

/// Makes `pid` carry the probes; its start time if it did not already.
fn follow(programs: &mut KernelPrograms, pid: u32, said: &mut WarnOnce) -> Option<u64> {
    let started = procfs::stat(pid).ok()?.start_time;
    match programs.cuda_probes().follow(pid, started) {
        // The pid may have been reused between the two: the events would then be
        // another process's (costing it the traps, though the programs charge only a
        // capped environment's calls).
        Ok(true) if procfs::stat(pid).is_ok_and(|stat| stat.start_time == started) => Some(started),
        Ok(true) => {
            programs.cuda_probes().unfollow(pid);
            None
        }
        Ok(false) => None,
        // Gone between the two.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => None,
        Err(e) => {
            if said.first(()) {
                tracing::warn!(
                    "--memory-at-alloc: process {pid} cannot carry the probes ({e}): its allocations are held to its environment's gpu_memory by the memory poll alone (said once)"
                );
            }
            None
        }
    }
}
