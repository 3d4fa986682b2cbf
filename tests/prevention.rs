//! `--deny`: the kernel decides at the open. On the refusing tiers (LSM, fmod_ret) a
//! process outside any environment gets EPERM; on the fentry and tracepoint tiers it is
//! killed before the open returns (it prints `returned …` the instant an open returns to
//! it, and prints nothing). Processes inside environments, and allow-listed executables,
//! are never refused. Real programs, real processes, real uids; the tier comes from
//! `GENV_TEST_BPF_TIER` (tracepoint on the host, LSM, fmod_ret and fentry in the VM).
//!
//! The programs decide for the whole machine, from the environments of the daemon that
//! loaded them: two `--deny` daemons of two tests would kill each other's processes. The
//! tests here therefore run one at a time.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use genv_enforcer_tests::events::{
    EventDaemon, holders_of, make_gpu_node, make_gpu_node_for, pinned_link_program, pinned_map_get,
    pinned_map_put, program_loaded, tier_refuses, tier_sees_failed_opens, ways_in,
};
use genv_enforcer_tests::{Genv, Node, device_record, env_record, path, serial};
use serde_json::json;

const DEATH: Duration = Duration::from_secs(30);
const ALICE: u32 = 64_101;
const BOB: u32 = 64_102;
/// A user with no environment. (Root outside environments is let through unless
/// --deny-root: see `tier_root_is_left_to_the_userspace_rules_unless_deny_root`.)
const OUTSIDER: u32 = 64_103;

/// A node with two GPUs, test nodes for both (reachable by every uid), and two
/// environments: `alice-env` (uid ALICE) on GPU 0 and `bob-env` (uid BOB) on GPU 1.
fn node() -> (Node, [PathBuf; 2]) {
    let mut node = Node::new(2);
    set_mode(&node.dir, 0o755);
    let gpus = [
        make_gpu_node(&node.dir.join("nvidia0")),
        make_gpu_node_for(&node.dir.join("nvidia1"), 1),
    ];
    let (alice_shell, bob_shell) = (node.shell(), node.shell());
    node.write_state(
        json!([
            env_record("alice-env", ALICE, "alice", None, alice_shell),
            env_record("bob-env", BOB, "bob", None, bob_shell),
        ]),
        json!([
            device_record(0, &["alice-env"]),
            device_record(1, &["bob-env"])
        ]),
    );
    (node, gpus)
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
}

fn deny(node: &Node, extra: &[&str]) -> Option<EventDaemon> {
    let mut args = vec!["--non-env-processes", "--deny"];
    args.extend_from_slice(extra);
    let daemon = EventDaemon::start(node, &args)?;
    daemon.expect("GPU opens outside any environment are ");
    Some(daemon)
}

/// Starts a helper that waits, then lets it open; what it printed.
fn attempt(
    node: &mut Node,
    eid: Option<&str>,
    uid: Option<u32>,
    args: &[&str],
) -> (u32, Vec<String>) {
    let mut all = vec!["--wait-stdin"];
    all.extend_from_slice(args);
    let pid = node.spawn_with(eid, &[], &all, uid);
    (pid, node.attempt(pid))
}

/// The kernel prevented every open `pid` made: EPERM on the refusing tiers (and the
/// process lives on), killed inside the syscall elsewhere (no open ever returned to it).
fn assert_prevented(node: &mut Node, daemon: &EventDaemon, pid: u32, lines: &[String], how: &str) {
    // Not opens of the node for use: an O_PATH descriptor (which cannot reach the
    // driver; the /proc/self/fd way in starts with one) and the directory of openat.
    let lines: Vec<String> = lines
        .iter()
        .filter(|l| !l.starts_with("returned ok O_PATH") && !l.starts_with("returned ok open dir"))
        .cloned()
        .collect();
    if tier_refuses(&daemon.tier) {
        assert!(
            !lines.is_empty() && lines.iter().all(|l| !l.starts_with("returned ok")),
            "{how}: an open succeeded: {lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("returned EPERM")),
            "{how}: {lines:?}"
        );
        daemon.expect(&format!("Refused process {pid} of user "));
        assert!(node.alive(pid), "{how}: a refused process is left running");
    } else {
        assert!(
            lines.iter().all(|l| !l.starts_with("returned")),
            "{how}: an open returned to the process: {lines:?}"
        );
        assert_eq!(node.wait_exit(pid, DEATH), Some(libc::SIGKILL), "{how}");
        daemon.expect(&format!("Killed process {pid} of user "));
    }
}

/// No process outside both environments of [`node`] holds either test GPU node: an
/// environment counts only with the uid that owns it (or root's), as the kernel judges.
fn assert_no_outsider_holds(gpus: &[PathBuf], how: &str) {
    for gpu in gpus {
        let outsiders: Vec<_> = holders_of(gpu)
            .into_iter()
            .filter(|h| match h.eid.as_deref() {
                Some("alice-env") => h.uid != ALICE && h.uid != 0,
                Some("bob-env") => h.uid != BOB && h.uid != 0,
                _ => true,
            })
            .collect();
        assert!(
            outsiders.is_empty(),
            "{how}: {} is held outside any environment by {outsiders:?}",
            gpu.display()
        );
    }
}

/// Every open returned to the process, none refused, and it still runs.
fn assert_untouched(node: &mut Node, pid: u32, lines: &[String], opens: usize, how: &str) {
    let returned: Vec<&String> = lines.iter().filter(|l| l.starts_with("returned")).collect();
    assert_eq!(returned.len(), opens, "{how}: {lines:?}");
    assert!(
        returned.iter().all(|l| !l.starts_with("returned EPERM")),
        "{how}: refused: {lines:?}"
    );
    assert_eq!(lines.last().map(String::as_str), Some("opened"), "{how}");
    assert!(node.alive(pid), "{how}: killed");
}

