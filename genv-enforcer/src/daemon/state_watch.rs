//! inotify on genv's state directory: a write to `envs.json` or `devices.json` (genv
//! rewrites them in place under its lock; other tools may rename into place) triggers a
//! full cycle at once.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, OwnedFd};

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::state::StateDir;

const FILES: [&str; 2] = ["envs.json", "devices.json"];

pub struct StateWatch {
    fd: AsyncFd<OwnedFd>,
    /// The directory's watch was removed (the directory went away).
    lost: bool,
}

impl StateWatch {
    /// Watches the directory as the state is read from it: opened safely (a FUSE mount
    /// there is refused), then watched through its descriptor's `/proc` link, so that
    /// the watch lands on the directory checked, never on whatever is mounted on its
    /// path by then (watching a path asks a FUSE server for permission).
    pub fn new(state: &StateDir) -> io::Result<Self> {
        let dir = state
            .open_checked()
            .map_err(|e| io::Error::other(e.kind))?
            .ok_or(io::ErrorKind::NotFound)?;
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?;
        inotify::add_watch(
            &fd,
            format!("/proc/self/fd/{}", dir.as_raw_fd()),
            WatchFlags::CLOSE_WRITE
                | WatchFlags::MOVED_TO
                | WatchFlags::MOVED_FROM
                | WatchFlags::DELETE
                | WatchFlags::DELETE_SELF,
        )?;
        Ok(Self {
            // SAFETY: the AsyncFd owns the inotify descriptor.
            fd: unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?,
            lost: false,
        })
    }

    /// Whether the directory itself went away (the watch is then dead).
    pub fn is_lost(&self) -> bool {
        self.lost
    }

    /// Waits for inotify events; `true` if one concerns a state file.
    pub async fn changed(&mut self) -> io::Result<bool> {
        let mut guard = self.fd.readable().await?;
        let mut relevant = false;
        let mut buf = [MaybeUninit::<u8>::uninit(); 4096];
        let mut reader = inotify::Reader::new(guard.get_inner(), &mut buf);
        loop {
            match reader.next() {
                Ok(event) => {
                    if event.events().contains(ReadFlags::IGNORED) {
                        self.lost = true;
                        relevant = true;
                    }
                    if let Some(name) = event.file_name() {
                        relevant |= FILES.iter().any(|f| name.to_bytes() == f.as_bytes());
                    }
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(e) => return Err(e.into()),
            }
        }
        guard.clear_ready();
        Ok(relevant)
    }
}
