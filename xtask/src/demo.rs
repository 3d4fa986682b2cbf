//! `cargo xtask demo`: the event-driven enforcer on a simulated GPU node, no GPU needed.
//!
//! Two fake GPUs (the test suite's fake NVML stands in for libnvidia-ml.so), a genv
//! environment attached to GPU 0 with a process on it, and a device node standing in for
//! GPU 1 (`/dev/full`'s number, which opens without an NVIDIA driver). The enforcer runs
//! `enforce --event-driven --non-env-processes`; then a rogue process outside any
//! environment opens GPU 1, and a process of the environment strays onto it. The demo
//! shows the daemon's lines and measures how long each intruder lived after its open.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::sim;

const GPU1_NODE: &str = "1:7=1";

pub fn run() -> Result<()> {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the demo loads kernel programs and makes a device node: run `sudo -E cargo xtask demo`"
        );
    }
    crate::toolchain::ensure_ebpf_toolchain()?;
    crate::build_node_artefacts(&["-q"])?;
    let target = crate::target_dir()?.join("debug");
    let dir = std::env::temp_dir().join(format!("genv-enforcer-demo-{}", std::process::id()));
    let state = dir.join("genv");
    std::fs::create_dir_all(&state)?;
    let result = demo(&target, &dir, &state);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn demo(target: &Path, dir: &Path, state: &Path) -> Result<()> {
    let mut node = DemoNode::set_up(target, dir, state)?;
    let mut daemon = node.start_daemon(target, state)?;
    // The intruders become GPU processes before they open, so that what is measured is
    // the enforcer's reaction to the open, not CUDA's start-up.
    node.list_contexts(&[(0, 0), (2, 1), (3, 1)])?;
    let [_, _, rogue, stray] = &mut node.helpers;
    for (what, child) in [
        ("a process outside any environment opens GPU 1", rogue),
        ("a process of `demo` opens GPU 1, not attached to it", stray),
    ] {
        intrude(what, &mut child.0)?;
    }
    // The pauses in this demo only let the daemon's lines (printed by another thread)
    // come out before the next heading; nothing waits on them.
    std::thread::sleep(Duration::from_millis(300));
    let worker = &mut node.helpers[1].0;
    println!(
        "\n  process {:>7} (in `demo`, on its own GPU 0): {}",
        worker.id(),
        if worker.try_wait()?.is_none() {
            "still running"
        } else {
            "ENDED (unexpected)"
        }
    );
    println!(
        "\n$ kill -TERM {}  # the daemon detaches its programs and exits",
        daemon.id()
    );
    // SAFETY: kill(2) takes no pointer; the daemon is the demo's child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let status = daemon.wait()?;
    std::thread::sleep(Duration::from_millis(100));
    println!("  (daemon exited: {status})");
    Ok(())
}

/// The simulated node: a stand-in device node for GPU 1, the fake NVML's config, genv's
/// state, and four helper processes: the environment's shell, its worker on GPU 0, and
/// two intruders (their stdout stays open: they print `opened` after opening).
struct DemoNode {
    dir: PathBuf,
    gpu1: PathBuf,
    nvml: PathBuf,
    helpers: [(Child, ChildStdout); 4],
}

impl DemoNode {
    fn set_up(target: &Path, dir: &Path, state: &Path) -> Result<Self> {
        let gpu1 = dir.join("nvidia1");
        sim::make_test_node(&gpu1)?;
        let helper = |eid: Option<&str>| spawn_helper(target, &gpu1, eid);
        let helpers = [
            helper(None)?,
            helper(Some("demo"))?,
            helper(None)?,
            helper(Some("demo"))?,
        ];
        write_state(state, helpers[0].0.id())?;
        let node = Self {
            dir: dir.to_owned(),
            gpu1,
            nvml: dir.join("nvml.json"),
            helpers,
        };
        node.list_contexts(&[(1, 0)])?;
        println!("Simulated GPU node in {}", dir.display());
        println!(
            "  GPUs 0 and 1 (fake NVML); {} stands in for GPU 1's device node",
            node.gpu1.display()
        );
        println!("  genv environment `demo` of user demo-user, attached to GPU 0");
        println!(
            "  process {:>7}: in `demo`, on GPU 0",
            node.helpers[1].0.id()
        );
        Ok(node)
    }

