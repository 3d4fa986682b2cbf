//! genv's active environments mirrored into the kernel: what the `ENVS` map should hold
//! ([`env_entries`], pure, tested without a kernel) and the sync that puts it there.

use std::collections::HashMap;

use genv_ebpf_common::{EnvEntry, MAX_ENV_ID, MAX_ENVS, env_id_hash};

use crate::kernel::policy_maps::PolicyMaps;
use crate::snapshot::DroppedEnv;
use crate::state::model::{Device, Env};

/// What the kernel's `ENVS` map should hold, and what it cannot.
#[derive(Debug, Default)]
pub struct EnvEntries {
    pub entries: HashMap<u64, EnvEntry>,
    /// Ids longer than the programs read: their processes count as outside.
    pub too_long: Vec<String>,
    /// Environments past the map's capacity (unconfirmed ones go first).
    pub over_capacity: Vec<String>,
}

/// Every active environment, keyed as the programs look it up: its owner's uid and the
/// GPUs attached to it. The map holds `MAX_ENVS`: environments whose owner the kernel
/// confirmed go first, so that a flood of forged entries cannot push real ones out.
/// Environments genv dropped whose processes are left running (`--orphans leave`) come
/// last, with the GPUs they had.
pub fn env_entries(envs: &[Env], devices: &[Device], dropped: &[DroppedEnv]) -> EnvEntries {
    let mut mirror = EnvEntries::default();
    let confirmed = envs.iter().filter(|e| e.verified);
    let others = envs.iter().filter(|e| !e.verified);
    for env in confirmed.chain(others) {
        if env.key_lost {
            continue; // another environment has its key (`snapshot::owners` said so)
        }
        if env.eid.len() > MAX_ENV_ID {
            mirror.too_long.push(env.eid.clone());
            continue;
        }
        if mirror.entries.len() >= MAX_ENVS as usize {
            mirror.over_capacity.push(env.eid.clone());
            continue;
        }
        let attached = devices
            .iter()
            .filter(|d| d.index < 64 && d.is_attached_to(&env.eid))
            .fold(0u64, |mask, d| mask | (1 << d.index));
        mirror.entries.insert(
            env_id_hash(env.eid.as_bytes()),
            EnvEntry {
                uid: env.uid,
                _pad: 0,
                attached,
            },
        );
    }
    for env in dropped {
        let key = env_id_hash(env.eid.as_bytes());
        if env.eid.len() > MAX_ENV_ID || mirror.entries.contains_key(&key) {
            continue;
        }
        if mirror.entries.len() >= MAX_ENVS as usize {
            break; // dropped ones are the first to do without
        }
        let attached = env
            .attached
            .iter()
            .filter(|&&i| i < 64)
            .fold(0u64, |mask, i| mask | (1 << i));
        mirror.entries.insert(
            key,
            EnvEntry {
                uid: env.uid,
                _pad: 0,
                attached,
            },
        );
    }
    mirror
}

/// Mirrors the active environments, as the full cycle just read them, into the kernel.
/// When a state file could not be read (`None`; the cycle said why), the kernel keeps
/// what it had: a malformed file never turns environments' processes into outsiders.
/// `true` if the mirror is current.
pub fn sync_environments(
    maps: &mut PolicyMaps,
    state: Option<(Vec<Env>, Vec<Device>)>,
    dropped: &[DroppedEnv],
) -> bool {
    let Some((envs, devices)) = state else {
        tracing::warn!("The kernel keeps its previous list of environments");
        return false;
    };
    let mirror = env_entries(&envs, &devices, dropped);
    for eid in &mirror.too_long {
        tracing::warn!(
            "Environment id {eid:?} is longer than {MAX_ENV_ID} bytes: the kernel \
             cannot match it, and its processes count as outside any environment"
        );
    }
    if let Some(first) = mirror.over_capacity.first() {
        tracing::warn!(
            "envs.json holds more than {MAX_ENVS} active environments: {} of them \
             (first {first:?}; environments whose owner is not confirmed go first) are not \
             known to the kernel, and their processes count as outside any environment",
            mirror.over_capacity.len()
        );
    }
    match maps.sync_envs(&mirror.entries) {
        Ok(()) => true,
        Err(e) => {
            tracing::error!("Cannot update the kernel's environments: {e}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(eid: &str, uid: u32) -> Env {
        serde_json::from_value(serde_json::json!({
            "eid": eid, "uid": uid, "creation": "22/11/2026 02:28:47", "username": null,
            "config": {}, "pids": [], "kernel_ids": []
        }))
        .unwrap()
    }

    fn device(index: u32, eids: &[&str]) -> Device {
        serde_json::from_value(serde_json::json!({
            "index": index, "total_memory": "16g",
            "attachments": eids.iter().map(|e| serde_json::json!({
                "eid": e, "gpu_memory": null, "time": "22/11/2026 02:28:47"
            })).collect::<Vec<_>>()
        }))
        .unwrap()
    }

    #[test]
    fn dropped_environments_come_last_with_the_gpus_they_had() {
        let dropped = |eid: &str| DroppedEnv {
            eid: eid.into(),
            uid: 1002,
            attached: vec![2, 3],
        };
        let mirror = env_entries(
            &[env("a", 1000)],
            &[device(0, &["a"])],
            &[dropped("gone"), dropped("a")],
        );
        let gone = mirror.entries[&env_id_hash(b"gone")];
        assert_eq!((gone.uid, gone.attached), (1002, 0b1100));
        // Active again: genv's current state wins.
        assert_eq!(mirror.entries[&env_id_hash(b"a")].uid, 1000);
    }

    #[test]
    fn environments_carry_their_owner_and_attached_gpus() {
        let EnvEntries {
            entries, too_long, ..
        } = env_entries(
            &[env("a", 1000), env("b", 1001)],
            &[device(0, &["a"]), device(1, &["a", "b"]), device(2, &[])],
            &[],
        );
        assert!(too_long.is_empty());
        let a = entries[&env_id_hash(b"a")];
        assert_eq!((a.uid, a.attached), (1000, 0b011));
        let b = entries[&env_id_hash(b"b")];
        assert_eq!((b.uid, b.attached), (1001, 0b010));
        assert_eq!(entries.len(), 2);
    }

    #[test]
    fn an_eid_longer_than_the_programs_read_is_left_out_and_named() {
        let long = "x".repeat(MAX_ENV_ID + 1);
        let mirror = env_entries(&[env(&long, 0)], &[], &[]);
        assert!(mirror.entries.is_empty());
        assert_eq!(mirror.too_long, [long]);
    }

    #[test]
    fn past_the_kernels_capacity_confirmed_environments_are_kept() {
        let mut envs: Vec<Env> = (0..MAX_ENVS + 10)
            .map(|i| env(&format!("forged-{i}"), 1000))
            .collect();
        let mut real = env("real", 1001);
        real.verified = true;
        envs.push(real);
        let mirror = env_entries(&envs, &[], &[]);
        assert_eq!(mirror.entries.len(), MAX_ENVS as usize);
        assert!(mirror.entries.contains_key(&env_id_hash(b"real")));
        assert_eq!(mirror.over_capacity.len(), 11);
    }
}
