//! Exec, fork and exit: the identities the kernel could not read resolved, the libcuda
//! probes' accounting kept per image (`--memory-at-alloc`), and what the snapshot knew
//! of a process dropped when its image or its life ends.

use super::Around;
use super::Wanted;

/// A new image (`pid` exec'd at `at_ns`): the old one's GPU memory went with its
/// address space; an identity the exec hook could not read is resolved before the
/// probes read it.
pub fn exec(
    (pid, at_ns): (u32, u64),
    unresolved: bool,
    verbose: bool,
    around: &mut Around<'_>,
) -> Wanted {
    around.counts.exec_events += 1;
    if let Some(alloc) = around.alloc.as_deref_mut() {
        alloc.execed(pid, at_ns);
    }
    if unresolved {
        around.mirror.resolve_identity(pid, verbose);
    }
    if let Some(alloc) = around.alloc.as_deref_mut() {
        alloc.place_probes(pid, around.devices);
    }
    Wanted::Forget(pid)
}

/// A child: its identity is its parent's, or resolved here if the parent's was not yet.
pub fn fork(child: u32, unresolved: bool, verbose: bool, around: &mut Around<'_>) {
    around.counts.fork_events += 1;
    if unresolved {
        around.mirror.resolve_identity(child, verbose);
    }
    if let Some(alloc) = around.alloc.as_deref_mut() {
        alloc.place_probes(child, around.devices);
    }
}

/// A process began exiting: its GPU memory goes once it is gone (`alloc` looks).
pub fn exit(pid: u32, around: &mut Around<'_>) -> Wanted {
    around.counts.exit_events += 1;
    if let Some(alloc) = around.alloc.as_deref_mut() {
        alloc.exiting(pid);
    }
    Wanted::Gone(pid)
}
