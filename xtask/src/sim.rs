//! Pieces of a simulated GPU node the benchmarks share: a device node that opens
//! without a driver, the fake NVML's configuration, and the daemon's output. Each is
//! the test harness's own (`genv_enforcer_tests::harness`), with the tool's errors.

use std::path::Path;
use std::process::{Child, ExitStatus};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use genv_enforcer_tests::harness;
use serde_json::Value;

/// The device number that stands in for a GPU: `/dev/full`'s, which opens without an
/// NVIDIA driver (the tracepoint tier sees only successful opens).
pub const TEST_NODE: (u32, u32) = (1, 7);

pub fn make_test_node(path: &Path) -> Result<()> {
    harness::mknod_char(path, TEST_NODE).with_context(|| format!("mknod {}", path.display()))
}

/// Replaces the fake NVML's configuration atomically (the library re-reads it).
pub fn write_nvml(path: &Path, config: &Value) -> Result<()> {
    harness::write_atomically(path, &config.to_string())
        .with_context(|| format!("writing {}", path.display()))
}

/// The daemon's stdout and stderr as lines, echoed with `echo` as a prefix if given.
pub fn stream(daemon: &mut Child, echo: Option<&'static str>) -> mpsc::Receiver<String> {
    harness::lines_of(daemon, echo)
}

/// The first line containing any of `needles`, within `timeout`.
pub fn wait_line(
    lines: &mpsc::Receiver<String>,
    needles: &[&str],
    timeout: Duration,
) -> Result<String> {
    match harness::until_line(lines, needles, timeout) {
        Ok((line, _)) => Ok(line),
        Err(seen) => {
            let last = &seen[seen.len().saturating_sub(20)..];
            bail!(
                "the daemon printed no line with {needles:?} within {timeout:?}; its last lines: {last:#?}"
            )
        }
    }
}

/// Waits for `child` to exit, polling finely (the wait is what is being timed).
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Result<ExitStatus> {
    let exited = harness::poll(timeout, Duration::from_micros(100), || {
        child.try_wait().transpose()
    });
    match exited {
        Some(status) => Ok(status?),
        None => {
            let _ = child.kill();
            bail!(
                "process {} still running {timeout:?} after its open",
                child.id()
            )
        }
    }
}

/// Runs `measure` in a scratch directory made afresh (never through something already
/// there) with a `genv` state directory in it, and the kernel's BPF statistics on
/// (`kernel.bpf_stats_enabled=1`, put back as it was afterwards).
pub fn with_bpf_stats(name: &str, measure: impl FnOnce(&Path) -> Result<String>) -> Result<String> {
    const STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";
    let dir = std::env::temp_dir().join(format!("genv-enforcer-{name}-{}", std::process::id()));
    std::fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::create_dir(dir.join("genv"))?;
    let before = std::fs::read_to_string(STATS_SYSCTL).unwrap_or_else(|_| "0".into());
    std::fs::write(STATS_SYSCTL, "1").context("enabling kernel.bpf_stats_enabled")?;
    let result = measure(&dir);
    let _ = std::fs::write(STATS_SYSCTL, before.trim());
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// A release `genv-enforcer enforce --event-driven` on a simulated node (genv's state
/// under `dir/genv`, the fake NVML configured by `nvml`) with `extra` flags and its
/// status under `run_dir`; its stderr lines, once it watches GPU nodes.
pub fn start_event_daemon(
    release: &Path,
    dir: &Path,
    nvml: &Path,
    run_dir: &Path,
    extra: &[&str],
) -> Result<(Child, mpsc::Receiver<String>)> {
    let mut daemon = std::process::Command::new(release.join("genv-enforcer"))
        .args(["enforce", "--event-driven"])
        .args(extra)
        .arg("--run-dir")
        .arg(run_dir)
        .env("GENV_TMPDIR", dir.join("genv"))
        .env("GENV_FAKE_NVML_CONFIG", nvml)
        .env(
            "GENV_ENFORCER_NVML_LIB",
            release.join("libnvidia_ml_fake.so"),
        )
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()?;
    let lines = stream(&mut daemon, None);
    let needles = ["Watching GPU nodes"];
    let (line, seen) = match harness::until_line(&lines, &needles, Duration::from_secs(60)) {
        Ok(found) => found,
        Err(seen) => bail!("the daemon did not start; its lines: {seen:#?}"),
    };
    // The lines read meanwhile stay readable: the start's own lines (the caps held, the
    // libraries probed) may come before that one.
    let (again, replayed) = mpsc::channel();
    for line in seen.into_iter().chain([line]) {
        let _ = again.send(line);
    }
    std::thread::spawn(move || {
        for line in lines {
            if again.send(line).is_err() {
                return;
            }
        }
    });
    Ok((daemon, replayed))
}
