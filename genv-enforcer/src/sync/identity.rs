//! The identity the kernel decides on: which environment each process claims, as a
//! hash of its `GENV_ENVIRONMENT_ID`. The exec and fork hooks keep it current; the daemon
//! seeds the processes that were there before the programs, and answers for the ones
//! whose environment block the exec hook could not read.

use genv_ebpf_common::{MAX_ENV_ID, env_id_hash, identity};

use crate::backends::procfs;
use crate::kernel::policy_maps::PolicyMaps;

/// The identity the kernel gives a process whose `GENV_ENVIRONMENT_ID` is `id`.
pub fn identity_of(id: Option<&str>) -> u64 {
    match id {
        // The programs read at most MAX_ENV_ID bytes of a value; a longer one is no
        // environment's (see `environments::env_entries`).
        Some(id) if id.len() <= MAX_ENV_ID => env_id_hash(id.as_bytes()),
        _ => identity::NO_ENV,
    }
}

/// What one seeding of the kernel's identities from `/proc` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Seeded {
    /// Processes whose identity was recorded.
    pub seeded: usize,
    /// Processes whose environment block did not answer in time (their owner holds
    /// their address space): recorded as unresolved, read again at each full cycle.
    pub unresolved: Vec<u32>,
}

impl Seeded {
    /// Said once per seeding that left some unresolved, naming the first few.
    pub fn say_unresolved(&self) {
        if self.unresolved.is_empty() {
            return;
        }
        let first: Vec<String> = self.unresolved.iter().take(8).map(u32::to_string).collect();
        tracing::warn!(
            "The environment blocks of {} process(es) did not answer in time (their owners hold their address spaces: pid {}): unresolved, read again at each full cycle; one that stays unreadable and uses a GPU is judged outside any environment",
            self.unresolved.len(),
            first.join(", ")
        );
    }
}

/// Records the identity its environment block gives each process in `pids`, or
/// `UNRESOLVED` where the block does not answer in time.
fn seed(maps: &mut PolicyMaps, pids: impl Iterator<Item = u32>) -> Seeded {
    let mut done = Seeded::default();
    for pid in pids {
        let identity = match procfs::environment_id(pid) {
            Ok(id) => identity_of(id.as_deref()),
            Err(procfs::EnvironError::NoAnswer(..)) => {
                done.unresolved.push(pid);
                identity::UNRESOLVED
            }
            // Gone, or a kernel thread (empty block): nothing to record.
            Err(_) => continue,
        };
        if maps.seed_identity(pid, identity).is_ok() && identity != identity::UNRESOLVED {
            done.seeded += 1;
        }
    }
    done
}

/// Records, for every process that exists now, the identity its environment block
/// gives; the exec and fork hooks keep it current from here on (they were attached
/// first, and an entry they wrote wins over this). A process whose block does not
/// answer within its deadline is recorded unresolved, and costs the start no more.
pub fn seed_identities(maps: &mut PolicyMaps) -> Seeded {
    seed(maps, procfs::pids().into_iter())
}

/// The identity of a process whose environment block the exec hook could not read in
/// full, from `/proc/<pid>/environ`; whether it was recorded.
pub fn resolve_identity(maps: &mut PolicyMaps, pid: u32, verbose: bool) -> bool {
    let Ok(id) = procfs::environment_id(pid) else {
        return false; // gone: nothing to record
    };
    // Said once it is recorded: a reader of the line may rely on the kernel knowing it.
    match maps.set_identity(pid, identity_of(id.as_deref())) {
        Ok(()) => {
            if verbose {
                tracing::info!(
                    target: "event", "Process {pid}'s environment block could not be read in the kernel; its environment was read from /proc"
                );
            }
            true
        }
        Err(e) => {
            tracing::warn!("Cannot record process {pid}'s environment in the kernel: {e}");
            false
        }
    }
}

/// What one resynchronisation of the kernel's identities did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resync {
    /// Unresolved identities read from `/proc` (a lost exec event, a child forked
    /// before its parent was resolved).
    pub resolved: usize,
    /// Processes the kernel had no identity for (an insert that failed), seeded.
    pub seeded: usize,
    /// Identities of processes that no longer exist (only when `prune`).
    pub pruned: usize,
    /// Processes seeded unresolved: their blocks did not answer in time.
    pub unresolved: usize,
}

/// Makes the kernel's identities whole again: no process stays unresolved or without
/// an identity for longer than one full cycle, whatever events were lost. With `prune`
/// (the map ran out of room), identities of processes gone without an exit the kernel
/// saw are dropped first.
pub fn resync_identities(maps: &mut PolicyMaps, prune: bool, verbose: bool) -> Resync {
    let mut done = Resync::default();
    let known = maps.identities();
    let mut recorded = std::collections::HashSet::with_capacity(known.len());
    for (pid, identity) in known {
        let exists = std::path::Path::new(&format!("/proc/{pid}")).exists();
        if prune && !exists && maps.forget_identity(pid).is_ok() {
            done.pruned += 1;
            // A new process may have taken the pid between the check and the removal:
            // it is seeded below like any process without an identity.
            continue;
        }
        recorded.insert(pid);
        if identity == identity::UNRESOLVED && exists && resolve_identity(maps, pid, verbose) {
            done.resolved += 1;
        }
    }
    let unseeded = procfs::pids()
        .into_iter()
        .filter(|pid| !recorded.contains(pid));
    let seeded = seed(maps, unseeded);
    done.seeded += seeded.seeded;
    done.unresolved += seeded.unresolved.len();
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_identity_is_the_hash_of_its_id_or_none() {
        assert_eq!(identity_of(Some("21210")), env_id_hash(b"21210"));
        assert_eq!(identity_of(None), identity::NO_ENV);
        assert_ne!(identity_of(Some("")), identity::NO_ENV);
        assert_eq!(
            identity_of(Some(&"x".repeat(MAX_ENV_ID + 1))),
            identity::NO_ENV
        );
    }
}
