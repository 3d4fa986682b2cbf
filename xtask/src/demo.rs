//! `cargo xtask demo`: the event-driven enforcer on a simulated GPU node, no GPU needed.
//!
//! The node is the test suites' own ([`Node`]): two fake GPUs (the fake NVML stands in
//! for libnvidia-ml.so), a genv environment attached to GPU 0 with a process on it, and
//! a device node standing in for GPU 1 (`/dev/full`'s number, which opens without an
//! NVIDIA driver). The enforcer runs `enforce --event-driven --non-env-processes`; then
//! a rogue process outside any environment opens GPU 1, and a process of the
//! environment strays onto it. The demo shows the daemon's lines, measures how long
//! each intruder lived after its open, and shows the line its user is told.

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use genv_enforcer_tests::{Daemon, Node, device_record, env_record, path};
use serde_json::json;

use crate::sim;

const GPU1_NODE: &str = "1:7=1";
/// Before each of the daemon's lines, as the demo shows them.
const SAID: &str = "  | ";

pub fn run() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!(
            "the demo loads kernel programs and makes a device node: run `sudo -E cargo xtask demo`"
        );
    }
    crate::toolchain::ensure_ebpf_toolchain()?;
    crate::build_node_artefacts(&["-q"])?;
    // The node goes (its processes killed, its directory removed) when it is dropped.
    let mut node = Node::new(2);
    let gpu1 = node.dir.join("nvidia1");
    sim::make_test_node(&gpu1)?;
    let [worker, rogue, stray] = set_up(&mut node, path(&gpu1));
    let (mut daemon, events) = start_daemon(&node)?;
    for (what, pid) in [
        ("a process outside any environment opens GPU 1", rogue),
        ("a process of `demo` opens GPU 1, not attached to it", stray),
    ] {
        intrude(&mut node, &daemon, events, what, pid)?;
    }
    println!(
        "\n  process {worker:>7} (in `demo`, on its own GPU 0): {}",
        if node.alive(worker) {
            "still running"
        } else {
            "ENDED (unexpected)"
        }
    );
    println!(
        "\n$ kill -TERM {}  # the daemon detaches its programs and exits",
        daemon.pid()
    );
    let status = daemon.stop(Duration::from_secs(30));
    // Its last lines, to the end of its output.
    while let Ok(line) = daemon.output.recv_timeout(Duration::from_secs(5)) {
        println!("{SAID}{line}");
    }
    match status {
        Some(status) => println!("  (daemon exited: {status})"),
        None => bail!("the daemon did not stop within 30 s of SIGTERM"),
    }
    Ok(())
}

/// genv's state (the environment `demo` of the demo's user, its shell, attached to GPU
/// 0) and three processes: the environment's worker on GPU 0, and two intruders that
/// open GPU 1 when told (each listed on it just before: see [`intrude`]).
fn set_up(node: &mut Node, gpu1: &str) -> [u32; 3] {
    let shell = node.shell();
    let uid = rustix::process::getuid().as_raw();
    node.write_state(
        json!([env_record("demo", uid, "demo-user", None, shell)]),
        json!([device_record(0, &["demo"]), device_record(1, &[])]),
    );
    let opens = ["--wait-stdin", "--open", gpu1];
    let worker = node.spawn_with(Some("demo"), &[(0, 512)], &opens, None);
    let rogue = node.spawn_with(None, &[], &opens, None);
    let stray = node.spawn_with(Some("demo"), &[], &opens, None);
    println!("Simulated GPU node in {}", node.dir.display());
    println!("  GPUs 0 and 1 (fake NVML); {gpu1} stands in for GPU 1's device node");
    println!("  genv environment `demo` of user demo-user, attached to GPU 0");
    println!("  process {worker:>7}: in `demo`, on GPU 0");
    [worker, rogue, stray]
}

/// The daemon, once it watches GPU nodes; whether it runs on kernel events.
fn start_daemon(node: &Node) -> Result<(Daemon, bool)> {
    let run_dir = node.dir.join("run");
    let args = [
        "--event-driven",
        "--non-env-processes",
        "--verbose",
        "--interval",
        "5",
        "--gpu-node",
        GPU1_NODE,
        "--run-dir",
        path(&run_dir),
    ];
    println!("\n$ genv-enforcer enforce {}", args.join(" "));
    let daemon = Daemon::start(node, &args);
    let needles = ["Watching GPU nodes", "No BPF tier could be loaded"];
    let started = show_until(&daemon, &needles, Duration::from_secs(60))?;
    let events = !started.contains("No BPF tier");
    if !events {
        println!("  (no kernel tier here: the full cycle every 5 s does the work)");
    }
    Ok((daemon, events))
}

/// Shows the daemon's lines up to the first containing any of `needles`.
fn show_until(daemon: &Daemon, needles: &[&str], timeout: Duration) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match daemon.output.recv_timeout(left) {
            Ok(line) => {
                println!("{SAID}{line}");
                if needles.iter().any(|n| line.contains(n)) {
                    return Ok(line);
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                bail!("the daemon printed no line with {needles:?} within {timeout:?}")
            }
            Err(RecvTimeoutError::Disconnected) => bail!("the daemon exited"),
        }
    }
}

/// Lets one intruder open GPU 1, and says how long it lived after. What the daemon said
/// of it (that it terminated it, and, reacting to the open, how fast) is shown under
/// its heading: the next heading waits for those lines.
fn intrude(node: &mut Node, daemon: &Daemon, events: bool, what: &str, pid: u32) -> Result<()> {
    println!("\n# {what} (pid {pid})");
    // A GPU process before it opens, so that what is measured is the enforcer's
    // reaction to the open, not CUDA's start-up; listed only now, so that the full
    // cycle (every 5 s) does not find it first.
    node.add_context(pid, 1, 512);
    let opened = Instant::now();
    node.tell(pid);
    let status = sim::wait_exit(node.child(pid), Duration::from_secs(30))?;
    let lived = opened.elapsed();
    let mut wanted = vec![format!("Terminating process {pid} ")];
    if events {
        wanted.push(format!("Acted on process {pid} "));
    }
    // The decision's record: what the process's user is told.
    wanted.push(format!("(pid {pid}) "));
    let mut told = None;
    // Two pipes (stdout, stderr): the lines come in either order.
    while !wanted.is_empty() {
        let needles: Vec<&str> = wanted.iter().map(String::as_str).collect();
        let line = show_until(daemon, &needles, Duration::from_secs(30))?;
        told = told.or_else(|| told_line(&line));
        wanted.retain(|w| !line.contains(w.as_str()));
    }
    println!(
        "  -> ended by {status} {:.1} ms after it was told to open (genv polls every 10 s)",
        lived.as_secs_f64() * 1e3
    );
    if let Some(told) = told {
        println!("  -> its user sees, on the process's terminal and in `genv why`:\n     {told}");
    }
    Ok(())
}

/// The line a `[DECISION]` record tells the user, without the record's fields.
fn told_line(line: &str) -> Option<String> {
    let told = line.split("[DECISION] ").nth(1)?;
    Some(told.split(" rule=").next().unwrap_or(told).to_owned())
}
