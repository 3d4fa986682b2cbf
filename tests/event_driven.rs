//! The event-driven daemon on this kernel, for real: its programs loaded, real processes
//! opening a test GPU node, the fake NVML listing them. Every daemon here runs its full
//! cycle once at start and then only hourly, so whatever it does during a test was
//! caused by a kernel event, a state-file change or the memory poll.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, SystemTime};

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::events::{
    EventDaemon, bpf_required, make_gpu_node, program_loaded, requested_tier,
    tier_sees_failed_opens, ways_in,
};
use genv_enforcer_tests::{
    Daemon, Node, device_record, env_record, harness, path, serial, wait_for_or,
};
use serde_json::json;

const SIGTERM: i32 = libc::SIGTERM;

/// A node with two GPUs, no environment yet, and a test node for GPU 0.
fn node() -> (Node, PathBuf) {
    let node = Node::new(2);
    let gpu = make_gpu_node(&node.dir.join("nvidia0"));
    node.write_state(
        json!([]),
        json!([device_record(0, &[]), device_record(1, &[])]),
    );
    (node, gpu)
}

/// The node with environment E (root's, its shell alive) attached to GPU 0.
fn node_with_e_on_gpu0() -> (Node, PathBuf) {
    let (mut node, gpu) = node();
    let shell = node.shell();
    node.write_state(
        json!([env_record("E", 0, "root", None, shell)]),
        json!([device_record(0, &["E"]), device_record(1, &[])]),
    );
    (node, gpu)
}

#[test]
fn tier_a_process_outside_any_environment_is_terminated_when_it_opens_a_gpu() {
    let (mut node, gpu) = node();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", path(&gpu)], None);
    let event = daemon.expect(&format!("[EVENT] Process {rogue} (thread {rogue}) "));
    assert!(event.contains(" GPU 0 (node "), "{event}");
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    daemon.expect(&format!(
        "Terminating process {rogue} from environment N/A that is running on GPU(s) 0"
    ));
    daemon.expect(&format!("Acted on process {rogue} "));
    assert_eq!(node.wait_exit(rogue, DEATH), Some(SIGTERM));
}

/// A program may open the nodes long before it creates its context (loading data
/// first): past the quick checks' window, it is still checked every second until it has
/// one, not left to the next full cycle (an hour away here).
#[test]
fn any_tier_a_context_created_long_after_the_open_is_answered_before_the_full_cycle() {
    // Apart from the exec storm, whose lost events would call for a full cycle.
    let _serial = serial();
    let (mut node, gpu) = node();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let rogue = node.spawn_with(None, &[], &["--open", path(&gpu)], None);
    daemon.expect(&format!("[EVENT] Process {rogue} (thread {rogue}) "));
    // The scenario: the program loads its data for longer than the window of quick
    // checks before it creates a context. The daemon began the window when it read the
    // open, before it printed the line just seen, so the window is over by
    // `window_over`. The wait ends on the daemon's work: a status published after
    // then, and a check (of the rogue, the one process it watches) counted above that
    // status's, so begun after it: one past the window. It found no context.
    let window_over = SystemTime::now() + genv_enforcer_window();
    let published = daemon.published_after(window_over);
    let checks = published["counts"]["open_checks"].as_u64().unwrap();
    let after = daemon.wait_count_at_least("open_checks", checks + 1);
    assert_eq!(
        after["counts"]["terminated"],
        0,
        "terminated without a context: {:#?}",
        daemon.lines()
    );
    assert!(node.alive(rogue), "{:#?}", daemon.lines());
    let cycles = daemon.count("full_cycles");
    node.add_context(rogue, 0, 100);
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    assert_eq!(
        node.wait_exit(rogue, Duration::from_secs(30)),
        Some(libc::SIGTERM)
    );
    assert_eq!(
        daemon.count("full_cycles"),
        cycles,
        "the full cycle found it"
    );
}

/// The daemon's window of quick checks after an open (`daemon::watchlist::WINDOW`).
fn genv_enforcer_window() -> Duration {
    Duration::from_secs(10)
}

