//! What a process maps: the files behind its executable mappings, from
//! `/proc/<pid>/maps`, each named by the `/proc/<pid>/map_files` link that reaches the
//! very file mapped (whatever was renamed, replaced or unlinked at its path since, and
//! whichever mount namespace the process is in).

use std::io::{self, Read};
use std::path::PathBuf;

/// The largest `/proc/<pid>/maps` read: a process with more mappings than this is
/// looked at only this far.
const MAPS_LIMIT: u64 = 4 << 20;

/// One file a process maps executable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// `/proc/<pid>/map_files/<range>`: opens the file mapped there.
    pub link: PathBuf,
    /// Its device (as `st_dev` encodes it) and inode, as the kernel lists them.
    pub dev: u64,
    pub inode: u64,
    /// Its path as the process saw it (for messages only: it may hold anything, and
    /// the file there may be another by now).
    pub path: String,
}

/// The files `pid` maps executable, each once (by device and inode), in the order
/// of their first mapping.
pub fn executable_files(pid: u32) -> io::Result<Vec<Mapping>> {
    let mut text = String::new();
    std::fs::File::open(format!("/proc/{pid}/maps"))?
        .take(MAPS_LIMIT)
        .read_to_string(&mut text)?;
    let mut seen = std::collections::HashSet::new();
    Ok(text
        .lines()
        .filter_map(|line| parse_line(pid, line))
        .filter(|m| seen.insert((m.dev, m.inode)))
        .collect())
}

/// `7f2c1a000000-7f2c1a200000 r-xp 00000000 fd:01 1234   /a path/lib (deleted)`: the
/// range, permissions, offset, device and inode, then the path: everything after the
/// fifth field, spaces included (the kernel pads before it and escapes only newlines).
/// `None` for a mapping that is not executable or not of a file.
fn parse_line(pid: u32, line: &str) -> Option<Mapping> {
    let mut rest = line;
    let mut field = || {
        let trimmed = rest.trim_start_matches(' ');
        let end = trimmed.find(' ').unwrap_or(trimmed.len());
        rest = &trimmed[end..];
        Some(&trimmed[..end]).filter(|f| !f.is_empty())
    };
    let (range, perms, _offset, dev, inode) = (field()?, field()?, field()?, field()?, field()?);
    let path = rest.trim_start_matches(' ');
    if perms.as_bytes().get(2) != Some(&b'x') || !path.starts_with('/') {
        return None; // not executable; anonymous, or [vdso] and the like
    }
    let inode: u64 = inode.parse().ok().filter(|&i| i != 0)?;
    let (major, minor) = dev.split_once(':')?;
    let major = u32::from_str_radix(major, 16).ok()?;
    let minor = u32::from_str_radix(minor, 16).ok()?;
    Some(Mapping {
        link: format!("/proc/{pid}/map_files/{range}").into(),
        dev: libc::makedev(major, minor),
        inode,
        path: path.strip_suffix(" (deleted)").unwrap_or(path).to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_everything_after_the_fifth_field() {
        let line = "7f00-7f10 r-xp 00001000 fd:01 1234                       /opt/my libs/libmine.so (deleted)";
        let mapping = parse_line(42, line).unwrap();
        assert_eq!(mapping.path, "/opt/my libs/libmine.so");
        assert_eq!(mapping.link, PathBuf::from("/proc/42/map_files/7f00-7f10"));
        assert_eq!((mapping.dev, mapping.inode), (libc::makedev(0xfd, 1), 1234));
        let spaced = "7f00-7f10 r-xp 00000000 00:2a 7 /a  b/ c";
        assert_eq!(parse_line(1, spaced).unwrap().path, "/a  b/ c");
    }

    #[test]
    fn only_executable_mappings_of_files_count() {
        for line in [
            "7f00-7f10 r--p 00000000 fd:01 1234 /usr/lib/libcuda.so.1",
            "7f00-7f10 rw-p 00000000 00:00 0 ",
            "7f00-7f10 r-xp 00000000 00:00 0 [vdso]",
            "7f00-7f10 r-xp 00000000 00:05 0 /anon",
            "7f00-7f10 r-xp",
            "",
            "7f00-7f10 r-xp 00000000 zz:01 12 /x",
        ] {
            assert_eq!(parse_line(1, line), None, "{line:?}");
        }
    }

    #[test]
    fn the_test_process_maps_its_own_executable() {
        let files = executable_files(std::process::id()).unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        assert!(
            files.iter().any(|m| m.path == exe.to_str().unwrap()),
            "{files:?}"
        );
        let ids: std::collections::HashSet<_> = files.iter().map(|m| (m.dev, m.inode)).collect();
        assert_eq!(ids.len(), files.len(), "each file once");
    }
}
