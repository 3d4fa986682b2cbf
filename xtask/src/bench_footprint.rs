//! The daemon's footprint on a node: the share of one core it takes over a minute, and
//! its resident memory, with no GPU process and with 1,000, next to genv's own daemon
//! (`genv enforce --interval 1`, genv 1.4.3) on the same simulated node.
//!
//! With none, the node is fresh (no environment: idle). The 1,000 are real processes in
//! one environment, attached to the GPU and listed in the fake NVML, with a memory cap
//! (so the memory poll runs every second over all of them): nothing to act on, every
//! check still made. genv-enforcer runs with its
//! defaults (`--event-driven`, 10 s full cycle, 1 s memory poll) on this host's tier.
//! CPU is the kernel's own account: every thread's `schedstat` for genv-enforcer; for
//! genv, user and system time with that of the `nvidia-smi` it runs every second.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::sim;

const WINDOW: Duration = Duration::from_secs(60);
/// Left to the daemon after its start, before the window (its first full cycle, the
/// identity seeding, the first memory polls).
const SETTLE: Duration = Duration::from_secs(5);
const PROCESSES: usize = 1000;
const MIB: u64 = 1 << 20;

/// One row: who, how many GPU processes, and what it took.
struct Row {
    who: &'static str,
    processes: usize,
    core_percent: f64,
    rss_mib: f64,
    peak_mib: f64,
}

