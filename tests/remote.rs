//! Remote enforcement over real OpenSSH: `genv-enforcer remote … enforce` against
//! simulated hosts, each a network namespace running Debian's sshd with its own genv
//! state and fake NVML ([`genv_enforcer_tests::sshd`]); and interop with genv 1.4.3's
//! own `genv remote`, both ways.

use std::time::{Duration, Instant};

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::harness::{self, hold_lock};
use genv_enforcer_tests::running::{Running, run};
use genv_enforcer_tests::sshd::{Runs, SshFleet};
use genv_enforcer_tests::{Node, PATIENCE, device_record, env_record, wait_until};
use serde_json::json;

#[path = "remote/faults.rs"]
mod faults;
#[allow(dead_code)]
#[path = "notify/terminal.rs"]
mod terminal;
#[path = "remote/told.rs"]
mod told;

/// alice holds device 0 on the first host and devices 0 and 1 on the second, a process
/// on each: three devices, one more than `--max-devices-per-user 2` allows. genv counts
/// across hosts and detaches the first host's device first. Her environments are
/// activated by shells of hers (her uid differs from host to host), so that hosts running
/// genv-enforcer name her as their user databases do.
fn alice_on_two_hosts(fleet: &mut SshFleet) -> [u32; 3] {
    let mut pids = [0; 3];
    let (shell, uid) = (
        fleet.hosts[0].shell_of("alice"),
        fleet.hosts[0].uid("alice"),
    );
    fleet.hosts[0].node.write_state(
        json!([env_record("a1", uid, "alice", None, shell)]),
        json!([device_record(0, &["a1"]), device_record(1, &[])]),
    );
    pids[0] = fleet.hosts[0].node.spawn(Some("a1"), &[(0, 100)]);
    let (shell, uid) = (
        fleet.hosts[1].shell_of("alice"),
        fleet.hosts[1].uid("alice"),
    );
    fleet.hosts[1].node.write_state(
        json!([env_record("a2", uid, "alice", None, shell)]),
        json!([device_record(0, &["a2"]), device_record(1, &["a2"])]),
    );
    pids[1] = fleet.hosts[1].node.spawn(Some("a2"), &[(0, 100)]);
    pids[2] = fleet.hosts[1].node.spawn(Some("a2"), &[(1, 100)]);
    pids
}

fn expected_alice_lines(fleet: &SshFleet, victim: u32) -> Vec<String> {
    let first = &fleet.hosts[0].name;
    vec![
        "User alice is using 3 devices on 2 hosts which is 1 more than the maximum allowed".into(),
        format!(
            "[{first}] Terminating process {victim} from environment a1 that is running on GPU(s) 0"
        ),
        format!("[{first}] Detaching environment a1 of user alice from device 0"),
    ]
}

fn assert_alice_enforced(fleet: &mut SshFleet, pids: [u32; 3]) {
    assert_eq!(
        fleet.hosts[0].node.wait_exit(pids[0], DEATH),
        Some(libc::SIGTERM)
    );
    assert!(
        fleet.hosts[0].node.attached("a1").is_empty(),
        "a1 must be detached"
    );
    assert_eq!(
        fleet.hosts[1].node.attached("a2"),
        [0, 1],
        "the second host is left alone"
    );
    assert!(fleet.hosts[1].node.alive(pids[1]) && fleet.hosts[1].node.alive(pids[2]));
}

/// alice's cross-host scenario on two hosts running `kind`, enforced by `command`:
/// genv's lines, and the first host's device detached and its process terminated.
fn alice_enforced_by(kind: Runs, command: impl FnOnce(&SshFleet) -> std::process::Command) {
    let mut fleet = SshFleet::start(&[kind.clone(), kind], 2);
    let pids = alice_on_two_hosts(&mut fleet);
    let (output, stdout, stderr) = run(command(&fleet));
    assert!(output.status.success(), "{stderr}");
    assert_eq!(
        stdout,
        expected_alice_lines(&fleet, pids[0]),
        "stderr: {stderr}"
    );
    assert_alice_enforced(&mut fleet, pids);
}

#[test]
fn a_cross_host_device_limit_detaches_on_the_right_host() {
    alice_enforced_by(Runs::Enforcer, |fleet| {
        fleet.remote(&["enforce", "--interval", "0", "--max-devices-per-user", "2"])
    });
}

