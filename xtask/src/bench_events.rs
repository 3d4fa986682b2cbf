//! The event-driven benchmark: how fast the daemon acts on a GPU open, and what its
//! kernel programs cost per run.
//!
//! A release daemon (`--event-driven --non-env-processes`, full cycle hourly) watches a
//! test node standing in for GPU 0. One at a time, 100 intruders are listed in the fake
//! NVML and then told to open the node; for each, the daemon's own figure (open → SIGTERM
//! sent, both on CLOCK_MONOTONIC) and the wall time until the intruder is reaped. Then
//! opens and execs run with the programs attached, and the kernel's statistics
//! (`kernel.bpf_stats_enabled=1` for the run) give each program's cost ([`bench_kernel`]).
//!
//! Then `--deny`: an outside process forks 10,000 children that each try to open the
//! node once; on this host's tracepoint tier each must die inside the open. The same loop
//! runs on the LSM, fmod_ret and fentry tiers in the VM, on Debian's 6.1 kernel (the first of
//! `cargo xtask vm-test`'s kernels; one is enough for counts).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::sim;

// Declared here, not in main.rs: it is this benchmark's second half.
#[path = "bench_kernel.rs"]
mod bench_kernel;

const INTRUDERS: usize = 100;
const ATTEMPTS: u32 = 10_000;
const STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