#[test]
fn tier_a_process_outside_any_environment_never_gets_the_gpu() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let (rogue, lines) = attempt(&mut node, None, Some(OUTSIDER), &["--open", path(&gpu)]);
    assert_prevented(&mut node, &daemon, rogue, &lines, "no environment");
    let counter = if tier_refuses(&daemon.tier) {
        "refused_in_kernel"
    } else {
        "killed_in_kernel"
    };
    assert!(daemon.wait_count(counter) >= 1);
}

#[test]
fn tier_forged_environment_ids_count_as_outside() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let open = ["--open", path(&gpu)];
    let (made_up, lines) = attempt(&mut node, Some("no-such-env"), Some(ALICE), &open);
    assert_prevented(&mut node, &daemon, made_up, &lines, "a made-up id");
    let (stolen, lines) = attempt(&mut node, Some("alice-env"), Some(BOB), &open);
    assert_prevented(&mut node, &daemon, stolen, &lines, "another user's id");
    // The owner, with the same id, is in.
    let (owner, lines) = attempt(&mut node, Some("alice-env"), Some(ALICE), &open);
    assert_untouched(&mut node, owner, &lines, 1, "alice in alice-env");
}

#[test]
fn tier_a_child_forked_without_exec_has_its_parents_identity() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let args = ["--fork", "--open", path(&gpu)];
    let (parent, lines) = attempt(&mut node, None, Some(OUTSIDER), &args);
    if tier_refuses(&daemon.tier) {
        assert!(
            lines.iter().any(|l| l.starts_with("returned EPERM")),
            "{lines:?}"
        );
        assert!(lines.contains(&"child exited 0".to_owned()), "{lines:?}");
        daemon.expect("Refused process ");
    } else {
        assert!(
            !lines.iter().any(|l| l.starts_with("returned")),
            "{lines:?}"
        );
        assert!(
            lines.contains(&"child killed by signal 9".to_owned()),
            "{lines:?}"
        );
        daemon.expect("Killed process ");
    }
    assert!(node.alive(parent), "the parent opened nothing");
    // A child of an environment's process is in the environment.
    let (parent, lines) = attempt(&mut node, Some("alice-env"), Some(ALICE), &args);
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("returned ok") || l.starts_with("returned ENXIO")),
        "{lines:?}"
    );
    assert!(lines.contains(&"child exited 0".to_owned()), "{lines:?}");
    assert!(node.alive(parent));
}

#[test]
fn any_tier_an_exec_with_a_changed_environment_is_read_again() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    // Started in alice-env as alice, then exec'd (same pid) without the variable, or
    // with bob's environment.
    for (changed, how) in [("-", "variable removed"), ("bob-env", "bob's id")] {
        let args = ["--reexec-env", changed, "--open", path(&gpu)];
        let (pid, lines) = attempt(&mut node, Some("alice-env"), Some(ALICE), &args);
        assert_prevented(&mut node, &daemon, pid, &lines, how);
    }
}

#[test]
fn tier_every_way_to_the_node_is_prevented() {
    let _serial = serial();
    let (mut node, gpus) = node();
    let ways = ways_in(&node.dir.clone(), &gpus[0], Some(OUTSIDER));
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    for (way, args) in ways {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (rogue, lines) = attempt(&mut node, None, Some(OUTSIDER), &args);
        assert_prevented(&mut node, &daemon, rogue, &lines, way);
        assert_no_outsider_holds(&gpus, way);
    }
}

#[test]
fn tier_an_open_through_io_uring_is_prevented() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    if daemon.tier == "tracepoint" {
        // io_uring makes no open syscall, so no syscall-exit tracepoint fires: this
        // tier cannot see it (the full cycle still finds a process using the GPU).
        eprintln!("not applicable on the tracepoint tier: io_uring opens make no syscall");
        return;
    }
    let (rogue, lines) = attempt(
        &mut node,
        None,
        Some(OUTSIDER),
        &["--open-uring", path(&gpu)],
    );
    if tier_refuses(&daemon.tier) {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("returned EPERM io_uring")),
            "{lines:?}"
        );
        daemon.expect(&format!("Refused process {rogue} of user "));
    } else {
        // The io_uring worker thread opens on the process's behalf; the signal goes to
        // the process, which never sees a completion.
        assert!(
            !lines.iter().any(|l| l.starts_with("returned")),
            "{lines:?}"
        );
        assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGKILL));
        daemon.expect(&format!("Killed process {rogue} of user "));
    }
}

#[test]
fn tier_an_environments_process_opens_every_gpu_node_as_cuda_does() {
    let _serial = serial();
    let (mut node, [gpu0, gpu1]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    // alice-env has GPU 0 only; CUDA opens every node at start anyway.
    let args = ["--open", path(&gpu0), "--open", path(&gpu1)];
    let (worker, lines) = attempt(&mut node, Some("alice-env"), Some(ALICE), &args);
    assert_untouched(
        &mut node,
        worker,
        &lines,
        2,
        "alice-env opening GPUs 0 and 1",
    );
    let attached = daemon.expect(&format!("[EVENT] Process {worker} (thread {worker}) "));
    assert!(attached.contains("in its environment"), "{attached}");
    daemon.expect("in its environment, not attached");
    // Root may claim any environment (genv's own rule for who may act on one).
    let (root, lines) = attempt(&mut node, Some("bob-env"), None, &args);
    assert_untouched(&mut node, root, &lines, 2, "root in bob-env");
    // Marker: the daemon saw root's opens and ran its quick checks on them since.
    daemon.expect(&format!("[EVENT] Process {root} (thread {root}) "));
    let checks = daemon.count("open_checks");
    daemon.wait_count_above("open_checks", checks + 2);
    assert!(node.alive(worker) && node.alive(root));
    assert!(
        !daemon
            .lines()
            .iter()
            .any(|l| l.contains("Refused") || l.contains("Killed"))
    );
}

#[test]
fn tier_allow_listed_executables_open_gpus_outside_environments() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    // A monitoring tool: a copy of the helper, allowed by its own device and inode.
    let tool = node.dir.join("gpu-monitor");
    std::fs::copy(genv_enforcer_tests::artefact("gpu-process"), &tool).unwrap();
    set_mode(&tool, 0o755);
    let Some(daemon) = deny(&node, &["--allow-exe", path(&tool)]) else {
        return;
    };
    let (monitor, lines) = run_tool(&mut node, &tool, &gpu);
    assert_untouched(&mut node, monitor, &lines, 1, "the allow-listed tool");
    daemon.expect("allow-listed executable");
    // The same program from another file is not allowed.
    let (rogue, lines) = attempt(&mut node, None, Some(OUTSIDER), &["--open", path(&gpu)]);
    assert_prevented(&mut node, &daemon, rogue, &lines, "the helper itself");
}

