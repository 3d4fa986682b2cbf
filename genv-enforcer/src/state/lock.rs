//! genv's global lock: `flock(LOCK_EX)` on `$GENV_TMPDIR/genv.lock`.
//!
//! genv opens the file with `O_RDWR|O_CREAT|O_TRUNC`, mode 0666 under umask 0, after
//! creating the directory 0777. Every user's genv takes this lock, so whatever we create
//! must stay writable by everyone: a 0644 lock file made by a root daemon would lock
//! ordinary users out of genv.

use std::fs::{self, DirBuilder, File, OpenOptions, Permissions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use rustix::fs::{FlockOperation, flock};

/// Held while alive; dropping it closes the file, which releases the lock.
#[derive(Debug)]
pub struct GlobalLock {
    _file: File,
}

impl GlobalLock {
    /// Blocks until the lock is ours.
    pub fn acquire(dir: &Path) -> io::Result<Self> {
        ensure_shared_dir(dir)?;
        let path = dir.join("genv.lock");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o666)
            .open(&path)?;
        make_shared(&file, 0o666)?;
        flock(&file, FlockOperation::LockExclusive)?;
        Ok(Self { _file: file })
    }
}

/// Creates `dir` (and parents) as genv does: mode 0777 whatever our umask.
pub fn ensure_shared_dir(dir: &Path) -> io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    DirBuilder::new().recursive(true).mode(0o777).create(dir)?;
    fs::set_permissions(dir, Permissions::from_mode(0o777))
}

/// Gives a file we may just have created genv's mode, compensating for our umask.
/// Files owned by someone else are left alone: their mode is theirs to keep.
pub fn make_shared(file: &File, mode: u32) -> io::Result<()> {
    let meta = file.metadata()?;
    let ours = std::os::unix::fs::MetadataExt::uid(&meta) == rustix::process::geteuid().as_raw();
    if ours && meta.permissions().mode() & 0o777 != mode {
        file.set_permissions(Permissions::from_mode(mode))?;
    }
    Ok(())
}
