//! inotify on genv's state directory: a write to `envs.json` or `devices.json` (genv
//! rewrites them in place under its lock; other tools may rename into place) triggers a
//! full cycle at once.
//!
//! genv creates its directory on first use, so on a fresh node the daemon usually starts
//! before it exists. Until it does, the watch sits on its nearest existing ancestor (for
//! `/var/tmp/genv`, `/var/tmp`), for the next component's creation; when that appears the
//! watch moves down, and onto the state directory itself once it exists. A directory
//! removed later puts the watch back on its ancestor. Each move triggers a full cycle,
//! which reads whatever genv wrote before the watch arrived.

use std::ffi::OsString;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use rustix::fs::{Mode, OFlags};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::state::StateDir;

const FILES: [&str; 2] = ["envs.json", "devices.json"];

/// How many times one re-arm may find the tree changed under it before giving up until
/// the next full cycle (a directory created and removed in a loop).
const REARM_TRIES: usize = 16;

pub struct StateWatch {
    fd: AsyncFd<OwnedFd>,
    state: StateDir,
    /// The one watch in place, and what it watches.
    watch: Option<(i32, Target)>,
}

/// What the watch sits on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The state directory itself.
    State,
    /// The state directory's nearest existing ancestor, for `next` (the following
    /// component of the state directory's path) to appear in it.
    Ancestor { dir: PathBuf, next: OsString },
}

impl Target {
    /// In words, for the status.
    pub fn describe(&self, state: &Path) -> String {
        match self {
            Target::State => format!("{} (envs.json, devices.json)", state.display()),
            Target::Ancestor { dir, next } => format!(
                "{} for {} to appear (no {} yet)",
                dir.display(),
                next.to_string_lossy(),
                state.display()
            ),
        }
    }
}

impl StateWatch {
    /// Watches the state directory, or, while it does not exist, its nearest existing
    /// ancestor.
    pub fn new(state: &StateDir) -> io::Result<Self> {
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?;
        let mut watch = Self {
            // SAFETY: the AsyncFd owns the inotify descriptor.
            fd: unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?,
            state: state.clone(),
            watch: None,
        };
        watch.rearm()?;
        Ok(watch)
    }

    /// What the watch sits on now; `None` when a re-arm failed (the daemon then makes a
    /// new watch at its next full cycle).
    pub fn target(&self) -> Option<&Target> {
        self.watch.as_ref().map(|(_, target)| target)
    }

    /// Whether the watch is gone (the daemon makes a new one at its next full cycle).
    pub fn is_lost(&self) -> bool {
        self.watch.is_none()
    }

