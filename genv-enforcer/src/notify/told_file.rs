//! Where a host keeps what it told its users when no daemon runs there to keep it:
//! `<run-dir>/told/<uid>.json`, one file per uid, the last [`PER_FILE`] decisions about
//! that uid's processes, a line of JSON each.
//!
//! Only `usage execute --with-reasons` writes here (a remote stop on a host without a
//! daemon, [`super::relay`]); `genv-enforcer why` reads the caller's own file beside
//! the daemon's answer. Root owns the directory and every file in it, so no user can
//! put a file, a link or a FIFO where root writes, or grow a file root must read. The
//! user may read their own file through an ACL entry (`user:<uid>:r--`, mode 0640
//! otherwise root's): the same view the daemon's socket gives, each user their own.
//! Where the file system keeps no ACLs the file stays root's alone, and `why` says so.
//!
//! A file is replaced whole (written beside it, then renamed over it) under a lock only
//! root can open, so a reader sees the old list or the new one, and no user can hold
//! up a writer.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, Mode, OFlags};

use super::decision::Decision;

/// The directory's name in the run directory.
pub const DIR: &str = "told";
/// Decisions kept per uid.
pub const PER_FILE: usize = 256;
/// Files kept at most: past it, the one written longest ago goes for a new uid's (a
/// user's subordinate uids could otherwise each have one).
const MAX_FILES: usize = 4096;
/// The most read of one file: far more than [`PER_FILE`] decisions take.
const MAX_BYTES: u64 = 1 << 20;
/// The writers' lock, root's alone.
const LOCK: &str = ".lock";

#[derive(Debug, thiserror::Error)]
pub enum ToldFileError {
    #[error("{0} is not root's alone (owner uid {1}, mode {2:o})")]
    Unsafe(PathBuf, u32, u32),
    #[error("{0}: {1}")]
    Io(PathBuf, io::Error),
}

/// `<run_dir>/told/<uid>.json`.
pub fn path(run_dir: &Path, uid: u32) -> PathBuf {
    run_dir.join(DIR).join(format!("{uid}.json"))
}

/// Adds `decision` to its uid's file, keeping the newest [`PER_FILE`]; the run directory
/// and `told/` are made (root's, 0755) where missing. Returns the file's path and
/// whether its user can read it.
pub fn append(run_dir: &Path, decision: &Decision) -> Result<(PathBuf, bool), ToldFileError> {
    root_dir(run_dir)?;
    let dir = run_dir.join(DIR);
    root_dir(&dir)?;
    let at = |e: io::Error| ToldFileError::Io(dir.clone(), e);
    let lock = rfs::openat(
        open_dir(&dir).map_err(at)?,
        LOCK,
        OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| at(e.into()))?;
    rfs::flock(&lock, rfs::FlockOperation::LockExclusive).map_err(|e| at(e.into()))?;
    let file = path(run_dir, decision.uid);
    if !file.exists() {
        make_room(&dir);
    }
    let mut kept = read_file(&file).unwrap_or_default();
    kept.push(decision.clone());
    let excess = kept.len().saturating_sub(PER_FILE);
    kept.drain(..excess);
    let readable =
        replace(&file, decision.uid, &kept).map_err(|e| ToldFileError::Io(file.clone(), e))?;
    Ok((file, readable))
}

/// The decisions in the files `caller` may read: their own uid's, or every uid's for
/// root. A file that cannot be read counts as empty; `Err` only says the caller's own
/// file is there and kept from them (no ACLs where it lies).
pub fn read(run_dir: &Path, caller: u32) -> Result<Vec<Decision>, ToldFileError> {
    if caller != 0 {
        let file = path(run_dir, caller);
        return match read_file(&file) {
            Ok(decisions) => Ok(mine(decisions, caller)),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                Err(ToldFileError::Io(file, e))
            }
            Err(_) => Ok(Vec::new()),
        };
    }
    let Ok(entries) = std::fs::read_dir(run_dir.join(DIR)) else {
        return Ok(Vec::new());
    };
    let mut all = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let uid = name
            .to_str()
            .and_then(|n| n.strip_suffix(".json")?.parse().ok());
        if let Some(uid) = uid {
            all.extend(mine(read_file(&entry.path()).unwrap_or_default(), uid));
        }
    }
    all.sort_by_key(|d| d.time);
    Ok(all)
}

/// Whether `run_dir` may be used: missing, or a directory root owns that no one else
/// may write (a socket or a file there is root's to trust).
pub fn check_run_dir(run_dir: &Path) -> Result<(), ToldFileError> {
    match std::fs::symlink_metadata(run_dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ToldFileError::Io(run_dir.to_owned(), e)),
        Ok(meta) if !meta.is_dir() || meta.uid() != 0 || meta.mode() & 0o022 != 0 => Err(
            ToldFileError::Unsafe(run_dir.to_owned(), meta.uid(), meta.mode() & 0o7777),
        ),
        Ok(_) => Ok(()),
    }
}

/// Removes the file written longest ago where `dir` holds [`MAX_FILES`] already.
fn make_room(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let files: Vec<(std::time::SystemTime, PathBuf)> = (entries.flatten())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    if files.len() >= MAX_FILES {
        if let Some((_, oldest)) = files.into_iter().min() {
            let _ = std::fs::remove_file(oldest);
        }
    }
}

/// Only `uid`'s: the file is named by uid, and a line about another is not believed.
fn mine(decisions: Vec<Decision>, uid: u32) -> Vec<Decision> {
    decisions.into_iter().filter(|d| d.uid == uid).collect()
}

