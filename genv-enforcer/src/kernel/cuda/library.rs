//! A libcuda to probe, opened so that no step can be made to wait on a user's file
//! server or to read another file than the one checked.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use super::{Exports, PROBES};
use crate::kernel::error::LoadError;
use crate::state::MountTable;

/// The largest library opened: a libcuda is tens of MB (only its symbol tables are
/// read, see [`crate::kernel::elf_symbols`]).
pub const LIBRARY_LIMIT: u64 = 256 << 20;

/// A file reached, not opened: an `O_PATH` descriptor, which asks the file system
/// nothing, on a mount checked not to be FUSE (any user's server, which could stall
/// every request). It can be told apart from other files ([`Self::version`]) before it
/// is opened.
pub struct Handle {
    fd: OwnedFd,
    /// What it is called in messages.
    pub name: String,
}

impl Handle {
    /// Reaches `path`, through the mount namespace `table` lists; refused on FUSE, or
    /// on a mount the table does not list.
    pub fn new(path: &Path, name: String, table: &MountTable) -> Result<Self, LoadError> {
        use rustix::fs::{Mode, OFlags};
        let refuse = |why: String| LoadError::Library(format!("{name}: {why}"));
        let fd = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| refuse(e.to_string()))?;
        match table.serves_fuse(&fd) {
            Ok(false) => Ok(Self { fd, name }),
            Ok(true) => Err(refuse("on a FUSE file system: not read".into())),
            Err(e) => Err(refuse(format!("cannot tell its file system: {e}"))),
        }
    }

    /// Its device, inode and what changes with its contents.
    #[allow(clippy::unnecessary_cast)] // `stat`'s field types differ between machines
    pub fn version(&self) -> Option<FileVersion> {
        rustix::fs::fstat(&self.fd).ok().map(|st| FileVersion {
            dev: st.st_dev,
            inode: st.st_ino,
            size: st.st_size as u64,
            modified: (st.st_mtime as i64, st.st_mtime_nsec as i64),
            changed: (st.st_ctime as i64, st.st_ctime_nsec as i64),
        })
    }

    /// Opens it for reading, through this descriptor, without blocking or taking a
    /// terminal: a regular file of at most [`LIBRARY_LIMIT`] bytes, else refused.
    pub fn open(self) -> Result<Library, LoadError> {
        use std::os::unix::fs::OpenOptionsExt;
        let name = self.name;
        let refuse = |why: String| LoadError::Library(format!("{name}: {why}"));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
            .map_err(|e| refuse(e.to_string()))?;
        let meta = file.metadata().map_err(|e| refuse(e.to_string()))?;
        if !meta.is_file() {
            return Err(refuse("not a regular file".into()));
        }
        if meta.len() > LIBRARY_LIMIT {
            return Err(refuse(format!(
                "{} bytes, over {LIBRARY_LIMIT}",
                meta.len()
            )));
        }
        Ok(Library { file, name })
    }
}

/// A file as [`Handle::version`] tells it: its device and inode, and what changes with
/// its contents (size, modification and change times), so that a new file given a
/// deleted one's inode is not taken for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileVersion {
    pub dev: u64,
    pub inode: u64,
    pub size: u64,
    pub modified: (i64, i64),
    pub changed: (i64, i64),
}

impl FileVersion {
    /// The file, whatever its contents.
    pub fn id(&self) -> (u64, u64) {
        (self.dev, self.inode)
    }
}

/// An open library, to be probed. Everything is done through this one descriptor: its
/// type and size are checked, its symbol tables read, and the probes attached through
/// `/proc/self/fd/N` at offsets found there, so that nothing is looked up by a path
/// someone else can change between the steps.
pub struct Library {
    pub(super) file: std::fs::File,
    /// What it is called in messages.
    pub name: String,
}

impl Library {
    /// Opens `path` (reached through the mount namespace `mountinfo` lists) for
    /// reading: first as `O_PATH`, so that a FUSE mount is refused before any open,
    /// stat or read reaches it, then through that descriptor (see [`Handle`]).
    pub fn open(path: &Path, name: String, mountinfo: &str) -> Result<Self, LoadError> {
        let table = MountTable::read(mountinfo)
            .map_err(|e| LoadError::Library(format!("{name}: cannot tell its file system: {e}")))?;
        Handle::new(path, name, &table)?.open()
    }

    /// Its device and inode (the file, whatever path reached it), and what changes
    /// with its contents.
    pub fn version(&self) -> Option<FileVersion> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.file.metadata().ok()?;
        Some(FileVersion {
            dev: meta.dev(),
            inode: meta.ino(),
            size: meta.size(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
        })
    }

    /// Where the probed calls start in it, read from its dynamic symbols (a bounded
    /// read, see [`crate::kernel::elf_symbols`]).
    pub fn exports(&self) -> Result<Exports, LoadError> {
        let wanted: Vec<&'static str> = PROBES
            .iter()
            .flat_map(|(_, symbols)| symbols.iter().copied())
            .collect();
        crate::kernel::elf_symbols::exported_offsets(&self.file, &wanted)
            .map(Exports)
            .map_err(|e| LoadError::Library(format!("{}: {e}", self.name)))
    }
}
