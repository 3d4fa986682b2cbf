//! One event-driven enforcer per machine: two would both act on every open. The lock is
//! an `flock` on `<run-dir>/lock`, released by the kernel however the daemon ends.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use rustix::fs::{FlockOperation, flock};

use super::status::{self, Status};

pub struct Instance {
    _lock: File,
    dir: PathBuf,
}

impl Instance {
    pub fn claim(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the runtime directory {}", dir.display()))?;
        let path = dir.join("lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        if flock(&lock, FlockOperation::NonBlockingLockExclusive).is_err() {
            let holder = std::fs::read_to_string(dir.join(status::FILE))
                .ok()
                .and_then(|text| serde_json::from_str::<Status>(&text).ok())
                .map_or_else(
                    || "another process".to_owned(),
                    |s| format!("pid {}", s.pid),
                );
            bail!(
                "another genv-enforcer is already running ({holder} holds {}); stop it first, or give this one another --run-dir",
                path.display()
            );
        }
        Ok(Self {
            _lock: lock,
            dir: dir.to_owned(),
        })
    }

    /// Replaces the status file (write then rename: readers never see half of it).
    pub fn publish(&self, status: &Status) {
        let path = self.dir.join(status::FILE);
        let temporary = self.dir.join(".status.json.new");
        let written = File::create(&temporary).and_then(|mut f| {
            f.write_all(
                serde_json::to_string_pretty(status)
                    .unwrap_or_default()
                    .as_bytes(),
            )?;
            std::fs::rename(&temporary, &path)
        });
        if let Err(e) = written {
            eprintln!("[WARNING] Cannot write {}: {e}", path.display());
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join(status::FILE));
    }
}