#[test]
fn per_host_rules_act_only_on_their_host() {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer], 2);
    // The same environment id on both hosts: on the first, its process uses device 1,
    // which is not attached there; on the second, device 1 is attached.
    let mut pids = Vec::new();
    for (host, attached) in [(0, 0), (1, 1)] {
        let node: &mut Node = &mut fleet.hosts[host].node;
        let shell = node.shell();
        let devices = match attached {
            0 => json!([device_record(0, &["env-a"]), device_record(1, &[])]),
            _ => json!([device_record(0, &[]), device_record(1, &["env-a"])]),
        };
        node.write_state(json!([env_record("env-a", 0, "bob", None, shell)]), devices);
        pids.push(node.spawn(Some("env-a"), &[(1, 100)]));
    }
    let (output, stdout, stderr) = run(fleet.remote(&["enforce", "--interval", "0"]));
    assert!(output.status.success(), "{stderr}");
    let first = &fleet.hosts[0].name;
    assert_eq!(
        stdout,
        [
            format!(
                "[{first}] Process {} from environment env-a is using non-attached GPU(s) 1",
                pids[0]
            ),
            format!(
                "[{first}] Terminating process {} from environment env-a that is running on GPU(s) 1",
                pids[0]
            ),
        ]
    );
    assert_eq!(
        fleet.hosts[0].node.wait_exit(pids[0], DEATH),
        Some(libc::SIGTERM)
    );
    assert!(fleet.hosts[1].node.alive(pids[1]));
}

/// A host's environment id that would retitle and clear the admin's terminal: the admin
/// side escapes it in the findings it prints and in the host's lines it reprints (here
/// from genv 1.4.3 on the host, which prints it raw), as `enforce` does locally.
#[test]
fn a_hosts_environment_id_never_reaches_the_admins_terminal_raw() {
    let mut fleet = SshFleet::start(&[Runs::PythonGenv], 2);
    let eid = "\u{1b}]0;pwned\u{7}\u{1b}[2J";
    let node: &mut Node = &mut fleet.hosts[0].node;
    let shell = node.shell();
    node.write_state(
        json!([env_record(eid, 0, "bob", None, shell)]),
        json!([device_record(0, &[eid]), device_record(1, &[])]),
    );
    let pid = node.spawn(Some(eid), &[(0, 100), (1, 100)]);
    let command = fleet.remote(&[
        "--remote-command",
        "sudo genv",
        "enforce",
        "--interval",
        "0",
    ]);
    let (output, stdout, stderr) = run(command);
    assert!(output.status.success(), "{stderr}");
    let (host, shown) = (&fleet.hosts[0].name, "$'\\e]0;pwned\\a\\e[2J'");
    assert_eq!(
        stdout,
        [
            format!(
                "[{host}] Process {pid} from environment {shown} is using non-attached GPU(s) 1"
            ),
            format!(
                "[{host}] Terminating process {pid} from environment {shown} that is running on GPU(s) 0,1"
            ),
        ],
        "stderr: {stderr}"
    );
    assert!(!stderr.contains(['\u{1b}', '\u{7}']), "{stderr:?}");
    assert_eq!(
        fleet.hosts[0].node.wait_exit(pid, DEATH),
        Some(libc::SIGTERM)
    );
}

