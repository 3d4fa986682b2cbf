//! The identity the kernel decides on: which environment each process claims, read from
//! its environment block at exec (as genv reads it), inherited at fork, resolved from
//! `/proc` where the exec hook could not read it, resynchronised by the full cycle, and
//! kept when genv's state is malformed. Real programs, real processes, real uids; the
//! tier comes from `GENV_TEST_BPF_TIER` (tracepoint on the host, LSM, fmod_ret and
//! fentry in the VM), as in `prevention`.
//!
//! The programs decide for the whole machine: the tests here run one at a time.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::deny::{
    ALICE, OUTSIDER, assert_prevented, assert_untouched, attempt, deny, node, set_mode,
};
use genv_enforcer_tests::events::{EventDaemon, make_gpu_node, tier_refuses};
use genv_enforcer_tests::{Genv, Node, device_record, env_record, path, serial};
use serde_json::json;

#[test]
fn each_tier_a_child_forked_without_exec_has_its_parents_identity() {
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
fn any_tier_identities_left_unrecorded_are_counted_and_resynchronised() {
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
