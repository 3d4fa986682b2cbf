//! `--bpf-log`'s cost on the open path, from the kernel's own statistics
//! (`kernel.bpf_stats_enabled=1`): a process in an environment attached to the test
//! GPU opens it 20,000 times under a daemon with the decision log off (the default)
//! and on. Off, the logging code is not loaded at all (the verifier removed it), which
//! the programs' loaded size shows.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::{Value, json};

use crate::sim;

const OPENS: u64 = 20_000;

pub fn run(release: &Path) -> Result<String> {
    sim::with_bpf_stats("bpf-log", |dir| measure(release, dir))
}

fn measure(release: &Path, dir: &Path) -> Result<String> {
    let gpu = dir.join("nvidia0");
    sim::make_test_node(&gpu)?;
    let nvml = dir.join("nvml.json");
    sim::write_nvml(
        &nvml,
        &json!({"devices": [{"uuid": "GPU-bench-0", "minor": 0, "total_memory": 16u64 << 30}],
                "processes": []}),
    )?;
    let envs = json!({"envs": [{
        "eid": "bench", "uid": 0, "creation": "23/11/2026 12:00:00", "username": "root",
        "config": {"name": null, "gpu_memory": null, "gpus": null},
        "pids": [std::process::id()], "kernel_ids": []}]});
    let devices = json!({"devices": [{"index": 0, "total_memory": "16384mi",
        "attachments": [{"eid": "bench", "gpu_memory": null, "time": "23/11/2026 12:00:00"}]}]});
    std::fs::write(dir.join("genv/envs.json"), envs.to_string())?;
    std::fs::write(dir.join("genv/devices.json"), devices.to_string())?;

    let mut table = format!(
        "\n## `--bpf-log` on the open path\n\n`cargo xtask bench`: a process in an environment attached to the test \
         GPU node opens it {OPENS} times; the open programs' runs and time over those opens from the kernel's \
         statistics (every other open in the system in that time counts too), and their size as loaded.\n\n\
         | `--bpf-log` | open program runs | ns/run | loaded bytes | `[BPF]` lines printed |\n|---|---:|---:|---:|---:|\n"
    );
    for log in [false, true] {
        table += &one_mode(release, dir, &nvml, &gpu, log)?;
    }
    Ok(table)
}

fn one_mode(release: &Path, dir: &Path, nvml: &Path, gpu: &Path, log: bool) -> Result<String> {
    let run_dir = dir.join(format!("run-{log}"));
    let mut flags = vec!["--interval", "3600", "--gpu-node", "1:7=0"];
    flags.extend(log.then_some("--bpf-log"));
    let (mut daemon, lines) = sim::start_event_daemon(release, dir, nvml, &run_dir, &flags)?;
    let before = open_programs(&status(&run_dir)?);
    let opener = Command::new("python3")
        .args([
            "-c",
            "import os, sys\nfor _ in range(int(sys.argv[2])): os.close(os.open(sys.argv[1], os.O_RDONLY))",
        ])
        .arg(gpu)
        .arg(OPENS.to_string())
        .env("GENV_ENVIRONMENT_ID", "bench")
        .status()?;
    if !opener.success() {
        bail!("the opener failed: {opener}");
    }
    // The status is rewritten within a second of a change; wait for every open counted.
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        let status = status(&run_dir)?;
        if status["counts"]["open_events"].as_u64().unwrap_or(0) >= OPENS {
            break open_programs(&status);
        }
        if Instant::now() > deadline {
            bail!("the daemon did not count {OPENS} GPU opens within 60 s: {status}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let printed = lines.try_iter().filter(|l| l.starts_with("[BPF]")).count();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let runs = after.0.saturating_sub(before.0);
    let ns = after.1.saturating_sub(before.1);
    Ok(format!(
        "| {} | {runs} | {:.0} | {} | {printed} |\n",
        if log { "on" } else { "off (default)" },
        ns as f64 / runs.max(1) as f64,
        after.2
    ))
}

fn status(run_dir: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(run_dir.join("status.json"))?;
    Ok(serde_json::from_str(&text)?)
}

/// The `open_*` programs' runs, run time (ns) and loaded bytes, summed.
fn open_programs(status: &Value) -> (u64, u64, u64) {
    let programs = status["programs"].as_array().cloned().unwrap_or_default();
    programs
        .iter()
        .filter(|p| p["name"].as_str().is_some_and(|n| n.starts_with("open_")))
        .fold((0, 0, 0), |(runs, ns, bytes), p| {
            let field = |k: &str| p[k].as_u64().unwrap_or(0);
            (
                runs + field("runs"),
                ns + field("run_time_ns"),
                bytes + field("translated_bytes"),
            )
        })
}
