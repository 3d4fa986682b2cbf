//! A snapshot that parses may still describe no possible host: a process twice, a
//! device twice, memory on a device the host does not have, an attachment of an
//! environment it does not list. Acting on one would detach or terminate by guesswork,
//! so such a host is refused for the cycle, as a malformed one is.

use std::collections::HashSet;

use crate::snapshot::Snapshot;

/// Why a snapshot cannot be acted on; the first inconsistency found.
pub fn inconsistency(snapshot: &Snapshot) -> Option<String> {
    let devices = snapshot.devices.as_deref().unwrap_or_default();
    let envs = snapshot.envs.as_deref().unwrap_or_default();
    let mut indices = HashSet::new();
    for device in devices {
        if !indices.insert(device.index) {
            return Some(format!("device {} is listed twice", device.index));
        }
    }
    let mut eids = HashSet::new();
    for env in envs {
        if !eids.insert(env.eid.as_str()) {
            return Some(format!("environment {:?} is listed twice", env.eid));
        }
    }
    for device in devices {
        if let Some(a) = device
            .attachments
            .iter()
            .find(|a| !eids.contains(a.eid.as_str()))
        {
            return Some(format!(
                "device {} is attached to environment {:?}, which is not listed",
                device.index, a.eid
            ));
        }
    }
    let mut pids = HashSet::new();
    for process in &snapshot.processes {
        if process.pid <= 1 {
            return Some(format!("process {} cannot be a GPU process", process.pid));
        }
        if !pids.insert(process.pid) {
            return Some(format!("process {} is listed twice", process.pid));
        }
        let mut on = HashSet::new();
        for usage in &process.used_gpu_memory {
            if !indices.contains(&usage.index) {
                return Some(format!(
                    "process {} uses device {}, which is not listed",
                    process.pid, usage.index
                ));
            }
            if !on.insert(usage.index) {
                return Some(format!(
                    "process {} lists device {} twice",
                    process.pid, usage.index
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn snapshot(processes: serde_json::Value, envs: serde_json::Value) -> Snapshot {
        let devices = json!({"devices": [
            {"index": 0, "total_memory": "16g", "attachments": [
                {"eid": "a", "gpu_memory": null, "time": "01/01/2026 00:00:00"}]},
            {"index": 1, "total_memory": "16g", "attachments": []}]});
        let text = json!({"processes": {"processes": processes}, "envs": envs, "devices": devices});
        Snapshot::from_genv_json(&text.to_string()).unwrap()
    }

    fn env(eid: &str) -> serde_json::Value {
        json!({"eid": eid, "uid": 1000, "creation": "01/01/2026 00:00:00", "username": "u",
               "config": {"name": null, "gpu_memory": null, "gpus": null}, "pids": [5], "kernel_ids": []})
    }

    fn process(pid: u32, index: u32) -> serde_json::Value {
        json!({"pid": pid, "used_gpu_memory": [{"index": index, "gpu_memory": "1mi"}], "eid": "a"})
    }

    #[test]
    fn a_possible_host_passes() {
        let s = snapshot(
            json!([process(10, 0), process(11, 1)]),
            json!({"envs": [env("a")]}),
        );
        assert_eq!(inconsistency(&s), None);
    }

    #[test]
    fn impossible_hosts_are_named() {
        let envs = json!({"envs": [env("a")]});
        let cases = [
            (
                json!([process(10, 0), process(10, 1)]),
                envs.clone(),
                "process 10 is listed twice",
            ),
            (json!([process(10, 7)]), envs.clone(), "device 7"),
            (json!([process(1, 0)]), envs.clone(), "process 1 cannot"),
            (json!([]), json!({"envs": []}), "not listed"),
            (
                json!([]),
                json!({"envs": [env("a"), env("a")]}),
                "listed twice",
            ),
        ];
        for (processes, envs, expected) in cases {
            let found = inconsistency(&snapshot(processes, envs)).unwrap_or_default();
            assert!(found.contains(expected), "{found:?} lacks {expected:?}");
        }
    }
}
