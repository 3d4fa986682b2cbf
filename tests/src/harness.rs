//! The waits and small helpers every suite (and `cargo xtask demo`) shares.
//!
//! A test never sleeps to show that something did not happen: it waits for a positive
//! event that comes after the moment the bad thing would have happened (a daemon
//! counter passing the event, a later line, a status published after it), then looks.
//! [`wait_for`] is that wait: it polls a condition until a deadline and, past it, fails
//! naming what it waited for.

use std::fmt::Display;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a wait for something that should come at once may take on these shared,
/// noisy machines. Speed is measured by the benchmarks, never here.
pub const PATIENCE: Duration = Duration::from_secs(30);
/// How long a process that should be killed or terminated may take to die, for the same
/// machines: a bound for the wait, never a figure a test asserts.
pub const DEATH: Duration = Duration::from_secs(30);

/// Polls `check` every `step` until it returns a value, or `timeout` passed (`None`).
/// The core of every wait here; a tool that times what it waits for picks a fine step.
pub fn poll<T>(
    timeout: Duration,
    step: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = check() {
            return Some(found);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(step);
    }
}

/// Polls `check` (every millisecond at first, backing off to every 100 ms) until it
/// returns a value; fails after `timeout` with "waited … for `what`".
pub fn wait_for<T>(what: impl Display, timeout: Duration, check: impl FnMut() -> Option<T>) -> T {
    wait_for_or(what, timeout, check, String::new)
}

/// [`wait_for`], whose failure also says what `now` says (the state reached, a log's end).
pub fn wait_for_or<T>(
    what: impl Display,
    timeout: Duration,
    mut check: impl FnMut() -> Option<T>,
    now: impl FnOnce() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    let mut step = Duration::from_millis(1);
    loop {
        if let Some(found) = check() {
            return found;
        }
        if Instant::now() >= deadline {
            let now = now();
            let sep = if now.is_empty() { "" } else { "; now " };
            panic!("waited {timeout:?} for {what}{sep}{now}");
        }
        std::thread::sleep(step);
        step = (step * 2).min(Duration::from_millis(100));
    }
}

/// [`wait_for`] a condition.
pub fn wait_until(what: impl Display, timeout: Duration, mut done: impl FnMut() -> bool) {
    wait_for(what, timeout, || done().then_some(()))
}

/// Waits up to `timeout` for `child` to exit.
pub fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    poll(timeout, Duration::from_millis(1), || {
        child.try_wait().unwrap()
    })
}

/// The end-to-end tests of one suite that must not run beside each other (each
/// daemon's probes see every process, a storm of events reaches every daemon): each
/// holds this while it runs. A test that failed holding it does not poison it.
pub fn serial() -> MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A path as the `&str` an argument list takes (test paths are UTF-8).
pub fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// The workspace's `xtask` binary (`cargo xtask …` without cargo).
pub fn xtask() -> Command {
    Command::new(crate::artefact("xtask"))
}

/// The lines `child`'s stdout and stderr print, as they come (one thread per stream:
/// a full pipe would stall it), each echoed after `echo` if given. The two streams'
/// relative order is lost.
pub fn lines_of(child: &mut Child, echo: Option<&'static str>) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let out = child
        .stdout
        .take()
        .map(|s| Box::new(s) as Box<dyn Read + Send>);
    let err = child
        .stderr
        .take()
        .map(|s| Box::new(s) as Box<dyn Read + Send>);
    for stream in [out, err].into_iter().flatten() {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if let Some(prefix) = echo {
                    println!("{prefix}{line}");
                }
                let _ = tx.send(line);
            }
        });
    }
    rx
}

/// Reads `lines` until one contains any of `needles`, within `timeout`: that line and
/// every line read, or `Err` with every line read.
pub fn until_line(
    lines: &mpsc::Receiver<String>,
    needles: &[&str],
    timeout: Duration,
) -> Result<(String, Vec<String>), Vec<String>> {
    let deadline = Instant::now() + timeout;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(line) = lines.recv_timeout(left) else {
            break;
        };
        if needles.iter().any(|n| line.contains(n)) {
            return Ok((line, seen));
        }
        seen.push(line);
    }
    Err(seen)
}

/// A process killed (and reaped) however the test ends.
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Holds an `flock` on `lock` with `flock(1)` (as `uid` if given, as any user can)
/// until dropped; returns once the kernel lists the lock as held. A file not there is
/// made as genv makes its lock, 0666.
pub fn hold_lock(lock: &Path, uid: Option<u32>) -> KillOnDrop {
    if !lock.exists() {
        std::fs::write(lock, "").unwrap();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o666);
        std::fs::set_permissions(lock, mode).unwrap();
    }
    let mut command = Command::new("flock");
    // --no-fork: flock(1) execs sleep itself, so killing it ends the holder (and the
    // lock) outright; no output, so nothing outlives the test on its pipes.
    command
        .arg("--no-fork")
        .arg(lock)
        .args(["sleep", "600"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if let Some(uid) = uid {
        std::os::unix::process::CommandExt::uid(&mut command, uid);
    }
    let holder = KillOnDrop(command.spawn().unwrap());
    let held = format!(" {} ", holder.0.id());
    wait_until(
        format_args!("flock to take {}", lock.display()),
        Duration::from_secs(10),
        || {
            std::fs::read_to_string("/proc/locks")
                .unwrap()
                .lines()
                .any(|l| l.contains(&held))
        },
    );
    holder
}

/// Makes a character device node `major:minor` at `path` (mode 0666), which needs root.
pub fn mknod_char(path: &Path, (major, minor): (u32, u32)) -> std::io::Result<()> {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    let dev = libc::makedev(major, minor);
    // SAFETY: a NUL-terminated path that lives across the call.
    match unsafe { libc::mknod(c_path.as_ptr(), libc::S_IFCHR | 0o666, dev) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Replaces `path` with `text` in one rename, so that a reader (the fake NVML re-reads
/// its configuration) never sees half of it.
pub fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let temporary = path.with_extension("new");
    std::fs::write(&temporary, text)?;
    std::fs::rename(&temporary, path)
}
