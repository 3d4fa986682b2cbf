//! GPU processes whose environment block does not answer, and since when.
//!
//! Only a process's owner can keep its address space held (see
//! `crate::backends::address_space`), so keeping a GPU process unreadable must gain its
//! owner nothing: past [`GRACE`] it is judged as outside any environment, as it would be
//! if its block said so. Before that it is left alone, so that a brief hold (a core
//! dump, a burst of `mmap`) never gets a process of an environment terminated.
//!
//! A daemon keeps these in memory. `usage snapshot`, which runs once per remote cycle,
//! keeps them in a file of root's ([`Unreadable::load`], [`Unreadable::save`]), so that
//! its grace runs across cycles too.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use super::Warning;
use crate::backends::procfs::EnvironError;

/// How long a GPU process's block may stay unreadable before the process is judged as
/// outside any environment: genv's own polling interval, so that such a process is
/// stopped no later than genv would stop it.
pub const GRACE: Duration = Duration::from_secs(10);

/// At most this many processes are tracked (the oldest go first).
const LIMIT: usize = 4096;

/// The largest file [`Unreadable::load`] reads.
const FILE_LIMIT: u64 = 256 * 1024;

/// Where a record is kept between runs, and the lock that is this run's turn.
pub struct Kept {
    path: std::path::PathBuf,
    _lock: std::fs::File,
}

impl Kept {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// When each process (pid, start time) was first found unreadable, in milliseconds of
/// `CLOCK_BOOTTIME` (so that a record never outlives a reboot as a valid one).
#[derive(Debug, Default)]
pub(crate) struct Unreadable {
    first: HashMap<u32, (u64, u64)>,
}

/// Milliseconds since boot, suspended time included.
pub(crate) fn now_ms() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    now.tv_sec as u64 * 1000 + now.tv_nsec as u64 / 1_000_000
}

impl Unreadable {
    /// Notes that process `pid`, started at `start_time`, did not answer at `now`; how
    /// long it has not, since it was first found so.
    pub(crate) fn noted(&mut self, pid: u32, start_time: u64, now: u64) -> Duration {
        let first = match self.first.get(&pid) {
            Some(&(started, first)) if started == start_time && first <= now => first,
            _ => {
                if self.first.len() >= LIMIT {
                    self.drop_oldest();
                }
                self.first.insert(pid, (start_time, now));
                now
            }
        };
        Duration::from_millis(now - first)
    }

    /// Process `pid`, started at `start_time`, did not answer (`e`): whether it has not
    /// for [`GRACE`], and so counts as outside any environment (said); before that it is
    /// left alone, said when first found so.
    pub(crate) fn past_grace(
        &mut self,
        pid: u32,
        start_time: u64,
        e: &EnvironError,
        warnings: &mut Vec<Warning>,
    ) -> bool {
        let held = self.noted(pid, start_time, now_ms());
        if held < GRACE {
            if held.is_zero() {
                warnings.push(warning!(
                    "{e}: leaving process {pid} alone for now; if it stays unreadable for {} s it counts as outside any environment",
                    GRACE.as_secs()
                ));
            }
            return false;
        }
        warnings.push(warning!(
            "process {pid}'s environment block has not been readable for {} s (its owner holds its address space): it counts as outside any environment",
            held.as_secs()
        ));
        true
    }

    /// Process `pid` answered (or is gone): its clock stops.
    pub(crate) fn answered(&mut self, pid: u32) {
        self.first.remove(&pid);
    }

    /// Keeps the processes `live` says still exist with the start time noted.
    pub(crate) fn retain(&mut self, mut live: impl FnMut(u32, u64) -> bool) {
        self.first
            .retain(|&pid, &mut (started, _)| live(pid, started));
    }

    fn drop_oldest(&mut self) {
        if let Some((&pid, _)) = self.first.iter().min_by_key(|(_, (_, first))| *first) {
            self.first.remove(&pid);
        }
    }