/// Runs `tool` (a copy of the helper) as the outsider, lets it open `gpu`; what it said.
fn run_tool(node: &mut Node, tool: &Path, gpu: &Path) -> (u32, Vec<String>) {
    let mut command = std::process::Command::new(tool);
    std::os::unix::process::CommandExt::uid(&mut command, OUTSIDER);
    command
        .args(["--wait-stdin", "--open", path(gpu)])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .env_remove("GENV_ENVIRONMENT_ID");
    let mut child = command.spawn().unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut ready,
    )
    .unwrap();
    let pid = node.adopt(child, &[]);
    (pid, node.attempt(pid))
}

/// Removes a test's pins whatever happens: left behind, they would go on deciding.
struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `--keep-pinned --pin-dir` for a test-private pin directory.
fn pin_args(pins: &Pins) -> [&str; 3] {
    ["--keep-pinned", "--pin-dir", path(&pins.0)]
}

/// A test-private pin directory named for `what`, removed however the test ends, and a
/// `--deny` daemon pinning there, started and pinned.
fn pinned(node: &Node, what: &str) -> Option<(Pins, EventDaemon)> {
    let pins = Pins(PathBuf::from(format!(
        "/sys/fs/bpf/genv-enforcer-{what}-{}",
        std::process::id()
    )));
    let daemon = deny(node, &pin_args(&pins))?;
    daemon.expect("pinned under");
    Some((pins, daemon))
}

fn generations(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .map(|entries| entries.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default()
}

#[test]
fn tier_pinned_programs_keep_deciding_while_the_daemon_is_down_until_unpinned() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some((pins, mut first)) = pinned(&node, "test") else {
        return;
    };
    let pin_dir = pin_args(&pins);
    let tier = first.tier.clone();
    let first_pid = first.daemon.pid();
    assert!(first.daemon.stop(DEATH).unwrap().success());
    let left = generations(&pins.0);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(std::fs::read_dir(left[0].join("links")).unwrap().count() >= 4);
    // The stopped daemon's pid, which another process will get, is exempt no more.
    let exempt = left[0].join("maps/EXEMPT_PIDS");
    assert_eq!(
        pinned_map_get(&exempt, first_pid),
        None,
        "a stopped daemon's pid stays exempt"
    );

    // No daemon: the kernel still decides, from the environments last mirrored.
    let open = ["--open", path(&gpu)];
    let (rogue, lines) = attempt(&mut node, None, Some(OUTSIDER), &open);
    if tier_refuses(&tier) {
        assert!(
            lines.iter().any(|l| l.starts_with("returned EPERM")),
            "{lines:?}"
        );
        assert!(node.alive(rogue));
    } else {
        assert!(
            !lines.iter().any(|l| l.starts_with("returned")),
            "{lines:?}"
        );
        assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGKILL));
    }
    let (worker, lines) = attempt(&mut node, Some("alice-env"), Some(ALICE), &open);
    assert_untouched(
        &mut node,
        worker,
        &lines,
        1,
        "alice-env with the daemon down",
    );

    // The next daemon takes over: its own pins in, the earlier ones out.
    let Some(mut second) = deny(&node, &pin_dir) else {
        return;
    };
    second.expect("Took over from an earlier run's pinned programs");
    let now = generations(&pins.0);
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now[0], left[0]);
    assert!(second.daemon.stop(DEATH).unwrap().success());
    let programs: Vec<u32> = std::fs::read_dir(now[0].join("links"))
        .unwrap()
        .map(|link| pinned_link_program(&link.unwrap().path()))
        .collect();
    assert!(
        programs.iter().all(|&id| program_loaded(id)),
        "{programs:?}"
    );

    let unpin = node
        .enforcer()
        .args(["unpin", "--pin-dir", path(&pins.0)])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&unpin.stdout);
    assert!(
        unpin.status.success() && said.contains("Removed "),
        "{said}"
    );
    assert!(!pins.0.exists());
    // Gone from the kernel by the time unpin says so (bpffs lets go of a removed pin
    // only after an RCU grace period).
    let still: Vec<u32> = programs
        .into_iter()
        .filter(|&id| program_loaded(id))
        .collect();
    assert!(still.is_empty(), "still loaded after unpin: {still:?}");
    // Nothing decides any more: the open returns (ENXIO in the VM, where no driver is).
    let (rogue, lines) = attempt(&mut node, None, Some(OUTSIDER), &open);
    assert_untouched(&mut node, rogue, &lines, 1, "after unpin");
}

