//! Why a name in the shared state directory was not opened, or opening it failed:
//! what [`super::safe_open`] refuses, in words an administrator can act on.

use std::fmt;
use std::io;

use rustix::fs::FileType;
use rustix::io::Errno;

use super::mounts;

/// What kind of thing a refused name turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileKind(pub(super) FileType);

impl FileKind {
    pub fn file_type(self) -> FileType {
        self.0
    }
}

impl fmt::Display for FileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            FileType::RegularFile => "a regular file",
            FileType::Directory => "a directory",
            FileType::Symlink => "a symbolic link",
            FileType::Fifo => "a FIFO",
            FileType::Socket => "a socket",
            FileType::CharacterDevice => "a character device",
            FileType::BlockDevice => "a block device",
            FileType::Unknown => "a file of unknown type",
        })
    }
}

/// What is mounted where a state file or the state directory is, for a refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountKind {
    /// The file system type as the kernel's mount table names it (`fuse.sshfs`,
    /// `tmpfs`); `None` where the table could not be read.
    pub fstype: Option<String>,
    pub fuse: bool,
}

impl MountKind {
    pub(super) fn of(mount: &mounts::Mount) -> Self {
        Self {
            fstype: Some(mount.fstype.clone()),
            fuse: mount.is_fuse(),
        }
    }

    fn risk(&self) -> &'static str {
        match self.fuse {
            true => " and a FUSE server (any user's process) could stall or forge every read",
            false => "",
        }
    }
}

impl fmt::Display for MountKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.fstype, self.fuse) {
            (Some(fstype), true) => write!(f, "a FUSE file system ({fstype})"),
            (Some(fstype), false) => write!(f, "a {fstype} file system"),
            (None, _) => f.write_str("a file system of unknown type"),
        }
    }
}

/// Why a name in the state directory was not used. Each is something genv itself never
/// makes there, so it is refused rather than worked around.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("is a symbolic link; state files are never followed through links")]
    Symlink,
    #[error("is {0}, not a regular file")]
    NotRegular(FileKind),
    #[error("is {0}, not a directory")]
    NotDirectory(FileKind),
    #[error("has {0} hard links; refusing to rewrite a file that is also another name")]
    HardLinked(u64),
    #[error("is larger than {cap} bytes, the most a state file is read up to")]
    TooLarge { cap: u64 },
    /// Something is mounted on a state file's name; genv never mounts anything there.
    #[error("is a mount point of {0}: not opened, since a state file is never a mount{risk}", risk = .0.risk())]
    MountedFile(MountKind),
    /// The state directory is a FUSE mount.
    #[error(
        "is a mount point of {0}: not opened, since a FUSE server (any user's process) could stall or forge every read"
    )]
    FuseDirectory(MountKind),
}

/// A refusal, or the system saying no.
#[derive(Debug)]
pub(super) enum OpenError {
    Refused(Refusal),
    Io(io::Error),
}

impl From<Refusal> for OpenError {
    fn from(refusal: Refusal) -> Self {
        Self::Refused(refusal)
    }
}

impl From<Errno> for OpenError {
    fn from(errno: Errno) -> Self {
        match errno {
            // Only `openat2` is missing anywhere the enforcer runs (Linux before 5.6,
            // or a seccomp filter that hides it).
            Errno::NOSYS => Self::Io(io::Error::new(
                io::ErrorKind::Unsupported,
                "openat2 is not available (Linux 5.6 or later is needed to open state files \
                 without following links or crossing mounts)",
            )),
            _ => Self::Io(errno.into()),
        }
    }
}

impl From<io::Error> for OpenError {
    fn from(error: io::Error) -> Self {
        Self::Io(error)
    }
}
