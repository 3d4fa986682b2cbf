//! Hosts that fail while connected: a `usage watch` stuck in NVML (whose init hangs on a
//! failed GPU, as the fake NVML's gates make it) never prints, or prints and then goes
//! silent. Each is reported within --host-timeout past a heartbeat, polled meanwhile,
//! and streamed again once it answers; what timed out does not stay behind on the host.

use std::time::Duration;

use genv_enforcer_tests::metrics::{assert_promtool_passes, free_local_addr, scrape};
use genv_enforcer_tests::sshd::{Runs, SshFleet};
use genv_enforcer_tests::{device_record, wait_for_or};
use serde_json::json;

use super::{DEATH, Running};

/// How often `needle` is in the enforcer's stderr so far.
fn said(enforcer: &Running, needle: &str) -> usize {
    enforcer.stderr.lock().unwrap().matches(needle).count()
}

fn wait_said(enforcer: &mut Running, needle: &str, times: usize) {
    let stderr = std::sync::Arc::clone(&enforcer.stderr);
    enforcer.wait_until(&format!("{times} × {needle:?} said"), || {
        stderr.lock().unwrap().matches(needle).count() >= times
    });
}

/// Two hosts with nothing but a process outside any environment on each; the second's
/// NVML hangs in init while `gate` exists.
fn two_hosts_one_hanging(gate: &std::path::Path) -> (SshFleet, [u32; 2]) {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer], 1);
    std::fs::write(gate, b"").unwrap();
    fleet.hosts[1].node.nvml_gate("nvmlInit_v2", gate);
    let mut pids = [0; 2];
    for (host, pid) in fleet.hosts.iter_mut().zip(&mut pids) {
        host.node
            .write_state(json!([]), json!([device_record(0, &[])]));
        *pid = host.node.spawn(None, &[(0, 100)]);
    }
    (fleet, pids)
}

/// A watch that never prints, then one that prints and goes silent: each is reported in
/// polling's words and polled, the healthy host is enforced meanwhile, and once NVML
/// answers the stream is back, said so, and the host enforced.
#[test]
fn a_silent_stream_is_a_failed_host_polled_until_its_stream_is_back() {
    let gate = std::env::temp_dir().join(format!("genv-gate-{}", std::process::id()));
    let (mut fleet, pids) = two_hosts_one_hanging(&gate);
    let sick = fleet.hosts[1].name.clone();
    let metrics = free_local_addr();
    let mut enforcer = Running::start(fleet.remote(&[
        "-v",
        "--metrics-addr",
        &metrics,
        "--host-timeout",
        "3",
        "enforce",
        "--event-driven",
        "--interval",
        "1",
        "--non-env-processes",
    ]));
    // --host-timeout 3 past a heartbeat of 1.5 s.
    let failed = format!("Failed running SSH command on {sick} (no answer within 4.5s)");
    let silent = format!("[{sick}] Cannot stream snapshots (its stream went silent");
    let back = format!("[{sick}] Its snapshot stream is back; no longer polling it");
    // Never a line: NVML's init hangs from the start.
    wait_said(&mut enforcer, &failed, 1);
    wait_said(&mut enforcer, &silent, 1);
    assert_eq!(
        fleet.hosts[0].node.wait_exit(pids[0], DEATH),
        Some(libc::SIGTERM)
    );
    assert!(fleet.hosts[1].node.alive(pids[1]));
    assert_eq!(said(&enforcer, &back), 0);
    // A fleet's Prometheus sees the dead host.
    let up =
        |host: &str, value: u32| format!("genv_enforcer_remote_host_up{{host=\"{host}\"}} {value}");
    let (healthy_up, sick_down) = (up(&fleet.hosts[0].name, 1), up(&sick, 0));
    enforcer.wait_until("the metrics saying so", || {
        let text = scrape(&metrics);
        text.contains(&healthy_up) && text.contains(&sick_down)
    });
    // promtool's lint passes on it, the healthy host's lag in it (the alerts read it).
    let answer = scrape(&metrics);
    assert_promtool_passes(&answer);
    let heard = format!(
        "genv_enforcer_remote_last_heard_seconds{{host=\"{}\"}} ",
        fleet.hosts[0].name
    );
    assert!(answer.contains(&heard), "{answer}");
    std::fs::remove_file(&gate).unwrap();
    wait_said(&mut enforcer, &back, 1);
    // -v: each stream's snapshots, and each decision.
    let connected = format!("[{sick}] Stream: a snapshot (");
    wait_said(&mut enforcer, &connected, 1);
    assert!(said(&enforcer, "(connected)") >= 2);
    assert!(said(&enforcer, "[INFO] Judged ") >= 1);
    assert_eq!(
        fleet.hosts[1].node.wait_exit(pids[1], DEATH),
        Some(libc::SIGTERM)
    );

    // A line, then silence: its next look at NVML hangs.
    std::fs::write(&gate, b"").unwrap();
    fleet.hosts[1]
        .node
        .nvml_gate("nvmlDeviceGetCount_v2", &gate);
    wait_said(&mut enforcer, &silent, 2);
    let healthy = fleet.hosts[0].node.spawn(None, &[(0, 100)]);
    assert_eq!(
        fleet.hosts[0].node.wait_exit(healthy, DEATH),
        Some(libc::SIGTERM)
    );
    let stranded = fleet.hosts[1].node.spawn(None, &[(0, 100)]);
    std::fs::remove_file(&gate).unwrap();
    wait_said(&mut enforcer, &back, 2);
    assert_eq!(
        fleet.hosts[1].node.wait_exit(stranded, DEATH),
        Some(libc::SIGTERM)
    );
    enforcer.stop();
}

