//! Bad input never makes the enforcer kill or detach anything, never crashes it, and is
//! never overwritten: malformed state files, unreadable environments, vanished
//! processes, a missing or failing NVML.

use std::time::Duration;

use genv_enforcer_tests::{Daemon, Node, device_record, env_record, run_with_stdin};
use serde_json::json;

/// env-a (root) is attached to GPU 0; `member` runs on GPU 1 (a violation of a *valid*
/// state) and `rogue` outside any environment on GPU 0.
fn node_with_violation() -> (Node, u32, u32) {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", 0, "root", Some("1g"), shell)]),
        json!([device_record(0, &["env-a"]), device_record(1, &["env-a"])]),
    );
    let member = node.spawn(Some("env-a"), &[(1, 100)]);
    let rogue = node.spawn(None, &[(0, 100)]);
    (node, member, rogue)
}

const BAD_FILES: &[(&str, &str, &str)] = &[
    ("malformed", "{\"envs\": [", "not valid JSON"),
    ("empty", "", "file is empty"),
    (
        "wrong type",
        "{\"envs\": [{\"eid\": 7, \"uid\": 0, \"pids\": [1]}]}",
        "envs[0].eid: invalid type",
    ),
    ("wrong shape", "{\"envs\": 3}", "envs: expected a list"),
    (
        "bad memory",
        "{\"envs\": [{\"eid\": \"e\", \"uid\": 0, \"config\": {\"gpu_memory\": \"lots\"}, \"pids\": [1]}]}",
        "envs[0].config.gpu_memory: not a memory amount",
    ),
];

#[test]
fn malformed_envs_json_stops_every_rule_that_needs_it() {
    for (what, text, message) in BAD_FILES {
        let (mut node, member, rogue) = node_with_violation();
        node.write_file("envs.json", text);
        let devices_before = node.read_file("devices.json");
        let run = node.enforce_once(&["--max-devices-per-user", "0"]);
        assert!(run.success, "{what}: {}", run.stderr);
        let envs_path = node.state.join("envs.json");
        assert!(
            run.stderr.contains(&format!("{}: ", envs_path.display()))
                && run.stderr.contains(message),
            "{what}: stderr must name the file and the problem: {}",
            run.stderr
        );
        assert!(
            run.stdout.is_empty(),
            "{what}: nothing may be enforced: {:?}",
            run.stdout
        );
        assert!(node.alive(member) && node.alive(rogue), "{what}: no kill");
        assert_eq!(
            node.read_file("devices.json"),
            devices_before,
            "{what}: no detach"
        );
        assert_eq!(
            node.read_file("envs.json"),
            *text,
            "{what}: never rewritten"
        );
    }
}

#[test]
fn malformed_devices_json_stops_the_device_rules_only() {
    let truncated = "{\n  \"devices\": [\n    {\n      \"index\": 0,\n      \"total_mem";
    for (what, text) in [
        ("truncated", truncated),
        (
            "wrong type",
            "{\"devices\": [{\"index\": \"0\", \"total_memory\": \"1g\"}]}",
        ),
    ] {
        let (mut node, member, rogue) = node_with_violation();
        node.write_file("devices.json", text);
        let run = node.enforce_once(&["--non-env-processes", "--max-devices-per-user", "0"]);
        assert!(
            run.stderr.contains("devices.json: "),
            "{what}: {}",
            run.stderr
        );
        // The rogue has no environment at all: judging it needs no state file.
        assert_eq!(
            run.stdout[0],
            format!("Process {rogue} is not running in a GPU environment"),
            "{what}"
        );
        assert_eq!(run.stdout.len(), 2, "{what}: {:?}", run.stdout);
        assert!(node.wait_exit(rogue, Duration::from_secs(10)).is_some());
        assert!(
            node.alive(member),
            "{what}: the environment's process is not judged without devices.json"
        );
        assert_eq!(
            node.read_file("devices.json"),
            text,
            "{what}: never rewritten"
        );
    }
}

#[test]
fn unreadable_state_file_is_named() {
    let (mut node, member, _) = node_with_violation();
    std::fs::remove_file(node.state.join("devices.json")).unwrap();
    std::fs::create_dir(node.state.join("devices.json")).unwrap();
    let run = node.enforce_once(&[]);
    assert!(
        run.stderr.contains("devices.json: cannot read"),
        "{}",
        run.stderr
    );
    assert!(node.alive(member));
}

