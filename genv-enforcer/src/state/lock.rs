//! genv's global lock: `flock(LOCK_EX)` on `$GENV_TMPDIR/genv.lock`.
//!
//! genv opens the file with `O_RDWR|O_CREAT|O_TRUNC`, mode 0666 under umask 0, after
//! creating the directory 0777. Every user's genv takes this lock, so whatever we create
//! must stay writable by everyone: a 0644 lock file made by a root daemon would lock
//! ordinary users out of genv. Unlike genv we never truncate it and never open it
//! through a link (see `safe_open`): the directory is everyone's to write, so the name
//! may point anywhere. Truncation buys nothing; the lock is the `flock`, not the content.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::fs::{FlockOperation, flock};
use rustix::io::Errno;

use super::safe_open::{Access, Dir, OpenError, Refusal};

pub const LOCK_FILE: &str = "genv.lock";

/// Between two attempts of [`GlobalLock::acquire_within`]: short next to genv's own
/// critical sections (a snapshot, a detach), cheap next to a check.
const POLL: Duration = Duration::from_millis(5);

#[derive(Debug, thiserror::Error)]
#[error("{}: {kind}", path.display())]
pub struct LockError {
    /// The lock file, or the state directory when that is what failed.
    pub path: PathBuf,
    pub kind: LockErrorKind,
}