/// The kernel reports the host's pids: a daemon in a pid namespace of its own would
/// signal the wrong processes, so it refuses to start, saying why.
#[test]
fn any_tier_the_daemon_refuses_a_pid_namespace_of_its_own() {
    let node = Node::new(1);
    // Bounded: a daemon that started anyway would run until killed.
    let mut command = std::process::Command::new("timeout");
    command.args(["20", "unshare", "--pid", "--fork", "--mount-proc"]);
    command.arg(node.enforcer().get_program());
    command.envs(
        node.enforcer()
            .get_envs()
            .filter_map(|(k, v)| Some((k, v?))),
    );
    let out = command
        .args(["enforce", "--event-driven"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--event-driven needs the host's pid namespace"),
        "{stderr}"
    );
}

#[test]
fn tier_an_open_attempt_that_fails_is_still_seen() {
    if !tier_sees_failed_opens() {
        eprintln!(
            "not applicable on the {} tier: it reads the descriptor a successful open returned",
            requested_tier()
        );
        return;
    }
    let (mut node, gpu) = node();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", path(&gpu)], None);
    daemon.expect(&format!("[EVENT] Process {rogue} "));
    // No driver owns the node: the open failed (ENXIO), and the process holds nothing.
    let held: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{rogue}/fd"))
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .collect();
    assert!(!held.contains(&gpu), "the open succeeded: {held:?}");
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    assert_eq!(node.wait_exit(rogue, DEATH), Some(SIGTERM));
}

#[test]
fn each_tier_a_process_on_a_device_not_attached_to_its_environment_is_terminated() {
    let (mut node, gpu) = node();
    let shell = node.shell();
    node.write_state(
        json!([env_record("E", 0, "root", None, shell)]),
        json!([device_record(0, &[]), device_record(1, &["E"])]),
    );
    let Some(daemon) = EventDaemon::start(&node, &[]) else {
        return;
    };
    let stray = node.spawn_with(Some("E"), &[(0, 100)], &["--open", path(&gpu)], None);
    daemon.expect(&format!("[EVENT] Process {stray} "));
    daemon.expect(&format!(
        "Process {stray} from environment E is using non-attached GPU(s) 0"
    ));
    assert_eq!(node.wait_exit(stray, DEATH), Some(SIGTERM));
    assert!(node.alive(shell));
}

#[test]
fn each_tier_a_process_on_its_attached_device_survives() {
    let (mut node, gpu) = node_with_e_on_gpu0();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let worker = node.spawn_with(Some("E"), &[(0, 100)], &["--open", path(&gpu)], None);
    daemon.expect(&format!("[EVENT] Process {worker} "));
    // Marker: several quick checks after the open ran, each with the context listed.
    let checks = daemon.count("open_checks");
    daemon.wait_count_above("open_checks", checks + 3);
    assert!(
        node.alive(worker),
        "a process on its own device was terminated"
    );
    let lines = daemon.lines();
    assert!(
        !lines.iter().any(|l| l.contains("Terminating")),
        "{lines:#?}"
    );
}

/// A process that writes over its environment block (`setproctitle`, in Ray or
/// gunicorn) keeps the environment it was started in: the kernel recorded it at exec,
/// and `/proc/<pid>/environ` no longer says it.
#[test]
fn any_tier_a_process_that_overwrites_its_environment_block_keeps_its_environment() {
    let (mut node, gpu) = node_with_e_on_gpu0();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let args = ["--clobber-environ", "--open", path(&gpu)];
    let worker = node.spawn_with(Some("E"), &[(0, 100)], &args, None);
    let environ = std::fs::read(format!("/proc/{worker}/environ")).unwrap();
    assert!(
        !String::from_utf8_lossy(&environ).contains("GENV_ENVIRONMENT_ID"),
        "the block was not overwritten"
    );
    // A process outside, started after it, is terminated: the checks ran.
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", path(&gpu)], None);
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    let checks = daemon.count("open_checks");
    daemon.wait_count_above("open_checks", checks + 3);
    assert!(node.alive(worker), "{:#?}", daemon.lines());
}

#[test]
fn any_tier_detaching_a_device_terminates_its_processes_without_waiting_for_the_interval() {
    let (mut node, _gpu) = node();
    let shell = node.shell();
    node.write_state(
        json!([env_record("E", 0, "root", None, shell)]),
        json!([device_record(0, &["E"]), device_record(1, &[])]),
    );
    let worker = node.spawn(Some("E"), &[(0, 100)]);
    let Some(daemon) = EventDaemon::start(&node, &[]) else {
        return;
    };
    assert!(node.alive(worker));
    // genv's detach: devices.json rewritten in place.
    node.write_file(
        "devices.json",
        &serde_json::to_string_pretty(
            &json!({"devices": [device_record(0, &[]), device_record(1, &["E"])]}),
        )
        .unwrap(),
    );
    daemon.expect(&format!(
        "Process {worker} from environment E is using non-attached GPU(s) 0"
    ));
    assert_eq!(node.wait_exit(worker, DEATH), Some(SIGTERM));
    daemon.wait_count("state_changes");
}

#[test]
fn any_tier_an_environment_over_its_memory_is_brought_under_it_by_the_memory_poll() {
    let (mut node, _gpu) = node();
    let shell = node.shell();
    node.write_state(
        json!([env_record("E", 0, "root", Some("1000mi"), shell)]),
        json!([device_record(0, &["E"]), device_record(1, &[])]),
    );
    let a = node.spawn(Some("E"), &[(0, 400)]);
    let b = node.spawn(Some("E"), &[(0, 400)]);
    let Some(daemon) = EventDaemon::start(&node, &["--memory-interval", "0.2"]) else {
        return;
    };
    // 800 MiB of 1000: nothing to do. A third process takes E to 1200 MiB; it opens
    // nothing, so only the memory poll can see it.
    let c = node.spawn(Some("E"), &[(0, 400)]);
    daemon.expect("Environment E is using");
    let line = daemon.expect("Terminating process");
    let victim = [a, b, c]
        .into_iter()
        .find(|pid| line.contains(&format!("process {pid} ")))
        .expect("the victim is one of E's processes");
    assert_eq!(node.wait_exit(victim, DEATH), Some(SIGTERM));
    // One process covers the 200 MiB excess: the greedy rule stops there. Marker: two
    // more memory polls ran after the victim was gone.
    let polls = daemon.count("memory_checks");
    daemon.wait_count_above("memory_checks", polls + 2);
    for pid in [a, b, c].into_iter().filter(|p| *p != victim) {
        assert!(node.alive(pid), "greedy rule killed more than needed");
    }
}

#[test]
fn tier_opens_are_seen_whatever_the_way_in() {
    let (mut node, gpu) = node();
    let ways = ways_in(&node.dir.clone(), &gpu, None);
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    for (way, args) in ways {
        // Without --deny, the tracepoint tier does not watch 32-bit opens (a program on
        // every syscall exit): the prevention suite covers that way.
        if way.contains("int 0x80") && daemon.tier == "tracepoint" {
            continue;
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let rogue = node.spawn_with(None, &[(0, 100)], &args, None);
        daemon.expect(&format!("[EVENT] Process {rogue} "));
        assert_eq!(
            node.wait_exit(rogue, DEATH),
            Some(SIGTERM),
            "opened by {way}"
        );
    }
}

#[test]
fn any_tier_a_storm_of_execs_loses_nothing_without_a_resync() {
    // Apart from the test that allows no full cycle in its span.
    let _serial = serial();
    let (mut node, gpu) = node();
    // A one-page ring buffer, and the daemon stopped while it fills: the rogue's open is
    // lost for sure, and only the resynchronising full cycle can find it.
    let Some(daemon) = EventDaemon::start(
        &node,
        &["--non-env-processes", "--ring-buffer-bytes", "4096"],
    ) else {
        return;
    };
    let pid = daemon.daemon.pid() as i32;
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let storm = |n: u32| {
        let status = Command::new("sh")
            .args([
                "-c",
                &format!("i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done"),
            ])
            .status()
            .unwrap();
        assert!(status.success());
    };
    storm(300);
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", path(&gpu)], None);
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    daemon.expect("[WARNING] The kernel lost");
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    assert_eq!(node.wait_exit(rogue, DEATH), Some(SIGTERM));

    // With the daemon running, a storm is either all delivered or resynchronised. The
    // baseline is a status published after the first storm was dealt with (its file
    // says the second it was written), and the daemon is then given as long as it
    // needs to count the second storm: a lost event that is never announced fails.
    // 600 execs are seven times what the one-page buffer holds (48-byte records).
    let before = daemon.barrier()["counts"].clone();
    storm(600);
    let count = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    let what = format!("every exec of the storm, or a loss and a resync, since {before}");
    let (execs, lost, cycles) = daemon.wait_status(&what, |status| {
        let after = &status["counts"];
        let execs = count(after, "exec_events") - count(&before, "exec_events");
        let lost = count(after, "lost_events") - count(&before, "lost_events");
        let cycles = count(after, "full_cycles") - count(&before, "full_cycles");
        (execs >= 600 || (lost > 0 && cycles > 0)).then_some((execs, lost, cycles))
    });
    eprintln!("storm: {execs} execs seen, {lost} lost, {cycles} resyncs");
}

#[test]
fn tier_one_instance_and_nothing_left_behind() {
    let (node, _gpu) = node();
    let Some(mut daemon) = EventDaemon::start(&node, &[]) else {
        return;
    };
    let status = daemon.status();
    assert_eq!(status["tier"], daemon.tier.as_str());
    let programs: Vec<u32> = status["programs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_u64().unwrap() as u32)
        .collect();
    assert!(programs.len() >= 4, "{programs:?}");
    // What verifying each program took on this kernel (a figure to watch: the verifier
    // has a budget), printed whatever libtest captures.
    let verified: Vec<String> = status["programs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| format!("{}={}", p["name"].as_str().unwrap(), p["verified_insns"]))
        .collect();
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!(
            "[verified instructions] tier={} {}\n",
            daemon.tier,
            verified.join(" ")
        )
        .as_bytes(),
    );
    assert!(programs.iter().all(|id| program_loaded(*id)));

    let shown = node
        .enforcer()
        .args(["status", "--run-dir", path(&daemon.run_dir)])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains(&format!("tier: {}", daemon.tier)), "{shown}");

    let second = node
        .enforcer()
        .args([
            "enforce",
            "--event-driven",
            "--interval",
            "3600",
            "--run-dir",
        ])
        .arg(&daemon.run_dir)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success());
    assert!(
        stderr.contains("another genv-enforcer is already running")
            && stderr.contains(&daemon.daemon.pid().to_string()),
        "{stderr}"
    );

    let exit = daemon
        .daemon
        .stop(DEATH)
        .expect("the daemon stops on SIGTERM");
    assert!(exit.success(), "{exit:?}");
    // The kernel frees a program once its last reference is gone, after an RCU grace
    // period: give it time.
    let left = || -> Vec<u32> {
        programs
            .iter()
            .copied()
            .filter(|id| program_loaded(*id))
            .collect()
    };
    wait_for_or(
        "the programs unloaded after exit",
        DEATH,
        || left().is_empty().then_some(()),
        || format!("{:?} loaded", left()),
    );
    assert!(!daemon.run_dir.join("status.json").exists());
}

/// The daemon's peak memory once its programs are loaded, beyond the pages of its files
/// (the binary's code and data, libraries): what it allocated at its busiest. The
/// kernel's BTF (5 to 10 MiB) is read once, by the daemon's own reader, and freed before
/// aya loads the object; when aya parsed it too (in `EbpfLoader::new`, and again for
/// each trampoline tier tried) that peak was over 30 MiB. A fact of memory, not a
/// timing: the bound is generous, under what one aya parse of vmlinux alone adds (about
/// 20 MiB), and far above the 5 MiB it comes to now.
#[test]
fn kernel_the_kernel_btf_is_parsed_once_at_start_up() {
    let (node, _gpu) = node();
    let Some(daemon) = EventDaemon::start(&node, &[]) else {
        return;
    };
    let status = std::fs::read_to_string(format!("/proc/{}/status", daemon.daemon.pid())).unwrap();
    let mib = |key: &str| -> f64 {
        let line = status.lines().find_map(|l| l.strip_prefix(key));
        let kib = line.and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok());
        kib.unwrap_or_else(|| panic!("no {key} in {status}")) / 1024.0
    };
    // File pages mapped now were mapped at the peak too, or later, but for the embedded
    // object's (2.5 MiB), given back after loading: what is left is at most the peak of
    // everything else, plus those.
    let (peak, files) = (mib("VmHWM:"), mib("RssFile:"));
    eprintln!(
        "[peak memory] tier={} VmHWM {peak:.1} MiB, file pages {files:.1} MiB",
        daemon.tier
    );
    assert!(
        peak - files < 16.0,
        "peak {peak:.1} MiB, of which {files:.1} MiB file pages: the rest is over 16 MiB"
    );
}