#[test]
fn tier_ten_thousand_attempts_from_outside_never_get_the_gpu() {
    let _serial = serial();
    let (node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let mut command = std::process::Command::new(genv_enforcer_tests::artefact("gpu-process"));
    std::os::unix::process::CommandExt::uid(&mut command, OUTSIDER);
    let output = command
        .args(["--attempts", "10000", path(&gpu)])
        .env_remove("GENV_ENVIRONMENT_ID")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&output.stdout);
    let figures: Vec<u32> = said
        .split_whitespace()
        .filter_map(|word| word.parse().ok())
        .collect();
    let [attempts, returned, succeeded, killed] = figures[..] else {
        panic!("unexpected output: {said}");
    };
    // The figure the benchmark table quotes, whatever the capture.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!(
            "[attempt loop] tier={} attempts={attempts} returned={returned} succeeded={succeeded} killed={killed}\n",
            daemon.tier
        )
        .as_bytes(),
    );
    assert_eq!(attempts, 10_000);
    assert_eq!(succeeded, 0, "{said}");
    if tier_refuses(&daemon.tier) {
        assert_eq!((returned, killed), (10_000, 0), "{said}");
    } else {
        assert_eq!((returned, killed), (0, 10_000), "{said}");
    }
}

#[test]
fn kernel_the_kernel_reads_the_environment_block_as_genv_does() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let open = |envp: &str| {
        [
            "--reexec-envp".to_owned(),
            envp.to_owned(),
            "--open".into(),
            path(&gpu).into(),
        ]
    };
    let run = |node: &mut Node, envp: &str| {
        let args = open(envp);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        attempt(node, None, Some(ALICE), &args)
    };
    // The variable alone, at the very start of the block.
    let (pid, lines) = run(&mut node, "GENV_ENVIRONMENT_ID=alice-env");
    assert_untouched(&mut node, pid, &lines, 1, "the only entry");
    // The last assignment wins (genv builds a dict from the block).
    let (pid, lines) = run(
        &mut node,
        "GENV_ENVIRONMENT_ID=no-such|A=1|GENV_ENVIRONMENT_ID=alice-env",
    );
    assert_untouched(&mut node, pid, &lines, 1, "alice-env assigned last");
    let (pid, lines) = run(
        &mut node,
        "GENV_ENVIRONMENT_ID=alice-env|GENV_ENVIRONMENT_ID=no-such",
    );
    assert_prevented(&mut node, &daemon, pid, &lines, "alice-env overridden");
    // Look-alikes are not the variable.
    let (pid, lines) = run(
        &mut node,
        "XGENV_ENVIRONMENT_ID=alice-env|GENV_ENVIRONMENT_IDX=alice-env",
    );
    assert_prevented(&mut node, &daemon, pid, &lines, "look-alike names");
    // A block far over a page: the kernel reads it whole (bpf_loop), and the daemon
    // never has to read it from /proc.
    let large = format!("PAD={}|GENV_ENVIRONMENT_ID=alice-env", "x".repeat(20_000));
    let (pid, lines) = run(&mut node, &large);
    assert_untouched(&mut node, pid, &lines, 1, "a 20 KB environment block");
    assert_not_read_from_proc(&daemon, pid);
    // The walk goes from the block's end: an assignment 20 KB before it is found, and
    // one after it still wins.
    let early = format!("GENV_ENVIRONMENT_ID=alice-env|PAD={}", "x".repeat(20_000));
    let (pid, lines) = run(&mut node, &early);
    assert_untouched(&mut node, pid, &lines, 1, "alice-env 20 KB before the end");
    assert_not_read_from_proc(&daemon, pid);
    let (pid, lines) = run(&mut node, &format!("{early}|GENV_ENVIRONMENT_ID=no-such"));
    assert_prevented(
        &mut node,
        &daemon,
        pid,
        &lines,
        "alice-env overridden 20 KB later",
    );
    // Look-alikes after the assignment, however many, neither hide it nor leave it to
    // the daemon: entries starting with `G`, and the name inside other entries' values.
    let mut crowded = "GENV_ENVIRONMENT_ID=alice-env".to_owned();
    for i in 0..40 {
        crowded.push_str(&format!("|G{i}=1|X{i}=GENV_ENVIRONMENT_ID=bob-env"));
    }
    let (pid, lines) = run(&mut node, &crowded);
    assert_untouched(&mut node, pid, &lines, 1, "80 look-alikes after alice-env");
    assert_not_read_from_proc(&daemon, pid);
}

fn assert_not_read_from_proc(daemon: &EventDaemon, pid: u32) {
    let needle = format!("Process {pid}'s environment block could not be read in the kernel");
    assert!(
        !daemon.lines().iter().any(|l| l.contains(&needle)),
        "the daemon had to read process {pid}'s environment from /proc"
    );
}

/// A block the exec hook leaves to the daemon: over 4 KiB, under the hook that reads 4
/// KiB only ([`four_k_hook`]). The hook that reads whole blocks leaves none: it gives up
/// only on a page it cannot read, which an exec never leaves.
fn unresolvable_block() -> String {
    format!("PAD={}|GENV_ENVIRONMENT_ID=alice-env", "x".repeat(5000))
}

/// The daemon `node` starts loads the exec hook kernels without `bpf_loop` get.
fn four_k_hook(node: &mut Node) {
    node.enforcer_env
        .push(("GENV_ENFORCER_ENV_SCAN".into(), "4k".into()));
}

/// A daemon stopped (SIGSTOP) once its first full cycle (and that cycle's
/// resynchronisation of identities) is over: whatever it resolves after it goes on came
/// from events, or from a cycle the test caused. It goes on when dropped too, so that a
/// failed assertion does not leave it stopped (and the test hung reaping it).
struct Stopped<'a>(&'a EventDaemon);

impl<'a> Stopped<'a> {
    fn after_first_cycle(daemon: &'a EventDaemon) -> Self {
        daemon.wait_count("full_cycles");
        // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
        unsafe { libc::kill(daemon.daemon.pid() as i32, libc::SIGSTOP) };
        Stopped(daemon)
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
        unsafe { libc::kill(self.0.daemon.pid() as i32, libc::SIGCONT) };
    }
}