#[derive(Debug, thiserror::Error)]
pub enum LockErrorKind {
    /// Something genv never puts there (a link, a FIFO, ...).
    #[error("{0}")]
    Refused(Refusal),
    /// The directory or the file could not be created or opened.
    #[error("cannot open: {0}")]
    Open(#[source] io::Error),
    /// `flock` itself failed.
    #[error("cannot lock: {0}")]
    Lock(#[source] io::Error),
    /// [`GlobalLock::acquire_within`] gave up.
    #[error("held by another process{} for more than {}", holder_text(*.holder), seconds(*.waited))]
    Held {
        waited: Duration,
        holder: Option<u32>,
    },
}

impl LockError {
    fn new(path: &Path, kind: LockErrorKind) -> Self {
        Self {
            path: path.to_owned(),
            kind,
        }
    }

    fn opening(path: &Path, error: OpenError) -> Self {
        let kind = match error {
            OpenError::Refused(refusal) => LockErrorKind::Refused(refusal),
            OpenError::Io(error) => LockErrorKind::Open(error),
        };
        Self::new(path, kind)
    }
}

/// For callers that report any I/O failure alike (the cycle, the CLI): the message keeps
/// the path and the reason, the kind keeps the system's error where there is one.
impl From<LockError> for io::Error {
    fn from(error: LockError) -> Self {
        let kind = match &error.kind {
            LockErrorKind::Open(e) | LockErrorKind::Lock(e) => e.kind(),
            LockErrorKind::Refused(_) => io::ErrorKind::InvalidData,
            LockErrorKind::Held { .. } => io::ErrorKind::TimedOut,
        };
        io::Error::new(kind, error)
    }
}

fn holder_text(holder: Option<u32>) -> String {
    holder
        .map(|pid| format!(" (pid {pid})"))
        .unwrap_or_default()
}

fn seconds(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

/// Held while alive; dropping it closes the file, which releases the lock.
#[derive(Debug)]
pub struct GlobalLock {
    _file: File,
}

impl GlobalLock {
    /// Blocks until the lock is ours, however long genv holds it (one-shot commands).
    pub fn acquire(dir: &Path) -> Result<Self, LockError> {
        let (file, path) = open(dir)?;
        loop {
            match flock(&file, FlockOperation::LockExclusive) {
                Ok(()) => return Ok(Self { _file: file }),
                Err(Errno::INTR) => continue,
                Err(errno) => return Err(LockError::new(&path, LockErrorKind::Lock(errno.into()))),
            }
        }
    }

    /// The lock if nobody holds it right now, else `None`; never waits.
    pub fn try_acquire(dir: &Path) -> Result<Option<Self>, LockError> {
        let (file, path) = open(dir)?;
        Ok(try_lock(&file, &path)?.then_some(Self { _file: file }))
    }

    /// Waits at most `timeout` for the lock, polling every few milliseconds, so that a
    /// process sitting on genv's lock (a stopped `genv`, a hostile user's `flock`) cannot
    /// stall the caller for ever. The error names the holder when `/proc/locks` does.
    pub fn acquire_within(dir: &Path, timeout: Duration) -> Result<Self, LockError> {
        let (file, path) = open(dir)?;
        let start = Instant::now();
        loop {
            if try_lock(&file, &path)? {
                return Ok(Self { _file: file });
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let holder = holder_of(&file);
                return Err(LockError::new(
                    &path,
                    LockErrorKind::Held { waited, holder },
                ));
            }
            std::thread::sleep(POLL.min(timeout - waited));
        }
    }
}

/// Opens (creating as genv does) the directory and the lock file in it, safely.
fn open(dir: &Path) -> Result<(File, PathBuf), LockError> {
    let state = Dir::create(dir).map_err(|e| LockError::opening(dir, e))?;
    let path = state.join(LOCK_FILE);
    let (file, _created) = state
        .open_or_create(LOCK_FILE, Access::ReadWrite)
        .map_err(|e| LockError::opening(&path, e))?;
    Ok((file, path))
}

/// `LOCK_EX|LOCK_NB`: whether the lock is now ours.
fn try_lock(file: &File, path: &Path) -> Result<bool, LockError> {
    loop {
        match flock(file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(true),
            Err(Errno::WOULDBLOCK) => return Ok(false),
            Err(Errno::INTR) => continue,
            Err(errno) => return Err(LockError::new(path, LockErrorKind::Lock(errno.into()))),
        }
    }
}

/// The pid `/proc/locks` gives for the `flock` on this file, if any. Best effort: the
/// pid is the one that took the lock, which may have passed the descriptor on.
fn holder_of(file: &File) -> Option<u32> {
    let stat = rustix::fs::fstat(file).ok()?;
    let id = format!(
        "{:02x}:{:02x}:{}",
        rustix::fs::major(stat.st_dev),
        rustix::fs::minor(stat.st_dev),
        stat.st_ino
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    locks.lines().find_map(|line| flock_holder(line, &id))
}

/// `1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF` → 1234 for id `fd:01:5678`.
/// Waiters (`1: -> FLOCK ...`) are skipped.
fn flock_holder(line: &str, id: &str) -> Option<u32> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    match fields.as_slice() {
        [_, "FLOCK", _, _, pid, file, ..] if file.eq_ignore_ascii_case(id) => pid.parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("genv-lock-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn try_acquire_does_not_wait_for_a_held_lock() {
        let dir = scratch("try");
        let held = GlobalLock::acquire(&dir).unwrap();
        // flock belongs to the open file description: a second open conflicts even in
        // the same process, as another process's would.
        let start = Instant::now();
        assert!(GlobalLock::try_acquire(&dir).unwrap().is_none());
        assert!(start.elapsed() < Duration::from_secs(1));
        drop(held);
        assert!(GlobalLock::try_acquire(&dir).unwrap().is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn acquire_within_gives_up_and_names_the_holder() {
        let dir = scratch("within");
        let _held = GlobalLock::acquire(&dir).unwrap();
        let start = Instant::now();
        let error = GlobalLock::acquire_within(&dir, Duration::from_millis(100)).unwrap_err();
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(waited < Duration::from_secs(2), "{waited:?}");
        let LockErrorKind::Held { holder, .. } = error.kind else {
            panic!("{error}");
        };
        assert_eq!(holder, Some(std::process::id()));
        let message = error.to_string();
        assert!(
            message.contains("genv.lock: held by another process"),
            "{message}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn acquire_within_gets_a_lock_released_in_time() {
        let dir = scratch("released");
        let held = GlobalLock::acquire(&dir).unwrap();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(held);
        });
        GlobalLock::acquire_within(&dir, Duration::from_secs(10)).unwrap();
        releaser.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn acquire_within_waits_for_another_process() {
        let dir = scratch("child");
        let lock = dir.join(LOCK_FILE);
        drop(GlobalLock::acquire(&dir).unwrap());
        // flock(1) holds the lock in a child (itself, no fork) until it is killed: a
        // fixed hold would end early for a test thread stalled on a loaded machine.
        let mut child = std::process::Command::new("flock")
            .args(["--no-fork"])
            .arg(&lock)
            .args(["sleep", "600"])
            .spawn()
            .unwrap();
        let start = Instant::now();
        while GlobalLock::try_acquire(&dir).unwrap().is_some() {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "flock(1) never took it"
            );
        }
        let error = GlobalLock::acquire_within(&dir, Duration::from_millis(50)).unwrap_err();
        assert!(matches!(error.kind, LockErrorKind::Held { .. }), "{error}");
        let pid = child.id() as i32;
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            // SAFETY: kill(2) takes no pointer; the pid is this test's unreaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        });
        GlobalLock::acquire_within(&dir, Duration::from_secs(10)).unwrap();
        releaser.join().unwrap();
        child.wait().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_flock_holders_from_proc_locks() {
        let id = "fd:01:5678";
        assert_eq!(
            flock_holder("1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF", id),
            Some(1234)
        );
        assert_eq!(
            flock_holder("1: -> FLOCK  ADVISORY  WRITE 99 fd:01:5678 0 EOF", id),
            None
        );
        assert_eq!(
            flock_holder("2: POSIX  ADVISORY  WRITE 7 fd:01:5678 0 EOF", id),
            None
        );
        assert_eq!(
            flock_holder("3: FLOCK  ADVISORY  WRITE 8 fd:01:9 0 EOF", id),
            None
        );
    }
}
