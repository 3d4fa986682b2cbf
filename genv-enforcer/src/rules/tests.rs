//! Rule tests on JSON snapshots in genv's `usage snapshot` format; no system access.

use std::collections::HashMap;

use super::*;
use crate::report::Report;
use crate::snapshot::Snapshot;

/// The observed reference run of shared/genv-compat.md, as genv would snapshot it.
const REFERENCE: &str = r#"{
  "processes": {"processes": [
    {"pid": 21372, "used_gpu_memory": [{"index": 0, "gpu_memory": "2000mi"}], "eid": "21364"},
    {"pid": 21375, "used_gpu_memory": [{"index": 1, "gpu_memory": "100mi"}], "eid": null}]},
  "envs": {"envs": [{"eid": "21364", "uid": 0, "creation": "22/11/2026 02:28:47", "username": "root",
    "config": {"name": null, "gpu_memory": "1g", "gpus": 2}, "pids": [21364], "kernel_ids": []}]},
  "devices": {"devices": [
    {"index": 0, "total_memory": "16384mi", "attachments": [{"eid": "21364", "gpu_memory": "1g", "time": "22/11/2026 02:28:47"}]},
    {"index": 1, "total_memory": "16384mi", "attachments": [{"eid": "21364", "gpu_memory": "1g", "time": "22/11/2026 02:28:47"}]}]}
}"#;

fn run(json: &str, rules: &Rules) -> (Vec<String>, Report) {
    let snapshot = Snapshot::from_genv_json(json).unwrap();
    let surveys = [Survey {
        hostname: None,
        snapshot: &snapshot,
    }];
    let findings = check(&surveys, rules);
    let lines = findings.iter().map(|f| f.line(&[None])).collect();
    (lines, Report::build(&surveys, &findings).remove(0))
}

fn limit(default: u32, per_user: &[(&str, u32)]) -> Option<DeviceLimit> {
    Some(DeviceLimit {
        default,
        per_user: per_user
            .iter()
            .map(|(u, n)| (u.to_string(), *n))
            .collect::<HashMap<_, _>>(),
    })
}

fn pids(report: &Report) -> Vec<u32> {
    report.terminate.iter().map(|p| p.pid).collect()
}

#[test]
fn reference_run_gives_genvs_lines_and_report() {
    let rules = Rules {
        non_env_processes: true,
        max_devices_per_user: limit(1, &[]),
        ..Rules::default()
    };
    let (lines, report) = run(REFERENCE, &rules);
    assert_eq!(
        lines,
        [
            "Process 21375 is not running in a GPU environment",
            "Environment 21364 is using 2097m on device 0 which is 1097m over its capacity of 1g",
            "User root is using 2 devices which is 1 more than the maximum allowed",
        ]
    );
    assert_eq!(pids(&report), [21372, 21375]);
    assert_eq!(report.detach.len(), 1);
    assert_eq!(
        (
            report.detach[0].index,
            report.detach[0].envs[0].eid.as_str()
        ),
        (0, "21364")
    );
}

#[test]
fn defaults_leave_non_env_processes_alone() {
    let (lines, report) = run(REFERENCE, &Rules::default());
    assert_eq!(lines.len(), 1, "only the memory rule: {lines:?}");
    assert_eq!(pids(&report), [21372]);
}

const MEMORY: &str = r#"{
  "processes": {"processes": [
    {"pid": 30, "used_gpu_memory": [{"index": 0, "gpu_memory": "600mi"}, {"index": 1, "gpu_memory": "5000mi"}], "eid": "e"},
    {"pid": 31, "used_gpu_memory": [{"index": 0, "gpu_memory": "600mi"}], "eid": "e"},
    {"pid": 32, "used_gpu_memory": [{"index": 0, "gpu_memory": "600mi"}], "eid": "e"},
    {"pid": 33, "used_gpu_memory": [{"index": 0, "gpu_memory": "600mi"}], "eid": "other"}]},
  "envs": {"envs": [
    {"eid": "e", "uid": 1000, "creation": "x", "username": "alice", "config": {"name": null, "gpu_memory": "1gi", "gpus": null}, "pids": [1], "kernel_ids": []},
    {"eid": "other", "uid": 1001, "creation": "x", "username": "bob", "config": {"name": null, "gpu_memory": null, "gpus": null}, "pids": [1], "kernel_ids": []}]},
  "devices": {"devices": [
    {"index": 0, "total_memory": "16384mi", "attachments": [{"eid": "e", "gpu_memory": null, "time": "x"}, {"eid": "other", "gpu_memory": null, "time": "x"}]},
    {"index": 1, "total_memory": "16384mi", "attachments": []}]}
}"#;