/// A host that answers, but with snapshots that are refused (a process listed twice),
/// is reported every time it is asked, not once.
#[test]
fn a_host_whose_snapshots_are_refused_is_reported_every_time() {
    let twice = r#"{"processes": {"processes": [{"pid": 4242, "used_gpu_memory": [], "eid": null}, {"pid": 4242, "used_gpu_memory": [], "eid": null}]}, "envs": {"envs": []}, "devices": {"devices": [{"index": 0, "total_memory": "16384mi", "attachments": []}]}}"#;
    let answer = format!("echo '{twice}'");
    let host = Runs::Script(format!(
        "case \"$1 $2\" in \"usage watch\") {answer}; exec sleep 600;; *) {answer};; esac"
    ));
    let fleet = SshFleet::start(&[host], 1);
    let mut enforcer = Running::start(fleet.remote(&[
        "enforce",
        "--event-driven",
        "--interval",
        "0.5",
        "--non-env-processes",
    ]));
    let refused = format!(
        "[{}] Refusing its answer (inconsistent snapshot: process 4242 is listed twice)",
        fleet.hosts[0].name
    );
    wait_said(&mut enforcer, &refused, 4);
    enforcer.stop();
}

/// Polling a host whose NVML hangs: each `usage snapshot` past --host-timeout ends on
/// the host with its session, instead of one more stuck there at every cycle.
#[test]
fn commands_that_time_out_do_not_stay_behind_on_the_host() {
    let gate = std::env::temp_dir().join(format!("genv-gate-p{}", std::process::id()));
    let (fleet, _) = two_hosts_one_hanging(&gate);
    let sick = &fleet.hosts[1];
    let mut enforcer = Running::start(fleet.remote(&[
        "--host-timeout",
        "1",
        "enforce",
        "--interval",
        "0.2",
        "--non-env-processes",
    ]));
    let failed = format!(
        "Failed running SSH command on {} (no answer within 1s)",
        sick.name
    );
    let cycles = 6;
    wait_said(&mut enforcer, &failed, cycles);
    let stuck = sick.running("snapshot");
    // The one of this cycle, and at most the last one, still ending.
    assert!(stuck <= 2, "{stuck} usage snapshot after {cycles} timeouts");
    enforcer.stop();
    wait_for_or(
        "no usage snapshot left on the host after the run",
        Duration::from_secs(20),
        || (sick.running("snapshot") == 0).then_some(()),
        || format!("{} left", sick.running("snapshot")),
    );
    std::fs::remove_file(&gate).unwrap();
}

/// `--host-option` and `--watch-option` reach the host's `usage watch`, which takes them
/// (its stream brings the snapshot the rogue is terminated on).
#[test]
fn the_hosts_options_are_given_from_the_admin_side() {
    let mut fleet = SshFleet::start(&[Runs::Enforcer], 1);
    let node = &mut fleet.hosts[0].node;
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let rogue = node.spawn(None, &[(0, 100)]);
    let state = format!("--host-option=--genv-tmpdir={}", node.state.display());
    let mut enforcer = Running::start(fleet.remote(&[
        &state,
        "--watch-option=--bpf-tier=none",
        "--watch-option",
        "--poll-interval=0.5",
        "enforce",
        "--event-driven",
        "--interval",
        "600",
        "--non-env-processes",
    ]));
    assert_eq!(
        fleet.hosts[0].node.wait_exit(rogue, DEATH),
        Some(libc::SIGTERM)
    );
    let watches = fleet.hosts[0].commands("watch");
    enforcer.stop();
    let given = [
        &state["--host-option=".len()..],
        "--bpf-tier=none",
        "--poll-interval=0.5",
    ];
    assert!(
        watches
            .iter()
            .any(|words| given.iter().all(|g| words.iter().any(|w| w == g))),
        "{watches:?}"
    );
}

/// A host whose genv-enforcer's `usage watch` has no `--heartbeat` (clap says so first,
/// then its usage) is polled at once, said with clap's line.
#[test]
fn a_host_whose_watch_has_no_heartbeat_is_polled() {
    let watch = "echo \"error: unexpected argument '--heartbeat' found\" >&2; echo >&2; \
                 echo 'Usage: genv-enforcer usage watch [OPTIONS]' >&2; exit 2";
    let (fleet, mut enforcer) = super::scripted_run(watch, "true", "1");
    super::wait_for_executes(&fleet, &mut enforcer, 1);
    let said = "Cannot stream snapshots (error: unexpected argument '--heartbeat' found)";
    wait_said(&mut enforcer, said, 1);
    enforcer.stop();
}
