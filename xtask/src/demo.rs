//! `cargo xtask demo`: the enforcer on a simulated GPU node, no GPU needed.
//!
//! Two fake GPUs (the test suite's fake NVML stands in for libnvidia-ml.so), a genv
//! environment attached to GPU 0 with one process on it, a process of that environment
//! straying onto GPU 1, and a rogue process outside any environment on GPU 1. The
//! enforcer runs one cycle, as `genv enforce --interval 0 --non-env-processes` would.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::json;

use crate::{cargo, run as run_command};

struct Proc {
    name: &'static str,
    child: Child,
}

pub fn run(root: &Path) -> Result<()> {
    run_command(&mut cargo(&[
        "build",
        "-q",
        "-p",
        "genv-enforcer",
        "-p",
        "fake-nvml",
    ]))?;
    let target = root.join("target/debug");
    let dir = std::env::temp_dir().join(format!("genv-enforcer-demo-{}", std::process::id()));
    let state = dir.join("genv");
    std::fs::create_dir_all(&state)?;

    let sleeper = |eid: Option<&str>| -> Result<Child> {
        let mut command = Command::new("sleep");
        command.arg("600").env_remove("GENV_ENVIRONMENT_ID");
        if let Some(eid) = eid {
            command.env("GENV_ENVIRONMENT_ID", eid);
        }
        command.spawn().context("starting a demo process")
    };
    let shell = sleeper(None)?;
    let mut procs = vec![
        Proc {
            name: "in env `demo` on its GPU 0",
            child: sleeper(Some("demo"))?,
        },
        Proc {
            name: "in env `demo` on GPU 1 (not attached)",
            child: sleeper(Some("demo"))?,
        },
        Proc {
            name: "outside any environment on GPU 1",
            child: sleeper(None)?,
        },
    ];
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
    std::fs::write(
        &nvml,
        json!({"devices": [
                {"uuid": "GPU-demo-0", "minor": 0, "total_memory": 16u64 << 30},
                {"uuid": "GPU-demo-1", "minor": 1, "total_memory": 16u64 << 30}],
               "processes": [
                {"pid": procs[0].child.id(), "gpu": 0, "used_memory": 512u64 << 20},
                {"pid": procs[1].child.id(), "gpu": 1, "used_memory": 512u64 << 20},
                {"pid": procs[2].child.id(), "gpu": 1, "used_memory": 1u64 << 30}]})
        .to_string(),
    )?;

    println!("Simulated GPU node in {}", dir.display());
    println!(
        "  GPUs: 0 and 1 (fake NVML: {})",
        target.join("libnvidia_ml_fake.so").display()
    );
    println!("  genv environment `demo` of user demo-user, attached to GPU 0");
    for p in &procs {
        println!("  process {:>7}: {}", p.child.id(), p.name);
    }
    println!("\n$ genv-enforcer enforce --interval 0 --non-env-processes");
    let start = Instant::now();
    let status = Command::new(target.join("genv-enforcer"))
        .args(["enforce", "--interval", "0", "--non-env-processes"])
        .env("GENV_TMPDIR", &state)
        .env("GENV_FAKE_NVML_CONFIG", &nvml)
        .env(
            "GENV_ENFORCER_NVML_LIB",
            target.join("libnvidia_ml_fake.so"),
        )
        .status()?;
    let elapsed = start.elapsed();
    std::thread::sleep(Duration::from_millis(100));
    println!(
        "\n(one cycle, {:.1} ms, exit {status})",
        elapsed.as_secs_f64() * 1e3
    );
    for p in &mut procs {
        let fate = match p.child.try_wait()? {
            Some(status) => format!("terminated ({status})"),
            None => "still running".to_owned(),
        };
        println!("  process {:>7} {}: {fate}", p.child.id(), p.name);
    }
    for mut child in procs.into_iter().map(|p| p.child).chain([shell]) {
        let _ = child.kill();
        let _ = child.wait();
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