/// Anyone on a host can hold genv's lock for ever (`flock genv.lock sleep inf`), or put
/// a FIFO or a link where it goes, which is refused as a lock and counts as held. `usage
/// snapshot` and `usage execute` wait a moment, then go on without it: each host's
/// outsider is terminated, and a detach due where the lock is held is named and left
/// for a cycle that gets the lock, which then makes it.
#[test]
fn hosts_whose_genv_lock_is_held_or_refused_are_still_enforced() {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer, Runs::Enforcer], 2);
    let (mut outsiders, mut alices) = (Vec::new(), Vec::new());
    for host in &mut fleet.hosts {
        let (shell, uid) = (host.shell_of("alice"), host.uid("alice"));
        host.node.write_state(
            json!([env_record("a", uid, "alice", None, shell)]),
            json!([device_record(0, &[]), device_record(1, &["a"])]),
        );
        alices.push(host.node.spawn(Some("a"), &[(1, 100)]));
        outsiders.push(host.node.spawn(None, &[(0, 100)]));
    }
    let lock: Vec<_> = (0..3)
        .map(|host| fleet.hosts[host].node.state.join("genv.lock"))
        .collect();
    let holder = hold_lock(&lock[0], Some(fleet.hosts[0].uid("mallory")));
    let fifo =
        std::ffi::CString::new(lock[1].clone().into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: `fifo` is a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o666) }, 0, "mkfifo");
    std::os::unix::fs::symlink(fleet.hosts[2].node.dir.join("elsewhere"), &lock[2]).unwrap();
    // alice holds device 1 on each host: one over the limit, the first host's goes.
    let flags = [
        // Generous: the old code waited for the held lock until this ran out.
        "--host-timeout",
        "20",
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
        "--max-devices-per-user",
        "2",
    ];
    let (output, stdout, stderr) = run(fleet.remote(&flags));
    assert!(output.status.success(), "{stderr}");
    for (host, outsider) in outsiders.iter().enumerate() {
        assert_eq!(
            fleet.hosts[host].node.wait_exit(*outsider, DEATH),
            Some(libc::SIGTERM),
            "the outsider on host {host}: {stdout:#?} {stderr}"
        );
    }
    let first = fleet.hosts[0].name.clone();
    assert!(
        stdout.contains(&format!(
            "[{first}] Terminating process {} from environment a that is running on GPU(s) 1",
            alices[0]
        )),
        "{stdout:#?}"
    );
    assert_eq!(
        fleet.hosts[0].node.wait_exit(alices[0], DEATH),
        Some(libc::SIGTERM)
    );
    let deferred = format!(
        "[{first}] [WARNING] Not detaching environment a of user alice from device 1 without genv's lock: a later check that gets it will"
    );
    assert!(stderr.contains(&deferred), "{stderr}");
    assert!(
        !stdout.iter().any(|l| l.contains("Detaching")),
        "{stdout:#?}"
    );
    assert_eq!(fleet.hosts[0].node.attached("a"), [1]);
    for (host, why) in [
        (0, "held by another process".to_owned()),
        (
            1,
            format!("Cannot take genv's lock: {}: is a FIFO", lock[1].display()),
        ),
        (
            2,
            format!(
                "Cannot take genv's lock: {}: is a symbolic link",
                lock[2].display()
            ),
        ),
    ] {
        let said = format!("[{}] [WARNING] ", fleet.hosts[host].name);
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(&said) && l.contains(&why)),
            "{said}…{why} not in {stderr}"
        );
    }

    // Free again: the next cycle detaches.
    drop(holder);
    let (output, stdout, stderr) = run(fleet.remote(&flags));
    assert!(output.status.success(), "{stderr}");
    assert_eq!(
        stdout,
        [
            "User alice is using 3 devices on 3 hosts which is 1 more than the maximum allowed"
                .to_owned(),
            format!("[{first}] Detaching environment a of user alice from device 1"),
        ],
        "{stderr}"
    );
    assert!(fleet.hosts[0].node.attached("a").is_empty());
}

/// On the first host bob holds device 0 and alice device 1, a process on each; on the
/// second, alice holds device 0, and mallory has written two entries naming bob,
/// attached to devices 1 and 2: one her own (her uid, her shell), one with bob's uid
/// there and her shell. Believed by name, as genv believes them, bob would hold three
/// devices, and `--max-devices-per-user 1` would detach his real one on the first host
/// (host order) and terminate his process. The pids of bob's and alice's processes on
/// the first host.
fn bob_forged_on_the_second_host(fleet: &mut SshFleet) -> (u32, u32) {
    let first = &mut fleet.hosts[0];
    let (bob_shell, alice_shell) = (first.shell_of("bob"), first.shell_of("alice"));
    first.node.write_state(
        json!([
            env_record("b1", first.uid("bob"), "bob", None, bob_shell),
            env_record("a1", first.uid("alice"), "alice", None, alice_shell),
        ]),
        json!([
            device_record(0, &["b1"]),
            device_record(1, &["a1"]),
            device_record(2, &[])
        ]),
    );
    let bob = first.node.spawn(Some("b1"), &[(0, 100)]);
    let alice = first.node.spawn(Some("a1"), &[(1, 100)]);
    let second = &mut fleet.hosts[1];
    let (alice_shell, mallory_shell) = (second.shell_of("alice"), second.shell_of("mallory"));
    second.node.write_state(
        json!([
            env_record("a2", second.uid("alice"), "alice", None, alice_shell),
            env_record("f1", second.uid("mallory"), "bob", None, mallory_shell),
            env_record("f2", second.uid("bob"), "bob", None, mallory_shell),
        ]),
        json!([
            device_record(0, &["a2"]),
            device_record(1, &["f1"]),
            device_record(2, &["f2"])
        ]),
    );
    second.node.spawn(Some("a2"), &[(0, 100)]);
    (bob, alice)
}

