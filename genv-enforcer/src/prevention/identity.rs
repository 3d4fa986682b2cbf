//! The identity the kernel decides on: which environment each process claims, as a
//! hash of its `GENV_ENVIRONMENT_ID`. The exec and fork hooks keep it current; the daemon
//! seeds the processes that were there before the programs, and answers for the ones
//! whose environment block the exec hook could not read.

use genv_ebpf_common::{MAX_ENV_ID, env_id_hash, identity};

use crate::backends::procfs;
use crate::bpf::policy_maps::PolicyMaps;

/// The identity the kernel gives a process whose `GENV_ENVIRONMENT_ID` is `id`.
pub fn identity_of(id: Option<&str>) -> u64 {
    match id {
        // The programs read at most MAX_ENV_ID bytes of a value; a longer one is no
        // environment's (see `mirror::env_entries`).
        Some(id) if id.len() <= MAX_ENV_ID => env_id_hash(id.as_bytes()),
        _ => identity::NO_ENV,
    }
}

/// Records, for every process that exists now, the identity its environment block
/// gives; the exec and fork hooks keep it current from here on (they were attached
/// first, and an entry they wrote wins over this). How many were seeded.
pub fn seed_identities(maps: &mut PolicyMaps) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut seeded = 0;
    for pid in dir
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
    {
        // Gone, or a kernel thread (empty block): nothing to record.
        let Ok(id) = procfs::environment_id(pid) else {
            continue;
        };
        if maps.seed_identity(pid, identity_of(id.as_deref())).is_ok() {
            seeded += 1;
        }
    }
    seeded
}

/// The identity of a process whose environment block the exec hook could not read in
/// full, from `/proc/<pid>/environ`.
pub fn resolve_identity(maps: &mut PolicyMaps, pid: u32, verbose: bool) {
    if let Ok(id) = procfs::environment_id(pid) {
        if verbose {
            eprintln!(
                "[EVENT] Process {pid}'s environment block is too large for the kernel to read; its environment was read from /proc"
            );
        }
        if let Err(e) = maps.set_identity(pid, identity_of(id.as_deref())) {
            eprintln!("[WARNING] Cannot record process {pid}'s environment in the kernel: {e}");
        }
    }
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