/// Kernels without `bpf_loop` read 4 KiB of the block (forced here with
/// `GENV_ENFORCER_ENV_SCAN=4k`): a larger one is read by the daemon at the exec.
#[test]
fn any_tier_without_bpf_loop_the_daemon_reads_large_blocks() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    four_k_hook(&mut node);
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    daemon.expect("reads environment blocks up to 4 KiB only");
    let large = format!("PAD={}|GENV_ENVIRONMENT_ID=alice-env", "x".repeat(20_000));
    let args = [
        "--reexec-envp",
        &large,
        "--wait-stdin",
        "--open",
        path(&gpu),
    ];
    let pid = node.spawn_with(None, &[], &args, Some(ALICE));
    daemon.expect(&format!(
        "Process {pid}'s environment block could not be read in the kernel"
    ));
    let lines = node.attempt(pid);
    assert_untouched(
        &mut node,
        pid,
        &lines,
        1,
        "a 20 KB block, read by the daemon",
    );
}

/// An exec storm the stopped daemon cannot read, which overflows its ring buffer, and a
/// process started after it: the storm's events and the process's exec are lost.
fn storm() {
    let storm = std::process::Command::new("sh")
        .args([
            "-c",
            "i=0; while [ $i -lt 300 ]; do /bin/true; i=$((i+1)); done",
        ])
        .status()
        .unwrap();
    assert!(storm.success());
}

fn spawn_with_block(node: &mut Node, block: &str, gpu: &Path) -> u32 {
    let args = ["--reexec-envp", block, "--wait-stdin", "--open", path(gpu)];
    node.spawn_with(None, &[], &args, Some(ALICE))
}

/// A 64 KiB block is read in the kernel even while the daemon cannot answer (stopped,
/// its ring buffer overflowing under an exec storm).
#[test]
fn kernel_a_64_kib_block_is_read_in_the_kernel_while_the_daemon_cannot_answer() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &["--ring-buffer-bytes", "4096"]) else {
        return;
    };
    let stopped = Stopped::after_first_cycle(&daemon);
    let big = format!(
        "PAD={}|GENV_ENVIRONMENT_ID=alice-env",
        "x".repeat(64 * 1024)
    );
    storm();
    let worker = spawn_with_block(&mut node, &big, &gpu);
    // The daemon is stopped: only the kernel decides this open.
    let lines = node.attempt(worker);
    assert_untouched(&mut node, worker, &lines, 1, "a 64 KiB block");
    drop(stopped);
    daemon.expect("[WARNING] The kernel lost");
    assert_not_read_from_proc(&daemon, worker);
}

/// An identity the kernel left unresolved, whose exec event was lost (the daemon
/// stopped, its ring buffer overflowing under an exec storm), is resolved by the
/// resynchronising cycle.
#[test]
fn any_tier_an_unresolved_identity_whose_exec_was_lost_is_resolved_by_the_resync() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    four_k_hook(&mut node);
    let Some(daemon) = deny(&node, &["--ring-buffer-bytes", "4096"]) else {
        return;
    };
    let stopped = Stopped::after_first_cycle(&daemon);
    // The first cycle may have resolved others' (the harness's own blocks can be over
    // 4 KiB): the resync after the loss counts above that.
    let resolved = daemon.count("identities_resolved");
    storm();
    let unresolved = spawn_with_block(&mut node, &unresolvable_block(), &gpu);
    drop(stopped);
    daemon.expect("[WARNING] The kernel lost");
    daemon.wait_count_above("identities_resolved", resolved);
    let lines = node.attempt(unresolved);
    assert_untouched(&mut node, unresolved, &lines, 1, "resolved after the loss");
}

/// A child forked before the daemon resolved its parent inherits "unresolved"; the
/// kernel reports the fork at once and the daemon resolves the child too.
#[test]
fn any_tier_a_child_forked_before_its_parent_was_resolved_is_resolved_too() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    four_k_hook(&mut node);
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let stopped = Stopped::after_first_cycle(&daemon);
    let block = unresolvable_block();
    let args = [
        "--reexec-envp",
        &block,
        "--fork-early",
        "--wait-stdin",
        "--open",
        path(&gpu),
    ];
    let parent = node.spawn_with(None, &[], &args, Some(ALICE));
    let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"));
    let child: u32 = children.unwrap().trim().parse().expect("one child");
    drop(stopped);
    for pid in [parent, child] {
        daemon.expect(&format!(
            "Process {pid}'s environment block could not be read in the kernel"
        ));
    }
    let lines = node.attempt(parent);
    assert!(lines.contains(&format!("pid {child}")), "{lines:?}");
    assert_untouched(&mut node, parent, &lines, 1, "a child forked unresolved");
}

