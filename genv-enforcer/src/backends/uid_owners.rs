//! Whose a uid is, for the bounds the daemon keeps per user (the `why` journal's share,
//! its connections and requests, the terminal lines and log records a user gets).
//!
//! A uid is not a user. `useradd` gives each new user 65,536 subordinate uids
//! (`/etc/subuid`, which rootless podman and docker need), and `newuidmap` lets that user
//! run processes as any of them; a user namespace the user made runs its processes as
//! uids the kernel maps for it. Bounds kept per uid would give one user 65,536 shares. So:
//! - a uid in a range of `/etc/subuid` counts as that range's user (named there by uid
//!   or by a name `/etc/passwd` gives a uid; a name it does not know keys the range by
//!   its first uid, which still makes the range one share);
//! - else, a process in a user namespace below the daemon's counts as the owner of the
//!   outermost such namespace (`NS_GET_OWNER_UID`), which the kernel, not the process,
//!   says;
//! - else, the uid is its own owner.
//!
//! The owner only keys bounds; what `why` shows a caller is still by the process's uid.
//! `/etc/subuid` is root's; it is read again when it changes (at most once a second,
//! and at most [`FILE_BYTES`] of it).

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The subordinate uid ranges, where `useradd` and `usermod --add-subuids` write them.
pub const SUBUID: &str = "/etc/subuid";
/// The most of `/etc/subuid` read (a few hundred thousand users' lines).
const FILE_BYTES: u64 = 16 << 20;
/// How often the file's stamp is looked at, at most.
const RECHECK: Duration = Duration::from_secs(1);
/// Namespaces walked up, at most (the kernel allows 32 levels).
const MAX_DEPTH: usize = 33;

/// `_IO(0xb7, 0x2)` and `_IO(0xb7, 0x4)` from `linux/nsfs.h`.
const NS_GET_PARENT: libc::c_ulong = 0xb702;
const NS_GET_OWNER_UID: libc::c_ulong = 0xb704;

/// `(first, end, owner)`: uids `first..end` count as `owner`.
type Range = (u32, u32, u32);
/// What says a file changed: device, inode, modification time (s, ns), size.
type Stamp = (u64, u64, i64, i64, u64);

/// A uid's owner, from `/etc/subuid` and the kernel's user namespaces.
pub struct UidOwners {
    subuid: PathBuf,
    passwd: PathBuf,
    /// The daemon's own user namespace (device, inode).
    own_ns: Option<(u64, u64)>,
    /// The ranges, the file's stamp they were read at, when it was last looked at.
    ranges: Mutex<(Vec<Range>, Option<Stamp>, Option<Instant>)>,
}

impl Default for UidOwners {
    fn default() -> Self {
        Self::from_files(Path::new(SUBUID), Path::new("/etc/passwd"))
    }
}

impl UidOwners {
    /// Owners from these files instead of `/etc`'s (for tests).
    pub fn from_files(subuid: &Path, passwd: &Path) -> Self {
        let own_ns = std::fs::metadata("/proc/self/ns/user")
            .ok()
            .map(|m| (m.dev(), m.ino()));
        Self {
            subuid: subuid.to_owned(),
            passwd: passwd.to_owned(),
            own_ns,
            ranges: Mutex::new((Vec::new(), None, None)),
        }
    }

    /// Who `uid` (of process `pid`, where known) counts as. The kernel's word first: a
    /// process running as a subordinate uid is in a namespace its user made. Root owns
    /// no one's share (a namespace root made, LXD's `root:` ranges): those count as
    /// themselves.
    pub fn owner(&self, uid: u32, pid: Option<u32>) -> u32 {
        let owned = |owner: &u32| *owner != 0;
        (pid.and_then(|pid| self.namespace_owner(pid)).filter(owned))
            .or_else(|| self.range_owner(uid).filter(owned))
            .unwrap_or(uid)
    }

    fn range_owner(&self, uid: u32) -> Option<u32> {
        let mut state = self.ranges.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if state.2.is_none_or(|at| now.duration_since(at) >= RECHECK) {
            state.2 = Some(now);
            let stamp = stamp(&self.subuid);
            if stamp != state.1 {
                state.1 = stamp;
                state.0 = self.read_ranges();
            }
        }
        // Sorted by first uid: the last range starting at or below `uid`. Ranges do
        // not overlap in a file shadow-utils wrote; where they do, one of them counts.
        let ranges = &state.0;
        let at = ranges.partition_point(|(first, _, _)| *first <= uid);
        let (_, end, owner) = *ranges.get(at.checked_sub(1)?)?;
        (uid < end).then_some(owner)
    }

