//! Never the wrong process, never a silent gap: protected pids, SIGKILL escalation,
//! genv's switches, dry runs, forged environment ids, and the daemon's life cycle.

use std::time::Duration;

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::harness::hold_lock;
use genv_enforcer_tests::{Daemon, Node, device_record, env_record, run_with_stdin};
use serde_json::json;

fn execute(node: &Node, pids: &[u32]) -> (String, String) {
    let processes: Vec<_> = pids
        .iter()
        .map(|p| json!({"pid": p, "used_gpu_memory": [{"index": 0, "gpu_memory": "1mi"}], "eid": null}))
        .collect();
    let report = json!({"terminate": {"processes": processes}, "detach": {}});
    let out = run_with_stdin(
        node.enforcer()
            .args(["usage", "execute", "--kill-after", "0"]),
        &report.to_string(),
    );
    assert!(out.status.success());
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn never_signals_pid_1_kernel_threads_itself_or_its_parents() {
    let node = Node::new(1);
    // The test process is the enforcer's parent; kthreadd is pid 2.
    let parent = std::process::id();
    let (stdout, stderr) = execute(&node, &[1, 2, parent]);
    assert!(
        stderr.contains("Not terminating process 1: it is PID 1"),
        "{stderr}"
    );
    assert!(
        stderr.contains("Not terminating process 2: it is a kernel thread"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "Not terminating process {parent}: it is a parent of the enforcer"
        )),
        "{stderr}"
    );
    assert!(
        !stdout.contains(&format!("Terminating process {parent} ")),
        "{stdout}"
    );
}

#[test]
fn sigterm_ignored_is_followed_by_sigkill_after_the_grace_period() {
    let mut node = Node::new(1);
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let stubborn = node.spawn_with(None, &[(0, 10)], &["--ignore-sigterm"], None);
    let run = node.enforce_once(&["--non-env-processes", "--kill-after", "0.5"]);
    assert_eq!(
        run.stdout.last().unwrap(),
        &format!(
            "Killing process {stubborn} from environment N/A that is still running 0.5s after SIGTERM"
        ),
        "{:?}",
        run.stdout
    );
    assert_eq!(node.wait_exit(stubborn, DEATH), Some(libc::SIGKILL));
}

#[test]
fn kill_after_zero_is_genvs_sigterm_only() {
    let mut node = Node::new(1);
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let stubborn = node.spawn_with(None, &[(0, 10)], &["--ignore-sigterm"], None);
    let run = node.enforce_once(&["--non-env-processes", "--kill-after", "0"]);
    assert_eq!(run.terminated(), [stubborn]);
    assert!(node.alive(stubborn));
}

#[test]
fn genv_terminate_processes_0_and_dry_run_act_on_nothing() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("e", 0, "root", None, shell)]),
        json!([device_record(0, &["e"]), device_record(1, &["e"])]),
    );
    let rogue = node.spawn(None, &[(0, 10)]);
    let devices = node.read_file("devices.json");

    let quiet = node
        .enforcer()
        .env("GENV_TERMINATE_PROCESSES", "0")
        .args(["enforce", "--interval", "0", "--non-env-processes"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&quiet.stdout)
            .contains(&format!("Terminating process {rogue} from environment N/A"))
    );
    assert!(node.alive(rogue));

    let dry = node.enforce_once(&[
        "--non-env-processes",
        "--max-devices-per-user",
        "1",
        "--dry-run",
    ]);
    assert!(
        dry.stdout.contains(&format!(
            "[DRY-RUN] Terminating process {rogue} from environment N/A that is running on GPU(s) 0"
        )),
        "{:?}",
        dry.stdout
    );
    assert!(
        dry.stdout
            .contains(&"[DRY-RUN] Detaching environment e of user root from device 0".to_owned()),
        "{:?}",
        dry.stdout
    );
    assert!(node.alive(rogue));
    assert_eq!(node.read_file("devices.json"), devices);
}