    /// The record kept in `run_dir` by earlier runs, and where it goes back; `None` where
    /// this is not root or `run_dir` is not root's alone (it is made, 0755, if missing).
    /// Runs at once take turns (an `flock` of root's own file, held until the record is
    /// saved), so that none loses another's update.
    pub(crate) fn in_run_dir(run_dir: &Path) -> Option<(Self, Kept)> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
        if !rustix::process::geteuid().is_root() {
            return None; // nothing root keeps can be trusted or written
        }
        let _ = std::fs::DirBuilder::new().mode(0o755).create(run_dir);
        let meta = std::fs::symlink_metadata(run_dir).ok()?;
        if !meta.is_dir() || meta.uid() != 0 || meta.mode() & 0o022 != 0 {
            return None;
        }
        let path = run_dir.join("unreadable-processes");
        let lock = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path.with_extension("lock"))
            .ok()?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).ok()?;
        Some((Self::load(&path), Kept { path, _lock: lock }))
    }

    /// The records of `path`: `pid start_time first_ms` lines. A missing, unreadable or
    /// malformed file is an empty record (the grace then starts again: later, never
    /// sooner); lines that do not parse are skipped.
    pub(crate) fn load(path: &Path) -> Self {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let mut text = String::new();
        // The directory is root's (see `usage_snapshot`); no link is followed all the same.
        let read = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
            .and_then(|file| file.take(FILE_LIMIT).read_to_string(&mut text));
        if read.is_err() {
            return Self::default();
        }
        let first = text
            .lines()
            .filter_map(|line| {
                let mut fields = line.split(' ').map(str::parse::<u64>);
                let (Some(Ok(pid)), Some(Ok(start)), Some(Ok(first)), None) =
                    (fields.next(), fields.next(), fields.next(), fields.next())
                else {
                    return None;
                };
                Some((u32::try_from(pid).ok()?, (start, first)))
            })
            .take(LIMIT)
            .collect();
        Self { first }
    }

    /// Keeps only the processes in `gpu_processes` (after a full snapshot): one that
    /// stopped using a GPU starts its clock anew if it is found unreadable again.
    pub(crate) fn keep_only(&mut self, gpu_processes: &[u32]) {
        self.first.retain(|pid, _| gpu_processes.contains(pid));
    }

    /// Writes the records where `kept` says (a new file renamed over it, mode 0600); an
    /// empty record removes it.
    pub(crate) fn save_to(&self, kept: &Kept) -> std::io::Result<()> {
        self.save(&kept.path)
    }

    /// Writes the records to `path` (a new file renamed over it, mode 0600); an empty
    /// record removes it.
    fn save(&self, path: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        if self.first.is_empty() {
            return match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            };
        }
        let mut text = String::new();
        for (pid, (start, first)) in &self.first {
            text.push_str(&format!("{pid} {start} {first}\n"));
        }
        let temporary = path.with_extension(format!("new.{}", std::process::id()));
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temporary)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .and_then(|()| std::fs::rename(&temporary, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&temporary);
        }
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_runs_from_the_first_time_per_process_image() {
        let mut unreadable = Unreadable::default();
        assert_eq!(unreadable.noted(10, 5, 1_000), Duration::ZERO);
        assert_eq!(unreadable.noted(10, 5, 4_500), Duration::from_millis(3_500));
        assert_eq!(
            unreadable.noted(10, 6, 5_000),
            Duration::ZERO,
            "another process given the pid starts anew"
        );
        unreadable.answered(10);
        assert_eq!(unreadable.noted(10, 6, 9_000), Duration::ZERO);
    }

    #[test]
    fn records_survive_a_save_and_load_and_bad_lines_are_skipped() {
        let dir = std::env::temp_dir().join(format!("unreadable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("unreadable");
        let mut unreadable = Unreadable::default();
        unreadable.noted(42, 7, 100);
        unreadable.save(&path).unwrap();
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str("garbage\n1 2\n-1 2 3\n");
        std::fs::write(&path, text).unwrap();
        let mut loaded = Unreadable::load(&path);
        assert_eq!(loaded.first.len(), 1);
        assert_eq!(loaded.noted(42, 7, 10_100), Duration::from_secs(10));
        Unreadable::default().save(&path).unwrap();
        assert!(!path.exists(), "an empty record removes the file");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
