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

use rustix::fs::{FlockOperation, flock};
use rustix::io::Errno;

use super::safe_open::{Access, Dir, OpenError, Refusal};

pub const LOCK_FILE: &str = "genv.lock";

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
        };
        io::Error::new(kind, error)
    }
}

/// Held while alive; dropping it closes the file, which releases the lock.
#[derive(Debug)]
pub struct GlobalLock {
    _file: File,
}

impl GlobalLock {
    /// Blocks until the lock is ours.
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
