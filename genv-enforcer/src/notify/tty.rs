//! A process's controlling terminal, found and opened as root without being fooled.
//!
//! The terminal is named by its device number (`tty_nr` in `/proc/<pid>/stat`, or what
//! the kernel recorded at the decision), never by a path a user gave. The number maps
//! to a node under `/dev` (root's), which is opened with `O_WRONLY | O_NOCTTY |
//! O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC` (no link followed, never made the daemon's own
//! terminal, never waited on) and then checked through its descriptor: a character
//! device with exactly that number, owned by the process's uid, and a terminal. Anything
//! else is left unwritten. The one write is non-blocking: a terminal whose output is
//! full or stopped (`^S`, nobody reading a pty) answers EAGAIN and the line is dropped.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;

/// A terminal's device number, as `st_rdev` has it.
pub type Rdev = u64;

/// Why a line was not written to a terminal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TtyRefusal {
    #[error("no node under /dev for this terminal number")]
    Unnamed,
    #[error("cannot open the terminal: {0}")]
    Open(Errno),
    #[error("the node is not a character device")]
    NotCharDevice,
    #[error("the node's device number is another")]
    OtherDevice,
    #[error("the terminal belongs to another user")]
    OtherOwner,
    #[error("the node is not a terminal")]
    NotATerminal,
    #[error("the terminal is not reading (full or stopped)")]
    Full,
    #[error("cannot write to the terminal: {0}")]
    Write(Errno),
}

/// `tty_nr` (the kernel's `new_encode_dev`) as a device number.
pub fn rdev_of_tty_nr(tty_nr: u32) -> Option<Rdev> {
    if tty_nr == 0 {
        return None;
    }
    let major = (tty_nr >> 8) & 0xfff;
    let minor = (tty_nr & 0xff) | ((tty_nr >> 12) & 0xfff00);
    Some(rustix::fs::makedev(major, minor))
}

/// The node under `/dev` for a terminal number: a pseudo-terminal (`/dev/pts/N`), a
/// virtual console (`/dev/ttyN`) or a serial line (`/dev/ttySN`).
pub fn path_of(rdev: Rdev) -> Option<PathBuf> {
    let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    match (major, minor) {
        // Unix98 pty slaves: 136, with the 20-bit minor as the index (137–143 are the
        // same range split in 8-bit minors, as older kernels numbered it).
        (136..=143, _) => Some(format!("/dev/pts/{}", (major - 136) * 256 + minor)),
        (4, 1..=63) => Some(format!("/dev/tty{minor}")),
        (4, 64..=255) => Some(format!("/dev/ttyS{}", minor - 64)),
        _ => None,
    }
    .map(PathBuf::from)
}

/// Opens terminal `rdev` for writing, if it is `uid`'s terminal.
pub fn open(rdev: Rdev, uid: u32) -> Result<OwnedFd, TtyRefusal> {
    let path = path_of(rdev).ok_or(TtyRefusal::Unnamed)?;
    open_checked(&path, rdev, uid)
}

/// Opens `path` and checks through the descriptor that it is terminal `rdev`, `uid`'s.
pub(super) fn open_checked(path: &Path, rdev: Rdev, uid: u32) -> Result<OwnedFd, TtyRefusal> {
    let flags =
        OFlags::WRONLY | OFlags::NOCTTY | OFlags::NONBLOCK | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rustix::fs::open(path, flags, Mode::empty()).map_err(TtyRefusal::Open)?;
    let stat = rustix::fs::fstat(&fd).map_err(TtyRefusal::Open)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::CharacterDevice {
        return Err(TtyRefusal::NotCharDevice);
    }
    if stat.st_rdev != rdev {
        return Err(TtyRefusal::OtherDevice);
    }
    if stat.st_uid != uid {
        return Err(TtyRefusal::OtherOwner);
    }
    // SAFETY: isatty only asks the kernel about the descriptor.
    if unsafe { libc::isatty(fd.as_fd().as_raw_fd()) } != 1 {
        return Err(TtyRefusal::NotATerminal);
    }
    Ok(fd)
}

/// Writes `bytes` in one non-blocking write; returns how many went.
pub fn write_once(fd: &OwnedFd, bytes: &[u8]) -> Result<usize, TtyRefusal> {
    match rustix::io::write(fd, bytes) {
        Ok(n) => Ok(n),
        Err(Errno::AGAIN) => Err(TtyRefusal::Full),
        Err(e) => Err(TtyRefusal::Write(e)),
    }
}

#[cfg(test)]
pub(crate) mod tests;