/// A `nohup` job outlives its environment's shells: genv drops the environment, and
/// leaves the job alone. By default so does the enforcer, on the GPUs the environment
/// had (reported); `--orphans terminate` counts it as outside.
#[test]
fn any_tier_a_job_whose_environment_genv_dropped_is_left_running_unless_orphans_terminate() {
    let _serial = serial();
    for policy in ["leave", "terminate"] {
        let mut node = Node::new(2);
        set_mode(&node.dir, 0o755);
        let gpu = make_gpu_node(&node.dir.join("nvidia0"));
        let shell = node.shell();
        let envs = json!([env_record("alice-env", ALICE, "alice", None, shell)]);
        let devices = json!([device_record(0, &["alice-env"]), device_record(1, &[])]);
        node.write_state(envs.clone(), devices.clone());
        let Some(daemon) = deny(&node, &["--orphans", policy]) else {
            return;
        };
        let open = ["--wait-stdin", "--open", path(&gpu)];
        // Listed with a context where it is left running (the cycle reports it); without
        // one where it goes, so that the kernel decides at its open.
        let usage: &[(u32, u64)] = if policy == "leave" { &[(0, 100)] } else { &[] };
        let job = node.spawn_with(Some("alice-env"), usage, &open, Some(ALICE));
        // The shell exits; genv's next read of envs.json drops the environment (and its
        // attachment). The rewrite wakes the daemon, whose cycle reads it so.
        // SAFETY: kill(2) takes no pointer; the process is one this test started.
        unsafe { libc::kill(shell as i32, libc::SIGKILL) };
        node.wait_exit(shell, DEATH);
        // Counted from a status published after the shell's death (the file read as it
        // is may be a second old, and a cycle that read the state before the death could
        // then pass for the one awaited, leaving the environment mirrored as active).
        let cycles = daemon.barrier()["counts"]["full_cycles"].as_u64().unwrap();
        node.write_state(envs.clone(), devices.clone());
        daemon.wait_count_above("full_cycles", cycles);
        let lines = node.attempt(job);
        if policy == "leave" {
            daemon.expect(&format!(
                "Process {job} of uid {ALICE} runs in environment alice-env, which genv dropped"
            ));
            assert_untouched(&mut node, job, &lines, 1, "a job left running");
            let status = daemon.wait_status("the orphan in the status", |status| {
                let orphans = status["orphans"].as_array()?.clone();
                (!orphans.is_empty()).then_some(orphans)
            });
            assert_eq!(status[0]["pid"], job, "{status:?}");
        } else {
            assert_prevented(&mut node, &daemon, job, &lines, "--orphans terminate");
        }
    }
}

/// An identity map too small for the machine's processes (here forced with
/// `GENV_ENFORCER_PROCESS_CAPACITY`): the kernel counts what it could not record, the
/// status shows it, and the daemon resynchronises at once, saying so.
#[test]
fn any_tier_identities_the_kernel_could_not_record_are_counted_and_resynchronised() {
    let _serial = serial();
    let (mut node, _) = node();
    node.enforcer_env
        .push(("GENV_ENFORCER_PROCESS_CAPACITY".into(), "16".into()));
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let cycles = daemon.count("full_cycles");
    // More new processes than the map has room for, alive at once.
    for _ in 0..24 {
        node.shell();
    }
    let lost = daemon.wait_count("identity_lost_in_kernel");
    assert!(lost > 0);
    daemon.expect("process identities (its map of 16 is full)");
    daemon.wait_count_above("full_cycles", cycles);
}

/// A leader thread that calls `pthread_exit` while its other threads go on: the process
/// keeps its identity (before 6.15 the exit tracepoint fires for the leader as if the
/// whole process ended).
#[test]
fn any_tier_a_process_whose_leader_thread_exited_keeps_its_environment() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(_daemon) = deny(&node, &[]) else {
        return;
    };
    let args = ["--leader-exits", "--wait-stdin", "--open", path(&gpu)];
    let pid = node.spawn_with(Some("alice-env"), &[], &args, Some(ALICE));
    let lines = node.attempt(pid);
    assert_untouched(&mut node, pid, &lines, 1, "after its leader thread exited");
}

#[test]
fn any_tier_a_malformed_state_file_never_turns_environments_into_outsiders() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let good = node.read_file("envs.json");
    node.write_file("envs.json", "{\"envs\": [ truncated");
    daemon.expect("enforcing from its last good contents");
    let open = ["--open", path(&gpu)];
    let (worker, lines) = attempt(&mut node, Some("alice-env"), Some(ALICE), &open);
    assert_untouched(
        &mut node,
        worker,
        &lines,
        1,
        "alice-env with envs.json malformed",
    );
    let (rogue, lines) = attempt(&mut node, None, Some(OUTSIDER), &open);
    assert_prevented(
        &mut node,
        &daemon,
        rogue,
        &lines,
        "outside, envs.json malformed",
    );
    // The file is left as it was found: the daemon never rewrites what it cannot read.
    assert_eq!(node.read_file("envs.json"), "{\"envs\": [ truncated");
    node.write_file("envs.json", &good);
}

/// Root's processes outside environments are not refused or killed by default (the
/// container runtime's hooks, MPS, persistenced, DCGM run as root); `--deny-root`
/// opts in.
#[test]
fn tier_root_is_left_to_the_userspace_rules_unless_deny_root() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let open = ["--open", path(&gpu)];
    {
        let Some(daemon) = deny(&node, &[]) else {
            return;
        };
        let (root, lines) = attempt(&mut node, None, None, &open);
        assert_untouched(&mut node, root, &lines, 1, "root, no --deny-root");
        let seen = daemon.expect(&format!("[EVENT] Process {root} (thread {root}) "));
        assert!(
            seen.contains("root (not denied without --deny-root)"),
            "{seen}"
        );
    }
    let Some(daemon) = deny(&node, &["--deny-root"]) else {
        return;
    };
    let (root, lines) = attempt(&mut node, None, None, &open);
    assert_prevented(&mut node, &daemon, root, &lines, "root with --deny-root");
}

