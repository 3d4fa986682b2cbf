//! Opening names in a directory that every user can write.
//!
//! genv makes `$GENV_TMPDIR` 0777 without the sticky bit, and genv users rely on that, so
//! any user can put anything under any name there at any moment: a symbolic link to
//! `/etc/ld.so.preload`, a FIFO that blocks its reader forever, a hard link to another
//! file, a file of many gigabytes. A root process that opens, truncates or chmods those
//! names by path does it to whatever they point at.
//!
//! So the directory is opened once per operation (never through a final symlink), each
//! file is opened relative to that descriptor with `O_NOFOLLOW` and `O_NONBLOCK`, and
//! what was opened is checked through the descriptor (`fstat`), never by name again.
//! Nothing is ever opened with `O_TRUNC`, and a mode is only set on a file this very
//! call created (`O_CREAT|O_EXCL`). The directory's parents are the administrator's
//! (`/var/tmp` is root's and sticky); only the last component is another user's to
//! replace.
//!
//! Any user can also mount a FUSE file system on those names (`fusermount` allows it on
//! a directory or file they can write), and a FUSE server answers every open, `stat` and
//! `flock` of its mount as it likes, or never. `O_NOFOLLOW`, `O_NONBLOCK` and `fstat` do
//! not see mounts. So every name is opened with `openat2(RESOLVE_NO_XDEV)` relative to
//! its parent's descriptor, which refuses to cross a mount before the mounted file
//! system is asked anything. A state file with anything mounted on it is refused. The
//! directory itself may be an administrator's mount (a tmpfs, a disk); what is mounted
//! there is read from the kernel's mount table ([`super::mounts`]), and a FUSE file
//! system is refused.

use std::ffi::OsStr;
use std::fs::{DirBuilder, File};
use std::io::{self, Read};
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, FileType, Mode, OFlags, ResolveFlags, Stat};
use rustix::io::Errno;

use super::mounts;
pub(super) use super::refusal::{FileKind, MountKind, OpenError, Refusal};

/// genv's modes (it runs under umask 0): every user's genv must be able to take the
/// lock and rewrite the state files, whoever created them.
const SHARED_DIR_MODE: u32 = 0o777;
const SHARED_FILE_MODE: u32 = 0o666;

/// How often to retry when a name disappears between `O_CREAT|O_EXCL` and a plain open
/// (someone deleting it in a loop); more means someone is playing games.
const OPEN_ATTEMPTS: usize = 3;

/// How a state file is opened for use.
#[derive(Clone, Copy, Debug)]
pub(super) enum Access {
    /// The lock: `flock` works on any open mode, and genv opens it read-write.
    ReadWrite,
    /// A state file about to be rewritten.
    WriteOnly,
}

impl Access {
    fn flags(self) -> OFlags {
        match self {
            Access::ReadWrite => OFlags::RDWR,
            Access::WriteOnly => OFlags::WRONLY,
        }
    }
}

/// Every open here: no controlling terminal, not inherited by what we exec.
fn base_flags() -> OFlags {
    OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY
}

/// Every name resolved here: never through a link, and never across a mount, which
/// fails with EXDEV before the mounted file system is asked anything.
fn beneath() -> ResolveFlags {
    ResolveFlags::NO_XDEV | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS
}