/// Across hosts a user is the owner each host's kernel confirms, named by that host:
/// mallory's entries count as hers, or as nobody's, never as bob's. alice, over the
/// limit for real, loses her first host's device; bob keeps his, and his process runs.
fn forged_names_are_not_believed(command: impl FnOnce(&SshFleet) -> std::process::Command) {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer], 3);
    let (bob, alice) = bob_forged_on_the_second_host(&mut fleet);
    let (output, stdout, stderr) = run(command(&fleet));
    assert!(output.status.success(), "{stderr}");
    let first = &fleet.hosts[0].name;
    assert_eq!(
        stdout,
        [
            "User alice is using 2 devices on 2 hosts which is 1 more than the maximum allowed"
                .to_owned(),
            format!(
                "[{first}] Terminating process {alice} from environment a1 that is running on GPU(s) 1"
            ),
            format!("[{first}] Detaching environment a1 of user alice from device 1"),
        ],
        "{stderr}"
    );
    assert_eq!(
        fleet.hosts[0].node.wait_exit(alice, DEATH),
        Some(libc::SIGTERM)
    );
    assert_eq!(fleet.hosts[0].node.attached("b1"), [0], "bob's device");
    assert!(fleet.hosts[0].node.alive(bob), "bob's process");
    assert_eq!(fleet.hosts[1].node.attached("f1"), [1]);
    assert_eq!(fleet.hosts[1].node.attached("f2"), [2]);
    let second = &fleet.hosts[1].name;
    for said in [
        format!(
            "[{second}] [WARNING] environment f1 names user \"bob\" in envs.json, but belongs to uid"
        ),
        format!(
            "[{second}] [WARNING] environment f2 names user \"bob\" in envs.json, but no shell"
        ),
    ] {
        assert!(stderr.contains(&said), "{said} not in {stderr}");
    }
}

#[test]
fn names_forged_on_one_host_never_detach_another_users_devices_elsewhere() {
    forged_names_are_not_believed(|fleet| {
        fleet.remote(&["enforce", "--interval", "0", "--max-devices-per-user", "1"])
    });
}

/// The confirmed owner travels in genv's own `username` field, so genv 1.4.3's
/// `remote enforce` driving genv-enforcer hosts is told the same.
#[test]
fn genvs_own_remote_is_told_only_confirmed_owners() {
    forged_names_are_not_believed(|fleet| {
        fleet.genv_remote(&["enforce", "--interval", "0", "--max-devices-per-user", "1"])
    });
}

/// A process outside any environment on each host, and an empty state.
fn rogues(fleet: &mut SshFleet) -> Vec<u32> {
    let mut pids = Vec::new();
    for host in &mut fleet.hosts {
        host.node
            .write_state(json!([]), json!([device_record(0, &[])]));
        pids.push(host.node.spawn(None, &[(0, 100)]));
    }
    pids
}

fn rogue_lines(host: &str, pid: u32) -> [String; 2] {
    [
        format!("[{host}] Process {pid} is not running in a GPU environment"),
        format!(
            "[{host}] Terminating process {pid} from environment N/A that is running on GPU(s) 0"
        ),
    ]
}

#[test]
fn hosts_down_or_hanging_are_reported_while_the_others_are_enforced() {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer, Runs::Enforcer], 1);
    let pids = rogues(&mut fleet);
    fleet.take_down(1);
    fleet.hang(2);
    let flags = [
        "-t",
        "2",
        // Generous: the healthy host must answer within it on a loaded machine. The
        // hung one fails on -t, ssh's ConnectTimeout, which covers the banner it
        // never sends.
        "--host-timeout",
        "30",
        "enforce",
        "--interval",
        "0",
        "--non-env-processes",
    ];
    let (output, stdout, stderr) = run(fleet.remote(&flags));
    assert!(output.status.success(), "{stderr}");
    assert_eq!(stdout, rogue_lines(&fleet.hosts[0].name, pids[0]));
    for host in [1, 2] {
        let said = format!("Failed running SSH command on {} (", fleet.hosts[host].name);
        assert!(stderr.contains(&said), "{said:?} not in {stderr}");
        assert!(fleet.hosts[host].node.alive(pids[host]));
    }
    assert_eq!(
        fleet.hosts[0].node.wait_exit(pids[0], DEATH),
        Some(libc::SIGTERM)
    );

    // -q: the same, silently; -e: the run ends with the error.
    let again = fleet.hosts[0].node.spawn(None, &[(0, 100)]);
    let quiet: Vec<&str> = ["-q"].iter().chain(&flags).copied().collect();
    let (output, stdout, stderr) = run(fleet.remote(&quiet));
    assert!(output.status.success(), "{stderr}");
    assert_eq!(stdout, rogue_lines(&fleet.hosts[0].name, again));
    assert!(!stderr.contains("Failed running SSH command"), "{stderr}");
    let exit: Vec<&str> = ["-e"].iter().chain(&flags).copied().collect();
    let (output, _, stderr) = run(fleet.remote(&exit));
    assert!(!output.status.success());
    assert!(stderr.contains("Failed running SSH command on"), "{stderr}");
}

