//! The maps through which the daemon tells the kernel programs what they decide on:
//! process identities (seeded from `/proc`; the programs keep them current), the active
//! environments mirrored from genv's state, the executable allow-list, the `--deny`
//! flag; and the kernel's own count of what it decided.

use std::collections::{HashMap, HashSet};
use std::os::fd::AsFd;

use aya::Ebpf;
use aya::maps::{Array, HashMap as BpfHashMap, IterableMap, Map, MapData, MapError, PerCpuArray};
use genv_ebpf_common::{
    ALLOWED_EXES_MAP, DECISIONS_MAP, ENVS_MAP, EXEMPT_PIDS_MAP, EnvEntry, ExeKey, GPU_NODES_MAP,
    MAX_ALLOWED_EXES, MAX_ENVS, MAX_GPU_NODES, POLICY_MAP, PROC_ENV_MAP, decision, policy,
};

use super::error::{LoadError, map_error, take_map};
use crate::backends::devmap::DeviceMap;

/// `BPF_NOEXIST`: insert only if absent.
const NOEXIST: u64 = 1;

pub struct PolicyMaps {
    /// The GPU nodes watched, by device number.
    nodes: BpfHashMap<MapData, u32, u32>,
    proc_env: BpfHashMap<MapData, u32, u64>,
    envs: BpfHashMap<MapData, u64, EnvEntry>,
    allowed: BpfHashMap<MapData, ExeKey, u8>,
    exempt: BpfHashMap<MapData, u32, u64>,
    policy: Array<MapData, u32>,
    decisions: PerCpuArray<MapData, u64>,
}

/// Reads the identity the kernel recorded for a process at its exec (or inherited at
/// fork): the environment block as it was then, whatever the process wrote over it
/// since (`setproctitle`).
pub struct IdentityReader(BpfHashMap<MapData, u32, u64>);

impl IdentityReader {
    pub fn get(&self, pid: u32) -> Option<u64> {
        self.0.get(&pid, 0).ok()
    }

    /// Every process the kernel holds an identity for, with it.
    pub fn all(&self) -> Vec<(u32, u64)> {
        self.0.iter().filter_map(Result::ok).collect()
    }
}

/// What the kernel decided, by its own per-CPU counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Decisions {
    pub refused: u64,
    pub killed: u64,
    /// `bpf_send_signal` failed: the open returned.
    pub kill_failed: u64,
    /// Identities that could not be recorded (the map was full).
    pub identity_lost: u64,
    /// Allocations past a cap refused (`--memory-at-alloc refuse`), reported or not.
    pub refused_at_alloc: u64,
}

/// What `--deny` covers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DenyPolicy {
    pub deny: bool,
    /// `--deny-root`: root's processes too.
    pub root: bool,
}

/// Removes `key` from `map`; a key that is not there is no failure. aya reports a
/// delete that finds nothing as a failed `bpf_map_delete_elem` (ENOENT), not as
/// `KeyNotFound`: taken for a failure, it was a warning at every exec of a capped
/// environment.
pub(super) fn remove_if_there<K: aya::Pod, V: aya::Pod>(
    map: &mut BpfHashMap<MapData, K, V>,
    key: &K,
) -> Result<(), MapError> {
    match map.remove(key) {
        Err(e) if is_absent(&e) => Ok(()),
        other => other,
    }
}