#[test]
fn forged_environment_ids_count_as_outside() {
    let mut node = Node::new(1);
    let shell = node.shell();
    node.write_state(
        json!([env_record("alice-env", 1000, "alice", None, shell)]),
        json!([device_record(0, &["alice-env"])]),
    );
    let made_up = node.spawn(Some("no-such-env"), &[(0, 10)]);
    // nobody (65534) claims alice's environment.
    let foreign = node.spawn_with(Some("alice-env"), &[(0, 10)], &[], Some(65534));

    let genv_like = node.enforce_once(&[
        "--non-env-processes",
        "--allow-unknown-env",
        "--allow-foreign-env",
    ]);
    assert!(
        genv_like.stdout.is_empty(),
        "genv believes both: {:?}",
        genv_like.stdout
    );

    let run = node.enforce_once(&["--non-env-processes"]);
    assert!(
        run.stderr.contains(&format!(
            "process {made_up} claims environment no-such-env, which is not active"
        )),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains(&format!(
            "process {foreign} of uid 65534 claims environment alice-env of uid 1000"
        )),
        "{}",
        run.stderr
    );
    let mut terminated = run.terminated();
    terminated.sort();
    let mut expected = vec![made_up, foreign];
    expected.sort();
    assert_eq!(terminated, expected, "{:?}", run.stdout);
    assert!(node.wait_exit(made_up, DEATH).is_some() && node.wait_exit(foreign, DEATH).is_some());
}

#[test]
fn daemon_acts_on_a_detach_at_the_next_cycle_and_stops_on_sigterm() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("e", 0, "root", None, shell)]),
        json!([device_record(0, &["e"]), device_record(1, &["e"])]),
    );
    let on1 = node.spawn(Some("e"), &[(1, 10)]);
    // Marker: a process of an environment attached to nothing, on GPU 0, is terminated
    // by the same cycle that sees on1 on its attached GPU and leaves it alone.
    let canary_shell = node.shell();
    node.write_state(
        json!([
            env_record("e", 0, "root", None, shell),
            env_record("c", 0, "root", None, canary_shell)
        ]),
        json!([device_record(0, &["e"]), device_record(1, &["e"])]),
    );
    let canary = node.spawn(Some("c"), &[(0, 10)]);
    let mut daemon = Daemon::start(&node, &["--interval", "0.2"]);
    daemon.expect_line(
        &format!("Process {canary} from environment c is using non-attached GPU(s) 0"),
        Duration::from_secs(20),
    );
    assert!(node.alive(on1), "attached: left alone");
    // genv (or an admin) detaches device 1: the process there is terminated.
    node.write_state(
        json!([env_record("e", 0, "root", None, shell)]),
        json!([device_record(0, &["e"]), device_record(1, &[])]),
    );
    daemon.expect_line(
        &format!("Process {on1} from environment e is using non-attached GPU(s) 1"),
        Duration::from_secs(20),
    );
    assert_eq!(node.wait_exit(on1, DEATH), Some(libc::SIGTERM));
    let status = daemon.stop(DEATH).expect("the daemon must stop on SIGTERM");
    assert!(status.success(), "{status:?}");
}

