//! `--memory-at-alloc`: what its probes cost on the allocation path, and the overshoot
//! they prevent, on the fake libcuda (`tests/fake-cuda`, a copy of its own here).
//!
//! - Cost: `cuda-user` makes 100,000 pairs of `cuMemAlloc_v2` (1 MiB) and
//!   `cuMemFree_v2` with no daemon, and under a daemon with `--memory-at-alloc kill`
//!   from inside an environment (a cap it never reaches: every charge, check and record
//!   runs) and from outside any (the breakpoints are there, the probes being
//!   registered system-wide, and the programs return at once; builds before this one
//!   placed none there). The probes' own run time
//!   comes from the kernel's statistics (`kernel.bpf_stats_enabled=1`).
//! - Overshoot: a process in an environment capped at 1g allocates 100 MiB every 20 ms,
//!   as a growing training job does, until it is stopped: by the memory rule after the
//!   fact (`--memory-at-alloc off`, the memory poll every second) or at the call
//!   (`kill`, and `refuse`, which returns out-of-memory where the kernel allows it and
//!   kills elsewhere, as the row says). How far past the cap it got, by the fake
//!   driver's account, and how long it ran past it; a refused program's cost of a
//!   refused call.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::sim;

const PAIRS: u64 = 100_000;
const CAP: u64 = 1_000_000_000;
const CHUNK: u64 = 100 << 20;
/// Processes carrying the probes meanwhile, for the row that measures what they add.
const OTHERS: usize = 20;
/// A uprobe's breakpoint (`int3`), as `cuda-user peek` reads it at a probed call.
const BREAKPOINT: u64 = 0xcc;

pub fn run(release: &Path) -> Result<String> {
    sim::with_bpf_stats("alloc", |dir| {
        std::fs::create_dir(dir.join("ledger"))?;
        measure(release, dir)
    })
}

struct Node<'a> {
    release: &'a Path,
    dir: &'a Path,
    nvml: std::path::PathBuf,
    lib: std::path::PathBuf,
}

fn measure(release: &Path, dir: &Path) -> Result<String> {
    let lib = dir.join("libcuda.so.1");
    std::fs::copy(release.join("libcuda_fake.so"), &lib)?;
    let nvml = dir.join("nvml.json");
    sim::write_nvml(
        &nvml,
        &json!({"devices": [{"uuid": "GPU-bench-0", "minor": 0, "total_memory": 16u64 << 30}],
                "processes": [], "ledger": dir.join("ledger")}),
    )?;
    let env = |eid: &str, cap: &str| {
        json!({"eid": eid, "uid": 0, "creation": "23/11/2026 12:00:00", "username": "root",
               "config": {"name": null, "gpu_memory": cap, "gpus": null},
               "pids": [std::process::id()], "kernel_ids": []})
    };
    let attached =
        |eid: &str| json!({"eid": eid, "gpu_memory": null, "time": "23/11/2026 12:00:00"});
    let envs = json!({"envs": [env("roomy", "1000g"), env("capped", "1g")]});
    let devices = json!({"devices": [{"index": 0, "total_memory": "16384mi",
        "attachments": [attached("roomy"), attached("capped")]}]});
    std::fs::write(dir.join("genv/envs.json"), envs.to_string())?;
    std::fs::write(dir.join("genv/devices.json"), devices.to_string())?;
    let node = Node {
        release,
        dir,
        nvml,
        lib,
    };
    Ok(format!("{}{}", cost(&node)?, overshoot(&node)?))
}

fn cost(node: &Node) -> Result<String> {
    let mut table = format!(
        "\n## `--memory-at-alloc`: the probes' cost per allocation call\n\n`cargo xtask bench`: {PAIRS} pairs of \
         `cuMemAlloc_v2` (1 MiB) and `cuMemFree_v2` on the fake libcuda (about 0.1 µs a call of its own); the \
         probes' run time from the kernel's statistics. A real `cuMemAlloc` takes tens of µs.\n\n\
         | caller | daemon | ns per alloc+free pair | added per call (ns) | probe runs | probe ns/run |\n\
         |---|---|---:|---:|---:|---:|\n"
    );
    let bare = pairs_ns(node, None, false)?;
    table += &format!("| in an environment | none | {bare:.0} | - | - | - |\n");
    let run_dir = node.dir.join("run-cost");
    let (mut daemon, _lines) = daemon(node, &run_dir, "kill", &["--memory-interval", "1"])?;
    for (caller, eid) in [
        ("in an environment (cap not reached)", Some("roomy")),
        ("outside any environment", None),
    ] {
        let before = probes(&run_dir)?;
        let ns = pairs_ns(node, eid, true)?;
        std::thread::sleep(Duration::from_millis(1500)); // the status file's next write
        let after = probes(&run_dir)?;
        let runs = after.0.saturating_sub(before.0);
        let run_ns = after.1.saturating_sub(before.1);
        table += &format!(
            "| {caller} | `--memory-at-alloc kill` | {ns:.0} | {:.0} | {runs} | {:.0} |\n",
            (ns - bare) / 2.0,
            run_ns as f64 / runs.max(1) as f64
        );
    }
    // What each other process carrying the probes adds to a hit (the kernel's filter
    // walks one perf event per process of the uprobe's).
    let mut others = Vec::new();
    for _ in 0..OTHERS {
        let mut other = CudaUser::start(node, Some("roomy"), false)?;
        wait_until_carrying(&mut other, Some("roomy"))?;
        others.push(other);
    }
    let before = probes(&run_dir)?;
    let ns = pairs_ns(node, Some("roomy"), true)?;
    std::thread::sleep(Duration::from_millis(1500));
    let after = probes(&run_dir)?;
    let runs = after.0.saturating_sub(before.0);
    table += &format!(
        "| in an environment, {OTHERS} other processes carrying the probes | `--memory-at-alloc kill` | {ns:.0} | {:.0} | {runs} | {:.0} |\n",
        (ns - bare) / 2.0,
        after.1.saturating_sub(before.1) as f64 / runs.max(1) as f64
    );
    drop(others);
    let _ = daemon.kill();
    let _ = daemon.wait();
    Ok(table)
}

