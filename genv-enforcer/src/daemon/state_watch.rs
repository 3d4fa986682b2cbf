//! inotify on genv's state directory: a write to `envs.json` or `devices.json` (genv
//! rewrites them in place under its lock; other tools may rename into place) triggers a
//! full cycle at once.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::Path;

use rustix::fs::inotify::{self, CreateFlags, ReadFlags, WatchFlags};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

const FILES: [&str; 2] = ["envs.json", "devices.json"];

pub struct StateWatch {
    fd: AsyncFd<OwnedFd>,
    /// The directory's watch was removed (the directory went away).
    lost: bool,
}

impl StateWatch {
    pub fn new(dir: &Path) -> io::Result<Self> {
        let fd = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK)?;
        inotify::add_watch(
            &fd,
            dir,
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