/// `dir`, made root's 0711 if missing (anyone may reach a file by its name, no one but
/// root list whose are there); refused unless it is a directory root owns that no one
/// else may write.
fn root_dir(dir: &Path) -> Result<(), ToldFileError> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o711).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => {
            return Err(ToldFileError::Io(dir.to_owned(), e));
        }
        _ => {}
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| ToldFileError::Io(dir.to_owned(), e))?;
    if !meta.is_dir() || meta.uid() != 0 || meta.mode() & 0o022 != 0 {
        return Err(ToldFileError::Unsafe(
            dir.to_owned(),
            meta.uid(),
            meta.mode() & 0o7777,
        ));
    }
    Ok(())
}

fn open_dir(dir: &Path) -> io::Result<OwnedFd> {
    let flags = OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::RDONLY | OFlags::CLOEXEC;
    Ok(rfs::open(dir, flags, Mode::empty())?)
}

/// Decisions from one file: a regular file root owns, at most [`MAX_BYTES`]; lines that
/// do not read are skipped.
fn read_file(file: &Path) -> io::Result<Vec<Decision>> {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let fd = rfs::open(file, flags, Mode::empty())?;
    let stat = rfs::fstat(&fd)?;
    if rfs::FileType::from_raw_mode(stat.st_mode) != rfs::FileType::RegularFile || stat.st_uid != 0
    {
        return Err(io::Error::other("not a regular file of root's"));
    }
    let mut text = Vec::new();
    std::fs::File::from(fd)
        .take(MAX_BYTES)
        .read_to_end(&mut text)?;
    Ok(text
        .split(|b| *b == b'\n')
        .filter_map(|line| serde_json::from_slice(line).ok())
        .collect())
}

/// Writes `kept` beside `file` and renames it over; its user may read it where the
/// file system keeps ACLs (the returned bool).
fn replace(file: &Path, uid: u32, kept: &[Decision]) -> io::Result<bool> {
    let temporary = file.with_extension("json.new");
    let _ = std::fs::remove_file(&temporary);
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let fd = rfs::open(&temporary, flags, Mode::from_raw_mode(0o600))?;
    rfs::fchown(&fd, Some(rfs::Uid::ROOT), Some(rfs::Gid::ROOT))?;
    rfs::fchmod(&fd, Mode::from_raw_mode(0o640))?;
    let readable = let_read(&fd, uid).is_ok();
    if !readable {
        rfs::fchmod(&fd, Mode::from_raw_mode(0o600))?;
    }
    let mut out = io::BufWriter::new(std::fs::File::from(fd));
    for decision in kept {
        serde_json::to_writer(&mut out, decision)?;
        out.write_all(b"\n")?;
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&temporary, file)?;
    Ok(readable)
}

/// The ACL `user::rw-, user:<uid>:r--, group::---, mask::r--, other::---`: the file
/// stays root's, and `uid` may read it. Linux's `system.posix_acl_access` format: a
/// version, then (tag, permissions, id) entries in tag order.
fn let_read(fd: impl AsFd, uid: u32) -> io::Result<()> {
    const VERSION: u32 = 2;
    const UNDEFINED: u32 = u32::MAX;
    let entries: [(u16, u16, u32); 5] = [
        (0x01, 6, UNDEFINED), // ACL_USER_OBJ
        (0x02, 4, uid),       // ACL_USER
        (0x04, 0, UNDEFINED), // ACL_GROUP_OBJ
        (0x10, 4, UNDEFINED), // ACL_MASK
        (0x20, 0, UNDEFINED), // ACL_OTHER
    ];
    let mut value = VERSION.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        value.extend_from_slice(&tag.to_le_bytes());
        value.extend_from_slice(&perm.to_le_bytes());
        value.extend_from_slice(&id.to_le_bytes());
    }
    rfs::fsetxattr(
        fd,
        "system.posix_acl_access",
        &value,
        rfs::XattrFlags::empty(),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::tests::{decision, unique};
    use std::os::unix::fs::PermissionsExt;

    fn run_dir() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("genv-told-{}-{}", std::process::id(), unique()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }

    #[test]
    fn a_users_file_keeps_their_newest_decisions_and_root_reads_all() {
        let dir = run_dir();
        for pid in 1..=(PER_FILE as u32 + 2) {
            append(&dir, &decision(pid, 4242)).unwrap();
        }
        append(&dir, &decision(9, 4343)).unwrap();
        let alice = read(&dir, 4242).unwrap();
        assert_eq!(alice.len(), PER_FILE);
        assert_eq!(alice.first().map(|d| d.pid), Some(3), "the oldest went");
        assert_eq!(read(&dir, 4343).unwrap().len(), 1);
        assert_eq!(read(&dir, 0).unwrap().len(), PER_FILE + 1);
        let (file, readable) = append(&dir, &decision(9, 4343)).unwrap();
        assert!(readable, "this machine's file systems keep ACLs");
        let meta = std::fs::metadata(&file).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o7777), (0, 0o640));
        let acl = rustix::fs::getxattr(&file, "system.posix_acl_access", &mut [0u8; 64]);
        assert_eq!(acl.unwrap(), 4 + 5 * 8, "five entries, one for uid 4343");
        let told = std::fs::metadata(dir.join(DIR)).unwrap();
        assert_eq!(told.mode() & 0o7777, 0o711);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_run_directory_another_user_may_write_is_refused() {
        let dir = run_dir();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = append(&dir, &decision(1, 4242)).unwrap_err();
        assert!(matches!(err, ToldFileError::Unsafe(..)), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