/// `envs.json` is world-writable: rewriting an environment's owner must not turn its
/// owner's processes into outsiders (nor hand the environment to someone else). The
/// first owner seen stands while the environment's shell lives.
#[test]
fn rewriting_an_environments_owner_in_envs_json_is_reported_and_ignored() {
    const ALICE: u32 = 64_201;
    const MALLORY: u32 = 64_202;
    let mut node = Node::new(1);
    // Alice's shell, which activated the environment, runs as alice: the kernel
    // confirms the owner the file first gives.
    let shell = node.spawn_with(None, &[], &[], Some(ALICE));
    let envs = |uid: u32| json!([env_record("alice-env", uid, "alice", None, shell)]);
    node.write_state(envs(ALICE), json!([device_record(0, &["alice-env"])]));
    let member = node.spawn_with(Some("alice-env"), &[(0, 100)], &[], Some(ALICE));
    let mut daemon = Daemon::start(&node, &["--interval", "0.2", "--non-env-processes"]);
    // Marker: a cycle that saw the member terminated an outsider.
    node.mark_cycle(&daemon);
    node.write_state(envs(MALLORY), json!([device_record(0, &["alice-env"])]));
    daemon.expect_line(
        "belongs to uid 64202, but it was created by uid 64201: ignoring the change",
        Duration::from_secs(20),
    );
    // Marker: a later cycle, which judged the member again, terminated another outsider.
    let seen = node.mark_cycle(&daemon);
    assert!(
        node.alive(member),
        "alice's process was made an outsider: {seen:#?}"
    );
    daemon.stop(DEATH);
}

/// Anyone can hold genv's lock for ever. The daemon waits for it briefly, then enforces
/// from the state read without it, and still answers SIGTERM at once.
#[test]
fn a_user_holding_genvs_lock_does_not_freeze_the_daemon() {
    let mut node = Node::new(1);
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let lock = node.state.join("genv.lock");
    let _holder = hold_lock(&lock, None);
    let rogue = node.spawn(None, &[(0, 100)]);
    let mut daemon = Daemon::start(&node, &["--interval", "0.2", "--non-env-processes"]);
    let seen = daemon.expect_line(
        &format!("Process {rogue} is not running in a GPU environment"),
        Duration::from_secs(20),
    );
    assert_eq!(
        node.wait_exit(rogue, DEATH),
        Some(libc::SIGTERM),
        "{seen:#?}"
    );
    let stopping = std::time::Instant::now();
    let status = daemon.stop(DEATH).expect("the daemon must stop on SIGTERM");
    assert!(status.success(), "{status:?}");
    eprintln!(
        "stopped {:?} after SIGTERM with genv.lock held",
        stopping.elapsed()
    );
}

/// A copy of the binary in a directory uid 65534 owns (as `pip install --user` or a
/// shared conda environment leaves it): root refuses to run it, naming the directory
/// and how to install it instead; `--allow-untrusted-binary` runs it; uid 65534 itself
/// may run it. The file itself writable by its group is refused as well.
#[test]
fn root_refuses_a_binary_another_user_could_replace() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let node = Node::new(1);
    let dir = node.dir.join("nobodys-bin");
    std::fs::create_dir(&dir).unwrap();
    let exe = dir.join("genv-enforcer");
    std::fs::copy(genv_enforcer_tests::artefact("genv-enforcer"), &exe).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let status = |exe: &std::path::Path, extra: &[&str], uid: u32| {
        let mut command = std::process::Command::new(exe);
        command
            .args(extra)
            .args(["status", "--run-dir"])
            .arg(node.dir.join("run"));
        command.uid(uid).gid(uid);
        command.env_remove("GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY");
        command.output().unwrap()
    };
    let refused = status(&exe, &[], 0);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!("not running as root from {}", exe.display())),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "{}: the directory is owned by uid 65534",
            dir.display()
        )),
        "{said}"
    );
    assert!(
        said.contains("sudo install -o root -g root -m 0755"),
        "{said}"
    );
    // Past the check, `status` finds no daemon: exit 3.
    assert_eq!(
        status(&exe, &["--allow-untrusted-binary"], 0).status.code(),
        Some(3)
    );
    assert_eq!(
        status(&exe, &[], 65534).status.code(),
        Some(3),
        "not root: no check"
    );
    std::os::unix::fs::chown(&dir, Some(0), Some(0)).unwrap();
    assert_eq!(status(&exe, &[], 0).status.code(), Some(3), "root's: runs");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o775)).unwrap();
    let refused = status(&exe, &[], 0);
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains("the file has mode 775"), "{said}");
}