/// The most instructions the verifier may process to accept the exec hook that reads
/// whole environment blocks: a quarter of its budget (1,000,000), so that a later
/// kernel's verifier, or a change to the hook, does not push it over (it would not
/// load, and every block over 4 KiB would go to the daemon).
const EXEC_HOOK_MAX_VERIFIED: u64 = 250_000;

/// The exec hook's verified instructions, as `genv-enforcer status` shows them (the
/// kernel reports them since 5.16), are under [`EXEC_HOOK_MAX_VERIFIED`]. The same on
/// every tier: the exec hook is.
#[test]
fn kernel_the_exec_hook_verifies_in_under_a_quarter_of_the_verifier_budget() {
    let (node, _gpu) = node();
    let Some(daemon) = EventDaemon::start(&node, &[]) else {
        return;
    };
    let shown = node
        .enforcer()
        .args(["status", "--run-dir", path(&daemon.run_dir)])
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    // Not `proc_exec_4k`, the fallback for kernels without `bpf_loop`: the whole-block
    // hook must have loaded.
    let line = shown
        .lines()
        .find(|l| l.starts_with("program proc_exec "))
        .unwrap_or_else(|| {
            // Why, in the daemon's words (the verifier's log included).
            let why: Vec<String> = daemon
                .lines()
                .into_iter()
                .filter(|l| l.contains("The exec hook reads environment blocks up to 4 KiB only"))
                .collect();
            panic!("the whole-block exec hook is not loaded: {why:?}\n{shown}")
        });
    let verified: u64 = line
        .split(" instructions verified")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no verified instruction count: {line}"));
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("[verified instructions] proc_exec={verified}\n").as_bytes(),
    );
    assert!(
        verified < EXEC_HOOK_MAX_VERIFIED,
        "the exec hook verifies in {verified} instructions, over {EXEC_HOOK_MAX_VERIFIED}: {line}"
    );
}