/// Whether `e` says only that the key was not there.
fn is_absent(e: &MapError) -> bool {
    match e {
        MapError::KeyNotFound => true,
        MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// Makes a kernel hash map hold exactly `wanted`: stale keys removed, the rest
/// written (the programs may read it meanwhile; every entry is valid at all times).
pub(super) fn sync_map<K, V>(
    map: &mut BpfHashMap<MapData, K, V>,
    wanted: HashMap<K, V>,
) -> Result<(), MapError>
where
    K: aya::Pod + Eq + std::hash::Hash,
    V: aya::Pod,
{
    let stale: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|key| !wanted.contains_key(key))
        .collect();
    for key in stale {
        remove_if_there(map, &key)?;
    }
    for (key, value) in wanted {
        map.insert(key, value, 0)?;
    }
    Ok(())
}

impl PolicyMaps {
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self, LoadError> {
        Ok(Self {
            nodes: take_map(ebpf, GPU_NODES_MAP)?,
            proc_env: take_map(ebpf, PROC_ENV_MAP)?,
            envs: take_map(ebpf, ENVS_MAP)?,
            allowed: take_map(ebpf, ALLOWED_EXES_MAP)?,
            exempt: take_map(ebpf, EXEMPT_PIDS_MAP)?,
            policy: take_map(ebpf, POLICY_MAP)?,
            decisions: take_map(ebpf, DECISIONS_MAP)?,
        })
    }

    /// Makes the kernel watch exactly the nodes of `map`.
    pub fn watch_nodes(&mut self, map: &DeviceMap) -> Result<(), LoadError> {
        let wanted = map.kernel_entries().take(MAX_GPU_NODES as usize).collect();
        sync_map(&mut self.nodes, wanted).map_err(map_error(GPU_NODES_MAP))
    }

    /// Records the identity of a process that existed before the programs, unless the
    /// exec or fork hook already did (theirs is newer than what `/proc` said).
    pub fn seed_identity(&mut self, pid: u32, identity: u64) -> Result<(), LoadError> {
        match self.proc_env.insert(pid, identity, NOEXIST) {
            Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {
                Ok(())
            }
            other => other.map_err(map_error(PROC_ENV_MAP)),
        }
    }

    /// Overwrites a process's identity (one whose block the exec hook could not read).
    pub fn set_identity(&mut self, pid: u32, identity: u64) -> Result<(), LoadError> {
        self.proc_env
            .insert(pid, identity, 0)
            .map_err(map_error(PROC_ENV_MAP))
    }

    /// Every process the kernel holds an identity for, with it.
    pub fn identities(&self) -> Vec<(u32, u64)> {
        self.proc_env.iter().filter_map(Result::ok).collect()
    }

    /// A second, read-only hold on the identities: the snapshot reads them for every
    /// GPU process, while these maps stay with the daemon's kernel side.
    pub fn identity_reader(&self) -> Result<IdentityReader, LoadError> {
        let fd = IterableMap::<u32, u64>::map(&self.proc_env)
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| LoadError::Map {
                map: PROC_ENV_MAP,
                message: e.to_string(),
            })?;
        let map = MapData::from_fd(fd)
            .and_then(Map::from_map_data)
            .and_then(BpfHashMap::try_from)
            .map_err(map_error(PROC_ENV_MAP))?;
        Ok(IdentityReader(map))
    }

    /// Drops a process's identity (one whose exit the kernel did not see).
    pub fn forget_identity(&mut self, pid: u32) -> Result<(), LoadError> {
        remove_if_there(&mut self.proc_env, &pid).map_err(map_error(PROC_ENV_MAP))
    }

    /// Makes the kernel's active environments exactly `wanted`.
    pub fn sync_envs(&mut self, wanted: &HashMap<u64, EnvEntry>) -> Result<(), LoadError> {
        let wanted = wanted.iter().take(MAX_ENVS as usize).map(|(k, v)| (*k, *v));
        sync_map(&mut self.envs, wanted.collect()).map_err(map_error(ENVS_MAP))
    }

    /// Makes the allow-list exactly `wanted`.
    pub fn allow_exes(&mut self, wanted: &HashSet<ExeKey>) -> Result<(), LoadError> {
        let wanted = wanted
            .iter()
            .take(MAX_ALLOWED_EXES as usize)
            .map(|k| (*k, 1));
        sync_map(&mut self.allowed, wanted.collect()).map_err(map_error(ALLOWED_EXES_MAP))
    }

    /// Puts in-kernel denial in force (or not), and what an allocation past an
    /// environment's cap meets (`memory`: `policy::MEMORY_*`, or 0).
    pub fn set_policy(&mut self, wanted: DenyPolicy, memory: u32) -> Result<(), LoadError> {
        let mut flags = memory;
        if wanted.deny {
            flags |= policy::DENY;
        }
        if wanted.root {
            flags |= policy::DENY_ROOT;
        }
        self.policy.set(0, flags, 0).map_err(map_error(POLICY_MAP))
    }

    /// Exempts a process (the enforcer itself) from every decision, by its id and its
    /// start time (clock ticks since boot, as `/proc/<pid>/stat` says).
    pub fn exempt(&mut self, pid: u32, start_time: u64) -> Result<(), LoadError> {
        self.exempt
            .insert(pid, start_time, 0)
            .map_err(map_error(EXEMPT_PIDS_MAP))
    }

    /// The identity the kernel recorded for `pid`.
    pub fn identity(&self, pid: u32) -> Option<u64> {
        self.proc_env.get(&pid, 0).ok()
    }

    /// Whether the kernel counts `pid` (running as `uid`) inside an active environment
    /// it may claim: the open hook's own test, from the same maps.
    pub fn in_environment(&self, pid: u32, uid: u32) -> bool {
        let Ok(identity) = self.proc_env.get(&pid, 0) else {
            return false;
        };
        self.envs
            .get(&identity, 0)
            .is_ok_and(|env| uid == 0 || env.uid == uid)
    }

    /// Whether `key` is on the allow-list.
    pub fn allows_exe(&self, key: &ExeKey) -> bool {
        self.allowed.get(key, 0).is_ok()
    }

    /// Ends an exemption: pinned maps outlive the daemon, and its pid will be reused.
    pub fn unexempt(&mut self, pid: u32) -> Result<(), LoadError> {
        remove_if_there(&mut self.exempt, &pid).map_err(map_error(EXEMPT_PIDS_MAP))
    }

    pub fn decisions(&self) -> Decisions {
        let sum = |slot: u32| {
            self.decisions
                .get(&slot, 0)
                .map(|per_cpu| per_cpu.iter().sum())
                .unwrap_or(0)
        };
        Decisions {
            refused: sum(decision::REFUSED),
            killed: sum(decision::KILLED),
            kill_failed: sum(decision::KILL_FAILED),
            identity_lost: sum(decision::IDENTITY_LOST),
            refused_at_alloc: sum(decision::ALLOC_REFUSED),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// aya's delete of a missing key is a failed syscall with ENOENT: no failure here.
    #[test]
    fn a_delete_of_a_missing_key_is_no_failure() {
        let missing = MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_delete_elem",
            io_error: std::io::Error::from_raw_os_error(libc::ENOENT),
        });
        assert!(is_absent(&missing));
        assert!(is_absent(&MapError::KeyNotFound));
        let refused = MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_delete_elem",
            io_error: std::io::Error::from_raw_os_error(libc::EPERM),
        });
        assert!(!is_absent(&refused));
    }
}