    /// `name_or_uid:first:count` lines; malformed ones are skipped (the file is root's:
    /// a line shadow-utils would not write says nothing about anyone).
    fn read_ranges(&self) -> Vec<Range> {
        let text = read_bounded(&self.subuid);
        if text.is_empty() {
            return Vec::new();
        }
        let passwd = read_bounded(&self.passwd);
        // Each name looked up once: a file of many users is read in linear time.
        let uids: std::collections::HashMap<&str, u32> = (passwd.lines())
            .filter_map(|l| {
                let mut fields = l.split(':');
                let name = fields.next()?;
                Some((name, fields.nth(1)?.parse().ok()?))
            })
            .collect();
        let mut ranges: Vec<Range> = (text.lines())
            .filter_map(|line| {
                let mut fields = line.trim().split(':');
                let (who, first, count) = (fields.next()?, fields.next()?, fields.next()?);
                let first: u32 = first.parse().ok()?;
                let count: u32 = count.parse().ok()?;
                let end = first.checked_add(count)?;
                let named = || uids.get(who).copied();
                let owner = who.parse().ok().or_else(named).unwrap_or(first);
                (count > 0).then_some((first, end, owner))
            })
            .collect();
        ranges.sort_unstable();
        ranges
    }

    /// The owner of the outermost user namespace below the daemon's that `pid` is in.
    fn namespace_owner(&self, pid: u32) -> Option<u32> {
        let own = self.own_ns?;
        let mut ns: OwnedFd = File::open(format!("/proc/{pid}/ns/user")).ok()?.into();
        if ids(&ns)? == own {
            return None;
        }
        for _ in 0..MAX_DEPTH {
            // SAFETY: an nsfs ioctl on a descriptor we own; it returns a new one or -1.
            let parent = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_PARENT) };
            if parent < 0 {
                return None;
            }
            // SAFETY: the kernel just gave us this descriptor, and nothing else owns it.
            let parent = unsafe { OwnedFd::from_raw_fd(parent) };
            if ids(&parent)? == own {
                let mut uid: libc::uid_t = 0;
                // SAFETY: NS_GET_OWNER_UID writes one uid_t to the pointer given.
                let got = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_OWNER_UID, &mut uid) };
                return (got == 0).then_some(uid);
            }
            ns = parent;
        }
        None
    }
}

/// A namespace's (device, inode).
fn ids(fd: &OwnedFd) -> Option<(u64, u64)> {
    let stat = rustix::fs::fstat(fd).ok()?;
    Some((stat.st_dev, stat.st_ino))
}

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size()))
}

/// The file's text, at most [`FILE_BYTES`]; empty where it cannot be read.
fn read_bounded(path: &Path) -> String {
    let mut text = String::new();
    if let Ok(file) = File::open(path) {
        let _ = file.take(FILE_BYTES).read_to_string(&mut text);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(subuid: &str) -> (UidOwners, PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "genv-uid-owners-{}-{}",
            std::process::id(),
            crate::notify::tests::unique()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("subuid"), subuid).unwrap();
        std::fs::write(
            dir.join("passwd"),
            "root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n",
        )
        .unwrap();
        (
            UidOwners::from_files(&dir.join("subuid"), &dir.join("passwd")),
            dir,
        )
    }

    #[test]
    fn a_subordinate_uid_counts_as_its_ranges_user() {
        let (owners, dir) = files(
            "alice:100000:65536\n1001:165536:65536\nghost:300000:10\nbad line\nx:1:0\nroot:400000:65536\n",
        );
        assert_eq!(owners.owner(100_000, None), 1000);
        assert_eq!(owners.owner(165_535, None), 1000);
        assert_eq!(owners.owner(165_536, None), 1001);
        // A name /etc/passwd does not know keys its range by its first uid.
        assert_eq!(owners.owner(300_009, None), 300_000);
        assert_eq!(owners.owner(300_010, None), 300_010);
        assert_eq!(owners.owner(1000, None), 1000);
        assert_eq!(owners.owner(1, None), 1, "an empty range owns nothing");
        assert_eq!(
            owners.owner(400_005, None),
            400_005,
            "root owns no one's share"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A process of uid 4321 that made a user namespace and sleeps in it: its owner is
    /// 4321 whatever uid it is asked about, as the kernel says.
    #[test]
    fn a_process_in_a_user_namespace_counts_as_the_namespaces_owner() {
        use std::os::unix::process::CommandExt;
        let (owners, dir) = files("");
        let mut command = std::process::Command::new("sleep");
        command.arg("30");
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            command.pre_exec(|| {
                if libc::setresgid(4321, 4321, 4321) != 0
                    || libc::setresuid(4321, 4321, 4321) != 0
                    || libc::unshare(libc::CLONE_NEWUSER) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .expect("a user namespace (unprivileged userns on)");
        assert_eq!(owners.owner(200_000, Some(child.id())), 4321);
        child.kill().unwrap();
        child.wait().unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_process_in_the_daemons_namespace_is_its_uids() {
        let (owners, dir) = files("");
        let me = std::process::id();
        assert_eq!(owners.owner(4242, Some(me)), 4242);
        assert_eq!(owners.owner(4242, Some(u32::MAX)), 4242, "no such process");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
