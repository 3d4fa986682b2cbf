//! The state directory: reading genv's files as genv reads them, and writing the one
//! change the enforcer makes (a detach) as genv writes it.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::lock::{GlobalLock, make_shared};
use super::model::{self, Device, Env, ShapeError};
use super::{StateError, StateErrorKind};
use crate::backends::procfs;

pub const DEFAULT_DIR: &str = "/var/tmp/genv";

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

    pub fn envs_path(&self) -> PathBuf {
        self.root.join("envs.json")
    }

    pub fn devices_path(&self) -> PathBuf {
        self.root.join("devices.json")
    }

    pub fn lock(&self) -> io::Result<GlobalLock> {
        GlobalLock::acquire(&self.root)
    }

    /// Active environments, cleaned as genv cleans them on load: an environment whose
    /// activating pids are all gone is dropped. (Jupyter kernels cannot be polled without
    /// Jupyter; an environment with kernel ids is kept.) A missing file means no
    /// environments, as genv would create it empty.
    pub fn load_envs(&self) -> Result<Vec<Env>, StateError> {
        let path = self.envs_path();
        let Some(document) = read_document(&path)? else {
            return Ok(Vec::new());
        };
        let mut envs = model::parse_envs(&document).map_err(|e| shape(&path, e))?;
        model::check_unique(envs.iter().map(|e| e.eid.clone()), "envs")
            .map_err(|e| shape(&path, e))?;
        for env in &mut envs {
            env.pids.retain(|pid| procfs::pid_exists(*pid));
        }
        envs.retain(|env| !env.pids.is_empty() || !env.kernel_ids.is_empty());
        Ok(envs)
    }

    /// Devices as recorded, with attachments of environments that are not active dropped
    /// (genv's cleanup). `None` when the file does not exist yet.
    pub fn load_devices(&self, envs: &[Env]) -> Result<Option<Vec<Device>>, StateError> {
        let path = self.devices_path();
        let Some(document) = read_document(&path)? else {
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

    /// Removes `eid`'s attachment to device `index`, as `genv.core.devices.detach` does:
    /// load (with cleanup), change, and rewrite in place, 2-space JSON, mode 0666.
    /// The caller holds the global lock. A file that does not parse is never rewritten.
    pub fn detach(&self, eid: &str, index: u32) -> Result<(), StateError> {
        let envs = self.load_envs()?;
        let path = self.devices_path();
        let Some(mut devices) = self.load_devices(&envs)? else {
            return Ok(());
        };
        for device in devices.iter_mut().filter(|d| d.index == index) {
            device.attachments.retain(|a| a.eid != eid);
        }
        let text = super::json::to_python_json(&serde_json::json!({ "devices": devices }))
            .map_err(|e| StateError::new(&path, StateErrorKind::Write(io::Error::other(e))))?;
        write_in_place(&path, text.as_bytes())
            .map_err(|e| StateError::new(&path, StateErrorKind::Write(e)))
    }
}

fn shape(path: &Path, error: ShapeError) -> StateError {
    StateError::new(path, StateErrorKind::Shape(error))
}

/// Reads and parses a state file; `None` if it does not exist.
fn read_document(path: &Path) -> Result<Option<Value>, StateError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StateError::new(path, StateErrorKind::Read(e))),
    };
    if text.trim().is_empty() {
        return Err(StateError::new(path, StateErrorKind::Empty));
    }
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| StateError::new(path, StateErrorKind::Syntax(e)))
}

/// genv truncates and rewrites its files in place (`open(path, "w")`, mode 0666 under
/// umask 0); doing the same keeps the inode, owner and mode that genv users rely on.
fn write_in_place(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o666)
        .open(path)?;
    make_shared(&file, 0o666)?;
    file.write_all(bytes)?;
    file.flush()
}
