//! One full enforcement cycle (lock, NVML, `/proc`, state files, rules, report) with
//! 0, 100, 1,000 and 10,000 GPU processes on a simulated node. Run through `cargo xtask bench`,
//! which builds the fake NVML and writes the table to docs/bench.md.
//!
//! Every process is real (a `sleep` in environment `bench`, attached to its device), so
//! `/proc/<pid>/environ` and `/proc/<pid>/stat` are really read; nothing is found, so
//! the cycle measures observation and judgement, not signalling. The fake NVML lists
//! them without asking whether they run (they all do), as the driver knows its contexts.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use genv_enforcer::actions::{Executor, ExecutorConfig};
use genv_enforcer::cycle::{Enforcer, LockPolicy};
use genv_enforcer::rules::Rules;
use genv_enforcer::snapshot::{EnvPolicy, SnapshotBuilder};
use genv_enforcer::state::StateDir;
use serde_json::json;

const ITERATIONS: usize = 200;

fn main() {
    // As `genv-enforcer enforce` does: one stat descriptor per GPU process.
    let mut limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    limit.current = limit.maximum;
    let _ = rustix::process::setrlimit(rustix::process::Resource::Nofile, limit);
    let lib = std::env::var_os("GENV_ENFORCER_NVML_LIB").expect("run through `cargo xtask bench`");
    let dir = std::env::temp_dir().join(format!("genv-enforcer-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let uid = rustix::process::getuid().as_raw();
    let shell = Command::new("sleep").arg("3600").spawn().unwrap();
    std::fs::write(
        dir.join("envs.json"),
        json!({"envs": [{"eid": "bench", "uid": uid, "creation": "22/11/2026 00:00:00", "username": "bench",
            "config": {"name": null, "gpu_memory": "1000g", "gpus": 8}, "pids": [shell.id()], "kernel_ids": []}]})
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("devices.json"),
        json!({"devices": (0..8).map(|i| json!({"index": i, "total_memory": "81920mi",
            "attachments": [{"eid": "bench", "gpu_memory": null, "time": "22/11/2026 00:00:00"}]})).collect::<Vec<_>>()})
        .to_string(),
    )
    .unwrap();
    let config = dir.join("nvml.json");
    // SAFETY: single-threaded at this point; the fake NVML reads it on load.
    unsafe { std::env::set_var("GENV_FAKE_NVML_CONFIG", &config) };

    println!("# Benchmark: one full enforcement cycle\n");
    println!(
        "Simulated node: 8 GPUs (fake NVML), every process real and in an attached environment."
    );
    println!(
        "{ITERATIONS} cycles per row, after one warm-up cycle. Reproduce with `cargo xtask bench`.\n"
    );
    println!("| GPU processes | median | p99 | max |");
    println!("|---:|---:|---:|---:|");
    let mut children: Vec<Child> = Vec::new();
    for count in [0usize, 100, 1000, 10_000] {
        while children.len() < count {
            children.push(
                Command::new("sleep")
                    .arg("3600")
                    .env("GENV_ENVIRONMENT_ID", "bench")
                    .spawn()
                    .unwrap(),
            );
        }
        let processes: Vec<_> = children
            .iter()
            .enumerate()
            .map(|(i, c)| json!({"pid": c.id(), "gpu": i % 8, "used_memory": 1 << 20}))
            .collect();
        let devices: Vec<_> = (0..8)
            .map(|i| json!({"uuid": format!("GPU-bench-{i}"), "minor": i, "total_memory": 80u64 << 30}))
            .collect();
        std::fs::write(
            &config,
            json!({"devices": devices, "processes": processes, "assume_live": true}).to_string(),
        )
        .unwrap();

        let mut enforcer = Enforcer {
            builder: SnapshotBuilder::new(StateDir::new(&dir), lib.clone(), EnvPolicy::default()),
            rules: Rules::default(),
            executor: Executor::new(ExecutorConfig {
                dry_run: true,
                signals: false,
                kill_after: None,
            }),
            lock: LockPolicy::blocking(),
        };
        let warm = enforcer.cycle();
        assert_eq!(warm.processes, count, "every process is seen");
        assert_eq!(warm.findings, 0);
        let mut times: Vec<Duration> = (0..ITERATIONS)
            .map(|_| {
                let start = Instant::now();
                enforcer.cycle();
                start.elapsed()
            })
            .collect();
        times.sort();
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        println!(
            "| {count} | {} | {} | {} |",
            ms(times[ITERATIONS / 2]),
            ms(times[ITERATIONS * 99 / 100]),
            ms(times[ITERATIONS - 1])
        );
    }
    for mut child in children.into_iter().chain([shell]) {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
