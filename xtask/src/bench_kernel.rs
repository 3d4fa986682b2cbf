//! What the kernel programs cost per run, from the kernel's own statistics
//! (`kernel.bpf_stats_enabled=1`, which `bench_events` turns on), as the daemon's status
//! file reports them: each program after opens and execs of a realistic kind, then the
//! exec hook per environment-block size, with `GENV_ENVIRONMENT_ID` last and with none
//! (then the whole block is read).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

const BACKGROUND_OPENS: usize = 100_000;
const EXECS: usize = 2_000;
/// Execs per environment-block size in the `proc_exec` rows.
const SIZED_EXECS: usize = 500;
/// 0: no variable but the identity (or none at all), the exec hook's floor here: what
/// it costs besides reading the block (the task's fields, the identity stored, the
/// event to the daemon), as `proc_exit`, which reads no block, costs its own floor.
const SIZES_KIB: [usize; 5] = [0, 2, 4, 16, 64];

/// Opens of `/dev/null` and of a regular file, and execs with this process's
/// environment, for the programs' per-run costs.
pub struct BackgroundLoad {
    open_close_ns: f64,
    env_vars: usize,
    env_bytes: usize,
    /// `open_exit_at`'s runs and ns over the regular-file opens alone.
    file_opens: (u64, u64),
    /// This process's descriptor slots (`FDSize`): past 64, a grown table.
    slots: u32,
    /// The same over opens of a regular file and of `/dev/null` from a thread with the
    /// kernel's embedded table.
    embedded: [(u64, u64); 2],
}

impl BackgroundLoad {
    /// Runs the load; `run_dir` is the daemon's, whose status gives the costs.
    pub fn run(run_dir: &Path) -> Result<Self> {
        let started = Instant::now();
        for _ in 0..BACKGROUND_OPENS {
            drop(std::fs::File::open("/dev/null")?);
        }
        let open_close_ns = started.elapsed().as_nanos() as f64 / BACKGROUND_OPENS as f64;
        let before = stats(&fresh_status(run_dir)?, &["open_exit_at"]);
        for _ in 0..BACKGROUND_OPENS {
            drop(std::fs::File::open("/etc/hostname")?);
        }
        let after = stats(&fresh_status(run_dir)?, &["open_exit_at"]);
        let embedded = [
            embedded_table_opens(run_dir, "/etc/hostname")?,
            embedded_table_opens(run_dir, "/dev/null")?,
        ];
        let environment = with_id(std::env::vars().collect(), true);
        exec_true(&environment, EXECS)?;
        Ok(Self {
            open_close_ns,
            env_vars: environment.len(),
            env_bytes: block_bytes(&environment),
            file_opens: (after.0 - before.0, after.1 - before.1),
            slots: slots("self")?,
            embedded,
        })
    }
}

/// The table of every program's runs, time and verified instructions.
pub fn programs_table(load: &BackgroundLoad, status: &Value) -> Result<String> {
    let BackgroundLoad {
        open_close_ns,
        env_vars,
        env_bytes,
        file_opens,
        slots,
        embedded,
    } = load;
    let mut table = format!(
        "\n## Kernel programs\n\nThe kernel's own statistics (`kernel.bpf_stats_enabled=1`) after the runs above, \
         {BACKGROUND_OPENS} opens of `/dev/null` (open+close took {open_close_ns:.0} ns each with the programs \
         attached), {BACKGROUND_OPENS} of a regular file, and {EXECS} execs of `/bin/true` with {env_vars} \
         environment variables ({env_bytes} bytes, `GENV_ENVIRONMENT_ID` last). The `open_*` programs run on every \
         open in the system; a regular file returns after its device number (0), a device after the number's \
         lookup, and a GPU node is decided on. `proc_exec` reads the environment block of every exec. \
         Verified: the instructions the verifier processed to accept the program (its budget is 1,000,000).\n\n\
         | program | runs | ns/run | verified |\n|---|---|---|---|\n"
    );
    for program in status["programs"].as_array().context("status: programs")? {
        let runs = program["runs"].as_u64().unwrap_or(0);
        let ns = program["run_time_ns"].as_u64().unwrap_or(0);
        table += &format!(
            "| {} | {runs} | {} | {} |\n",
            program["name"].as_str().unwrap_or("?"),
            per_run(runs, ns),
            program["verified_insns"].as_u64().unwrap_or(0)
        );
    }
    table += &format!(
        "\n`open_exit_at` over the regular-file opens alone: {} ns/run (this process's descriptor table has \
         {slots} slots{}). From a thread with the kernel's embedded table (64 slots, read by direct loads: a \
         process that never had a descriptor past 63, nor had its parent at the fork), {BACKGROUND_OPENS} opens \
         each: a regular file {} ns/run, `/dev/null` {} ns/run.\n",
        per_run(file_opens.0, file_opens.1),
        if *slots > 64 {
            ", grown: read through probe reads"
        } else {
            ""
        },
        per_run(embedded[0].0, embedded[0].1),
        per_run(embedded[1].0, embedded[1].1),
    );
    Ok(table)
}