#[test]
fn malformed_or_inconsistent_snapshots_are_refused_and_never_acted_on() {
    let snapshot_only = |answer: &str| {
        Runs::Script(format!(
            "case \"$1 $2\" in \"usage snapshot\") echo '{answer}';; *) cat >/dev/null;; esac"
        ))
    };
    // Would terminate process 4242 (outside any environment) if believed; device 5 does
    // not exist there.
    let inconsistent = r#"{"processes": {"processes": [{"pid": 4242, "used_gpu_memory": [{"index": 5, "gpu_memory": "1mi"}], "eid": null}]}, "envs": {"envs": []}, "devices": {"devices": [{"index": 0, "total_memory": "16384mi", "attachments": []}]}}"#;
    let malformed = r#"{"processes": {"processes": [{"pid": 4242,"#;
    let mut fleet = SshFleet::start(
        &[
            Runs::Enforcer,
            snapshot_only(inconsistent),
            snapshot_only(malformed),
        ],
        1,
    );
    fleet.hosts[0]
        .node
        .write_state(json!([]), json!([device_record(0, &[])]));
    let rogue = fleet.hosts[0].node.spawn(None, &[(0, 100)]);
    let (output, stdout, stderr) =
        run(fleet.remote(&["enforce", "--interval", "0", "--non-env-processes"]));
    assert!(output.status.success(), "{stderr}");
    assert_eq!(stdout, rogue_lines(&fleet.hosts[0].name, rogue));
    let inconsistent_said = format!(
        "[ERROR] [{}] Refusing its answer (inconsistent snapshot: process 4242 uses device 5, which is not listed)",
        fleet.hosts[1].name
    );
    assert!(stderr.contains(&inconsistent_said), "{stderr}");
    let malformed_said = format!(
        "[ERROR] [{}] Refusing its answer (malformed snapshot: not valid JSON",
        fleet.hosts[2].name
    );
    assert!(stderr.contains(&malformed_said), "{stderr}");
    for host in [1, 2] {
        assert_eq!(
            fleet.hosts[host].script_calls(),
            "usage snapshot\n",
            "nothing but the snapshot ran there"
        );
    }
}

#[test]
fn with_usage_watch_a_violation_is_acted_on_without_waiting_for_the_interval() {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer], 2);
    let (shell, uid) = (
        fleet.hosts[0].shell_of("alice"),
        fleet.hosts[0].uid("alice"),
    );
    fleet.hosts[0].node.write_state(
        json!([env_record("a1", uid, "alice", None, shell)]),
        json!([device_record(0, &["a1"]), device_record(1, &[])]),
    );
    let victim = fleet.hosts[0].node.spawn(Some("a1"), &[(0, 100)]);
    let (shell, uid) = (
        fleet.hosts[1].shell_of("alice"),
        fleet.hosts[1].uid("alice"),
    );
    let envs = json!([env_record("a2", uid, "alice", None, shell)]);
    fleet.hosts[1].node.write_state(
        envs.clone(),
        json!([device_record(0, &[]), device_record(1, &[])]),
    );
    let mut enforcer = Running::start(fleet.remote(&[
        "-v",
        "enforce",
        "--event-driven",
        "--interval",
        "600",
        "--max-devices-per-user",
        "1",
    ]));
    // The attach is to come as a change streamed, not in a host's first snapshot: the
    // engine has judged both hosts' first ones (nothing over) before it is made.
    let stderr = std::sync::Arc::clone(&enforcer.stderr);
    enforcer.wait_until("both hosts' first snapshots judged", || {
        stderr.lock().unwrap().contains("Judged 2 of 2 hosts")
    });
    // alice attaches a device on the second host: two, one over. Her job runs on the
    // first host's; the new attachment runs nothing yet, so it is the one to go (an idle
    // environment's devices go before a busy one's: entries anyone could write cost
    // their own attachments first), and her job lives.
    let attached = Instant::now();
    fleet.hosts[1].node.write_state(
        envs,
        json!([device_record(0, &["a2"]), device_record(1, &[])]),
    );
    // Polled finely: how long it took is said.
    let detached = harness::poll(Duration::from_secs(60), Duration::from_millis(2), || {
        (fleet.hosts[1].node.try_attached("a2") == Some(Vec::new())).then_some(())
    });
    assert!(
        detached.is_some(),
        "not detached within 60 s (the interval is 600 s)"
    );
    eprintln!(
        "detached {:?} after the attach, over SSH",
        attached.elapsed()
    );
    let second = &fleet.hosts[1].name;
    assert_eq!(
        enforcer.lines(2, Duration::from_secs(30)),
        [
            "User alice is using 2 devices on 2 hosts which is 1 more than the maximum allowed"
                .to_owned(),
            format!("[{second}] Detaching environment a2 of user alice from device 0"),
        ]
    );
    assert_eq!(fleet.hosts[0].node.attached("a1"), [0]);
    assert!(
        fleet.hosts[0].node.alive(victim),
        "alice's running job lives"
    );
    enforcer.stop();
}