#[test]
fn memory_rule_is_greedy_in_snapshot_order_and_counts_the_device_only() {
    let rules = Rules {
        env_devices: false,
        ..Rules::default()
    };
    let (lines, report) = run(MEMORY, &rules);
    // 1800 MiB on device 0 against 1 GiB: 776 MiB over; 30 frees 600, 31 covers the rest.
    assert_eq!(
        lines,
        ["Environment e is using 1887m on device 0 which is 813m over its capacity of 1gi"]
    );
    assert_eq!(pids(&report), [30, 31]);
}

#[test]
fn env_devices_names_each_non_attached_device() {
    let (lines, report) = run(
        MEMORY,
        &Rules {
            env_memory: false,
            ..Rules::default()
        },
    );
    assert_eq!(
        lines,
        ["Process 30 from environment e is using non-attached GPU(s) 1"]
    );
    assert_eq!(pids(&report), [30]);
}

#[test]
fn per_user_override_and_detach_terminates_processes_on_that_device() {
    let rules = Rules {
        env_devices: false,
        env_memory: false,
        max_devices_per_user: limit(5, &[("bob", 0)]),
        ..Rules::default()
    };
    let (lines, report) = run(MEMORY, &rules);
    assert_eq!(
        lines,
        ["User bob is using 1 devices which is 1 more than the maximum allowed"]
    );
    assert_eq!(report.detach[0].envs[0].username.as_deref(), Some("bob"));
    assert_eq!(pids(&report), [33]);
}

/// On one host a user is a uid: another `username` on a second environment of the same
/// uid (anyone can write envs.json) does not split the user's devices in two, and an
/// environment without a name still counts.
#[test]
fn a_user_is_counted_by_uid_whatever_the_username_fields_say() {
    let mut snapshot = Snapshot::from_genv_json(MEMORY).unwrap();
    let envs = snapshot.envs.as_mut().unwrap();
    envs[1].uid = 1000;
    envs[1].username = Some("someone-else".into());
    let devices = snapshot.devices.as_mut().unwrap();
    devices[0].attachments.retain(|a| a.eid == "e");
    devices[1].attachments = vec![
        serde_json::from_value(
            serde_json::json!({"eid": "other", "gpu_memory": null, "time": "x"}),
        )
        .unwrap(),
    ];
    let rules = Rules {
        env_devices: false,
        env_memory: false,
        max_devices_per_user: limit(1, &[]),
        ..Rules::default()
    };
    let lines = |snapshot: &Snapshot| -> Vec<String> {
        let surveys = [Survey {
            hostname: None,
            snapshot,
        }];
        let findings = check(&surveys, &rules);
        findings.iter().map(|f| f.line(&[None])).collect()
    };
    assert_eq!(
        lines(&snapshot),
        ["User alice is using 2 devices which is 1 more than the maximum allowed"]
    );
    snapshot.envs.as_mut().unwrap()[0].username = None;
    snapshot.envs.as_mut().unwrap()[1].username = None;
    assert_eq!(
        lines(&snapshot),
        ["User 1000 is using 2 devices which is 1 more than the maximum allowed"]
    );
}

