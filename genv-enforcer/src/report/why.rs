//! Why each process of a report is terminated, kept for the line its user is told
//! ([`crate::notify`]): genv's report lists pids only, and the rule that asked is gone
//! by the time the executor signals.

use std::collections::BTreeMap;

use crate::notify::Rule;
use crate::rules::{Action, Finding, FindingKind};
use crate::snapshot::Snapshot;

/// Why one process is terminated. Also carried to a remote host with its report
/// ([`super::reasons`]), so that the host can tell the process's user.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Why {
    #[serde(flatten)]
    pub rule: Rule,
    /// The GPUs the rule is about: the ones not attached, the one over its cap, the one
    /// detached; or all the process uses.
    pub gpus: Vec<u32>,
    /// It goes because its environment's GPU was detached.
    #[serde(default)]
    pub detached: bool,
    /// Its environment's `config.name`, where it has one.
    #[serde(default)]
    pub env_name: Option<String>,
}

/// For each pid that `findings` terminate on survey `host`, the first finding's reason
/// (genv terminates each process once, whichever rules asked).
pub fn of_findings(host: usize, snapshot: &Snapshot, findings: &[Finding]) -> BTreeMap<u32, Why> {
    let mut why = BTreeMap::new();
    for finding in findings {
        for action in finding.actions.iter().filter(|a| a.host() == host) {
            for (pid, reason) in reasons(&finding.kind, action, snapshot) {
                why.entry(pid).or_insert(reason);
            }
        }
    }
    why
}

/// The processes `action` terminates, each with why.
fn reasons(kind: &FindingKind, action: &Action, snapshot: &Snapshot) -> Vec<(u32, Why)> {
    let one =
        |pid: u32, rule: Rule, gpus: Option<Vec<u32>>| vec![(pid, why(snapshot, pid, rule, gpus))];
    match (kind, action) {
        (FindingKind::NonEnvProcess { .. }, Action::Terminate { pid, .. }) => {
            one(*pid, Rule::NonEnvProcesses, None)
        }
        (FindingKind::NonAttachedDevices { indices, .. }, Action::Terminate { pid, .. }) => {
            one(*pid, Rule::EnvDevices, Some(indices.clone()))
        }
        (
            FindingKind::EnvOverMemory {
                used,
                index,
                capacity,
                ..
            },
            Action::Terminate { pid, .. },
        ) => {
            let rule = Rule::EnvMemory {
                used_mb: used / 1_000_000,
                capacity: capacity.to_string(),
            };
            one(*pid, rule, Some(vec![*index]))
        }
        (
            FindingKind::UserOverDevices {
                username,
                devices,
                over,
                hosts,
            },
            Action::Detach { index, eids, .. },
        ) => {
            let rule = Rule::MaxDevicesPerUser {
                user: username.clone(),
                devices: *devices,
                maximum: devices.saturating_sub(*over),
                hosts: *hosts,
            };
            detached(snapshot, *index, eids, &rule)
        }
        _ => Vec::new(),
    }
}

/// Why process `pid` goes: `rule`, about `gpus` (by default, all it uses).
fn why(snapshot: &Snapshot, pid: u32, rule: Rule, gpus: Option<Vec<u32>>) -> Why {
    let process = snapshot.processes.iter().find(|p| p.pid == pid);
    let eid = process.and_then(|p| p.eid.as_deref());
    let envs = snapshot.envs.as_deref().unwrap_or_default();
    Why {
        rule,
        gpus: gpus.unwrap_or_else(|| process.map(|p| p.indices().collect()).unwrap_or_default()),
        detached: false,
        env_name: envs
            .iter()
            .find(|e| Some(e.eid.as_str()) == eid)
            .and_then(|e| e.config.name.clone()),
    }
}

/// The processes a detach of `index` from `eids` terminates, each told of the detach.
fn detached(snapshot: &Snapshot, index: u32, eids: &[String], rule: &Rule) -> Vec<(u32, Why)> {
    snapshot
        .processes
        .iter()
        .filter(|p| p.eid.as_ref().is_some_and(|e| eids.contains(e)) && p.is_on(index))
        .map(|p| {
            let why = Why {
                detached: true,
                ..why(snapshot, p.pid, rule.clone(), Some(vec![index]))
            };
            (p.pid, why)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Report;
    use crate::rules::{self, DeviceLimit, Rules, Survey};

    /// genv-compat.md's reference run: an environment over its memory on device 0, an
    /// outsider on device 1, and root over one device.
    const REFERENCE: &str = r#"{
      "processes": {"processes": [
        {"pid": 21372, "used_gpu_memory": [{"index": 0, "gpu_memory": "2000mi"}], "eid": "21364"},
        {"pid": 21375, "used_gpu_memory": [{"index": 1, "gpu_memory": "100mi"}], "eid": null},
        {"pid": 21380, "used_gpu_memory": [{"index": 1, "gpu_memory": "10mi"}], "eid": "21364"}]},
      "envs": {"envs": [{"eid": "21364", "uid": 0, "creation": "22/11/2026 02:28:47", "username": "root",
        "config": {"name": "train", "gpu_memory": "1g", "gpus": 1}, "pids": [21364], "kernel_ids": []}]},
      "devices": {"devices": [
        {"index": 0, "total_memory": "16384mi", "attachments": [{"eid": "21364", "gpu_memory": "1g", "time": "22/11/2026 02:28:47"}]},
        {"index": 1, "total_memory": "16384mi", "attachments": []}]}
    }"#;

    fn report(rules: &Rules) -> Report {
        let snapshot = Snapshot::from_genv_json(REFERENCE).unwrap();
        let surveys = [Survey {
            hostname: None,
            snapshot: &snapshot,
        }];
        let findings = rules::check(&surveys, rules);
        Report::build(&surveys, &findings).remove(0)
    }

    #[test]
    fn each_terminated_process_keeps_the_rule_that_asked() {
        let report = report(&Rules {
            non_env_processes: true,
            env_devices: true,
            env_memory: true,
            max_devices_per_user: None,
        });
        let pids: Vec<u32> = report.terminate.iter().map(|p| p.pid).collect();
        assert_eq!(pids, [21372, 21375, 21380]);
        let memory = &report.why[&21372];
        assert_eq!(
            memory.rule,
            Rule::EnvMemory {
                used_mb: 2097,
                capacity: "1g".into()
            }
        );
        assert_eq!(
            (memory.gpus.as_slice(), memory.env_name.as_deref()),
            (&[0][..], Some("train"))
        );
        assert_eq!(report.why[&21375].rule, Rule::NonEnvProcesses);
        assert_eq!(report.why[&21375].gpus, [1]);
        let stray = &report.why[&21380];
        assert_eq!(
            (&stray.rule, stray.gpus.as_slice()),
            (&Rule::EnvDevices, &[1][..])
        );
    }

    #[test]
    fn a_detach_tells_its_processes_the_users_limit() {
        let report = report(&Rules {
            non_env_processes: false,
            env_devices: false,
            env_memory: false,
            max_devices_per_user: Some(DeviceLimit {
                default: 0,
                per_user: Default::default(),
            }),
        });
        let why = &report.why[&21372];
        assert!(why.detached);
        assert_eq!(why.gpus, [0]);
        assert_eq!(
            why.rule,
            Rule::MaxDevicesPerUser {
                user: "root".into(),
                devices: 1,
                maximum: 0,
                hosts: None,
            }
        );
        assert_eq!(report.why.len(), 1, "{:?}", report.why);
    }
}
