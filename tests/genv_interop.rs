//! Side by side with an unmodified genv 1.4.3: state genv writes is read, detaches
//! genv-enforcer writes are what genv then shows, and concurrent updates are not lost.

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use genv_enforcer_tests::{Genv, Node, PATIENCE, artefact, device_record, env_record, wait_until};
use serde_json::{Value, json};

/// A genv user's shell: activates `eid`, attaches `gpus` devices, caps memory, starts a
/// GPU process in the environment and waits. Returns the GPU process's pid.
fn activate(node: &mut Node, eid: &str, gpus: u32, gpu_on: &[(u32, u64)]) -> u32 {
    let script = format!(
        "genv activate --id {eid}; genv config gpus {gpus}; genv attach; genv config gpu-memory 1g; \
         \"$GPU_PROCESS\" >/dev/null & echo $!; wait"
    );
    let mut child = Genv::get()
        .shell_command(node, &script)
        .env("GPU_PROCESS", artefact("gpu-process"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let gpu_pid: u32 = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("genv shell said {line:?}"));
    node.adopt(child, &[]);
    for (gpu, mib) in gpu_on {
        node.add_context(gpu_pid, *gpu, *mib);
    }
    gpu_pid
}

#[test]
fn reads_what_genv_writes_and_prints_the_same_snapshot() {
    let mut node = Node::new(2);
    let genv = Genv::get();
    let gpu_pid = activate(&mut node, "interop", 2, &[(0, 300), (1, 200)]);
    // Wait until the GPU process runs in the environment (genv's shell is asynchronous).
    wait_until("the GPU process in the environment", PATIENCE, || {
        std::fs::read(format!("/proc/{gpu_pid}/environ"))
            .is_ok_and(|e| e.windows(22).any(|w| w == b"GENV_ENVIRONMENT_ID=in"))
    });
    let theirs = genv
        .command(&node)
        .args(["usage", "snapshot"])
        .output()
        .unwrap();
    let ours = node
        .enforcer()
        .args(["usage", "snapshot"])
        .output()
        .unwrap();
    assert!(
        ours.status.success(),
        "{}",
        String::from_utf8_lossy(&ours.stderr)
    );
    let (theirs, ours) = (
        String::from_utf8(theirs.stdout).unwrap(),
        String::from_utf8(ours.stdout).unwrap(),
    );
    assert_eq!(
        ours, theirs,
        "genv-enforcer's usage snapshot must be genv's, byte for byte"
    );
    let snapshot: Value = serde_json::from_str(&ours).unwrap();
    assert_eq!(snapshot["envs"]["envs"][0]["config"]["gpu_memory"], "1g");
    assert_eq!(snapshot["processes"]["processes"][0]["eid"], "interop");
    for part in ["devices", "envs", "processes"] {
        let theirs = genv
            .command(&node)
            .args(["usage", "snapshot", "--type", part])
            .output()
            .unwrap();
        let ours = node
            .enforcer()
            .args(["usage", "snapshot", "--type", part])
            .output()
            .unwrap();
        assert_eq!(ours.stdout, theirs.stdout, "usage snapshot --type {part}");
    }
    // Over its 1g cap on device 0 only when the usage says so: 300 MiB is within it.
    let run = node.enforce_once(&[]);
    assert!(run.stdout.is_empty(), "{:?} {}", run.stdout, run.stderr);
    assert!(node.alive(gpu_pid));
}

#[test]
fn genv_sees_the_detach() {
    let mut node = Node::new(2);
    let genv = Genv::get();
    let gpu_pid = activate(&mut node, "detach-me", 2, &[(0, 100)]);
    let run = node.enforce_once(&["--max-devices-per-user", "1"]);
    assert_eq!(
        run.stdout,
        [
            "User root is using 2 devices which is 1 more than the maximum allowed".to_owned(),
            format!(
                "Terminating process {gpu_pid} from environment detach-me that is running on GPU(s) 0"
            ),
            "Detaching environment detach-me of user root from device 0".to_owned(),
        ],
        "{}",
        run.stderr
    );
    let devices = genv.bash(&node, "genv devices");
    let rows: Vec<&String> = devices.stdout.iter().skip(1).collect();
    assert!(
        rows[0].trim() == "0",
        "device 0 must show no environment: {rows:?}"
    );
    assert!(
        rows[1].contains("detach-me"),
        "device 1 stays attached: {rows:?}"
    );
    assert_eq!(
        std::fs::metadata(node.state.join("devices.json"))
            .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
            .unwrap(),
        0o666
    );
}

/// genv attaching and detaching while genv-enforcer detaches: every change lands,
/// because both take genv's global lock around read-modify-write.
#[test]
fn concurrent_attach_loses_no_update() {
    let mut node = Node::new(4);
    let genv = Genv::get();
    let alice_shell = node.shell();
    // genv's own environment (root), created by genv, attached to nothing yet.
    let mut root_shell = genv
        .shell_command(&node, "genv activate --id mine; echo ready; sleep 600")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(root_shell.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    node.adopt(root_shell, &[]);
    let mine: Value =
        serde_json::from_str::<Value>(&node.read_file("envs.json")).unwrap()["envs"][0].clone();
    for round in 0..10 {
        // alice is one device over her limit; genv attaches `mine` to device 3 meanwhile.
        node.write_state(
            json!([
                mine,
                env_record("alice-env", 1000, "alice", None, alice_shell)
            ]),
            json!([
                device_record(0, &["alice-env"]),
                device_record(1, &["alice-env"]),
                device_record(2, &[]),
                device_record(3, &[])
            ]),
        );
        let attach = genv
            .command(&node)
            .args(["attach", "--index", "3"])
            .env("GENV_ENVIRONMENT_ID", "mine")
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let ours = node.enforce_once(&[
            "--max-devices-per-user",
            "1",
            "--max-devices-for-user",
            "root=4",
        ]);
        let attach = attach.wait_with_output().unwrap();
        assert!(
            attach.status.success(),
            "round {round}: genv attach failed: {}",
            String::from_utf8_lossy(&attach.stderr)
        );
        assert!(ours.success, "round {round}: {}", ours.stderr);
        assert_eq!(
            node.attached("alice-env"),
            [1],
            "round {round}: our detach landed"
        );
        assert_eq!(
            node.attached("mine"),
            [3],
            "round {round}: genv's attach landed"
        );
    }
}