/// Anyone can write an entry with bob's uid and attach devices to it, and can even make
/// it look confirmed (list a live process of bob's as its shell). Its devices are
/// detached before those of bob's environment that runs his jobs, so bob keeps the
/// device he really uses (genv's device order would take it).
#[test]
fn entries_anyone_could_write_are_detached_before_an_environment_running_jobs() {
    for forged_looks_confirmed in [false, true] {
        let mut snapshot = Snapshot::from_genv_json(MEMORY).unwrap();
        // No process of bob's can be made to count in an entry someone else wrote.
        snapshot.processes.retain(|p| p.eid.as_deref() != Some("e"));
        let envs = snapshot.envs.as_mut().unwrap();
        envs[0].uid = 1001; // "e", written with bob's uid
        envs[0].verified = forged_looks_confirmed;
        envs[1].verified = true; // "other": bob's own, running process 33 on device 0
        let devices = snapshot.devices.as_mut().unwrap();
        devices[0].attachments.retain(|a| a.eid == "other");
        devices[1].attachments = vec![
            serde_json::from_value(
                serde_json::json!({"eid": "e", "gpu_memory": null, "time": "x"}),
            )
            .unwrap(),
        ];
        let rules = Rules {
            env_devices: false,
            env_memory: false,
            max_devices_per_user: limit(1, &[]),
            ..Rules::default()
        };
        let surveys = [Survey {
            hostname: None,
            snapshot: &snapshot,
        }];
        let findings = check(&surveys, &rules);
        let report = Report::build(&surveys, &findings).remove(0);
        let detached: Vec<(u32, &str)> = report
            .detach
            .iter()
            .flat_map(|d| d.envs.iter().map(move |e| (d.index, e.eid.as_str())))
            .collect();
        assert_eq!(
            detached,
            [(1, "e")],
            "bob's own device 0 stays attached (forged entry confirmed: {forged_looks_confirmed})"
        );
        assert!(
            !pids(&report).contains(&33),
            "bob's process on device 0 lives"
        );
    }
}

#[test]
fn rules_needing_state_do_nothing_without_it() {
    let mut snapshot = Snapshot::from_genv_json(MEMORY).unwrap();
    snapshot.devices = None;
    let surveys = [Survey {
        hostname: None,
        snapshot: &snapshot,
    }];
    let rules = Rules {
        max_devices_per_user: limit(0, &[]),
        ..Rules::default()
    };
    assert!(check(&surveys, &rules).is_empty());
    snapshot.memory_known = false;
    snapshot.devices = Snapshot::from_genv_json(MEMORY).unwrap().devices;
    let surveys = [Survey {
        hostname: None,
        snapshot: &snapshot,
    }];
    let lines: Vec<String> = check(&surveys, &Rules::default())
        .iter()
        .map(|f| f.line(&[None]))
        .collect();
    assert_eq!(
        lines,
        ["Process 30 from environment e is using non-attached GPU(s) 1"]
    );
}

#[test]
fn several_hosts_prefix_their_lines_and_count_users_across_hosts() {
    let a = Snapshot::from_genv_json(REFERENCE).unwrap();
    let b = Snapshot::from_genv_json(REFERENCE).unwrap();
    let surveys = [
        Survey {
            hostname: Some("h1"),
            snapshot: &a,
        },
        Survey {
            hostname: Some("h2"),
            snapshot: &b,
        },
    ];
    let rules = Rules {
        non_env_processes: true,
        env_memory: false,
        max_devices_per_user: limit(1, &[]),
        ..Rules::default()
    };
    let findings = check(&surveys, &rules);
    let lines: Vec<String> = findings
        .iter()
        .map(|f| f.line(&[Some("h1"), Some("h2")]))
        .collect();
    assert_eq!(
        lines,
        [
            "[h1] Process 21375 is not running in a GPU environment",
            "[h2] Process 21375 is not running in a GPU environment",
            "User root is using 4 devices on 2 hosts which is 3 more than the maximum allowed",
        ]
    );
    let reports = Report::build(&surveys, &findings);
    assert_eq!(
        reports[0]
            .detach
            .iter()
            .map(|d| d.index)
            .collect::<Vec<_>>(),
        [0, 1]
    );
    assert_eq!(
        reports[1]
            .detach
            .iter()
            .map(|d| d.index)
            .collect::<Vec<_>>(),
        [0]
    );
}

#[test]
fn report_round_trips_through_genvs_json() {
    let rules = Rules {
        non_env_processes: true,
        max_devices_per_user: limit(1, &[]),
        ..Rules::default()
    };
    let (_, report) = run(REFERENCE, &rules);
    let text = report.to_genv_json();
    assert!(
        text.starts_with("{\n  \"terminate\": {\n    \"processes\": [\n"),
        "{text}"
    );
    assert_eq!(Report::from_genv_json(&text).unwrap().to_genv_json(), text);
}
