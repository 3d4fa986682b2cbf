//! What is mounted where, as the kernel itself tells it.
//!
//! Any user can mount a FUSE file system (through the setuid `fusermount`) on a
//! directory they can write that is not someone else's sticky one, and on a regular file
//! they can open for writing: the 0777 state directory and its 0666 files qualify. Every
//! open, `stat` or `flock` of such a mount is a request to the mounting user's server,
//! which may forge the answer or never give one, and a thread waiting on it does not
//! even wake for SIGTERM. So what a mount is, is read from
//! `/proc/thread-self/fdinfo/N` (the mount's id) and `/proc/thread-self/mountinfo` (its
//! file system type): text the kernel writes from its own records, without asking the
//! file system anything. Never from `stat`/`statfs` of the mount, which FUSE serves.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::fd::{AsFd, AsRawFd};

/// A mount, as one line of `mountinfo` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Mount {
    pub id: u64,
    /// `tmpfs`, `ext4`, `fuse`, `fuse.sshfs`, `fuseblk`, ...
    pub fstype: String,
}

impl Mount {
    /// Served by a FUSE server: `fuse`, `fuseblk`, or either with a subtype
    /// (`fuse.sshfs`), as the kernel names them.
    pub fn is_fuse(&self) -> bool {
        let base = self.fstype.split('.').next().unwrap_or_default();
        base == "fuse" || base == "fuseblk"
    }
}

/// The mount that `fd` (an `O_PATH` descriptor is enough) lies on, found by the mount
/// id the kernel gives for the descriptor. Neither read calls into that file system.
pub(super) fn of(fd: impl AsFd) -> io::Result<Mount> {
    of_in(fd, "/proc/thread-self/mountinfo")
}

/// The largest `mountinfo` read: a namespace with more mounts than this is refused.
const MOUNTINFO_LIMIT: u64 = 8 << 20;

/// A mount namespace's table, read once, for asking about many descriptors (every file
/// a process maps): which mounts, and which devices, FUSE serves.
pub struct MountTable {
    /// The `mountinfo` read, for messages.
    source: String,
    listed: HashSet<u64>,
    fuse: HashSet<u64>,
    fuse_devices: HashSet<u64>,
}

impl MountTable {
    /// Reads `mountinfo` (`/proc/<pid>/mountinfo`: the namespace a file was reached
    /// through).
    pub fn read(mountinfo: &str) -> io::Result<Self> {
        use io::Read;
        let mut text = String::new();
        let read = fs::File::open(mountinfo)
            .and_then(|f| f.take(MOUNTINFO_LIMIT + 1).read_to_string(&mut text))
            .map_err(|e| context(mountinfo, e))?;
        if read as u64 > MOUNTINFO_LIMIT {
            return Err(invalid(mountinfo, "too many mounts to read"));
        }
        let mut table = Self {
            source: mountinfo.to_owned(),
            listed: HashSet::new(),
            fuse: HashSet::new(),
            fuse_devices: HashSet::new(),
        };
        for line in text.lines() {
            let Some(mount) = parse_line(line) else {
                continue;
            };
            table.listed.insert(mount.id);
            if mount.is_fuse() {
                table.fuse.insert(mount.id);
                table.fuse_devices.extend(device(line));
            }
        }
        Ok(table)
    }

    /// Whether `fd` (an `O_PATH` descriptor is enough) lies on a FUSE mount; an error if
    /// its mount is not in this table.
    pub fn serves_fuse(&self, fd: impl AsFd) -> io::Result<bool> {
        let fd = fd.as_fd().as_raw_fd();
        let fdinfo = format!("/proc/thread-self/fdinfo/{fd}");
        let text = fs::read_to_string(&fdinfo).map_err(|e| context(&fdinfo, e))?;
        let id = mount_id(&text).ok_or_else(|| invalid(&fdinfo, "no mnt_id"))?;
        if !self.listed.contains(&id) {
            return Err(invalid(&self.source, &format!("mount {id} is not listed")));
        }
        Ok(self.fuse.contains(&id))
    }