#[test]
fn any_tier_without_bpf_the_full_cycle_enforces_alone() {
    let (mut node, _gpu) = node();
    let run_dir = node.dir.join("run");
    let daemon = Daemon::start(
        &node,
        &[
            "--event-driven",
            "--bpf-tier",
            "none",
            "--non-env-processes",
            "--interval",
            "0.5",
            "--run-dir",
            path(&run_dir),
        ],
    );
    daemon.expect_line("the full cycle alone", DEATH);
    let rogue = node.spawn(None, &[(0, 100)]);
    daemon.expect_line(
        &format!("Process {rogue} is not running in a GPU environment"),
        DEATH,
    );
    assert_eq!(node.wait_exit(rogue, DEATH), Some(SIGTERM));
}

/// The open tiers, best first, as `--bpf-tier` names them.
const TIERS: [&str; 4] = ["lsm", "fmod_ret", "fentry", "tracepoint"];

/// `auto` runs on the best tier this kernel accepts, saying why each better one was
/// refused; forced, each of those is an error naming the tier and the same reason, and
/// no daemon runs. On this machine's sandboxed 6.18 that is lsm, fmod_ret and fentry
/// (EPERM); in the VM's kernel with the BPF LSM, none.
#[test]
fn kernel_a_tier_the_kernel_refuses_is_an_error_when_forced_naming_why() {
    let (node, _gpu) = node();
    let run_dir = node.dir.join("run");
    let args = |tier: &str| {
        let run_dir = path(&run_dir);
        [
            "--event-driven",
            "--bpf-tier",
            tier,
            "--interval",
            "3600",
            "--run-dir",
            run_dir,
        ]
        .map(str::to_owned)
    };
    let auto = Daemon::start(&node, &args("auto").each_ref().map(String::as_str));
    let mut lines = Vec::new();
    let chosen = loop {
        let line = auto
            .output
            .recv_timeout(DEATH)
            .expect("the daemon says its tier");
        if let Some(rest) = line.split("Event-driven on the ").nth(1) {
            break rest.split(' ').next().unwrap().to_owned();
        }
        if line.contains("No BPF tier could be loaded") {
            assert!(!bpf_required(), "GENV_REQUIRE_BPF=1 and {line}");
            eprintln!("skipped (GENV_REQUIRE_BPF is not set): {line}");
            return;
        }
        lines.push(line);
    };
    drop(auto);
    let refused: Vec<(String, String)> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("[INFO] The kernel refused the "))
        .filter_map(|l| l.split_once(" tier: "))
        .map(|(tier, why)| (tier.to_owned(), why.to_owned()))
        .collect();
    let better = TIERS
        .iter()
        .position(|t| *t == chosen)
        .expect("a known tier");
    let names: Vec<&str> = refused.iter().map(|(tier, _)| tier.as_str()).collect();
    assert_eq!(names, TIERS[..better], "auto chose {chosen}: {lines:#?}");
    for (tier, why) in &refused {
        let mut child = node
            .enforcer()
            .arg("enforce")
            .args(args(tier))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let Some(status) = harness::wait_exit(&mut child, DEATH) else {
            let _ = child.kill();
            panic!("--bpf-tier {tier} ran, where auto said the kernel refused it: {why}");
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
        let said = format!("--bpf-tier {tier}: no open tier could be loaded: {tier}: {why}");
        assert!(
            !status.success() && stderr.contains(&said),
            "{status:?}: {stderr}"
        );
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            format!("[forced {tier}] refused as auto said: {why}\n").as_bytes(),
        );
    }
}

