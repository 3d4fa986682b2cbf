//! A process whose `mmap_lock` its own user holds, through FUSE, as a hostile user can:
//! whoever then reads its `/proc/PID/environ`, `cmdline` or `smaps_rollup`, or
//! registers a uprobe in it, waits until the user lets go (see the `fuse-stall` helper
//! for how). Its `maps`, `stat` and `status` stay readable (on 6.18 `maps` is read
//! under per-VMA locks).
//!
//! A [`StallFuse`] is the user's FUSE server, mounted in a fresh directory; a holder
//! ([`holder_command`], [`hold_lock_in`]) maps its file and stalls on it. Dropping the
//! server (killing it) frees every waiter. A holder killed while its server lives cannot
//! finish dying: drop the server first (a `KillOnDrop` holder declared before the
//! server is dropped after it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use crate::harness::{lines_of, until_line};
use crate::{artefact, path};

/// A `fuse-stall serve` mount, owned by a user, whose file's pages never come (or come
/// late).
pub struct StallFuse {
    server: Child,
    dir: PathBuf,
}

impl StallFuse {
    /// A server for `uid` that never answers a READ.
    pub fn new(uid: u32) -> Self {
        Self::start(uid, None)
    }

    /// A server for `uid` that answers each READ `after` it came.
    pub fn answering_after(uid: u32, after: Duration) -> Self {
        Self::start(uid, Some(after))
    }

    fn start(uid: u32, after: Option<Duration>) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "fuse-stall-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir(&dir).unwrap();
        let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
        std::fs::set_permissions(&dir, mode).unwrap();
        let mut command = Command::new(artefact("fuse-stall"));
        command.args([
            "serve",
            "--mountpoint",
            path(&dir),
            "--uid",
            &uid.to_string(),
        ]);
        if let Some(after) = after {
            command.args(["--answer-after-ms", &after.as_millis().to_string()]);
        }
        command.stdin(Stdio::null()).stdout(Stdio::piped());
        let server = command.spawn().expect("starting fuse-stall serve");
        // Made before the wait, so that a failed start is cleaned up too.
        let mut fuse = Self { server, dir };
        let lines = lines_of(&mut fuse.server, None);
        if let Err(seen) = until_line(&lines, &["mounted"], Duration::from_secs(20)) {
            panic!("fuse-stall serve did not say `mounted` within 20 s; it said {seen:?}");
        }
        fuse
    }

    /// The mount's one file, `data` (1 MiB).
    pub fn file(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn mountpoint(&self) -> &Path {
        &self.dir
    }

    /// Kills the server `after` this (unless it is gone by then), whatever the test is
    /// waiting for: an enforcer that waits on a held process in the kernel, unkillable
    /// until the hold ends, then fails its test instead of hanging it.
    pub fn release_after(&self, after: Duration) {
        let pid = self.server.id() as i32;
        let started = start_time(self.server.id());
        std::thread::spawn(move || {
            std::thread::sleep(after);
            // The same server still (a pid reused meanwhile is left alone).
            if start_time(pid as u32) == started {
                // SAFETY: kill(2) of a child of this test, still that process.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        });
    }
}

impl Drop for StallFuse {
    fn drop(&mut self) {
        // The server's death aborts the connection: every held READ fails at once.
        let _ = self.server.kill();
        let _ = self.server.wait();
        let dir = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path alive across the call.
        unsafe { libc::umount2(dir.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// `fuse-stall hold` on `fuse`'s file, opening each of `opens` once the lock is held,
/// with its stdout piped (for [`wait_held`]). The caller sets the user (the server's)
/// and the environment.
pub fn holder_command(fuse: &StallFuse, opens: &[&Path]) -> Command {
    let mut command = Command::new(artefact("fuse-stall"));
    command.args(["hold", "--file", path(&fuse.file())]);
    for open in opens {
        command.args(["--open", path(open)]);
    }
    command.stdin(Stdio::null()).stdout(Stdio::piped());
    command
}

/// Spawns `command` (from [`holder_command`]) and returns once its `mmap_lock` is held.
pub fn hold_lock_in(command: &mut Command) -> Child {
    let mut child = command.spawn().expect("starting fuse-stall hold");
    wait_held(&mut child);
    child
}

/// Waits (20 s at most) for a holder to say `held`: its lock is held, a writer queued
/// behind, and its `--open`s done. Takes its stdout.
pub fn wait_held(child: &mut Child) {
    let lines = lines_of(child, Some("fuse-stall hold: "));
    if let Err(seen) = until_line(&lines, &["held"], Duration::from_secs(20)) {
        let status = child.try_wait().ok().flatten();
        panic!(
            "fuse-stall hold (pid {}) did not say `held` within 20 s (exit: {status:?}); it \
             said {seen:?}",
            child.id()
        );
    }
}

/// Whether a read of all of `path` is still waiting `within` after it started (it goes
/// on, on a thread left behind).
pub fn blocks_reading(path: &Path, within: Duration) -> bool {
    let (tx, rx) = mpsc::channel();
    let path = path.to_owned();
    std::thread::spawn(move || {
        let _ = tx.send(std::fs::read(path));
    });
    matches!(
        rx.recv_timeout(within),
        Err(mpsc::RecvTimeoutError::Timeout)
    )
}

/// A process's start time (`/proc/<pid>/stat`'s 22nd field), `None` once it is gone.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}