#[test]
fn genvs_own_remote_drives_hosts_running_genv_enforcer() {
    alice_enforced_by(Runs::Enforcer, |fleet| {
        fleet.genv_remote(&["enforce", "--interval", "0", "--max-devices-per-user", "2"])
    });
}

#[test]
fn genv_enforcers_remote_drives_hosts_running_python_genv() {
    alice_enforced_by(Runs::PythonGenv, |fleet| {
        fleet.remote(&[
            "--remote-command",
            "sudo genv",
            "enforce",
            "--interval",
            "0",
            "--max-devices-per-user",
            "2",
        ])
    });
}

#[test]
fn hosts_that_cannot_stream_are_polled() {
    let mut fleet = SshFleet::start(&[Runs::PythonGenv], 1);
    let flags = [
        "--remote-command",
        "sudo genv",
        "enforce",
        "--event-driven",
        "--interval",
        "1",
        "--non-env-processes",
    ];
    let mut enforcer = Running::start(fleet.remote(&flags));
    let pids = rogues(&mut fleet);
    let seen = enforcer.lines(2, Duration::from_secs(30));
    assert_eq!(seen, rogue_lines(&fleet.hosts[0].name, pids[0]));
    assert_eq!(
        fleet.hosts[0].node.wait_exit(pids[0], DEATH),
        Some(libc::SIGTERM)
    );
    let stderr = enforcer.stop();
    assert!(stderr.contains("Cannot stream snapshots"), "{stderr}");
}

/// A host that answers as a script says, with process 4242 outside any environment on
/// its only GPU: `watch` is what its `usage watch` does (SNAPSHOT and OTHER print a
/// snapshot, the second with other memory figures), `execute` what its `usage execute`
/// does after reading the report.
fn scripted_host(watch: &str, execute: &str) -> Runs {
    scripted_host_with(watch, "SNAPSHOT", &format!("cat >/dev/null; {execute}"))
}

/// [`scripted_host`] whose `usage snapshot` does `check`, and whose `execute` reads the
/// report itself; LATER prints a snapshot where 4242 is gone and 4343, outside any
/// environment too, runs instead.
fn scripted_host_with(watch: &str, check: &str, execute: &str) -> Runs {
    let snapshot = |pid: u32, mib: u32| {
        format!(
            r#"echo '{{"processes": {{"processes": [{{"pid": {pid}, "used_gpu_memory": [{{"index": 0, "gpu_memory": "{mib}mi"}}], "eid": null}}]}}, "envs": {{"envs": []}}, "devices": {{"devices": [{{"index": 0, "total_memory": "16384mi", "attachments": []}}]}}}}'"#
        )
    };
    let fill = |script: &str| {
        script
            .replace("SNAPSHOT", &snapshot(4242, 1))
            .replace("OTHER", &snapshot(4242, 2))
            .replace("LATER", &snapshot(4343, 1))
    };
    Runs::Script(format!(
        "case \"$1 $2\" in\n\"usage watch\") {};;\n\"usage snapshot\") {};;\n*) {execute};;\nesac",
        fill(watch),
        fill(check)
    ))
}

fn executes(fleet: &SshFleet) -> usize {
    fleet.hosts[0]
        .script_calls()
        .matches("usage execute")
        .count()
}

/// One scripted host under `remote enforce --event-driven --non-env-processes` with
/// this `--interval`.
fn scripted_run(watch: &str, execute: &str, interval: &str) -> (SshFleet, Running) {
    let fleet = SshFleet::start(&[scripted_host(watch, execute)], 1);
    let enforcer = Running::start(fleet.remote(&[
        "enforce",
        "--event-driven",
        "--interval",
        interval,
        "--non-env-processes",
    ]));
    (fleet, enforcer)
}

/// Waits until the scripted host has run `usage execute` `count` times, within 60 s;
/// fails with the end of the enforcer's stderr.
fn wait_for_executes(fleet: &SshFleet, enforcer: &mut Running, count: usize) {
    enforcer.wait_until(&format!("{count} executes"), || executes(fleet) >= count);
}

