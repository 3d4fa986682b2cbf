//! A remote stop told to its user, on the host where the process ran: its terminal
//! gets the line a local stop writes, and the host's `why` shows it to that user.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use genv_enforcer_tests::sshd::{Runs, SshFleet};
use genv_enforcer_tests::{DEATH, artefact, device_record, env_record, wait_until};
use serde_json::json;

use super::expected_alice_lines;
use crate::terminal::{Terminal, lines, told};

/// alice's shell on the first host holds a pty and runs her job in the background, on
/// GPU 0 in environment a1; on the second host she holds GPUs 0 and 1. One over
/// `--max-devices-per-user 2`: the first host's GPU 0 is detached and the job stopped.
/// Returns the job's pid, the shell (which exits once its job is gone) and the pty.
fn alice_at_a_terminal(fleet: &mut SshFleet) -> (u32, std::process::Child, Terminal) {
    let uid = fleet.hosts[0].uid("alice");
    let terminal = Terminal::new(uid);
    let mut shell = Command::new("/bin/sh");
    shell
        .args(["-c", "sleep 600 & echo $!; wait"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    terminal.attach(&mut shell, uid);
    shell.env("GENV_ENVIRONMENT_ID", "a1");
    let mut shell = shell.spawn().unwrap();
    let mut said = String::new();
    BufReader::new(shell.stdout.take().unwrap())
        .read_line(&mut said)
        .unwrap();
    let job: u32 = said.trim().parse().unwrap();
    let host = &mut fleet.hosts[0];
    host.node.write_state(
        json!([env_record("a1", uid, "alice", None, shell.id())]),
        json!([device_record(0, &["a1"]), device_record(1, &[])]),
    );
    host.node.add_context(job, 0, 100);
    let (other, uid) = (
        fleet.hosts[1].shell_of("alice"),
        fleet.hosts[1].uid("alice"),
    );
    fleet.hosts[1].node.write_state(
        json!([env_record("a2", uid, "alice", None, other)]),
        json!([device_record(0, &["a2"]), device_record(1, &["a2"])]),
    );
    fleet.hosts[1].node.spawn(Some("a2"), &[(0, 100)]);
    fleet.hosts[1].node.spawn(Some("a2"), &[(1, 100)]);
    (job, shell, terminal)
}

/// `remote enforce --interval 0 --max-devices-per-user 2`: genv's lines, and alice's job
/// on the first host stopped.
fn enforce_the_limit(fleet: &mut SshFleet, job: u32) {
    let output = fleet
        .remote(&["enforce", "--interval", "0", "--max-devices-per-user", "2"])
        .output()
        .unwrap();
    let stdout: Vec<String> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(stdout, expected_alice_lines(fleet, job), "{stderr}");
    wait_until("alice's job stopped", DEATH, || {
        !fleet.hosts[0].node.alive(job)
    });
}

/// With no daemon on the host, `usage execute --with-reasons` tells the terminal and
/// keeps the decision in alice's file there, which her `why` reads; the admin's lines
/// are genv's, unchanged. (Before, the terminal got nothing and `why` found nothing.)
#[test]
fn a_remote_stop_is_told_on_the_processs_terminal_and_in_the_hosts_why() {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer], 2);
    let (job, mut shell, terminal) = alice_at_a_terminal(&mut fleet);
    enforce_the_limit(&mut fleet, job);
    let expected = format!(
        "genv-enforcer: detached GPU 0 from environment with id \"a1\" in envs.json and stopped process \"sleep\" (pid {job}): user \"alice\" had 3 GPUs attached across 2 hosts, 2 allowed; run 'genv detach' in the environments you do not need"
    );
    let shown = terminal.wait_for(&expected);
    assert_eq!(
        told(shown.as_bytes()),
        std::slice::from_ref(&expected),
        "{:?}",
        lines(shown.as_bytes())
    );
    let _ = shell.wait();
    // alice's `why` on that host, as her uid there.
    let mut why = Command::new(artefact("genv-enforcer"));
    why.arg("why")
        .env("GENV_ENFORCER_RUN_DIR", fleet.hosts[0].run_dir());
    let uid = fleet.hosts[0].uid("alice");
    std::os::unix::process::CommandExt::uid(&mut why, uid);
    std::os::unix::process::CommandExt::gid(&mut why, uid);
    let seen = why.output().unwrap();
    let text = String::from_utf8_lossy(&seen.stdout);
    assert!(seen.status.success(), "{seen:?}");
    assert!(
        text.contains(&format!("{job:>7}  sleep")) && text.contains("max-devices-per-user"),
        "{text}"
    );
    assert!(text.contains(&expected), "{text}");
    // The file where it is kept: alice may read it, another user of that host not.
    let file = fleet.hosts[0].run_dir().join(format!("told/{uid}.json"));
    let bob = fleet.hosts[0].uid("bob");
    for (who, readable) in [(uid, true), (bob, false)] {
        let mut cat = Command::new("cat");
        cat.arg(&file);
        std::os::unix::process::CommandExt::uid(&mut cat, who);
        std::os::unix::process::CommandExt::gid(&mut cat, who);
        let read = cat.output().unwrap();
        assert_eq!(read.status.success(), readable, "uid {who}: {read:?}");
    }
}

/// A host whose sudoers allows `usage execute` exactly (without `--with-reasons`, as the
/// docs advised before) refuses the flag through sudo, before anything runs: it is sent
/// genv's report alone, and the stop is made all the same.
#[test]
fn a_host_whose_sudo_allows_only_the_plain_execute_is_still_enforced() {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer], 2);
    let (job, mut shell, _terminal) = alice_at_a_terminal(&mut fleet);
    let bin = fleet.hosts[0].bin.join("genv-enforcer");
    let bin = bin.display();
    fleet.hosts[0].restrict_sudo(&format!(
        "root ALL=(root) NOPASSWD: {bin} usage snapshot, {bin} usage execute"
    ));
    enforce_the_limit(&mut fleet, job);
    let _ = shell.wait();
}