#[test]
fn legacy_state_is_enforced() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_file(
        "envs.json",
        &json!({"envs": {"old": {"eid": "old", "uid": 0, "creation": "01/01/2022 00:00:00", "username": "root",
            "config": {"name": null, "gpu_memory": null, "gpus": null}, "pids": [shell], "kernel_ids": []}}})
        .to_string(),
    );
    node.write_file(
        "devices.json",
        &json!({"devices": {"0": {"total_memory": "16384mi", "eids": {"old": {"eid": "old", "attached": "01/01/2022 00:00:00"}}},
                            "1": {"total_memory": "16384mi", "eids": {}}}})
        .to_string(),
    );
    let good = node.spawn(Some("old"), &[(0, 100)]);
    let bad = node.spawn(Some("old"), &[(1, 100)]);
    let run = node.enforce_once(&[]);
    assert_eq!(
        run.stdout[0],
        format!("Process {bad} from environment old is using non-attached GPU(s) 1"),
        "{}",
        run.stderr
    );
    assert!(node.wait_exit(bad, Duration::from_secs(10)).is_some());
    assert!(node.alive(good));
}

#[test]
fn unreadable_environ_is_left_alone() {
    let (mut node, member, rogue) = node_with_violation();
    // The enforcer runs as nobody, the GPU processes as root: their environ is not
    // readable. Like genv it says so; unlike genv it does not then treat them as
    // outside any environment (and terminate them).
    for path in [&node.dir, &node.state] {
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
    }
    let mut command = node.enforcer();
    std::os::unix::process::CommandExt::uid(&mut command, 65534);
    let output = command
        .args(["enforce", "--interval", "0", "--non-env-processes"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(
        output.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(
        stderr.contains(&format!(
            "not enough permissions to read /proc/{rogue}/environ"
        )),
        "{stderr}"
    );
    assert!(node.alive(member) && node.alive(rogue));
}

#[test]
fn vanished_process_in_a_report_is_reported_not_fatal() {
    let node = Node::new(1);
    let report = json!({"terminate": {"processes": [{"pid": 4_194_000, "used_gpu_memory": [], "eid": null}]}, "detach": {}});
    let output = run_with_stdin(
        node.enforcer().args(["usage", "execute"]),
        &report.to_string(),
    );
    assert!(output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .contains("[DEBUG] Process 4194000 already terminated")
    );
}

#[test]
fn malformed_report_is_refused_with_its_field() {
    let node = Node::new(1);
    let report = json!({"terminate": {"processes": [{"pid": "x", "used_gpu_memory": [], "eid": null}]}, "detach": {}});
    let output = run_with_stdin(
        node.enforcer().args(["usage", "execute"]),
        &report.to_string(),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("terminate.processes[0].pid"), "{stderr}");
}

#[test]
fn missing_nvml_falls_back_to_gpu_nodes_held_open() {
    let mut node = Node::new(4);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", 0, "root", Some("1m"), shell)]),
        json!([device_record(3, &["env-a"])]),
    );
    // A GPU node with no driver behind it, made in a private directory: recognised by
    // its device number, not its path.
    let gpu = node.make_char_node("not-a-gpu-name", 195, 3);
    let gpu = gpu.to_str().unwrap();
    let rogue = node.spawn_with(None, &[], &["--hold", gpu], None);
    let member = node.spawn_with(Some("env-a"), &[], &["--hold", gpu], None);
    let run = node
        .enforcer()
        .env("GENV_ENFORCER_NVML_LIB", "/nonexistent/libnvidia-ml.so")
        .args(["enforce", "--interval", "0", "--non-env-processes"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let stdout: Vec<String> = String::from_utf8_lossy(&run.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(
        stderr.contains("cannot load NVML from /nonexistent/libnvidia-ml.so")
            && stderr.contains("skipping the memory rule"),
        "{stderr}"
    );
    assert_eq!(
        stdout,
        [
            format!("Process {rogue} is not running in a GPU environment"),
            format!("Terminating process {rogue} from environment N/A that is running on GPU(s) 3"),
        ],
        "{stderr}"
    );
    assert!(node.wait_exit(rogue, Duration::from_secs(10)).is_some());
    assert!(
        node.alive(member),
        "within its attached device; memory is unknown, so not judged"
    );
}

#[test]
fn daemon_survives_bad_state_and_failing_nvml_then_enforces() {
    let (mut node, member, rogue) = node_with_violation();
    node.write_file("devices.json", "{\"devices\": [");
    let daemon = Daemon::start(&node, &["--interval", "0.2"]);
    daemon.expect_line("devices.json: not valid JSON", Duration::from_secs(20));
    // NVML breaks too: the daemon logs and keeps going.
    let config = std::fs::read_to_string(node.config_path()).unwrap();
    let mut broken: serde_json::Value = serde_json::from_str(&config).unwrap();
    broken["fail"] = json!({"nvmlDeviceGetComputeRunningProcesses_v3": 999});
    node.write_nvml(broken);
    daemon.expect_line("NVML running compute processes", Duration::from_secs(20));
    assert!(node.alive(member) && node.alive(rogue));
    // Both repaired: enforcement resumes without a restart.
    node.write_nvml(serde_json::from_str(&config).unwrap());
    node.write_state(
        json!([env_record("env-a", 0, "root", None, node_shell(&node))]),
        json!([device_record(0, &["env-a"])]),
    );
    daemon.expect_line(
        &format!("Terminating process {member} from environment env-a"),
        Duration::from_secs(20),
    );
    assert!(node.wait_exit(member, Duration::from_secs(10)).is_some());
    assert!(node.alive(rogue), "--non-env-processes is off by default");
}

/// The activating shell `node_with_violation` recorded for env-a.
fn node_shell(node: &Node) -> u32 {
    let envs: serde_json::Value = serde_json::from_str(&node.read_file("envs.json")).unwrap();
    envs["envs"][0]["pids"][0].as_u64().unwrap() as u32
}

/// Anyone can write `envs.json`. One that stops parsing after a good one must not
/// switch the rules off for processes that claim an environment: the daemon keeps
/// enforcing from the last good parse, says so, and leaves the file as it is.
#[test]
fn a_malformed_envs_json_after_a_good_one_leaves_the_last_good_in_force() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", 0, "root", None, shell)]),
        json!([device_record(0, &["env-a"]), device_record(1, &[])]),
    );
    let member = node.spawn(Some("env-a"), &[(0, 100)]);
    // Marker: a cycle that read the good file terminates this one.
    let canary = node.spawn(Some("env-a"), &[(1, 100)]);
    let mut daemon = Daemon::start(&node, &["--interval", "0.2"]);
    daemon.expect_line(
        &format!("Process {canary} from environment env-a is using non-attached GPU(s) 1"),
        Duration::from_secs(20),
    );
    let forged = "{\"envs\": [{\"eid\": \"env-a\", \"uid\": 0, \"creation\": 0, \"pids\": [1]}]}";
    node.write_file("envs.json", forged);
    let stray = node.spawn(Some("env-a"), &[(1, 100)]);
    daemon.expect_line(
        &format!("Process {stray} from environment env-a is using non-attached GPU(s) 1"),
        Duration::from_secs(20),
    );
    // Said at every cycle while the file stays malformed.
    daemon.expect_line(
        "enforcing from its last good contents",
        Duration::from_secs(20),
    );
    assert!(node.alive(member), "a process on its attached GPU stays");
    assert_eq!(node.read_file("envs.json"), forged, "never rewritten");
    daemon.stop(Duration::from_secs(30));
}

/// One device map: a node mapped with `--gpu-node` is a GPU for the `/proc` scan that
/// stands in for a missing NVML, as it is for the kernel programs.
#[test]
fn without_nvml_a_node_mapped_with_gpu_node_is_a_gpu() {
    let mut node = Node::new(1);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", 0, "root", None, shell)]),
        json!([device_record(0, &["env-a"])]),
    );
    // /dev/full's number, in a private node: nothing says it is a GPU but the flag.
    let gpu = node.make_char_node("stand-in", 1, 7);
    let gpu = gpu.to_str().unwrap();
    let rogue = node.spawn_with(None, &[], &["--hold", gpu], None);
    let member = node.spawn_with(Some("env-a"), &[], &["--hold", gpu], None);
    let run = node
        .enforcer()
        .env("GENV_ENFORCER_NVML_LIB", "/nonexistent/libnvidia-ml.so")
        .args(["enforce", "--interval", "0", "--non-env-processes"])
        .args(["--gpu-node", "1:7=0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!(
            "Terminating process {rogue} from environment N/A that is running on GPU(s) 0"
        )),
        "{stdout}\n{stderr}"
    );
    assert!(node.wait_exit(rogue, Duration::from_secs(10)).is_some());
    assert!(node.alive(member), "on its attached GPU");
}

/// genv keeps an environment entry that appears twice (its lookups take the first),
/// and any user can write one. Such a file must not freeze the daemon on an old parse:
/// an environment activated after it still counts.
#[test]
fn a_duplicated_entry_does_not_freeze_the_state_the_daemon_enforces() {
    let mut node = Node::new(2);
    let (shell_a, shell_b) = (node.shell(), node.shell());
    let a = env_record("env-a", 0, "root", None, shell_a);
    node.write_state(
        json!([a.clone()]),
        json!([device_record(0, &["env-a"]), device_record(1, &[])]),
    );
    let mut daemon = Daemon::start(&node, &["--interval", "0.2", "--non-env-processes"]);
    node.mark_cycle(&daemon);
    // A duplicate of env-a, and env-b activated since, attached to GPU 1.
    node.write_state(
        json!([a.clone(), a, env_record("env-b", 0, "root", None, shell_b)]),
        json!([device_record(0, &["env-a"]), device_record(1, &["env-b"])]),
    );
    let member_b = node.spawn(Some("env-b"), &[(1, 100)]);
    daemon.expect_line(
        "holds environment env-a more than once",
        Duration::from_secs(20),
    );
    // Marker: a later cycle, which judged env-b's process too, terminated an outsider.
    let seen = node.mark_cycle(&daemon);
    assert!(
        node.alive(member_b),
        "env-b's process was made an outsider: {seen:#?}"
    );
    daemon.stop(Duration::from_secs(30));
}
