//! What the event-driven daemon publishes about itself in `<run-dir>/status.json`, and
//! `genv-enforcer status`, which prints it.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::clock::unix_now;
use crate::exit_code::{NOT_RUNNING, STUCK};
use crate::kernel::ProgramStats;
use crate::snapshot::Orphan;

pub const FILE: &str = "status.json";
/// How old the file's `updated` may get while nothing else in it changes: an idle
/// daemon rewrites it this often instead of every second (a write and a rename per
/// second is most of an idle daemon's cost).
pub const HEARTBEAT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Status {
    pub pid: u32,
    /// Seconds since the epoch.
    pub started: u64,
    pub updated: u64,
    /// The open tier in use; `None` when no BPF could be loaded (full cycle alone).
    pub tier: Option<String>,
    /// What the tier sees, in words.
    pub sees: String,
    /// Better tiers the kernel refused, with why.
    pub refused: Vec<String>,
    /// The loaded programs, with the kernel's run statistics when
    /// `kernel.bpf_stats_enabled` is 1.
    pub programs: Vec<ProgramStats>,
    /// The watched GPU nodes, `MAJOR:MINOR=GPUn`.
    pub gpu_nodes: String,
    /// What happens to a GPU open outside any environment, in words.
    pub guarantee: String,
    pub interval_s: f64,
    pub memory_interval_s: f64,
    pub counts: Counts,
    /// GPU processes of environments genv dropped, left running (`--orphans leave`), as
    /// the last full cycle saw them.
    #[serde(default)]
    pub orphans: Vec<Orphan>,
    /// The NVML library loaded (where the node keeps it: `/usr/local/nvidia/lib64` on
    /// some), if any.
    #[serde(default)]
    pub nvml: Option<String>,
    /// The tools allowed to open GPU nodes outside environments, as found.
    #[serde(default)]
    pub allowed: String,
    /// What inotify watches for genv's state files.
    #[serde(default)]
    pub watching: Option<String>,
    /// The last full cycle's figures.
    #[serde(default)]
    pub last_cycle: Option<LastCycle>,
    /// What users were told: decisions recorded, log records held back, terminal lines.
    #[serde(default)]
    pub told: crate::notify::ToldCounts,
    /// Reads of processes' address spaces waiting past their deadline now (their owners
    /// hold them; see `backends::address_space`), as of the last full cycle.
    #[serde(default)]
    pub address_spaces_held: usize,
    /// `--memory-at-alloc`: a registration of the libcuda probes has been waiting on the
    /// kernel for over a second (see `kernel::cuda::registrar`).
    #[serde(default)]
    pub probes_registration_stalled: bool,
    /// `--memory-at-alloc`: what an allocation past a cap meets (`refuse`, or `kill`
    /// with the kernel's reason where refuse was asked for and cannot be kept); absent
    /// when off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_at_alloc: Option<String>,
    /// `--deny` is armed in the kernel's policy (after the first mirror of genv's
    /// environments); false without `--deny`, without programs, or where arming failed.
    #[serde(default)]
    pub deny_in_force: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct LastCycle {
    /// Seconds since the epoch.
    pub at: u64,
    pub took_ms: f64,
    pub gpu_processes: usize,
    pub findings: usize,
    pub terminated: usize,
    pub detached: usize,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct Counts {
    pub exec_events: u64,
    pub fork_events: u64,
    pub exit_events: u64,
    pub open_events: u64,
    /// Events the ring buffer had no room for (each loss triggers a full cycle).
    pub lost_events: u64,
    pub full_cycles: u64,
    pub open_checks: u64,
    pub memory_checks: u64,
    pub state_changes: u64,
    pub terminated: u64,
    pub detached: u64,
    /// In-kernel decisions reported as events.
    pub refused: u64,
    pub killed: u64,
    /// The kernel's own counts of the same (exact even when events were lost).
    pub refused_in_kernel: u64,
    pub killed_in_kernel: u64,
    /// `bpf_send_signal` failures (the open returned to a process that should have died).
    pub kill_failed_in_kernel: u64,
    /// Processes outside environments killed for holding a GPU node opened by a
    /// process the kernel killed (a shared file table).
    pub killed_holders: u64,
    /// Identities the kernel could not record (its map full); each leads to a
    /// resynchronisation.
    pub identity_lost_in_kernel: u64,
    /// Runs of the GPU-open programs, and of the exec, fork and exit hooks, the kernel
    /// skipped (its recursion guard: `crate::kernel::skipped_runs`); each look that
    /// finds some sweeps (`--deny`) and resynchronises.
    #[serde(default)]
    pub skipped_open_runs: u64,
    #[serde(default)]
    pub skipped_lifecycle_runs: u64,
    /// Unresolved identities the full cycle read from `/proc` (a lost exec event, a child
    /// forked before its parent was resolved).
    pub identities_resolved: u64,
    /// Processes the kernel had no identity for, recorded by the full cycle.
    pub identities_seeded: u64,
    /// `--memory-at-alloc`: processes seen starting CUDA, and allocations past a cap
    /// (killed in the call, or reported).
    #[serde(default)]
    pub cuda_starts: u64,
    #[serde(default)]
    pub killed_at_alloc: u64,
    #[serde(default)]
    pub reported_at_alloc: u64,
    /// Allocations past a cap that returned out-of-memory (`--memory-at-alloc refuse`),
    /// every one, said or held back, as the kernel counts them.
    #[serde(default)]
    pub refused_at_alloc: u64,
}

/// `genv-enforcer status`; with `max_age`, a status older than that many seconds is a
/// stuck daemon's.
pub fn show(run_dir: &Path, max_age: Option<u64>) -> Result<ExitCode> {
    let path = run_dir.join(FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            println!(
                "genv-enforcer is not running in event-driven mode (no {})",
                path.display()
            );
            return Ok(ExitCode::from(NOT_RUNNING));
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let status: Status = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a status file", path.display()))?;
    if !crate::backends::procfs::pid_exists(status.pid as i32) {
        println!(
            "genv-enforcer is not running: {} is left from pid {}, which is gone",
            path.display(),
            status.pid
        );
        return Ok(ExitCode::from(NOT_RUNNING));
    }
    let age = unix_now().saturating_sub(status.updated);
    if let Some(max_age) = max_age.filter(|max_age| age > *max_age) {
        println!(
            "genv-enforcer pid {} is stuck: it last wrote {} {age} s ago (more than --max-age {max_age}; it rewrites it every {} s at least)",
            status.pid,
            path.display(),
            HEARTBEAT.as_secs()
        );
        return Ok(ExitCode::from(STUCK));
    }
    print(&status);
    Ok(ExitCode::SUCCESS)
}

fn print(status: &Status) {
    println!("genv-enforcer pid {} (event-driven)", status.pid);
    match &status.tier {
        Some(tier) => println!("tier: {tier}: sees {}", status.sees),
        None => println!("tier: none: {}", status.sees),
    }
    for refused in &status.refused {
        println!("refused: {refused}");
    }
    for p in &status.programs {
        let cost = match p.runs {
            0 => String::new(),
            runs => format!(", {runs} runs, {} ns/run", p.run_time_ns / runs),
        };
        let verified = match (p.verified_insns, p.translated_bytes) {
            (0, _) => String::new(),
            (n, 0) => format!(", {n} instructions verified"),
            (n, bytes) => format!(", {n} instructions verified, {bytes} bytes loaded"),
        };
        println!("program {} (id {}{verified}){cost}", p.name, p.id);
    }
    println!("gpu nodes: {}", status.gpu_nodes);
    print_sources(status);
    print_rest(status);
}

/// NVML, the tools allowed, what is watched, the last cycle.
fn print_sources(status: &Status) {
    println!("nvml: {}", status.nvml.as_deref().unwrap_or("not loaded"));
    println!("allowed outside environments: {}", status.allowed);
    println!(
        "watching: {}",
        status
            .watching
            .as_deref()
            .unwrap_or("nothing (genv's state directory is polled by the full cycle)")
    );
    if let Some(last) = &status.last_cycle {
        println!(
            "last full cycle: {:.2} ms, {} GPU processes, {} findings, {} terminated, {} detached",
            last.took_ms, last.gpu_processes, last.findings, last.terminated, last.detached
        );
    }
}

/// Intervals, counts, orphans.
fn print_rest(status: &Status) {
    let c = &status.counts;
    println!("outside any environment: {}", status.guarantee);
    println!(
        "interval: {}s full cycle, {}s memory poll",
        status.interval_s, status.memory_interval_s
    );
    println!(
        "events: {} exec, {} fork, {} exit, {} open, {} lost",
        c.exec_events, c.fork_events, c.exit_events, c.open_events, c.lost_events
    );
    println!(
        "checks: {} full, {} after opens, {} memory, {} state changes",
        c.full_cycles, c.open_checks, c.memory_checks, c.state_changes
    );
    println!(
        "actions: {} terminated, {} detached",
        c.terminated, c.detached
    );
    let t = &status.told;
    let lines = &t.terminals;
    println!(
        "told: {} decisions ({} log records held back); terminal lines: {} written, {} held back, {} to a full terminal, {} refused, {} dropped",
        t.decisions,
        t.logs_held_back,
        lines.written,
        lines.held_back,
        lines.terminal_full,
        lines.refused,
        lines.queue_full
    );
    for o in &status.orphans {
        // The id is a user's (envs.json): escaped as genv's lines are.
        crate::genv_lines::print(&format!(
            "orphan: process {} of uid {} in environment {}, which genv dropped (left running)",
            o.pid, o.uid, o.eid
        ));
    }
    println!(
        "in the kernel: {} refused, {} killed ({} and {} reported as events)",
        c.refused_in_kernel, c.killed_in_kernel, c.refused, c.killed
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run directory whose status file says `pid`, written `age` seconds ago.
    fn run_dir(name: &str, pid: u32, age: u64) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("genv-status-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let status = Status {
            pid,
            updated: unix_now() - age,
            ..Status::default()
        };
        std::fs::write(dir.join(FILE), serde_json::to_string(&status).unwrap()).unwrap();
        dir
    }

    #[test]
    fn a_status_older_than_max_age_is_a_stuck_daemons() {
        let me = std::process::id();
        let old = run_dir("old", me, 100);
        assert_eq!(show(&old, Some(60)).unwrap(), ExitCode::from(STUCK));
        assert_eq!(show(&old, Some(120)).unwrap(), ExitCode::SUCCESS);
        // Without --max-age, any age will do.
        assert_eq!(show(&old, None).unwrap(), ExitCode::SUCCESS);
        let fresh = run_dir("fresh", me, 0);
        assert_eq!(show(&fresh, Some(20)).unwrap(), ExitCode::SUCCESS);
        // A dead daemon's file: not running, however fresh.
        let dead = run_dir("dead", i32::MAX.unsigned_abs(), 0);
        assert_eq!(show(&dead, Some(20)).unwrap(), ExitCode::from(NOT_RUNNING));
        for dir in [old, fresh, dead] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