pub fn run(release: &Path, venv: &Path) -> Result<String> {
    let dir = std::env::temp_dir().join(format!("genv-enforcer-footprint-{}", std::process::id()));
    // Made afresh (never through something already there), then its state directory.
    std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::create_dir(dir.join("genv"))?;
    let result = measure(release, venv, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(release: &Path, venv: &Path, dir: &Path) -> Result<String> {
    let nvml = dir.join("nvml.json");
    let mut rows = Vec::new();
    let mut sleepers: Vec<Child> = Vec::new();
    for processes in [0, PROCESSES] {
        write_node(dir, &nvml, &sleepers)?;
        rows.push(ours(release, dir, &nvml, processes)?);
        // `GENV_BENCH_NO_GENV`: genv's rows left out (when comparing two builds of ours).
        if std::env::var_os("GENV_BENCH_NO_GENV").is_none() {
            rows.push(genvs(venv, dir, &nvml, processes)?);
        }
        // The 1,000 for the second round.
        while sleepers.len() < PROCESSES {
            sleepers.push(
                Command::new("sleep")
                    .arg("3600")
                    .env("GENV_ENVIRONMENT_ID", "bench")
                    .spawn()?,
            );
        }
    }
    for mut sleeper in sleepers {
        let _ = sleeper.kill();
        let _ = sleeper.wait();
    }
    let mut table = format!(
        "\n## Footprint\n\n`cargo xtask bench`: each daemon alone on the simulated node (one GPU, fake NVML), \
         measured over {}s after {}s to settle. 0: a fresh node, no environment. {PROCESSES}: real processes in one \
         environment attached to the GPU, listed in NVML, under a memory cap (the memory poll runs every second). genv-enforcer with its defaults on this host's \
         tier; genv 1.4.3's own daemon at `--interval 1`.\n\n\
         | daemon | GPU processes | CPU (% of one core) | RSS | peak RSS |\n|---|---:|---:|---:|---:|\n",
        WINDOW.as_secs(),
        SETTLE.as_secs()
    );
    for row in rows {
        table.push_str(&format!(
            "| {} | {} | {:.3} % | {:.1} MiB | {:.1} MiB |\n",
            row.who, row.processes, row.core_percent, row.rss_mib, row.peak_mib
        ));
    }
    Ok(table)
}

/// genv's state and the fake NVML. Without sleepers, a fresh node: no environment.
/// With them, environment `bench` (root's, 1000 GiB cap) on GPU 0, each sleeper listed
/// on it with 1 MiB.
fn write_node(dir: &Path, nvml: &Path, sleepers: &[Child]) -> Result<()> {
    let shell = std::process::id();
    let (envs, attachments) = match sleepers.is_empty() {
        true => (json!([]), json!([])),
        false => (
            json!([{
                "eid": "bench", "uid": 0, "creation": "23/11/2026 12:00:00", "username": "root",
                "config": {"name": null, "gpu_memory": "1000g", "gpus": null},
                "pids": [shell], "kernel_ids": []}]),
            json!([{"eid": "bench", "gpu_memory": null, "time": "23/11/2026 12:00:00"}]),
        ),
    };
    let envs = json!({ "envs": envs });
    let devices = json!({"devices": [{"index": 0, "total_memory": "16384mi",
        "attachments": attachments}]});
    std::fs::write(dir.join("genv/envs.json"), envs.to_string())?;
    std::fs::write(dir.join("genv/devices.json"), devices.to_string())?;
    let processes: Vec<Value> = sleepers
        .iter()
        .map(|s| json!({"pid": s.id(), "gpu": 0, "used_memory": MIB}))
        .collect();
    let config = json!({"devices": [{"uuid": "GPU-bench-0", "minor": 0, "total_memory": 16u64 << 30}],
                        "processes": processes});
    sim::write_nvml(nvml, &config)
}

fn ours(release: &Path, dir: &Path, nvml: &Path, processes: usize) -> Result<Row> {
    let run_dir = dir.join(format!("run-{processes}"));
    let (mut daemon, lines) = sim::start_event_daemon(release, dir, nvml, &run_dir, &[])?;
    let row = window(
        &mut daemon,
        "genv-enforcer --event-driven",
        processes,
        thread_cpu,
    );
    let said: Vec<String> = lines
        .try_iter()
        .filter(|l| l.contains("Terminat"))
        .collect();
    let _ = daemon.kill();
    let _ = daemon.wait();
    if !said.is_empty() {
        bail!("the footprint run acted on its own processes: {said:?}");
    }
    row
}

fn genvs(venv: &Path, dir: &Path, nvml: &Path, processes: usize) -> Result<Row> {
    let support = crate::root().join("tests/support");
    let path = format!(
        "{}:{}:{}",
        support.display(),
        venv.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut genv = Command::new(venv.join("bin/genv"))
        .args(["enforce", "--interval", "1"])
        .env("PATH", path)
        .env("GENV_TMPDIR", dir.join("genv"))
        .env("GENV_FAKE_NVML_CONFIG", nvml)
        .env("GENV_TERMINATE_PROCESSES", "0")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting genv enforce")?;
    let row = window(
        &mut genv,
        "genv enforce --interval 1",
        processes,
        with_children_cpu,
    );
    let _ = genv.kill();
    let _ = genv.wait();
    row
}

/// Lets `child` settle, then takes its CPU over [`WINDOW`] with `cpu_ns`, and its
/// memory at the end.
fn window(
    child: &mut Child,
    who: &'static str,
    processes: usize,
    cpu_ns: fn(u32) -> Result<u64>,
) -> Result<Row> {
    std::thread::sleep(SETTLE);
    let pid = child.id();
    let (before, at) = (cpu_ns(pid)?, Instant::now());
    std::thread::sleep(WINDOW);
    let used = cpu_ns(pid)?.saturating_sub(before);
    if let Some(status) = child.try_wait()? {
        bail!("{who} exited during the footprint window: {status}");
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| -> f64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok(Row {
        who,
        processes,
        core_percent: used as f64 / at.elapsed().as_nanos() as f64 * 100.0,
        rss_mib: kib("VmRSS:") / 1024.0,
        peak_mib: kib("VmHWM:") / 1024.0,
    })
}

/// Nanoseconds every thread of `pid` has run (the kernel's `schedstat`).
fn thread_cpu(pid: u32) -> Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let stat = std::fs::read_to_string(task?.path().join("schedstat")).unwrap_or_default();
        total += stat
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Ok(total)
}

/// Nanoseconds of user and system time of `pid` and of its children it has reaped.
fn with_children_cpu(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command name's closing parenthesis: state is field 3; utime, stime,
    // cutime and cstime are fields 14 to 17.
    let rest = stat.rsplit_once(") ").context("/proc/<pid>/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11..15]
        .iter()
        .filter_map(|f| f.parse::<u64>().ok())
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Ok(ticks * 1_000_000_000 / hz)
}
