//! One event-driven enforcer per machine: two would both act on every open. The lock is
//! an `flock` on `<run-dir>/lock`, released by the kernel however the daemon ends.

use std::cell::RefCell;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use rustix::fs::{FlockOperation, flock};

use super::status::{self, HEARTBEAT, Status};

pub struct Instance {
    _lock: File,
    dir: PathBuf,
    /// The status last written (its `updated` zeroed), and when.
    written: RefCell<Option<(Status, Instant)>>,
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
            written: RefCell::new(None),
        })
    }

    /// Replaces the status file (write then rename: readers never see half of it) when
    /// anything but `updated` changed, or [`HEARTBEAT`] after the last write.
    pub fn publish(&self, status: &Status) {
        let now = Instant::now();
        let content = Status {
            updated: 0,
            ..status.clone()
        };
        if let Some((last, at)) = &*self.written.borrow() {
            if *last == content && now.duration_since(*at) < HEARTBEAT {
                return;
            }
        }
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
        match written {
            Ok(()) => *self.written.borrow_mut() = Some((content, now)),
            Err(e) => tracing::warn!("Cannot write {}: {e}", path.display()),
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join(status::FILE));
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn an_unchanged_status_is_not_rewritten_until_the_heartbeat() {
        let dir = std::env::temp_dir().join(format!("genv-instance-{}", std::process::id()));
        let instance = Instance::claim(&dir).unwrap();
        let file = dir.join(status::FILE);
        let inode = || std::fs::metadata(&file).unwrap().ino();
        let mut status = Status {
            pid: 1,
            updated: 100,
            ..Status::default()
        };
        instance.publish(&status);
        let first = inode();
        // Only `updated` moved: no write (each write renames a new file into place).
        status.updated = 101;
        instance.publish(&status);
        assert_eq!(inode(), first);
        // A count moved: written at once.
        status.counts.open_checks += 1;
        instance.publish(&status);
        let second = inode();
        assert_ne!(second, first);
        let written: Status =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!((written.updated, written.counts.open_checks), (101, 1));
        // Nothing moved, but the last write is a heartbeat old: written again.
        let (content, _) = instance.written.borrow_mut().take().unwrap();
        *instance.written.borrow_mut() = Some((content, Instant::now() - HEARTBEAT));
        status.updated = 111;
        instance.publish(&status);
        assert_ne!(inode(), second);
        drop(instance);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