/// For `O_PATH` descriptors, which name a file without opening it (`openat2` refuses
/// any other flag beside them).
fn path_flags() -> OFlags {
    OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// `openat2(dir, name, flags, mode, beneath())`.
fn open_in(dir: &OwnedFd, name: &OsStr, flags: OFlags, mode: Mode) -> Result<OwnedFd, Errno> {
    rfs::openat2(dir, name, flags, mode, beneath())
}

/// The state directory, opened once for one operation.
#[derive(Debug)]
pub(super) struct Dir {
    fd: OwnedFd,
    path: PathBuf,
}

impl Dir {
    /// Opens an existing state directory; `None` if it does not exist (no state yet).
    /// Opened relative to its parent (the administrator's), never through a link; a
    /// mount point only where [`mounted_dir`] accepts what is mounted.
    pub fn open(path: &Path) -> Result<Option<Self>, OpenError> {
        let Some(name) = path.file_name() else {
            let error = io::Error::new(
                io::ErrorKind::InvalidInput,
                "names no directory (it is `/` or ends in `..`)",
            );
            return Err(error.into());
        };
        let parent = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
        let parent = match rfs::open(parent, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(errno) => return Err(errno.into()),
        };
        let flags = OFlags::RDONLY | OFlags::DIRECTORY | base_flags();
        let fd = match open_in(&parent, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(Errno::XDEV) => mounted_dir(&parent, name)?,
            // A final symlink fails with ELOOP, a file with ENOTDIR under O_DIRECTORY.
            Err(errno @ (Errno::LOOP | Errno::NOTDIR)) => {
                return Err(describe(&parent, name, errno, FileType::Directory));
            }
            Err(errno) => return Err(errno.into()),
        };
        Ok(Some(Self {
            fd,
            path: path.to_owned(),
        }))
    }

    /// Opens the state directory, creating it first as genv does when it is missing:
    /// parents as needed, the directory itself mode 0777 whatever our umask. (`mkdir`
    /// never follows a final symlink, so a planted link fails the open below.)
    pub fn create(path: &Path) -> Result<Self, OpenError> {
        if let Some(dir) = Self::open(path)? {
            return Ok(dir);
        }
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            DirBuilder::new()
                .recursive(true)
                .mode(SHARED_DIR_MODE)
                .create(parent)?;
        }
        let created = match rfs::mkdir(path, Mode::from_raw_mode(SHARED_DIR_MODE)) {
            Ok(()) => true,
            Err(Errno::EXIST) => false,
            Err(errno) => return Err(errno.into()),
        };
        let dir = Self::open(path)?.ok_or_else(|| OpenError::from(Errno::NOENT))?;
        if created {
            dir.share_if_ours(SHARED_DIR_MODE)?;
        }
        Ok(dir)
    }

    /// The path of `name` inside this directory, for messages.
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The directory's descriptor, for what must act on the directory checked here
    /// rather than on its path (an inotify watch).
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// Compensates our umask on a directory we just made. Should another user have
    /// swapped it for their own in between (only possible where they can write the
    /// parent), theirs is left as it is.
    fn share_if_ours(&self, mode: u32) -> Result<(), OpenError> {
        if rfs::fstat(&self.fd)?.st_uid == rustix::process::geteuid().as_raw() {
            rfs::fchmod(&self.fd, Mode::from_raw_mode(mode))?;
        }
        Ok(())
    }

    /// Opens `name` for reading: a regular file reached without following a link.
    /// `None` if it does not exist. `O_NONBLOCK` makes a FIFO open return at once, to
    /// be refused by the type check instead of waiting for a writer.
    pub fn open_read(&self, name: &str) -> Result<Option<File>, OpenError> {
        let flags = OFlags::RDONLY | OFlags::NONBLOCK | base_flags();
        match open_in(&self.fd, name.as_ref(), flags, Mode::empty()) {
            Ok(fd) => {
                regular(&fd)?;
                Ok(Some(fd.into()))
            }
            Err(Errno::NOENT) => Ok(None),
            Err(errno) => Err(self.describe(name, errno)),
        }
    }

    /// Opens `name`, creating it with genv's mode 0666 if it does not exist. Returns the
    /// file and whether this call created it. Creation is `O_CREAT|O_EXCL` (which never
    /// follows a link), and only a file created here gets its mode set; an existing one
    /// is opened without `O_CREAT` and must be a regular file. Never truncates.
    pub fn open_or_create(&self, name: &str, access: Access) -> Result<(File, bool), OpenError> {
        for _ in 0..OPEN_ATTEMPTS {
            if let Some(file) = self.create_new(name, access)? {
                return Ok((file, true));
            }
            let flags = access.flags() | OFlags::NONBLOCK | base_flags();
            match open_in(&self.fd, name.as_ref(), flags, Mode::empty()) {
                Ok(fd) => {
                    regular(&fd)?;
                    return Ok((fd.into(), false));
                }
                // Deleted between the two opens: try creating it again.
                Err(Errno::NOENT) => continue,
                Err(errno) => return Err(self.describe(name, errno)),
            }
        }
        Err(OpenError::Io(io::Error::other(format!(
            "{name} kept disappearing while being opened"
        ))))
    }

    /// Opens `name` to be rewritten in place: like [`Dir::open_or_create`], and an
    /// existing file must have exactly one link. genv's files always have one; a second
    /// name means the inode is also some other file, which a rewrite would clobber.
    pub fn open_for_rewrite(&self, name: &str) -> Result<File, OpenError> {
        let (file, created) = self.open_or_create(name, Access::WriteOnly)?;
        if !created {
            // `st_nlink` is u64 on x86_64, narrower on some other architectures.
            #[allow(clippy::useless_conversion)]
            let links = u64::from(rfs::fstat(&file)?.st_nlink);
            if links != 1 {
                return Err(Refusal::HardLinked(links).into());
            }
        }
        Ok(file)
    }

    /// `O_CREAT|O_EXCL`: `None` if the name exists (whatever it is, links included).
    fn create_new(&self, name: &str, access: Access) -> Result<Option<File>, OpenError> {
        let flags = access.flags() | OFlags::CREATE | OFlags::EXCL | base_flags();
        let mode = Mode::from_raw_mode(SHARED_FILE_MODE);
        match open_in(&self.fd, name.as_ref(), flags, mode) {
            Ok(fd) => {
                // Ours since a moment ago: give it genv's mode despite our umask.
                rfs::fchmod(&fd, Mode::from_raw_mode(SHARED_FILE_MODE))?;
                Ok(Some(fd.into()))
            }
            Err(Errno::EXIST) => Ok(None),
            Err(errno) => Err(self.describe(name, errno)),
        }
    }

    /// Turns a failed open of a state file into a clear refusal where the name is
    /// something genv never makes (a mount: EXDEV; a link: ELOOP; a FIFO without a
    /// reader: ENXIO; ...), else the error.
    fn describe(&self, name: &str, errno: Errno) -> OpenError {
        describe(&self.fd, name.as_ref(), errno, FileType::RegularFile)
    }
}

