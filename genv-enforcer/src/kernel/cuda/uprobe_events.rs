//! The libcuda probes as tracefs uprobe events, registered system-wide.
//!
//! Each probed call of a library is one tracefs uprobe event, made once, and its
//! *carrier*: a perf event on it for every process (`pid` -1, on CPU 0), which holds the
//! BPF program (`PERF_EVENT_IOC_SET_BPF`). A system-wide perf event makes the uprobe's
//! filter want every process, so the kernel places the breakpoints in each process that
//! maps the library, at its `mmap`, in that process's own context; the program runs on
//! every hit, on any CPU (the program is the event's, not the perf event's), and returns
//! at once for a process outside a capped environment. Nothing here is done per process:
//! opening or closing a perf event on a uprobe walks every address space that maps the
//! file, under a lock every `fork()` needs (see [`super::registrar`]).
//!
//! The carrier is disabled: it records no sample (the programs return 0, and a disabled
//! event collects nothing); it is there for the filter and the program.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// The tracefs group of this daemon's events: per daemon, so that one left by a daemon
/// that died can be told from a running one's ([`remove_stale`]).
const GROUP_PREFIX: &str = "genv_enforcer_";

const PERF_TYPE_TRACEPOINT: u32 = 2;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `_IOW('$', 8, __u32)`.
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
/// `perf_event_attr.disabled`, the first of its bit fields.
const ATTR_DISABLED: u64 = 1;

/// `struct perf_event_attr` as of its first version (`PERF_ATTR_SIZE_VER0`, 64 bytes):
/// every kernel takes it, and nothing past it is needed.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

/// Entry or return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Entry,
    Return,
}

/// One tracefs uprobe event, its carrier holding the program. Dropped, the program is
/// taken off and the event removed (the kernel refuses to remove an event still open:
/// it is then left, and said).
pub struct UprobeEvent {
    tracefs: PathBuf,
    group: String,
    name: String,
    id: u64,
    carrier: Option<OwnedFd>,
}

impl UprobeEvent {
    /// Makes the event `name` at `offset` of the file `target` (the kernel resolves the
    /// path when it reads it: `/proc/self/fd/N` of a descriptor the daemon holds is the
    /// file it read), and gives it `program`.
    pub fn new(
        tracefs: &Path,
        name: String,
        side: Side,
        target: &Path,
        offset: u64,
        program: BorrowedFd<'_>,
    ) -> io::Result<Self> {
        let group = group();
        let kind = match side {
            Side::Entry => 'p',
            Side::Return => 'r',
        };
        let definition = format!("{kind}:{group}/{name} {}:{offset:#x}", target.display());
        write_definition(tracefs, &definition)?;
        let mut event = Self {
            tracefs: tracefs.to_owned(),
            group,
            name,
            id: 0,
            carrier: None,
        };
        // From here on, dropping `event` removes the definition again.
        let id_path = event.dir().join("id");
        let text = std::fs::read_to_string(&id_path)?;
        event.id = text.trim().parse().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: not an id: {text:?}", id_path.display()),
            )
        })?;
        let carrier = open_system_wide(event.id)?;
        // SAFETY: an ioctl on a perf event we own, with a program descriptor as its
        // argument, as the kernel defines it.
        let set = unsafe {
            libc::ioctl(
                carrier.as_raw_fd(),
                PERF_EVENT_IOC_SET_BPF,
                program.as_raw_fd(),
            )
        };
        if set != 0 {
            return Err(io::Error::last_os_error());
        }
        event.carrier = Some(carrier);
        Ok(event)
    }

    fn dir(&self) -> PathBuf {
        self.tracefs
            .join("events")
            .join(&self.group)
            .join(&self.name)
    }
}

impl Drop for UprobeEvent {
    fn drop(&mut self) {
        // The program first: an event with a perf event open cannot be removed.
        drop(self.carrier.take());
        let removal = format!("-:{}/{}", self.group, self.name);
        if let Err(e) = write_definition(&self.tracefs, &removal) {
            tracing::warn!(
                "--memory-at-alloc: cannot remove the uprobe event {}/{}: {e}",
                self.group,
                self.name
            );
        }
    }
}

/// This daemon's group of events.
fn group() -> String {
    format!("{GROUP_PREFIX}{}", std::process::id())
}

/// One line to `uprobe_events`, appended (a write without `O_APPEND` would clear every
/// other event first).
fn write_definition(tracefs: &Path, line: &str) -> io::Result<()> {
    let path = tracefs.join("uprobe_events");
    let mut file = std::fs::OpenOptions::new().append(true).open(&path)?;
    file.write_all(format!("{line}\n").as_bytes())
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {line:?}: {e}", path.display())))
}

/// `perf_event_open` of tracepoint `id` for every process (on CPU 0: a perf event for
/// every process names one CPU; the program runs on all of them), disabled.
fn open_system_wide(id: u64) -> io::Result<OwnedFd> {
    let attr = PerfEventAttr {
        kind: PERF_TYPE_TRACEPOINT,
        size: size_of::<PerfEventAttr>() as u32,
        config: id,
        sample_period: 1,
        flags: ATTR_DISABLED,
        ..PerfEventAttr::default()
    };
    // SAFETY: `attr` is a whole first-version `perf_event_attr`, read by the kernel
    // during the call only.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            -1 as libc::c_int,
            0 as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Removes the events of daemons no longer running (one killed outright leaves its
/// group behind: harmless, as no process carries its breakpoints, but in the way of a
/// daemon given its pid, whose events would clash). A running daemon's, another's on
/// this node, are left alone. Called before this daemon makes any.
pub fn remove_stale(tracefs: &Path) {
    let Ok(groups) = std::fs::read_dir(tracefs.join("events")) else {
        return;
    };
    for group in groups.filter_map(Result::ok) {
        let name = group.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(GROUP_PREFIX))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        // This daemon's own pid: a dead daemon's that had it (this one has made no
        // event yet; left, its events would clash with ours).
        if pid != std::process::id() && Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let Ok(events) = std::fs::read_dir(group.path()) else {
            continue;
        };
        for event in events.filter_map(Result::ok) {
            if !event.path().join("id").exists() {
                continue; // the group's own `enable`, `filter`
            }
            let line = format!(
                "-:{}/{}",
                name.to_string_lossy(),
                event.file_name().to_string_lossy()
            );
            if let Err(e) = write_definition(tracefs, &line) {
                tracing::warn!("--memory-at-alloc: cannot remove a dead daemon's uprobe: {e}");
            }
        }
    }
}