/// Returns once `user` has the probes' breakpoints if its environment (`eid`) has a cap
/// (both of the bench's have). Outside any environment nothing is waited for: this
/// build places them in every process that maps libcuda at its `mmap` (the programs
/// return at once for it); a build from before placed them only in capped processes.
fn wait_until_carrying(user: &mut CudaUser, eid: Option<&str>) -> Result<()> {
    if eid.is_none() {
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    // A `cuda-user` from before `peek` (another build's, measured side by side)
    // answers `unknown`: that build's daemon probed every process alike.
    while let Some(answer) = user
        .call("peek cuMemAlloc_v2")?
        .filter(|a| a.starts_with("ok "))
    {
        if answer == format!("ok {BREAKPOINT:#x}") {
            break;
        }
        if Instant::now() > deadline {
            bail!("the process in {eid:?} has no breakpoint after 10 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Mean nanoseconds per alloc+free pair, after a warm-up. Under a daemon
/// (`daemon`), once the process carries the probes if its environment has a cap, and
/// making sure it does not otherwise.
fn pairs_ns(node: &Node, eid: Option<&str>, daemon: bool) -> Result<f64> {
    let mut user = CudaUser::start(node, eid, false)?;
    if daemon {
        wait_until_carrying(&mut user, eid)?;
    }
    for call in ["init", "ctx 0", "loop 1000"] {
        user.ok(call)?;
    }
    let total = user.ok(&format!("loop {PAIRS}"))?;
    Ok(total as f64 / PAIRS as f64)
}

fn overshoot(node: &Node) -> Result<String> {
    let mut table = String::from(
        "\n## `--memory-at-alloc`: overshoot past a 1g cap\n\nA process in an environment capped at 1g \
         allocates 100 MiB every 20 ms until it is stopped; how far past the cap it got by the fake driver's \
         account, and how long it ran once past it.\n\n\
         | stopped by | overshoot (bytes) | ran past the cap (ms) | how |\n|---|---:|---:|---|\n",
    );
    for mode in ["off", "kill", "refuse"] {
        let run_dir = node.dir.join(format!("run-{mode}"));
        let (mut daemon, _lines) = daemon(node, &run_dir, mode, &[])?;
        let mut user = CudaUser::start(node, Some("capped"), true)?;
        if mode != "off" {
            // What a real program's CUDA start-up (hundreds of ms) gives the daemon:
            // this one would otherwise reach its first allocation within the
            // millisecond the daemon takes to have it carry the probes.
            wait_until_carrying(&mut user, Some("capped"))?;
        }
        user.ok("init")?;
        user.ok("ctx 0")?;
        let (mut granted, mut crossed, mut refused) = (0u64, None, false);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            match user.call("alloc 100")? {
                Some(answer) if answer.starts_with("ok ") => granted += CHUNK,
                Some(answer) if mode == "refuse" && answer == "err 2" => {
                    refused = true;
                    break;
                }
                Some(answer) => bail!("alloc 100: {answer}"),
                None => break,
            }
            if granted > CAP && crossed.is_none() {
                crossed = Some(Instant::now());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let ran_past = crossed.map_or(0.0, |at| at.elapsed().as_secs_f64() * 1000.0);
        let how = how_stopped(mode, refused, &mut user, &run_dir)?;
        if refused {
            // It lives on, which is the point: ended here.
            let _ = user.child.kill();
        }
        let status = user.child.wait()?;
        let counted = mode == "off" || counted_at_alloc(&run_dir, refused);
        let _ = daemon.kill();
        let _ = daemon.wait();
        if !counted {
            bail!("--memory-at-alloc {mode}: the daemon did not count its stop ({status})");
        }
        table += &format!(
            "| `--memory-at-alloc {mode}` | {} | {ran_past:.0} | {how} |\n",
            granted.saturating_sub(CAP)
        );
    }
    Ok(table)
}

fn daemon(
    node: &Node,
    run_dir: &Path,
    mode: &str,
    extra: &[&str],
) -> Result<(Child, mpsc::Receiver<String>)> {
    let lib = node.lib.to_str().context("library path")?;
    let mut flags = vec!["--interval", "3600", "--memory-at-alloc", mode];
    if mode != "off" {
        flags.extend(["--cuda-lib", lib]);
    }
    flags.extend(extra);
    let (daemon, lines) =
        sim::start_event_daemon(node.release, node.dir, &node.nvml, run_dir, &flags)?;
    if mode != "off" {
        sim::wait_line(
            &lines,
            &["caps held at the allocation: capped 1g"],
            Duration::from_secs(30),
        )?;
    }
    Ok((daemon, lines))
}

/// How the bench's program was stopped, for the table.
fn how_stopped(mode: &str, refused: bool, user: &mut CudaUser, run_dir: &Path) -> Result<String> {
    Ok(match (mode, refused) {
        ("off", _) => "the memory rule at its next poll (SIGTERM)".to_owned(),
        (_, true) => refusal_cost(user)?,
        ("refuse", false) => format!(
            "SIGKILL in the allocation call: this kernel cannot refuse, so refuse is kill here ({})",
            status_field(run_dir, "memory_at_alloc")
        ),
        _ => "SIGKILL in the allocation call".to_owned(),
    })
}

/// The program lives past the refusal: what a refused call costs it, measured over
/// 1,000 more.
fn refusal_cost(user: &mut CudaUser) -> Result<String> {
    const TRIES: u64 = 1000;
    let ns = user.ok(&format!("refusals {TRIES} 100"))?;
    Ok(format!(
        "CUDA_ERROR_OUT_OF_MEMORY from the call, which never ran; the program lives ({:.0} ns per refused call)",
        ns as f64 / TRIES as f64
    ))
}

/// A field of the daemon's status, as text.
fn status_field(run_dir: &Path, field: &str) -> String {
    let status = std::fs::read_to_string(run_dir.join("status.json")).unwrap_or_default();
    let status: Value = serde_json::from_str(&status).unwrap_or_default();
    status[field].as_str().unwrap_or("not in status").to_owned()
}

/// Whether the daemon's status counts a kill (or, `refused`, a refusal) at the
/// allocation (the status file is rewritten within seconds of a change).
fn counted_at_alloc(run_dir: &Path, refused: bool) -> bool {
    let counter = match refused {
        true => "refused_at_alloc",
        false => "killed_at_alloc",
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let status = std::fs::read_to_string(run_dir.join("status.json")).unwrap_or_default();
        let status: Value = serde_json::from_str(&status).unwrap_or_default();
        if status["counts"][counter].as_u64().unwrap_or(0) > 0 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// The probe programs' runs and run time (ns), summed, from the status file.
fn probes(run_dir: &Path) -> Result<(u64, u64)> {
    let status: Value =
        serde_json::from_str(&std::fs::read_to_string(run_dir.join("status.json"))?)?;
    let programs = status["programs"].as_array().cloned().unwrap_or_default();
    Ok(programs
        .iter()
        .filter(|p| p["name"].as_str().is_some_and(|n| n.starts_with("cu_mem_")))
        .fold((0, 0), |(runs, ns), p| {
            (
                runs + p["runs"].as_u64().unwrap_or(0),
                ns + p["run_time_ns"].as_u64().unwrap_or(0),
            )
        }))
}

/// `cuda-user` on the bench's libcuda, in `eid` (or outside any environment).
struct CudaUser {
    child: Child,
    stdin: ChildStdin,
    answers: mpsc::Receiver<String>,
}

impl CudaUser {
    fn start(node: &Node, eid: Option<&str>, ledger: bool) -> Result<Self> {
        let mut command = Command::new(node.release.join("cuda-user"));
        command
            .env("GENV_FAKE_CUDA_LIB", &node.lib)
            .env("CUDA_VISIBLE_DEVICES", "0")
            .env_remove("GENV_ENVIRONMENT_ID")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(eid) = eid {
            command.env("GENV_ENVIRONMENT_ID", eid);
        }
        if ledger {
            command.env("GENV_FAKE_CUDA_LEDGER", node.dir.join("ledger"));
        }
        let mut child = command.spawn().context("starting cuda-user")?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = child.stdout.take().context("stdout")?;
        let (tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut user = Self {
            child,
            stdin,
            answers,
        };
        match user.answer() {
            Some(line) if line.starts_with("ready") => Ok(user),
            other => bail!("cuda-user did not start: {other:?}"),
        }
    }

    fn answer(&mut self) -> Option<String> {
        self.answers.recv_timeout(Duration::from_secs(60)).ok()
    }

    /// The answer to one call; `None` once the process is gone.
    fn call(&mut self, call: &str) -> Result<Option<String>> {
        if writeln!(self.stdin, "{call}").is_err() {
            return Ok(None);
        }
        let _ = self.stdin.flush();
        Ok(self.answer())
    }

    fn ok(&mut self, call: &str) -> Result<u64> {
        match self.call(call)? {
            Some(answer) if answer.starts_with("ok ") => {
                let hex = answer["ok 0x".len()..].trim();
                Ok(u64::from_str_radix(hex, 16)?)
            }
            other => bail!("{call}: {other:?}"),
        }
    }
}

impl Drop for CudaUser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