/// `doctor` loads every tier for real and says which one the configuration gets on this
/// kernel, and why each better one was refused, in the kernel's words: the tracepoint
/// tier on this machine's 6.18 (lsm, fmod_ret and fentry: EPERM), lsm in the VM's
/// kernels booted with the BPF LSM. `--json` carries the same verdict; a forced tier
/// the kernel refuses, or flags that do not go together, exit 5. Nothing is pinned
/// (with `--keep-pinned` asked), and nothing is mounted where anyone else sees it.
#[test]
fn kernel_doctor_names_the_tier_this_kernel_gives_and_why_better_ones_are_refused() {
    let (node, _gpu) = node();
    let pins = node.dir.join("pins");
    let doctor = |extra: &[&str]| run_doctor(&node, &pins, extra);
    let (code, text) = doctor(&[]);
    let verdict = text.lines().last().unwrap_or_default().to_owned();
    let chosen = verdict
        .split("event-driven on the ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no tier in the verdict: {text}"));
    assert_eq!(code, Some(0), "{text}");
    assert!(verdict.starts_with("verdict: ready: "), "{text}");
    // Straight to stderr: libtest keeps a passing test's output, and a run should show
    // what each kernel answered.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("[doctor]\n{text}").as_bytes(),
    );
    let at = TIERS
        .iter()
        .position(|t| *t == chosen)
        .expect("a known tier");
    for tier in TIERS {
        let line = text
            .lines()
            .find(|l| l.contains(&format!(" tier {tier} ")))
            .unwrap_or_else(|| panic!("no line for {tier}: {text}"));
        let refused = line.split(" refused: ").nth(1);
        if TIERS[..at].contains(&tier) {
            // The kernel's answer: its errno at the load, or the LSM list without bpf.
            let why = refused.unwrap_or_else(|| panic!("{tier} not refused: {line}"));
            assert!(
                why.contains("os error") || why.contains("not active"),
                "{line}"
            );
        } else if tier == chosen {
            assert!(
                line.starts_with("ok ") && line.contains("not attached"),
                "{line}"
            );
        }
    }
    let requested = requested_tier();
    if requested != "auto" {
        let rank = TIERS
            .iter()
            .position(|t| *t == requested)
            .expect("a known tier");
        assert!(
            at <= rank,
            "doctor chose {chosen}, the test runs on {requested}"
        );
    }

    let (code, json) = doctor(&["--json"]);
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(code, Some(0));
    assert_eq!(json["ready"], true);
    assert_eq!(json["tier"], chosen);
    assert_eq!(
        format!("verdict: {}", json["verdict"].as_str().unwrap()),
        verdict
    );
    let refused: Vec<&str> = json["refused"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["tier"].as_str().unwrap())
        .collect();
    assert_eq!(refused[..at], TIERS[..at], "{json:#}");

    // Forced onto a tier the kernel refuses (with the libcuda probes asked for, loaded
    // too), else (every tier loads) flags that do not go together, which load nothing:
    // not ready, exit 5.
    let (args, failing): (&[&str], &str) = match at {
        0 => (&["--deny"], "FAIL configuration"),
        _ => (
            &["--bpf-tier", TIERS[0], "--memory-at-alloc", "kill"],
            "FAIL event-driven",
        ),
    };
    let (code, text) = doctor(args);
    assert_eq!(code, Some(5), "{text}");
    assert!(text.lines().any(|l| l.starts_with(failing)), "{text}");
    assert!(
        text.lines()
            .last()
            .unwrap()
            .starts_with("verdict: not ready: "),
        "{text}"
    );
    if at > 0 {
        let item = |l: &&str| {
            l.get(5..)
                .is_some_and(|r| r.starts_with("memory-at-alloc "))
        };
        let probes = text.lines().find(item).unwrap();
        assert!(
            probes.starts_with("ok ") && probes.contains("bpf_send_signal"),
            "{probes}"
        );
    }

    assert!(!pins.exists(), "doctor made {}", pins.display());
    doctor_leaves_no_mount_behind(&node);
}