    /// Makes the fake NVML list a context for each (helper, GPU).
    fn list_contexts(&self, contexts: &[(usize, u32)]) -> Result<()> {
        let processes: Vec<Value> = contexts
            .iter()
            .map(|&(helper, gpu)| {
                json!({"pid": self.helpers[helper].0.id(), "gpu": gpu, "used_memory": 512u64 << 20})
            })
            .collect();
        let config = json!({"devices": [
                {"uuid": "GPU-demo-0", "minor": 0, "total_memory": 16u64 << 30},
                {"uuid": "GPU-demo-1", "minor": 1, "total_memory": 16u64 << 30}],
            "processes": processes});
        sim::write_nvml(&self.nvml, &config)
    }

    fn start_daemon(&self, target: &Path, state: &Path) -> Result<Child> {
        let args = [
            "enforce",
            "--event-driven",
            "--non-env-processes",
            "--verbose",
            "--interval",
            "5",
            "--gpu-node",
            GPU1_NODE,
            "--run-dir",
        ];
        let run_dir = self.dir.join("run");
        println!("\n$ genv-enforcer {} {}", args.join(" "), run_dir.display());
        let mut daemon = Command::new(target.join("genv-enforcer"))
            .args(args)
            .arg(run_dir)
            .env("GENV_TMPDIR", state)
            .env("GENV_FAKE_NVML_CONFIG", &self.nvml)
            .env(
                "GENV_ENFORCER_NVML_LIB",
                target.join("libnvidia_ml_fake.so"),
            )
            .env_remove("GENV_TERMINATE_PROCESSES")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let lines = sim::stream(&mut daemon, Some("  | "));
        let started = sim::wait_line(
            &lines,
            &["Watching GPU nodes", "No BPF tier could be loaded"],
            Duration::from_secs(60),
        )?;
        if started.contains("No BPF tier") {
            println!("  (no kernel tier here: the full cycle every 5 s does the work)");
        }
        Ok(daemon)
    }
}

impl Drop for DemoNode {
    fn drop(&mut self) {
        for (child, _) in &mut self.helpers {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A helper that waits for a line on stdin, then opens GPU 1's node.
fn spawn_helper(target: &Path, gpu1: &Path, eid: Option<&str>) -> Result<(Child, ChildStdout)> {
    let mut command = Command::new(target.join("gpu-process"));
    command
        .args(["--wait-stdin", "--open", gpu1.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .env_remove("GENV_ENVIRONMENT_ID");
    if let Some(eid) = eid {
        command.env("GENV_ENVIRONMENT_ID", eid);
    }
    let mut child = command.spawn().context("starting a demo process")?;
    let mut stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(&mut stdout).read_line(&mut line)?;
    Ok((child, stdout))
}

fn write_state(state: &Path, shell: u32) -> Result<()> {
    // SAFETY: getuid(2) takes nothing and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::fs::write(
        state.join("envs.json"),
        serde_json::to_string_pretty(&json!({"envs": [{"eid": "demo", "uid": uid,
            "creation": "22/11/2026 09:00:00", "username": "demo-user",
            "config": {"name": "demo", "gpu_memory": null, "gpus": 1},
            "pids": [shell], "kernel_ids": []}]}))?,
    )?;
    std::fs::write(
        state.join("devices.json"),
        serde_json::to_string_pretty(&json!({"devices": [
            {"index": 0, "total_memory": "16384mi", "attachments": [{"eid": "demo", "gpu_memory": null, "time": "22/11/2026 09:00:00"}]},
            {"index": 1, "total_memory": "16384mi", "attachments": []}]}))?,
    )?;
    Ok(())
}

/// Lets one intruder open GPU 1, and says how long it lived after.
fn intrude(what: &str, child: &mut Child) -> Result<()> {
    std::thread::sleep(Duration::from_millis(300));
    println!("\n# {what} (pid {})", child.id());
    let opened = Instant::now();
    child.stdin.as_mut().unwrap().write_all(b"go\n")?;
    let status = sim::wait_exit(child, Duration::from_secs(30))?;
    let lived = opened.elapsed();
    std::thread::sleep(Duration::from_millis(100));
    println!(
        "  -> ended by {status} {:.1} ms after it was told to open (genv polls every 10 s)",
        lived.as_secs_f64() * 1e3
    );
    Ok(())
}
