//! `cargo xtask demo`: the event-driven enforcer on a simulated GPU node, no GPU needed.
//!
//! Two fake GPUs (the test suite's fake NVML stands in for libnvidia-ml.so), a genv
//! environment attached to GPU 0 with a process on it, and a device node standing in for
//! GPU 1 (`/dev/full`'s number, which opens without an NVIDIA driver). The enforcer runs
//! `enforce --event-driven --non-env-processes`; then a rogue process outside any
//! environment opens GPU 1, and a process of the environment strays onto it. The demo
//! shows the daemon's lines and measures how long each intruder lived after its open.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::sim;

const GPU1_NODE: &str = "1:7=1";

pub fn run(root: &Path) -> Result<()> {
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "the demo loads kernel programs and makes a device node: run `sudo -E cargo xtask demo`"
        );
    }
    crate::toolchain::ensure_ebpf_toolchain()?;
    crate::build_node_artefacts(&["-q"])?;
    let target = root.join("target/debug");
    let dir = std::env::temp_dir().join(format!("genv-enforcer-demo-{}", std::process::id()));
    let state = dir.join("genv");
    std::fs::create_dir_all(&state)?;
    let result = demo(&target, &dir, &state);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn demo(target: &Path, dir: &Path, state: &Path) -> Result<()> {
    let gpu1 = dir.join("nvidia1");
    sim::make_test_node(&gpu1)?;
    let helper = |eid: Option<&str>| -> Result<(Child, ChildStdout)> {
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
    };
    // (Their stdout stays open: they print `opened` after opening.)
    let (mut shell, _shell_out) = helper(None)?;
    let (mut worker, _worker_out) = helper(Some("demo"))?;
    let (mut rogue, _rogue_out) = helper(None)?;
    let (mut stray, _stray_out) = helper(Some("demo"))?;
    let uid = unsafe { libc::getuid() };
    std::fs::write(
        state.join("envs.json"),
        serde_json::to_string_pretty(&json!({"envs": [{"eid": "demo", "uid": uid,
            "creation": "22/11/2026 09:00:00", "username": "demo-user",
            "config": {"name": "demo", "gpu_memory": null, "gpus": 1},
            "pids": [shell.id()], "kernel_ids": []}]}))?,
    )?;
    std::fs::write(
        state.join("devices.json"),
        serde_json::to_string_pretty(&json!({"devices": [
            {"index": 0, "total_memory": "16384mi", "attachments": [{"eid": "demo", "gpu_memory": null, "time": "22/11/2026 09:00:00"}]},
            {"index": 1, "total_memory": "16384mi", "attachments": []}]}))?,
    )?;
    let nvml = dir.join("nvml.json");
    let context = |child: &Child, gpu: u32| json!({"pid": child.id(), "gpu": gpu, "used_memory": 512u64 << 20});
    let nvml_config = |processes: Vec<Value>| {
        let config = json!({"devices": [
                {"uuid": "GPU-demo-0", "minor": 0, "total_memory": 16u64 << 30},
                {"uuid": "GPU-demo-1", "minor": 1, "total_memory": 16u64 << 30}],
            "processes": processes});
        sim::write_nvml(&nvml, &config)
    };
    nvml_config(vec![context(&worker, 0)])?;

    println!("Simulated GPU node in {}", dir.display());
    println!(
        "  GPUs 0 and 1 (fake NVML); {} stands in for GPU 1's device node",
        gpu1.display()
    );
    println!("  genv environment `demo` of user demo-user, attached to GPU 0");
    println!("  process {:>7}: in `demo`, on GPU 0", worker.id());
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
    println!("\n$ genv-enforcer {} {}/run", args.join(" "), dir.display());
    let mut daemon = Command::new(target.join("genv-enforcer"))
        .args(args)
        .arg(dir.join("run"))
        .env("GENV_TMPDIR", state)
        .env("GENV_FAKE_NVML_CONFIG", &nvml)
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
    // The intruders become GPU processes before they open, so that what is measured is
    // the enforcer's reaction to the open, not CUDA's start-up.
    nvml_config(vec![
        context(&worker, 0),
        context(&rogue, 1),
        context(&stray, 1),
    ])?;

    for (what, child) in [
        ("a process outside any environment opens GPU 1", &mut rogue),
        (
            "a process of `demo` opens GPU 1, not attached to it",
            &mut stray,
        ),
    ] {
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
    }
    std::thread::sleep(Duration::from_millis(300));
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
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let status = daemon.wait()?;
    std::thread::sleep(Duration::from_millis(100));
    println!("  (daemon exited: {status})");
    for child in [&mut shell, &mut worker, &mut rogue, &mut stray] {
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(())
}