/// A fresh node: the daemon starts before genv has ever run, so genv's state directory
/// does not exist yet. genv's own shell then creates it (`activate`), attaches a GPU, and
/// a process of that environment opens it at once, far inside the daemon's interval: the
/// kernel must already know the environment. (Root with --deny-root, so that an unknown
/// environment would be refused.)
#[test]
fn any_tier_an_environment_genv_creates_after_the_daemon_started_is_known_at_once() {
    let _serial = serial();
    let mut node = Node::new(1);
    set_mode(&node.dir, 0o755);
    let gpu = make_gpu_node(&node.dir.join("nvidia0"));
    std::fs::remove_dir(&node.state).unwrap();
    let Some(daemon) = deny(&node, &["--deny-root"]) else {
        return;
    };
    daemon.expect("does not exist yet; watching ");
    let script = format!(
        "genv activate --id fresh; genv attach --index 0; echo attached; \
         exec \"$GPU_PROCESS\" --wait-stdin --open {}",
        path(&gpu)
    );
    let mut shell = Genv::get()
        .shell_command(&node, &script)
        .env("GPU_PROCESS", genv_enforcer_tests::artefact("gpu-process"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(shell.stdout.take().unwrap());
    let mut said = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        said.push(line.trim().to_owned());
    }
    assert_eq!(
        said,
        ["attached", "ready"],
        "genv's shell did not get there"
    );
    let attached = Instant::now();
    shell.stdout = Some(stdout.into_inner());
    let pid = node.adopt(shell, &[]);
    let lines = node.attempt(pid);
    eprintln!(
        "[fresh node] opened {:.0?} after genv attach returned",
        attached.elapsed()
    );
    assert_untouched(&mut node, pid, &lines, 1, "genv's new environment");
    assert!(node.read_file("envs.json").contains("\"fresh\""));
    let seen = daemon.expect(&format!("[EVENT] Process {pid} (thread {pid}) "));
    assert!(seen.contains("in its environment"), "{seen}");
    assert!(
        !daemon.lines().iter().any(|l| l.contains("Cannot watch")),
        "{:#?}",
        daemon.lines()
    );
}

/// `--bpf-log`: the kernel's own account of each GPU open it decided about, naming the
/// identity it found, the environment and its owner, and the verdict. Off (the default),
/// no such line, and the open programs are loaded smaller: the verifier dropped the
/// logging code, so it cannot cost anything on the open path.
#[test]
fn tier_bpf_log_says_why_the_kernel_decided_and_is_not_loaded_when_off() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let open = ["--open", path(&gpu)];
    let off = {
        let Some(daemon) = deny(&node, &[]) else {
            return;
        };
        let (outsider, lines) = attempt(&mut node, None, Some(OUTSIDER), &open);
        assert_prevented(
            &mut node,
            &daemon,
            outsider,
            &lines,
            "outsider, no --bpf-log",
        );
        assert!(!daemon.lines().iter().any(|l| l.starts_with("[BPF]")));
        open_program_bytes(&daemon)
    };
    let Some(daemon) = deny(&node, &["--bpf-log"]) else {
        return;
    };
    let (alice, lines) = attempt(&mut node, Some("alice-env"), Some(ALICE), &open);
    assert_untouched(&mut node, alice, &lines, 1, "alice in alice-env");
    let said = daemon.expect(&format!("[BPF] GPU 0 opened by pid {alice} uid {ALICE}: "));
    for part in [
        "(env \"alice-env\")",
        "its environment is active and may be used by its uid",
        &format!("owner uid {ALICE}, attached 1"),
        "allowed: the GPU is attached to its environment",
    ] {
        assert!(said.contains(part), "{part:?} not in {said}");
    }
    let (bob, lines) = attempt(&mut node, Some("alice-env"), Some(BOB), &open);
    assert_prevented(&mut node, &daemon, bob, &lines, "bob claiming alice-env");
    let said = daemon.expect(&format!("[BPF] GPU 0 opened by pid {bob} uid {BOB}: "));
    assert!(
        said.contains("its environment belongs to another uid"),
        "{said}"
    );
    let (outsider, lines) = attempt(&mut node, None, Some(OUTSIDER), &open);
    assert_prevented(&mut node, &daemon, outsider, &lines, "outsider");
    let said = daemon.expect(&format!(
        "[BPF] GPU 0 opened by pid {outsider} uid {OUTSIDER}: "
    ));
    let verdict = match tier_refuses(&daemon.tier) {
        true => "refused with EPERM (--deny)",
        false => "SIGKILL in the open (--deny)",
    };
    assert!(
        said.contains("no GENV_ENVIRONMENT_ID at its exec") && said.contains(verdict),
        "{said}"
    );
    let on = open_program_bytes(&daemon);
    eprintln!(
        "[bpf-log] tier={} open programs loaded: {off} bytes off, {on} bytes on",
        daemon.tier
    );
    assert!(
        off < on,
        "the logging code was loaded with --bpf-log off: {off} bytes, {on} on"
    );
}

/// The size of the open programs as loaded (after the verifier's dead-code removal).
fn open_program_bytes(daemon: &EventDaemon) -> u64 {
    let status = daemon.status();
    let bytes: Vec<u64> = status["programs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["name"].as_str().unwrap().starts_with("open_"))
        .map(|p| p["translated_bytes"].as_u64().unwrap())
        .collect();
    assert!(bytes.iter().all(|&b| b > 0), "{status}");
    bytes.iter().sum()
}

/// NVIDIA's tools are allowed where they are: on the daemon's PATH (here a root-owned
/// directory), not only in /usr/bin. A copy in a directory anyone can write is not.
#[test]
fn any_tier_tools_are_allowed_where_the_daemon_finds_them_and_only_there() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let trusted = node.dir.join("nvidia/bin");
    let open_dir = node.dir.join("anyone/bin");
    for (dir, mode) in [(&trusted, 0o755), (&open_dir, 0o777)] {
        std::fs::create_dir_all(dir).unwrap();
        set_mode(dir.parent().unwrap(), 0o755);
        set_mode(dir, mode);
        let tool = dir.join("nvidia-smi");
        std::fs::copy(genv_enforcer_tests::artefact("gpu-process"), &tool).unwrap();
        set_mode(&tool, 0o755);
    }
    let path_var = format!("{}:{}:/usr/bin:/bin", trusted.display(), open_dir.display());
    node.enforcer_env.push(("PATH".into(), path_var));
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    daemon.expect(&format!("{}/nvidia-smi (", trusted.display()));
    daemon.expect(&format!(
        "{}: the directory is owned by uid 0 with mode 777",
        open_dir.display()
    ));
    let (smi, lines) = run_tool(&mut node, &trusted.join("nvidia-smi"), &gpu);
    assert_untouched(&mut node, smi, &lines, 1, "nvidia-smi on the daemon's PATH");
    let (planted, lines) = run_tool(&mut node, &open_dir.join("nvidia-smi"), &gpu);
    assert_prevented(
        &mut node,
        &daemon,
        planted,
        &lines,
        "an nvidia-smi anyone could plant",
    );
}