/// `open_exit_at`'s runs and ns over {BACKGROUND_OPENS} opens of `path` from a thread
/// whose descriptor table is the kernel's embedded one, whatever this process inherited:
/// `close_range(3, ~0, CLOSE_RANGE_UNSHARE)` gives a thread sharing its process's table
/// a copy of descriptors 0–2 alone, which fits in it.
fn embedded_table_opens(run_dir: &Path, path: &str) -> Result<(u64, u64)> {
    const CLOSE_RANGE_UNSHARE: u32 = 1 << 1;
    let before = stats(&fresh_status(run_dir)?, &["open_exit_at"]);
    let path = std::ffi::CString::new(path)?;
    std::thread::spawn(move || -> Result<()> {
        // SAFETY: close_range(2) on this thread's own copy of the table (UNSHARE), whose
        // descriptors past 2 it never uses; no pointers.
        if unsafe { libc::syscall(libc::SYS_close_range, 3, u32::MAX, CLOSE_RANGE_UNSHARE) } != 0 {
            bail!("close_range: {}", std::io::Error::last_os_error());
        }
        if slots("thread-self")? != 64 {
            bail!("a thread's fresh descriptor table is not the embedded one");
        }
        for _ in 0..BACKGROUND_OPENS {
            // SAFETY: a NUL-terminated path alive across the call; the descriptor is
            // closed at once.
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                bail!("open: {}", std::io::Error::last_os_error());
            }
            // SAFETY: the descriptor just opened, ours alone.
            unsafe { libc::close(fd) };
        }
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the embedded-table thread panicked"))??;
    let after = stats(&fresh_status(run_dir)?, &["open_exit_at"]);
    Ok((after.0 - before.0, after.1 - before.1))
}

/// `FDSize` of `/proc/<which>/status` (`self` or `thread-self`): its table's slots.
fn slots(which: &str) -> Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{which}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("FDSize:"))
        .and_then(|n| n.trim().parse().ok())
        .context("FDSize in /proc/<pid>/status")
}

/// `proc_exec`'s cost per exec by block size: this process's environment repeated
/// (names made unique) up to each size, `GENV_ENVIRONMENT_ID` last or absent.
pub fn exec_rows(run_dir: &Path) -> Result<String> {
    let exec_hook = ["proc_exec", "proc_exec_4k"];
    let mut rows = format!(
        "\n`proc_exec` by environment-block size ({SIZED_EXECS} execs of `/bin/true` each; this process's \
         variables repeated up to the size; ns per exec):\n\n\
         | block | `GENV_ENVIRONMENT_ID` last | none (the block read whole) |\n|---|---|---|\n"
    );
    let mut last = stats(&fresh_status(run_dir)?, &exec_hook);
    for kib in SIZES_KIB {
        let mut row = format!("| {kib} KiB |");
        for id in [true, false] {
            exec_true(&with_id(sized(kib * 1024), id), SIZED_EXECS)?;
            let now = stats(&fresh_status(run_dir)?, &exec_hook);
            row += &format!(" {} |", per_run(now.0 - last.0, now.1 - last.1));
            last = now;
        }
        rows += &row;
        rows.push('\n');
    }
    Ok(rows)
}

/// This process's variables, repeated with numbered names until the block (with the
/// variable added) is about `bytes` long.
fn sized(bytes: usize) -> Vec<(String, String)> {
    let base: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k != "GENV_ENVIRONMENT_ID")
        .collect();
    let mut environment = Vec::new();
    let mut size = "GENV_ENVIRONMENT_ID=bench-env\0".len();
    'fill: for round in 0.. {
        for (k, v) in &base {
            if size >= bytes {
                break 'fill;
            }
            let name = if round == 0 {
                k.clone()
            } else {
                format!("{k}_{round}")
            };
            size += name.len() + v.len() + 2;
            environment.push((name, v.clone()));
        }
    }
    environment
}

/// `environment` without `GENV_ENVIRONMENT_ID`, and with it last if `id`.
fn with_id(environment: Vec<(String, String)>, id: bool) -> Vec<(String, String)> {
    let mut environment: Vec<_> = environment
        .into_iter()
        .filter(|(k, _)| k != "GENV_ENVIRONMENT_ID")
        .collect();
    if id {
        environment.push(("GENV_ENVIRONMENT_ID".into(), "bench-env".into()));
    }
    environment
}

fn block_bytes(environment: &[(String, String)]) -> usize {
    environment.iter().map(|(k, v)| k.len() + v.len() + 2).sum()
}

fn exec_true(environment: &[(String, String)], times: usize) -> Result<()> {
    for _ in 0..times {
        let status = Command::new("/bin/true")
            .env_clear()
            .envs(environment.iter().cloned())
            .status()?;
        if !status.success() {
            bail!("/bin/true failed");
        }
    }
    Ok(())
}

/// Runs and run time of the first of `names` the status lists.
fn stats(status: &Value, names: &[&str]) -> (u64, u64) {
    let programs = status["programs"].as_array().cloned().unwrap_or_default();
    programs
        .iter()
        .find(|p| names.iter().any(|n| p["name"] == *n))
        .map(|p| {
            let runs = p["runs"].as_u64().unwrap_or(0);
            (runs, p["run_time_ns"].as_u64().unwrap_or(0))
        })
        .unwrap_or((0, 0))
}

fn per_run(runs: u64, ns: u64) -> String {
    if runs == 0 {
        return "-".into();
    }
    format!("{:.0}", ns as f64 / runs as f64)
}

/// The daemon's status file, once it has been rewritten after now (it says the second
/// it was written, and is rewritten about once a second while events come).
pub fn fresh_status(run_dir: &Path) -> Result<Value> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status: Value =
            serde_json::from_str(&std::fs::read_to_string(run_dir.join("status.json"))?)?;
        if status["updated"].as_u64().unwrap_or(0) > now {
            return Ok(status);
        }
        if Instant::now() > deadline {
            bail!("the daemon's status file was not rewritten within 30 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