    /// Waits for inotify events; `true` if one concerns a state file, or the watch moved
    /// (the state directory appeared or went away): either way the state must be read.
    pub async fn changed(&mut self) -> io::Result<bool> {
        let mut guard = self.fd.readable().await?;
        let mut relevant = false;
        let mut rearm = false;
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(guard.get_inner(), &mut buf);
        loop {
            match reader.next() {
                Ok(event) => {
                    // The kernel's queue overflowed (a user can flood it from the 0777
                    // state directory): events were lost, genv's among them maybe.
                    if event.events().contains(ReadFlags::QUEUE_OVERFLOW) {
                        rearm = true;
                        continue;
                    }
                    let Some((wd, target)) = &self.watch else {
                        continue;
                    };
                    // Events of a watch this one replaced (its IGNORED, mostly).
                    if event.wd() != *wd {
                        continue;
                    }
                    let flags = event.events();
                    // Renamed (or its file system unmounted): the watch no longer sits
                    // on the path genv uses.
                    let gone = flags
                        .intersects(ReadFlags::IGNORED | ReadFlags::MOVE_SELF | ReadFlags::UNMOUNT);
                    let name = event.file_name().map(|n| n.to_bytes());
                    match target {
                        Target::State => {
                            relevant |=
                                name.is_some_and(|n| FILES.iter().any(|f| n == f.as_bytes()));
                            rearm |= gone;
                        }
                        Target::Ancestor { next, .. } => {
                            rearm |= gone || name.is_some_and(|n| n == next.as_encoded_bytes());
                        }
                    }
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => return Err(e.into()),
            }
        }
        guard.clear_ready();
        if rearm {
            if let Err(e) = self.rearm() {
                self.watch = None;
                return Err(e);
            }
        }
        Ok(relevant || rearm)
    }

    /// Puts the watch on the state directory if it exists, else on its nearest existing
    /// ancestor; re-checks after watching an ancestor, so a directory created between
    /// the look and the watch is not missed.
    fn rearm(&mut self) -> io::Result<()> {
        if let Some((wd, _)) = self.watch.take() {
            // Fails harmlessly when the kernel already dropped it (directory removed).
            let _ = inotify::remove_watch(self.fd.get_ref(), wd);
        }
        for _ in 0..REARM_TRIES {
            if let Some(dir) = self
                .state
                .open_checked()
                // The kind alone: the daemon's warning names the directory already.
                .map_err(|e| io::Error::other(e.kind))?
            {
                let wd = add_watch(&self.fd, &dir, state_flags())?;
                self.watch = Some((wd, Target::State));
                return Ok(());
            }
            let (dir, next, fd) = nearest_ancestor(self.state.root())?;
            let wd = add_watch(&self.fd, &fd, ancestor_flags())?;
            self.watch = Some((
                wd,
                Target::Ancestor {
                    dir: dir.clone(),
                    next: next.clone(),
                },
            ));
            // Looked up in the directory held, never following a link: a user's link
            // to a stalled FUSE or NFS mount must not hang the daemon here. Anything
            // but a directory (or root's link) there is waited out: its replacement
            // is an event.
            let flags = rustix::fs::AtFlags::SYMLINK_NOFOLLOW;
            match rustix::fs::statat(&fd, next.as_os_str(), flags) {
                Err(rustix::io::Errno::NOENT) => return Ok(()),
                Err(e) => return Err(e.into()),
                Ok(stat) if !walkable(&stat) => return Ok(()),
                Ok(_) => {}
            }
            // `next` appeared before the watch did: move down.
            let _ = inotify::remove_watch(self.fd.get_ref(), wd);
            self.watch = None;
        }
        Err(io::Error::other(format!(
            "{} kept changing while it was being watched",
            self.state.root().display()
        )))
    }
}

fn state_flags() -> WatchFlags {
    WatchFlags::CLOSE_WRITE
        | WatchFlags::MOVED_TO
        | WatchFlags::MOVED_FROM
        | WatchFlags::DELETE
        | WatchFlags::DELETE_SELF
        | WatchFlags::MOVE_SELF
}

fn ancestor_flags() -> WatchFlags {
    WatchFlags::CREATE
        | WatchFlags::MOVED_TO
        | WatchFlags::DELETE_SELF
        | WatchFlags::MOVE_SELF
        | WatchFlags::ONLYDIR
}

/// Watches the directory open as `dir` through its descriptor's `/proc` link, so the
/// watch lands on the directory checked, never on whatever is mounted on its path by
/// then (watching a path asks a FUSE server for permission).
fn add_watch(inotify: &AsyncFd<OwnedFd>, dir: &OwnedFd, flags: WatchFlags) -> io::Result<i32> {
    let link = format!("/proc/self/fd/{}", dir.as_raw_fd());
    Ok(inotify::add_watch(inotify.get_ref(), link, flags)?)
}

/// A directory, or a link root owns (the administrator's): what the watch moves onto.
fn walkable(stat: &rustix::fs::Stat) -> bool {
    let kind = rustix::fs::FileType::from_raw_mode(stat.st_mode);
    kind == rustix::fs::FileType::Directory
        || (kind == rustix::fs::FileType::Symlink && stat.st_uid == 0)
}

/// The nearest ancestor of `root` that exists (the administrator's path, as the state
/// directory's parent is opened), the component of `root` that follows it, and the
/// ancestor opened.
fn nearest_ancestor(root: &Path) -> io::Result<(PathBuf, OsString, OwnedFd)> {
    let root = std::path::absolute(root)?;
    let mut child = root.as_path();
    while let Some(parent) = child.parent() {
        // The administrator's path, as the state directory's parent is opened; but a
        // link as its last component is followed only if root owns it (`/var/tmp` may
        // be root's link to `/tmp`): a user's could lead to a stalled FUSE mount, and
        // the watch then goes further up.
        let follow = rustix::fs::lstat(parent).is_ok_and(|stat| walkable(&stat));
        let nofollow = if follow {
            OFlags::empty()
        } else {
            OFlags::NOFOLLOW
        };
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | nofollow;
        match rustix::fs::open(parent, flags, Mode::empty()) {
            Ok(fd) => {
                let next = child.file_name().unwrap_or_default().to_owned();
                return Ok((parent.to_owned(), next, fd));
            }
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR) => child = parent,
            Err(e) => return Err(e.into()),
        }
    }
    Err(io::Error::other(format!(
        "no ancestor of {} exists",
        root.display()
    )))
}

#[cfg(test)]
mod tests;
