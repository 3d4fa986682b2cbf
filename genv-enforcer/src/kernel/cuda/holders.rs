//! Who holds an address space that a uprobe registration would wait for: the processes
//! that map a library and whose address spaces do not answer now, and the processes
//! whose threads wait where a holder's do (see `crate::backends::address_space`).

use crate::backends::procfs;

/// The largest `/proc/<pid>/maps` read.
const MAPS_LIMIT: u64 = 4 << 20;

/// The processes that map `file` and whose address spaces do not answer now (the
/// registration's walk would wait for them, holding `dup_mmap_sem`), with their owners.
/// A process whose mappings cannot be read in time (kernels that read them under the
/// lock) counts as one. What a user starts holding after this look is still waited for:
/// the look narrows the window, it cannot close it (see SECURITY.md).
pub(super) fn held_mappers(file: &std::fs::File) -> Vec<(u32, u32)> {
    use crate::backends::address_space::{self, NoAnswer, SpaceFile};
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else {
        return Vec::new();
    };
    let (major, minor) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let needle = format!(" {major:02x}:{minor:02x} {} ", meta.ino());
    let mut held = Vec::new();
    for pid in procfs::pids() {
        let Ok(stat) = procfs::stat(pid) else {
            continue;
        };
        let process = stat.image_of(pid);
        let path = format!("/proc/{pid}/maps");
        let maps = address_space::read(process, SpaceFile::Maps, move || {
            use std::io::Read;
            let mut text = String::new();
            // As far as `maps::executable_files` reads one.
            let _ = std::fs::File::open(path)
                .and_then(|file| file.take(MAPS_LIMIT).read_to_string(&mut text));
            text
        });
        let maps_it = match maps {
            Ok(maps) => maps.lines().any(|line| line.contains(&needle)),
            Err(NoAnswer::Held) => true,
            Err(NoAnswer::Busy) => false,
        };
        // Whether it holds its lock now: its block takes the lock to be read.
        let holds = maps_it
            && matches!(
                procfs::environment_id(pid),
                Err(procfs::EnvironError::NoAnswer(..))
            );
        if holds {
            held.push((pid, owner_of(pid)));
        }
    }
    held
}

/// Where the threads of a process that holds its own address space wait (`wchan`): on
/// its FUSE server, in the page fault that called it, or queued to map.
const WAITS_OF_A_HOLDER: [&str; 4] = ["fuse", "request_wait_answer", "filemap_fault", "mmap"];

/// Processes with a thread waiting on a FUSE server (as its `wchan` names the kernel
/// function it sleeps in), with their owners: the likely holders of their own address
/// spaces. Neither `wchan` nor the directory's owner takes a lock of the address space.
pub(super) fn holders() -> Vec<(u32, u32)> {
    let mut found = Vec::new();
    for pid in procfs::pids() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        let waits_on_fuse = tasks.filter_map(Result::ok).any(|task| {
            let mut wchan = [0u8; 64];
            std::fs::File::open(task.path().join("wchan"))
                .and_then(|mut f| std::io::Read::read(&mut f, &mut wchan))
                .is_ok_and(|n| {
                    let name = String::from_utf8_lossy(&wchan[..n]);
                    WAITS_OF_A_HOLDER.iter().any(|w| name.contains(w))
                })
        });
        if waits_on_fuse {
            found.push((pid, owner_of(pid)));
        }
        if found.len() == 16 {
            break; // enough to name
        }
    }
    found
}

/// The owner (effective uid) of process `pid`, from its `/proc` directory; `u32::MAX`
/// once it is gone.
fn owner_of(pid: u32) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}")).map_or(u32::MAX, |m| m.uid())
}

/// "processes 12 (uid 1000), 13 (uid 1000)".
pub(super) fn named(processes: &[(u32, u32)]) -> String {
    let named: Vec<String> = processes
        .iter()
        .map(|(pid, uid)| format!("{pid} (uid {uid})"))
        .collect();
    format!("process(es) {}", named.join(", "))
}