    /// Whether the device `dev` (`st_dev`'s encoding) is one a FUSE mount of this table
    /// is on: a file there is refused without being opened at all.
    pub fn is_fuse_device(&self, dev: u64) -> bool {
        self.fuse_devices.contains(&dev)
    }
}

/// The device field (`0:40`) of a `mountinfo` line, as `st_dev` encodes it.
fn device(line: &str) -> Option<u64> {
    let (major, minor) = line.split(' ').nth(2)?.split_once(':')?;
    Some(libc::makedev(major.parse().ok()?, minor.parse().ok()?))
}

fn of_in(fd: impl AsFd, mountinfo: &str) -> io::Result<Mount> {
    let fd = fd.as_fd().as_raw_fd();
    let fdinfo = format!("/proc/thread-self/fdinfo/{fd}");
    let text = fs::read_to_string(&fdinfo).map_err(|e| context(&fdinfo, e))?;
    let id = mount_id(&text).ok_or_else(|| invalid(&fdinfo, "no mnt_id"))?;
    let table = fs::read_to_string(mountinfo).map_err(|e| context(mountinfo, e))?;
    table
        .lines()
        .filter_map(parse_line)
        .find(|mount| mount.id == id)
        .ok_or_else(|| invalid(mountinfo, &format!("mount {id} is not listed")))
}

fn context(path: &str, error: io::Error) -> io::Error {
    io::Error::new(error.kind(), format!("{path}: {error}"))
}

fn invalid(path: &str, what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{path}: {what}"))
}

/// `mnt_id:\t69` in an fdinfo file.
fn mount_id(fdinfo: &str) -> Option<u64> {
    fdinfo
        .lines()
        .find_map(|line| line.strip_prefix("mnt_id:"))
        .and_then(|id| id.trim().parse().ok())
}

/// `69 46 0:40 / /var/tmp/genv/envs.json rw,relatime shared:7 - fuse.sshfs src rw,...`:
/// the id, then the file system type after the `-`. `None` for a line not of that
/// shape.
pub(super) fn parse_line(line: &str) -> Option<Mount> {
    let mut fields = line.split(' ');
    let id = fields.next()?.parse().ok()?;
    // Parent, device, root, mount point and options, then optional fields up to `-`.
    fields.nth(4)?;
    fields.find(|field| *field == "-")?;
    let fstype = unescape(fields.next()?);
    Some(Mount { id, fstype })
}