/// A host whose stream writes megabytes to stderr (a warning at every poll, for hours)
/// still streams; a violation its execute does not clear is acted on again each
/// --interval, as genv's cycle would.
#[test]
fn a_stream_flows_past_a_flood_of_stderr_and_a_standing_violation_is_acted_on_again() {
    let watch = "head -c 3000000 /dev/zero | tr '\\0' x >&2; SNAPSHOT; exec sleep 600";
    let (fleet, mut enforcer) = scripted_run(watch, "true", "1");
    wait_for_executes(&fleet, &mut enforcer, 3);
    enforcer.stop();
}

/// Snapshots streamed while a report is being executed predate it: the report is not
/// executed again on their account, nor its lines printed again, within --interval.
#[test]
fn lines_streamed_during_an_execute_do_not_act_twice() {
    let scratch = std::env::temp_dir().join(format!(
        "genv-remote-later-{}-{}",
        std::process::id(),
        genv_enforcer_tests::unique()
    ));
    std::fs::create_dir(&scratch).unwrap();
    let (over, reports) = (scratch.join("over"), scratch.join("reports"));
    // The stream's lines come 0.3 s apart (the scenario: they flow while the first
    // report's execute, a second long, runs); after them, the marker: 4242 gone and
    // 4343 there instead, which `usage snapshot` says too from then on, so that the
    // engine comes to judge it whichever of the two it reads last.
    let watch = format!(
        "for i in 1 2 3 4 5; do SNAPSHOT; sleep 0.3; OTHER; sleep 0.3; done; touch {o}; LATER; exec sleep 600",
        o = over.display()
    );
    let check = format!(
        "if [ -e {} ]; then LATER; else SNAPSHOT; fi",
        over.display()
    );
    let execute = format!("cat >> {r}; echo >> {r}; sleep 1", r = reports.display());
    let fleet = SshFleet::start(&[scripted_host_with(&watch, &check, &execute)], 1);
    let mut enforcer = Running::start(fleet.remote(&[
        "enforce",
        "--event-driven",
        "--interval",
        "600",
        "--non-env-processes",
    ]));
    // The engine reads the stream in order and executes on one host one report at a
    // time, each after the check that follows the last: once the report naming 4343 is
    // executed, any execute on the account of the lines before it came first.
    enforcer.wait_until("the report naming 4343 executed", || {
        std::fs::read_to_string(&reports).is_ok_and(|r| r.contains("4343"))
    });
    let (executed, reports) = (executes(&fleet), std::fs::read_to_string(&reports));
    // Its lines come after every line printed before.
    let printed = enforcer.expect_printed("Process 4343 is not running");
    enforcer.stop();
    let _ = std::fs::remove_dir_all(&scratch);
    assert_eq!(
        executed, 2,
        "executed again on lines that predate the execute: {reports:?}"
    );
    let said = printed
        .iter()
        .filter(|l| l.contains("Process 4242 is not running"))
        .count();
    assert_eq!(said, 1, "{printed:?}");
}

/// A host where `usage watch` keeps failing before its first line (sudo allowing only
/// `usage snapshot` and `usage execute`) is still enforced: asked every interval while
/// its state is unknown, then polled.
#[test]
fn a_host_whose_stream_keeps_failing_is_polled() {
    let watch = "echo 'Sorry, user root is not allowed to execute usage watch' >&2; exit 1";
    let (fleet, mut enforcer) = scripted_run(watch, "true", "1");
    wait_for_executes(&fleet, &mut enforcer, 1);
    // Asked every interval as a host whose state is unknown, then polled as one that
    // cannot stream.
    let said = "Cannot stream snapshots (3 streams failed";
    let stderr = std::sync::Arc::clone(&enforcer.stderr);
    enforcer.wait_until("said it polls", || stderr.lock().unwrap().contains(said));
    enforcer.stop();
}

