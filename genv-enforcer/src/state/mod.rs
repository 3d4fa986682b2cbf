//! genv's state: `envs.json`, `devices.json` and the global lock under `$GENV_TMPDIR`.
//!
//! Reading follows genv (both shapes, cleanup of inactive environments); the only write
//! is a detach, made as genv makes it. A file that cannot be read or parsed is reported
//! with its path and the offending field, and is never written.

pub mod admin_file;
mod dir;
mod json;
mod lock;
pub mod memory;
pub mod model;
mod mounts;
mod refusal;
mod safe_open;

#[cfg(test)]
mod hostile_file_tests;
#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod mount_tests;

#[cfg(test)]
mod fuzz_tests;
#[cfg(test)]
mod python_tests;
#[cfg(test)]
pub(crate) mod test_support;

use std::io;
use std::path::{Path, PathBuf};

pub use dir::{DEFAULT_DIR, MAX_STATE_FILE, StateDir, drop_inactive};
pub use json::to_python_json;
pub use lock::{GlobalLock, LockError, LockErrorKind};
pub use memory::MemorySpec;
pub use model::{Attachment, Device, Env, EnvConfig};
pub use mounts::MountTable;
pub use refusal::{FileKind, MountKind, Refusal};

#[derive(Debug, thiserror::Error)]
#[error("{}: {kind}", path.display())]
pub struct StateError {
    pub path: PathBuf,
    pub kind: StateErrorKind,
}

#[derive(Debug, thiserror::Error)]
pub enum StateErrorKind {
    /// The file exists but could not be read (permissions, I/O).
    #[error("cannot read: {0}")]
    Read(#[source] io::Error),
    /// Not something genv would have put there (a symbolic link, a FIFO or other
    /// non-regular file, a file over the size cap), so not read: never followed, waited
    /// on or partly parsed, since the directory is writable by every user.
    #[error("cannot read: {0}")]
    ReadRefused(Refusal),
    /// The file is empty (genv never writes an empty state file).
    #[error("file is empty")]
    Empty,
    /// Not JSON, or truncated.
    #[error("not valid JSON: {0}")]
    Syntax(#[source] serde_json::Error),
    /// JSON, but not in genv's shape.
    #[error("{0}")]
    Shape(#[source] model::ShapeError),
    /// Writing the file back failed.
    #[error("cannot write: {0}")]
    Write(#[source] io::Error),
    /// Not rewritten: it is not (or no longer) a single-link regular file.
    #[error("cannot write: {0}")]
    WriteRefused(Refusal),
}

impl StateError {
    fn new(path: &Path, kind: StateErrorKind) -> Self {
        Self {
            path: path.to_owned(),
            kind,
        }
    }
}