/// mountinfo writes space, tab, newline and backslash as `\ooo` octal escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let octal = bytes.get(at + 1..at + 4).filter(|digits| {
            bytes[at] == b'\\' && digits.iter().all(|d| (b'0'..=b'7').contains(d))
        });
        match octal {
            Some(digits) => {
                let value = digits.iter().fold(0u32, |v, d| v * 8 + u32::from(d - b'0'));
                out.push(u8::try_from(value).unwrap_or(b'?'));
                at += 4;
            }
            None => {
                out.push(bytes[at]);
                at += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as kernels 6.1 to 6.18 write them (from real `/proc/self/mountinfo`s).
    const LINES: [&str; 7] = [
        "26 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,errors=remount-ro",
        "69 46 0:40 / /var/tmp/genv/envs.json rw,relatime - fuse x rw,user_id=0,group_id=0,default_permissions,allow_other",
        "70 26 0:41 / /var/tmp/genv rw,nosuid,nodev,relatime shared:32 master:5 - fuse.sshfs mallory@host:/x rw,user_id=1000,group_id=1000",
        "71 26 8:17 / /mnt/usb rw,relatime - fuseblk /dev/sdb1 rw,user_id=0,group_id=0,allow_other,blksize=4096",
        "72 26 0:42 / /var/tmp/genv rw,nosuid,nodev shared:40 - tmpfs tmpfs rw,size=65536k,mode=777",
        "73 26 254:1 /srv/genv\\040state /var/tmp/my\\040genv rw,relatime shared:1 - ext4 /dev/vda1 rw",
        "74 26 0:43 / /run/user/1000/doc rw,nosuid,nodev,relatime shared:50 - fuse.portal portal rw,user_id=1000",
    ];

    fn parsed(at: usize) -> Mount {
        parse_line(LINES[at]).unwrap()
    }

    #[test]
    fn reads_id_and_type() {
        assert_eq!(
            parsed(1),
            Mount {
                id: 69,
                fstype: "fuse".into()
            }
        );
        // Optional fields (shared:, master:) before the separator.
        assert_eq!(
            (parsed(2).id, parsed(2).fstype.as_str()),
            (70, "fuse.sshfs")
        );
        assert_eq!(parsed(4).fstype, "tmpfs");
        // Escaped spaces in the root and the mount point.
        assert_eq!((parsed(5).id, parsed(5).fstype.as_str()), (73, "ext4"));
    }

    #[test]
    fn unescapes_octal_escapes() {
        assert_eq!(unescape("fuse.my\\040fs"), "fuse.my fs");
        assert_eq!(unescape("a\\011b\\012c\\134d"), "a\tb\nc\\d");
        // Not an escape: left as it is.
        assert_eq!(unescape("a\\9b\\"), "a\\9b\\");
    }

    #[test]
    fn tells_fuse_from_the_rest() {
        let fuse: Vec<bool> = (0..LINES.len()).map(|at| parsed(at).is_fuse()).collect();
        assert_eq!(fuse, [false, true, true, true, false, false, true]);
        let named = |fstype: &str| Mount {
            id: 1,
            fstype: fstype.into(),
        };
        assert!(named("fuseblk.ntfs-3g").is_fuse());
        assert!(!named("fusectl").is_fuse());
        assert!(!named("virtiofs").is_fuse());
    }

    #[test]
    fn rejects_lines_of_another_shape() {
        assert_eq!(parse_line(""), None);
        assert_eq!(parse_line("x 1 0:1 / / rw - ext4 a rw"), None);
        assert_eq!(
            parse_line("26 1 254:1 / / rw shared:1 ext4 /dev/vda1"),
            None
        );
    }

    #[test]
    fn reads_the_device_of_a_mount() {
        assert_eq!(device(LINES[1]), Some(libc::makedev(0, 40)));
        assert_eq!(device(LINES[0]), Some(libc::makedev(254, 1)));
        assert_eq!(device("69 46 zz / /"), None);
    }

    #[test]
    fn a_table_answers_for_descriptors_it_lists() {
        let table = MountTable::read("/proc/thread-self/mountinfo").unwrap();
        let root = std::fs::File::open("/").unwrap();
        assert!(!table.serves_fuse(&root).unwrap());
        let empty = MountTable {
            source: "none".into(),
            listed: HashSet::new(),
            fuse: HashSet::new(),
            fuse_devices: HashSet::from([libc::makedev(0, 40)]),
        };
        assert!(empty.serves_fuse(&root).is_err(), "not listed: refused");
        assert!(empty.is_fuse_device(libc::makedev(0, 40)));
    }

    #[test]
    fn reads_the_mount_id_of_a_descriptor() {
        assert_eq!(
            mount_id("pos:\t0\nflags:\t010400000\nmnt_id:\t69\nino:\t1\n"),
            Some(69)
        );
        assert_eq!(mount_id("pos:\t0\n"), None);
        // This process's root is listed, under the id its fdinfo gives.
        let root = std::fs::File::open("/").unwrap();
        let fdinfo = format!("/proc/thread-self/fdinfo/{}", root.as_raw_fd());
        let id = mount_id(&fs::read_to_string(fdinfo).unwrap()).unwrap();
        assert_eq!(of(&root).unwrap().id, id);
    }
}