/// Nothing of a run stays behind: SIGKILLed, its hosts' `usage watch` end with their
/// ssh sessions; stopped with SIGTERM, its multiplexed connections end and their
/// directory goes.
#[test]
fn nothing_of_a_run_stays_behind() {
    let fleet = SshFleet::start(&[Runs::Enforcer], 1);
    fleet.hosts[0]
        .node
        .write_state(json!([]), json!([device_record(0, &[])]));
    let args = ["-v", "enforce", "--event-driven", "--interval", "600"];
    let wait_for = |what: &str, done: &dyn Fn() -> bool| wait_until(what, PATIENCE, done);
    let mut killed = Running::start(fleet.remote(&args));
    wait_for("a stream", &|| fleet.hosts[0].watching());
    let _ = killed.child.kill();
    let _ = killed.child.wait();
    wait_for("usage watch ending with its session", &|| {
        !fleet.hosts[0].watching()
    });

    let mut stopped = Running::start(fleet.remote(&args));
    wait_for("a stream", &|| fleet.hosts[0].watching());
    let control_dir = || {
        let said = stopped.stderr.lock().unwrap().clone();
        said.lines()
            .find_map(|l| l.strip_prefix("[INFO] SSH control sockets in "))
            .map(str::to_owned)
    };
    wait_for("the control directory said", &|| control_dir().is_some());
    let dir = control_dir().unwrap();
    assert!(std::path::Path::new(&dir).exists());
    stopped.stop();
    let uses_dir = || {
        std::fs::read_dir("/proc").unwrap().flatten().any(|entry| {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmdline).contains(&dir)
        })
    };
    wait_for("the masters ending", &|| !uses_dir());
    assert!(!std::path::Path::new(&dir).exists(), "{dir} left behind");
    wait_for("usage watch ending", &|| !fleet.hosts[0].watching());
}

// ---- `usage watch` on its own ----

/// `usage watch` with a poll of ten minutes, so that every line within the test comes
/// from an event: a write to genv's state, a GPU open (the context listed after it),
/// the exit of a listed process. Its stdin closing ends it.
#[test]
fn usage_watch_prints_a_line_at_each_change_as_it_happens() {
    use genv_enforcer_tests::events;
    let mut node = Node::new(1);
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let gpu = events::make_gpu_node(&node.dir.join("gpu0"));
    let [gpu_flag, _] = events::test_node_flags();
    let mut watch = node
        .enforcer()
        .args([
            "usage",
            "watch",
            "--poll-interval",
            "600",
            "--gpu-node",
            &gpu_flag,
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<serde_json::Value>();
    let out = watch.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(serde_json::from_str(&line).expect("one JSON document a line"));
        }
    });
    let next = |what: &str| {
        rx.recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("no line for {what} within 20 s (the poll is 600 s)"))
    };
    // A change may come as more than one line: `envs.json` and `devices.json` are two
    // writes (as they are in genv, each under its own lock), and the watch may print
    // the state between them. Lines up to the one that shows the change are skipped.
    let next_where = |what: &str, shows: &dyn Fn(&serde_json::Value) -> bool| loop {
        let line = next(what);
        if shows(&line) {
            return line;
        }
    };
    let pids = |doc: &serde_json::Value| -> Vec<u64> {
        doc["processes"]["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["pid"].as_u64().unwrap())
            .collect()
    };
    let first = next("the start");
    assert_eq!(first["envs"]["envs"], json!([]));

    let shell = node.shell();
    node.write_state(
        json!([env_record("e", 0, "root", None, shell)]),
        json!([device_record(0, &["e"])]),
    );
    let attached = next_where("the state change", &|doc| {
        doc["devices"]["devices"][0]["attachments"][0]["eid"] == "e"
    });
    assert_eq!(attached["envs"]["envs"][0]["eid"], "e");

    let stderr = watch.stderr.take().unwrap();
    let mut stderr = std::io::BufReader::new(stderr);
    let mut said = String::new();
    std::io::BufRead::read_line(&mut stderr, &mut said).unwrap();
    if !said.contains("kernel programs on the") {
        assert!(
            !events::bpf_required(),
            "GENV_REQUIRE_BPF=1 and usage watch polls: {said}"
        );
        eprintln!("usage watch has no kernel programs here ({said}); the GPU-open part is not run");
        let _ = watch.kill();
        let _ = watch.wait();
        return;
    }
    let opener = node.spawn_with(
        Some("e"),
        &[],
        &["--wait-stdin", "--open", gpu.to_str().unwrap()],
        None,
    );
    // The context is listed first, so that whichever of the looks the open schedules
    // comes first, however late, finds it: the line still comes from the open.
    node.add_context(opener, 0, 100);
    node.release(opener);
    let opened = next_where("the GPU open", &|doc| !pids(doc).is_empty());
    assert_eq!(pids(&opened), [u64::from(opener)]);

    // SAFETY: kill(2) takes no pointer; the opener is this test's.
    unsafe { libc::kill(opener as i32, libc::SIGKILL) };
    assert_eq!(node.wait_exit(opener, DEATH), Some(libc::SIGKILL));
    let gone = next_where("the exit", &|doc| !pids(doc).contains(&u64::from(opener)));
    assert!(pids(&gone).is_empty());

    drop(watch.stdin.take());
    assert!(
        harness::wait_exit(&mut watch, Duration::from_secs(10)).is_some(),
        "usage watch outlived its stdin"
    );
}