/// What `name` in `dir` is, where that explains why opening it as a `want` failed. It
/// is looked at through an `O_PATH` descriptor of the name itself (a link is not
/// followed, a mount not crossed), never with `stat` by name, which would ask a file
/// system mounted there.
fn describe(dir: &OwnedFd, name: &OsStr, errno: Errno, want: FileType) -> OpenError {
    let found = match open_in(dir, name, path_flags(), Mode::empty()) {
        Ok(fd) => rfs::fstat(&fd).map(|stat| kind(&stat)),
        Err(errno) => Err(errno),
    };
    match found {
        Err(Errno::XDEV) if want == FileType::RegularFile => mounted_file(dir, name),
        Ok(found) if found == want => errno.into(),
        Ok(FileType::Symlink) => Refusal::Symlink.into(),
        Ok(other) if want == FileType::Directory => Refusal::NotDirectory(FileKind(other)).into(),
        Ok(other) => Refusal::NotRegular(FileKind(other)).into(),
        Err(_) => errno.into(),
    }
}

/// The top mount on `name` in `dir`, and a descriptor of its root. `O_PATH` crosses the
/// mount without asking the mounted file system anything (no open, no permission
/// check); the type comes from the kernel's mount table.
fn top_mount(dir: &OwnedFd, name: &OsStr) -> Result<(OwnedFd, mounts::Mount), OpenError> {
    let resolve = ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    let top = rfs::openat2(dir, name, path_flags(), Mode::empty(), resolve)?;
    let mount = mounts::of(&top)?;
    Ok((top, mount))
}

/// The refusal of a state file that something is mounted on, saying what.
fn mounted_file(dir: &OwnedFd, name: &OsStr) -> OpenError {
    let kind = match top_mount(dir, name) {
        Ok((_, mount)) => MountKind::of(&mount),
        Err(_) => MountKind {
            fstype: None,
            fuse: false,
        },
    };
    Refusal::MountedFile(kind).into()
}

/// Opens a state directory that is a mount point: an administrator's tmpfs or disk is
/// used as it is, a FUSE file system is refused (so is a mount table that cannot be
/// read). Decided on the very descriptor then used, so that a mount stacked on it
/// meanwhile is not picked up.
fn mounted_dir(parent: &OwnedFd, name: &OsStr) -> Result<OwnedFd, OpenError> {
    let (top, mount) = top_mount(parent, name)?;
    if mount.is_fuse() {
        return Err(Refusal::FuseDirectory(MountKind::of(&mount)).into());
    }
    // Not FUSE: its `fstat` is the kernel's own.
    match kind(&rfs::fstat(&top)?) {
        FileType::Directory => {}
        FileType::Symlink => return Err(Refusal::Symlink.into()),
        other => return Err(Refusal::NotDirectory(FileKind(other)).into()),
    }
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC;
    Ok(open_in(&top, ".".as_ref(), flags, Mode::empty())?)
}

fn kind(stat: &Stat) -> FileType {
    FileType::from_raw_mode(stat.st_mode)
}

/// Checks, on the descriptor itself, that what was opened is a regular file.
pub(super) fn regular(fd: impl std::os::fd::AsFd) -> Result<Stat, OpenError> {
    let stat = rfs::fstat(fd)?;
    match kind(&stat) {
        FileType::RegularFile => Ok(stat),
        other => Err(Refusal::NotRegular(FileKind(other)).into()),
    }
}

/// Reads a whole file of at most `cap` bytes. A larger one is refused outright, never
/// parsed in part: checked by size first, then by reading one byte past the cap, since
/// another user can append while we read.
pub(super) fn read_capped(file: &File, cap: u64) -> Result<Vec<u8>, OpenError> {
    let size = u64::try_from(rfs::fstat(file)?.st_size).unwrap_or(0);
    if size > cap {
        return Err(Refusal::TooLarge { cap }.into());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(cap + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(Refusal::TooLarge { cap }.into());
    }
    Ok(bytes)
}