pub fn run(target: &Path) -> Result<String> {
    if !rustix::process::geteuid().is_root() {
        bail!("the event-driven benchmark loads kernel programs: run it as root");
    }
    let before = std::fs::read_to_string(STATS_SYSCTL).unwrap_or_else(|_| "0".into());
    std::fs::write(STATS_SYSCTL, "1").context("enabling kernel.bpf_stats_enabled")?;
    let dir =
        std::env::temp_dir().join(format!("genv-enforcer-bench-events-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("genv"))?;
    let result = measure(target, &dir);
    let _ = std::fs::write(STATS_SYSCTL, before.trim());
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(target: &Path, dir: &Path) -> Result<String> {
    let gpu = dir.join("nvidia0");
    sim::make_test_node(&gpu)?;
    let nvml = dir.join("nvml.json");
    write_bench_nvml(&nvml, json!([]))?;
    let run_dir = dir.join("run");
    let (mut daemon, lines, tier) = start_daemon(
        target,
        dir,
        &nvml,
        "run",
        &["--verbose"],
        "Watching GPU nodes",
    )?;
    let (reacted_ms, gone_ms) = reactions(target, &gpu, &nvml, &lines)?;
    let title = format!("Event-driven reaction ({tier} tier)");
    // The reaction alone, for runs beside a load of one's own (what sets its tail).
    if std::env::var_os("GENV_BENCH_REACTION_ONLY").is_some() {
        // SAFETY: kill(2) takes no pointer; the daemon is this benchmark's child.
        unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
        daemon.wait()?;
        return Ok(reaction_table(&title, reacted_ms, gone_ms));
    }
    write_bench_nvml(&nvml, json!([]))?;
    let load = bench_kernel::BackgroundLoad::run(&run_dir)?;
    let status = bench_kernel::fresh_status(&run_dir)?;
    let by_size = bench_kernel::exec_rows(&run_dir)?;
    // SAFETY: kill(2) takes no pointer; the daemon is this benchmark's child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    daemon.wait()?;
    let without_nvml = reaction_without_nvml(target, dir, &gpu, &nvml)?;
    let host_loop = attempt_loop(target, dir, &gpu, &nvml)?;

    let mut table = reaction_table(&title, reacted_ms, gone_ms);
    table += &without_nvml;
    table += &bench_kernel::programs_table(&load, &status)?;
    table += &by_size;
    table += &format!(
        "\n## `--deny`: {ATTEMPTS} open attempts by a process outside any environment\n\n\
         One process of an unprivileged user (root is let through unless `--deny-root`) forks {ATTEMPTS} children one after the other; each opens the test GPU node once and, if the \
         open returns to it, says so through a pipe. The LSM, fmod_ret and fentry rows come from the VM \
         (`cargo xtask vm-test --kernel 6.1`, TCG: counts, not times).\n\n\
         | tier | attempts | open returned | open succeeded | killed in the open |\n|---|---|---|---|---|\n"
    );
    table += &host_loop;
    table += &vm_attempt_loops()?;
    Ok(table)
}

/// The same reaction on a node where NVML does not load (`--nvml-lib` missing, the node
/// named by `--gpu-node`): GPU use then comes from the opener's descriptors.
fn reaction_without_nvml(target: &Path, dir: &Path, gpu: &Path, nvml: &Path) -> Result<String> {
    let missing = "/nonexistent/libnvidia-ml.so.1";
    let (mut daemon, lines, tier) = start_daemon(
        target,
        dir,
        nvml,
        "run-no-nvml",
        &["--verbose", "--nvml-lib", missing],
        "Watching GPU nodes",
    )?;
    let (reacted_ms, gone_ms) = reactions(target, gpu, nvml, &lines)?;
    // SAFETY: kill(2) takes no pointer; the daemon is this benchmark's child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    daemon.wait()?;
    let title = format!("Event-driven reaction without NVML ({tier} tier, `--nvml-lib {missing}`)");
    Ok(reaction_table(&title, reacted_ms, gone_ms))
}

/// The reaction table: the daemon's own figure and the wall time, in ms.
fn reaction_table(title: &str, mut reacted_ms: Vec<f64>, mut gone_ms: Vec<f64>) -> String {
    let mut table = format!(
        "\n## {title}\n\n\
         `cargo xtask bench`: {INTRUDERS} intruders, one at a time, each listed in the fake NVML and then opening the \
         test GPU node; release build.\n\n\
         | measure | median | p99 | max |\n|---|---|---|---|\n"
    );
    for (what, samples) in [
        (
            "open → SIGTERM sent (daemon, CLOCK_MONOTONIC)",
            &mut reacted_ms,
        ),
        (
            "told to open → reaped (wall, includes the open itself)",
            &mut gone_ms,
        ),
    ] {
        samples.sort_by(f64::total_cmp);
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
        table += &format!(
            "| {what} | {:.2} ms | {:.2} ms | {:.2} ms |\n",
            at(0.5),
            at(0.99),
            samples[samples.len() - 1]
        );
    }
    table
}

fn write_bench_nvml(nvml: &Path, processes: Value) -> Result<()> {
    let config = json!({"devices": [{"uuid": "GPU-bench-0", "minor": 0, "total_memory": 16u64 << 30}],
                        "processes": processes});
    sim::write_nvml(nvml, &config)
}

/// {INTRUDERS} intruders, one at a time, each listed in the fake NVML and then opening
/// the node: the daemon's reaction time (open → SIGTERM, as it reports it) and the
/// wall time until each is reaped.
fn reactions(
    target: &Path,
    gpu: &Path,
    nvml: &Path,
    lines: &mpsc::Receiver<String>,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut reacted_ms = Vec::new();
    let mut gone_ms = Vec::new();
    for _ in 0..INTRUDERS {
        let mut intruder = Command::new(target.join("gpu-process"))
            .args(["--wait-stdin", "--open", gpu.to_str().unwrap()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .env_remove("GENV_ENVIRONMENT_ID")
            .spawn()?;
        let mut out = BufReader::new(intruder.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line)?;
        write_bench_nvml(
            nvml,
            json!([{"pid": intruder.id(), "gpu": 0, "used_memory": 1u64 << 30}]),
        )?;
        let start = Instant::now();
        intruder.stdin.as_mut().unwrap().write_all(b"go\n")?;
        sim::wait_exit(&mut intruder, Duration::from_secs(30))?;
        gone_ms.push(start.elapsed().as_secs_f64() * 1e3);
        let acted = wait_line(lines, &format!("Acted on process {} ", intruder.id()))?;
        let ms: f64 = acted
            .split(" ms after")
            .next()
            .and_then(|head| head.rsplit(' ').next())
            .and_then(|n| n.parse().ok())
            .context("parsing the daemon's reaction time")?;
        reacted_ms.push(ms);
    }
    Ok((reacted_ms, gone_ms))
}

/// A release daemon on the simulated node (`--event-driven --non-env-processes`, the
/// test node as GPU 0, full cycle hourly) with `extra` flags; its stderr lines and tier,
/// once it printed `ready`.
fn start_daemon(
    target: &Path,
    dir: &Path,
    nvml: &Path,
    run_dir: &str,
    extra: &[&str],
    ready: &str,
) -> Result<(std::process::Child, mpsc::Receiver<String>, String)> {
    let mut daemon = Command::new(target.join("genv-enforcer"))
        .args(["enforce", "--event-driven", "--non-env-processes"])
        .args(extra)
        .args(["--interval", "3600", "--gpu-node", "1:7=0", "--run-dir"])
        .arg(dir.join(run_dir))
        .env("GENV_TMPDIR", dir.join("genv"))
        .env("GENV_FAKE_NVML_CONFIG", nvml)
        .env(
            "GENV_ENFORCER_NVML_LIB",
            target.join("libnvidia_ml_fake.so"),
        )
        .env_remove("GENV_TERMINATE_PROCESSES")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    let lines = sim::stream(&mut daemon, None);
    let tier = wait_line(&lines, "Event-driven on the ")?;
    let tier = tier.split("Event-driven on the ").nth(1).unwrap_or("");
    let tier = tier.split(' ').next().unwrap_or("").to_owned();
    wait_line(&lines, ready)?;
    Ok((daemon, lines, tier))
}

/// The uid the attempt loop runs as: `nobody`.
const NOBODY: u32 = 65_534;

/// The attempt loop against a `--deny` daemon on this host; its table row.
fn attempt_loop(target: &Path, dir: &Path, gpu: &Path, nvml: &Path) -> Result<String> {
    let (mut daemon, _lines, tier) = start_daemon(
        target,
        dir,
        nvml,
        "run-deny",
        &["--deny"],
        "GPU opens outside any environment are ",
    )?;
    // As an unprivileged user: --deny lets root through unless --deny-root.
    let mut attempts = Command::new(target.join("gpu-process"));
    std::os::unix::process::CommandExt::uid(&mut attempts, NOBODY);
    let output = attempts
        .args(["--attempts", &ATTEMPTS.to_string()])
        .arg(gpu)
        .env_remove("GENV_ENVIRONMENT_ID")
        .output()?;
    // SAFETY: kill(2) takes no pointer; the daemon is this benchmark's child.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    daemon.wait()?;
    let said = String::from_utf8_lossy(&output.stdout);
    let figures: Vec<u64> = said
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let [attempts, returned, succeeded, killed] = figures[..] else {
        bail!("the attempt loop said {said:?}");
    };
    Ok(format!(
        "| {tier} (this host) | {attempts} | {returned} | {succeeded} | {killed} |\n"
    ))
}

/// The same loop on the LSM, fmod_ret and fentry tiers, in the VM: the prevention
/// suite's test prints it as
/// `[attempt loop] tier=… attempts=… returned=… succeeded=… killed=…`.
fn vm_attempt_loops() -> Result<String> {
    // `cargo xtask bench events` alone (a side-by-side run of two builds) can leave
    // the VM out: its rows are counts, the same on both.
    if std::env::var_os("GENV_BENCH_NO_VM").is_some() {
        return Ok("| (VM tiers: not run, GENV_BENCH_NO_VM) | | | | |\n".to_owned());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let options = crate::vm::Options::parse(&[
        "--kernel".into(),
        crate::vm::KERNELS[0].version.into(),
        "--".into(),
        "--exact".into(),
        "tier_thousands_of_attempts_from_outside_get_the_gpu_only_through_skipped_runs".into(),
    ])?;
    let outcome = crate::vm::test(root, &options)?;
    if !outcome.passed() {
        bail!(
            "the attempt loop failed in the VM: {}",
            outcome.failures().join("; ")
        );
    }
    let mut rows = String::new();
    for line in outcome.console() {
        let Some(rest) = line.strip_prefix("[attempt loop] ") else {
            continue;
        };
        let field = |name: &str| {
            rest.split_whitespace()
                .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
                .unwrap_or("?")
                .to_owned()
        };
        rows += &format!(
            "| {} (VM) | {} | {} | {} | {} |\n",
            field("tier"),
            field("attempts"),
            field("returned"),
            field("succeeded"),
            field("killed")
        );
    }
    Ok(rows)
}

fn wait_line(lines: &mpsc::Receiver<String>, needle: &str) -> Result<String> {
    sim::wait_line(lines, &[needle], Duration::from_secs(60))
}
