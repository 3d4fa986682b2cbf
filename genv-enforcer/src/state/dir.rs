//! The state directory: reading genv's files as genv reads them, and writing the one
//! change the enforcer makes (a detach) as genv writes it.

use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use super::lock::{GlobalLock, LockError};
use super::model::{self, Device, Env, ShapeError};
use super::safe_open::{self, Dir, OpenError};
use super::{StateError, StateErrorKind};
use crate::backends::procfs;

pub const DEFAULT_DIR: &str = "/var/tmp/genv";

const ENVS_FILE: &str = "envs.json";
const DEVICES_FILE: &str = "devices.json";

/// The most of a state file that is read. genv writes a few hundred bytes per
/// environment and per device, so thousands of environments stay well under 1 MiB;
/// 16 MiB leaves room for anything genv makes while bounding what a planted file (or
/// `/dev/zero` behind a link) could make a root process allocate.
pub const MAX_STATE_FILE: u64 = 16 * 1024 * 1024;

/// `$GENV_TMPDIR`, default `/var/tmp/genv`.
#[derive(Clone, Debug)]
pub struct StateDir {
    root: PathBuf,
}

impl StateDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The directory genv itself would use in this environment.
    pub fn from_env() -> Self {
        Self::new(std::env::var_os("GENV_TMPDIR").unwrap_or_else(|| DEFAULT_DIR.into()))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// genv's global lock, waiting as long as it takes ([`GlobalLock::acquire`]).
    pub fn lock(&self) -> Result<GlobalLock, LockError> {
        GlobalLock::acquire(&self.root)
    }

    /// genv's global lock if it is free now ([`GlobalLock::try_acquire`]).
    pub fn try_lock(&self) -> Result<Option<GlobalLock>, LockError> {
        GlobalLock::try_acquire(&self.root)
    }

    /// genv's global lock, waiting at most `timeout` ([`GlobalLock::acquire_within`]).
    pub fn lock_within(&self, timeout: Duration) -> Result<GlobalLock, LockError> {
        GlobalLock::acquire_within(&self.root, timeout)
    }

    /// Opens the directory for one operation; `None` if it does not exist yet, which
    /// means no state files either.
    fn open(&self) -> Result<Option<Dir>, StateError> {
        Dir::open(&self.root).map_err(|e| opening(&self.root, e, Purpose::Read))
    }

    /// The directory as every operation opens it (never through a link, never a FUSE
    /// mount), for what must act on the directory checked rather than on its path, which
    /// another user may mount something on at any moment (an inotify watch). `None` if
    /// it does not exist.
    pub fn open_checked(&self) -> Result<Option<OwnedFd>, StateError> {
        Ok(self.open()?.map(Dir::into_fd))
    }

    /// Active environments, cleaned as genv cleans them on load: an environment whose
    /// activating pids are all gone is dropped. (Jupyter kernels cannot be polled without
    /// Jupyter; an environment with kernel ids is kept.) A missing file means no
    /// environments, as genv would create it empty.
    pub fn load_envs(&self) -> Result<Vec<Env>, StateError> {
        match self.open()? {
            Some(dir) => load_envs(&dir),
            None => Ok(Vec::new()),
        }
    }

    /// Devices as recorded, with attachments of environments that are not active dropped
    /// (genv's cleanup). `None` when the file does not exist yet.
    pub fn load_devices(&self, envs: &[Env]) -> Result<Option<Vec<Device>>, StateError> {
        match self.open()? {
            Some(dir) => load_devices(&dir, envs),
            None => Ok(None),
        }
    }

    /// Removes `eid`'s attachment to device `index`, as `genv.core.devices.detach` does:
    /// load (with cleanup), change, and rewrite in place, 2-space JSON, mode 0666.
    /// The caller holds the global lock. A file that does not parse is never rewritten,
    /// nor one that is not a plain single-link regular file (see `safe_open`).
    pub fn detach(&self, eid: &str, index: u32) -> Result<(), StateError> {
        let Some(dir) = self.open()? else {
            return Ok(());
        };
        let envs = load_envs(&dir)?;
        let path = dir.join(DEVICES_FILE);
        let Some(mut devices) = load_devices(&dir, &envs)? else {
            return Ok(());
        };
        for device in devices.iter_mut().filter(|d| d.index == index) {
            device.attachments.retain(|a| a.eid != eid);
        }
        let text = super::json::to_python_json(&serde_json::json!({ "devices": devices }))
            .map_err(|e| StateError::new(&path, StateErrorKind::Write(io::Error::other(e))))?;
        write_in_place(&dir, DEVICES_FILE, text.as_bytes())
    }
}