/// `doctor --event-driven --keep-pinned --pin-dir PINS EXTRA`: its exit code and stdout.
fn run_doctor(
    node: &genv_enforcer_tests::Node,
    pins: &std::path::Path,
    extra: &[&str],
) -> (Option<i32>, String) {
    let args = ["doctor", "--event-driven", "--keep-pinned", "--pin-dir"];
    let out = node
        .enforcer()
        .args(args)
        .arg(pins)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The mounts a daemon makes where the system has not (tracefs, securityfs, bpffs) are
/// the same before and after a `doctor` run, as its caller sees them: both taken in a
/// mount namespace of the caller's own (private), so that what other tests of this
/// suite mount meanwhile does not show.
fn doctor_leaves_no_mount_behind(node: &genv_enforcer_tests::Node) {
    let enforcer = node.enforcer();
    let mut command = Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(
            "m() { grep -E ' - (tracefs|securityfs|bpf) ' /proc/self/mountinfo; }; \
             m; echo ---; \"$0\" doctor --event-driven >/dev/null; m",
        )
        .arg(enforcer.get_program());
    for (key, value) in enforcer.get_envs() {
        match value {
            Some(value) => command.env(key, value),
            None => command.env_remove(key),
        };
    }
    let out = command.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let (before, after) = text.split_once("---\n").expect("both lists");
    assert_eq!(
        after, before,
        "doctor left mounts where its caller sees them"
    );
}