/// The daemon is exempt by its process id, not by its executable: a user running the
/// enforcer's own binary (whose NVML opens the nodes, and which could load a library of
/// the user's choosing) is denied like anyone else.
#[test]
fn tier_the_enforcer_is_exempt_by_process_not_by_executable() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    node.nvml_opens(&[&gpu]);
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    // (The daemon's own NVML opens, with its programs deciding, are the upgrade test's.)
    let mut command = node.enforcer();
    std::os::unix::process::CommandExt::uid(&mut command, OUTSIDER);
    let child = command
        .args(["usage", "snapshot"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let user = node.adopt(child, &[]);
    if tier_refuses(&daemon.tier) {
        daemon.expect(&format!("Refused process {user} of user "));
    } else {
        assert_eq!(node.wait_exit(user, DEATH), Some(libc::SIGKILL));
        daemon.expect(&format!("Killed process {user} of user "));
    }
}

/// An upgrade under `--keep-pinned`: the new binary (another file) starts while the old
/// run's pinned programs decide, and its first NVML call opens the GPU nodes. It is
/// exempt in their maps too, so it is neither killed nor refused, and takes over.
#[test]
fn tier_an_upgraded_daemon_survives_its_predecessors_pinned_programs() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    node.nvml_opens(&[&gpu]);
    let Some((pins, mut first)) = pinned(&node, "upgrade") else {
        return;
    };
    let pin_dir = pin_args(&pins);
    assert!(first.daemon.stop(DEATH).unwrap().success());
    let upgraded = node.dir.join("genv-enforcer-upgraded");
    std::fs::copy(genv_enforcer_tests::artefact("genv-enforcer"), &upgraded).unwrap();
    set_mode(&upgraded, 0o755);
    node.enforcer_binary = Some(upgraded);
    let Some(mut second) = deny(&node, &pin_dir) else {
        return;
    };
    second.expect("Took over from an earlier run's pinned programs");
    let own = second.daemon.pid();
    assert!(
        Path::new(&format!("/proc/{own}")).exists(),
        "the upgraded daemon was killed"
    );
    assert!(
        !second
            .lines()
            .iter()
            .any(|l| l.contains(&format!("process {own} "))),
        "{:#?}",
        second.lines()
    );
    assert!(second.daemon.stop(DEATH).unwrap().success());
}

/// On the kill tiers SIGKILL reaches the opener's thread group only: a process sharing
/// its file table (`clone(CLONE_FILES)`; a sibling that `dup`s the descriptor away is
/// the same case) would keep the GPU. The daemon kills every such holder outside an
/// environment; on the refusing tiers the open is refused and nobody holds anything.
#[test]
fn tier_a_process_sharing_the_openers_file_table_does_not_keep_the_gpu() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some(daemon) = deny(&node, &[]) else {
        return;
    };
    let args = ["--open-clone-files", path(&gpu)];
    let (sharer, lines) = attempt(&mut node, None, Some(OUTSIDER), &args);
    if tier_sees_failed_opens() {
        // LSM, fmod_ret and fentry in the VM: the node has no driver behind it, so the child's
        // open fails whatever is decided (refused, or killed and ENXIO), and nothing is
        // left to share. (On a real GPU the fentry tier installs the descriptor before
        // the child dies: the case the tracepoint tier shows here.)
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("returned none clone(CLONE_FILES)")),
            "{lines:?}"
        );
        let verb = if tier_refuses(&daemon.tier) {
            "Refused"
        } else {
            "Killed"
        };
        daemon.expect(&format!("{verb} process "));
        assert!(node.alive(sharer), "it holds nothing: left alone");
    } else {
        assert_eq!(
            node.wait_exit(sharer, DEATH),
            Some(libc::SIGKILL),
            "{lines:?}"
        );
        let line = daemon.expect(&format!("Killed process {sharer} of user "));
        assert!(
            line.contains("opened by a process the kernel killed"),
            "{line}"
        );
        assert!(daemon.wait_count("killed_holders") >= 1);
    }
    // Nobody outside an environment holds the node now.
    assert_no_outsider_holds(&[gpu], "after the sharer");
}

/// A daemon killed outright (no chance to clean up) leaves its exemption in the pinned
/// maps. A process that later gets its pid must not inherit it: the exemption names the
/// process by its start time too. Here an outsider stands for such a process: entered
/// under its own pid with the crashed daemon's start time.
#[test]
fn tier_a_crashed_daemons_exemption_names_no_later_process() {
    let _serial = serial();
    let (mut node, [gpu, _]) = node();
    let Some((pins, mut daemon)) = pinned(&node, "crash") else {
        return;
    };
    let tier = daemon.tier.clone();
    let crashed = daemon.daemon.pid();
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(crashed as i32, libc::SIGKILL) };
    daemon.daemon.stop(DEATH);
    let generation = generations(&pins.0).pop().expect("the pins stay");
    let exempt = generation.join("maps/EXEMPT_PIDS");
    let start = pinned_map_get(&exempt, crashed).expect("a crash leaves the exemption");
    let (rogue, lines) = {
        let pid = node.spawn_with(
            None,
            &[],
            &["--wait-stdin", "--open", path(&gpu)],
            Some(OUTSIDER),
        );
        pinned_map_put(&exempt, pid, start);
        (pid, node.attempt(pid))
    };
    if tier_refuses(&tier) {
        assert!(
            lines.iter().any(|l| l.starts_with("returned EPERM")),
            "{lines:?}"
        );
    } else {
        assert!(
            !lines.iter().any(|l| l.starts_with("returned")),
            "{lines:?}"
        );
        assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGKILL));
    }
}
