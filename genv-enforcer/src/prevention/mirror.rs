//! genv's active environments mirrored into the kernel: what the `ENVS` map should hold
//! ([`env_entries`], pure, tested without a kernel) and the sync that puts it there.

use std::collections::HashMap;

use genv_ebpf_common::{EnvEntry, MAX_ENV_ID, env_id_hash};

use crate::bpf::policy_maps::PolicyMaps;
use crate::state::model::{Device, Env};

/// Every active environment, keyed as the programs look it up: its owner's uid and the
/// GPUs attached to it. An eid longer than the programs read is left out (its processes
/// count as outside); `skipped` names them.
pub fn env_entries(envs: &[Env], devices: &[Device]) -> (HashMap<u64, EnvEntry>, Vec<String>) {
    let mut entries = HashMap::new();
    let mut skipped = Vec::new();
    for env in envs {
        if env.eid.len() > MAX_ENV_ID {
            skipped.push(env.eid.clone());
            continue;
        }
        let attached = devices
            .iter()
            .filter(|d| d.index < 64 && d.is_attached_to(&env.eid))
            .fold(0u64, |mask, d| mask | (1 << d.index));
        entries.insert(
            env_id_hash(env.eid.as_bytes()),
            EnvEntry {
                uid: env.uid,
                _pad: 0,
                attached,
            },
        );
    }
    (entries, skipped)
}

/// Mirrors the active environments, as the full cycle just read them, into the kernel.
/// When a state file could not be read (`None`; the cycle said why), the kernel keeps
/// what it had: a malformed file never turns environments' processes into outsiders.
/// `true` if the mirror is current.
pub fn sync_environments(maps: &mut PolicyMaps, state: Option<(Vec<Env>, Vec<Device>)>) -> bool {
    let Some((envs, devices)) = state else {
        eprintln!("[WARNING] The kernel keeps its previous list of environments");
        return false;
    };
    let (entries, skipped) = env_entries(&envs, &devices);
    for eid in skipped {
        eprintln!(
            "[WARNING] Environment id {eid:?} is longer than {} bytes: the kernel cannot \
             match it, and its processes count as outside any environment",
            genv_ebpf_common::MAX_ENV_ID
        );
    }
    match maps.sync_envs(&entries) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("[ERROR] Cannot update the kernel's environments: {e}");
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
    fn environments_carry_their_owner_and_attached_gpus() {
        let (entries, skipped) = env_entries(
            &[env("a", 1000), env("b", 1001)],
            &[device(0, &["a"]), device(1, &["a", "b"]), device(2, &[])],
        );
        assert!(skipped.is_empty());
        let a = entries[&env_id_hash(b"a")];
        assert_eq!((a.uid, a.attached), (1000, 0b011));
        let b = entries[&env_id_hash(b"b")];
        assert_eq!((b.uid, b.attached), (1001, 0b010));
        assert_eq!(entries.len(), 2);
    }

    #[test]
    fn an_eid_longer_than_the_programs_read_is_left_out_and_named() {
        let long = "x".repeat(MAX_ENV_ID + 1);
        let (entries, skipped) = env_entries(&[env(&long, 0)], &[]);
        assert!(entries.is_empty());
        assert_eq!(skipped.len(), 1);
        assert_eq!(skipped[0], long);
    }
}