/// `envs.json`, cleaned as genv cleans it on load.
fn load_envs(dir: &Dir) -> Result<Vec<Env>, StateError> {
    let path = dir.join(ENVS_FILE);
    let Some(document) = read_document(dir, ENVS_FILE)? else {
        return Ok(Vec::new());
    };
    // Duplicate eids are kept: genv writes and reads such files (its lookups take the
    // first), and which one counts is the snapshot's decision (`snapshot::owners`).
    let mut envs = model::parse_envs(&document).map_err(|e| shape(&path, e))?;
    drop_inactive(&mut envs);
    Ok(envs)
}

/// genv's cleanup: an environment whose activating shells are all gone (and that has no
/// Jupyter kernels) is no longer active.
pub fn drop_inactive(envs: &mut Vec<Env>) {
    for env in envs.iter_mut() {
        env.pids.retain(|pid| procfs::pid_exists(*pid));
    }
    envs.retain(|env| !env.pids.is_empty() || !env.kernel_ids.is_empty());
}

/// `devices.json`, with attachments of inactive environments dropped.
fn load_devices(dir: &Dir, envs: &[Env]) -> Result<Option<Vec<Device>>, StateError> {
    let path = dir.join(DEVICES_FILE);
    let Some(document) = read_document(dir, DEVICES_FILE)? else {
        return Ok(None);
    };
    let mut devices = model::parse_devices(&document).map_err(|e| shape(&path, e))?;
    model::check_unique(devices.iter().map(|d| d.index.to_string()), "devices")
        .map_err(|e| shape(&path, e))?;
    for device in &mut devices {
        device
            .attachments
            .retain(|a| envs.iter().any(|e| e.eid == a.eid));
    }
    Ok(Some(devices))
}

fn shape(path: &Path, error: ShapeError) -> StateError {
    StateError::new(path, StateErrorKind::Shape(error))
}

/// Whether a failed open was for reading or for rewriting: the error says which.
#[derive(Clone, Copy)]
enum Purpose {
    Read,
    Write,
}

/// A failed safe open as a state error, keeping the refusal's reason or the I/O error.
fn opening(path: &Path, error: OpenError, purpose: Purpose) -> StateError {
    let kind = match (error, purpose) {
        (OpenError::Refused(refusal), Purpose::Read) => StateErrorKind::ReadRefused(refusal),
        (OpenError::Refused(refusal), Purpose::Write) => StateErrorKind::WriteRefused(refusal),
        (OpenError::Io(error), Purpose::Read) => StateErrorKind::Read(error),
        (OpenError::Io(error), Purpose::Write) => StateErrorKind::Write(error),
    };
    StateError::new(path, kind)
}

/// Reads and parses a state file; `None` if it does not exist. Only a regular file is
/// read, never through a link, and never more than [`MAX_STATE_FILE`] bytes.
fn read_document(dir: &Dir, name: &str) -> Result<Option<Value>, StateError> {
    let path = dir.join(name);
    let failed = |e| opening(&path, e, Purpose::Read);
    let Some(file) = dir.open_read(name).map_err(failed)? else {
        return Ok(None);
    };
    let bytes = safe_open::read_capped(&file, MAX_STATE_FILE).map_err(failed)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let error = io::Error::new(io::ErrorKind::InvalidData, e);
        StateError::new(&path, StateErrorKind::Read(error))
    })?;
    if text.trim().is_empty() {
        return Err(StateError::new(&path, StateErrorKind::Empty));
    }
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| StateError::new(&path, StateErrorKind::Syntax(e)))
}

/// genv truncates and rewrites its files in place (`open(path, "w")`, mode 0666 under
/// umask 0); doing the same keeps the inode, owner and mode that genv users rely on.
/// The truncation comes only after the open file has been checked (regular, one link),
/// so it can only ever empty the state file itself.
fn write_in_place(dir: &Dir, name: &str, bytes: &[u8]) -> Result<(), StateError> {
    let path = dir.join(name);
    let mut file = dir
        .open_for_rewrite(name)
        .map_err(|e| opening(&path, e, Purpose::Write))?;
    let written = file
        .set_len(0)
        .and_then(|()| file.write_all(bytes))
        .and_then(|()| file.flush());
    written.map_err(|e| StateError::new(&path, StateErrorKind::Write(e)))
}
