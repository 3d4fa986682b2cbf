//! `--memory-at-alloc`'s half of the programs: the uprobes on libcuda's memory and
//! context calls (`genv-ebpf/src/cuda.rs`), attached to every libcuda the daemon finds.
//! Their accounting maps are [`super::alloc_maps`]'.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::io;

use aya::Ebpf;
use aya::programs::{ProbeKind, UProbe};

mod library;
mod uprobe_events;

pub use library::{FileVersion, Handle, LIBRARY_LIMIT, Library};
use uprobe_events::{Follower, Side, UprobeEvent};

use super::alloc_maps::AllocMaps;
use super::attached::{Attached, program_mut};
use super::error::{LoadError, program_error};

/// Allocations on the current context's device, with `(dptr, size, …)` arguments; the
/// `_ptsz` forms are the same calls on the per-thread default stream.
const ALLOCATIONS: &[&str] = &[
    "cuMemAlloc_v2",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync_ptsz",
];
/// Every allocation call, for the return probe.
const ALL_ALLOCATIONS: &[&str] = &[
    "cuMemAlloc_v2",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync_ptsz",
    "cuMemAllocPitch_v2",
    "cuMemCreate",
];
const FREES: &[&str] = &[
    "cuMemFree_v2",
    "cuMemFreeAsync",
    "cuMemFreeAsync_ptsz",
    "cuMemRelease",
];
const CONTEXT_MADE: &[&str] = &["cuDevicePrimaryCtxRetain", "cuCtxCreate_v2"];
/// The calls that change a thread's context stack, applied on their return.
const CONTEXT_SWITCHES: &[&str] = &[
    "cuCtxSetCurrent",
    "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent_v2",
    "cuCtxDestroy_v2",
];

/// Each program and the libcuda symbols it is attached to. The entry and return probes
/// of one call go together; a library must have the first two calls (the plain
/// allocation and its free), and the rest are attached where the library has them.
const PROBES: &[(&str, &[&str])] = &[
    ("cu_mem_alloc", ALLOCATIONS),
    ("cu_mem_alloc_ret", ALL_ALLOCATIONS),
    ("cu_mem_free", FREES),
    ("cu_mem_free_ret", FREES),
    ("cu_mem_alloc_pitch", &["cuMemAllocPitch_v2"]),
    ("cu_mem_create", &["cuMemCreate"]),
    ("cu_init", &["cuInit"]),
    ("cu_ctx_retain", &["cuDevicePrimaryCtxRetain"]),
    ("cu_ctx_create", &["cuCtxCreate_v2"]),
    ("cu_ctx_made", CONTEXT_MADE),
    ("cu_ctx_set_current", &["cuCtxSetCurrent"]),
    ("cu_ctx_push", &["cuCtxPushCurrent_v2"]),
    ("cu_ctx_pop", &["cuCtxPopCurrent_v2"]),
    ("cu_ctx_destroy", &["cuCtxDestroy_v2"]),
    ("cu_ctx_switched", CONTEXT_SWITCHES),
];

/// Without these a library is not a libcuda the probes can account for.
const REQUIRED: [&str; 2] = ["cuMemAlloc_v2", "cuMemFree_v2"];

/// Off, every map of the probes is one entry: no kernel memory for a feature not used.
pub(super) fn size_maps(loader: &mut aya::EbpfLoader<'_>, memory_at_alloc: bool) {
    if !memory_at_alloc {
        for map in genv_ebpf_common::alloc::ALL_MAPS {
            loader.map_max_entries(map, 1);
        }
    }
}

/// With `--memory-at-alloc`, the probes loaded (not attached yet) and their maps.
pub(super) fn load_if(
    memory_at_alloc: bool,
    ebpf: &mut Ebpf,
    programs: &mut Vec<Attached>,
) -> Result<Option<AllocMaps>, LoadError> {
    if !memory_at_alloc {
        return Ok(None);
    }
    let wrap = |e: LoadError| LoadError::MemoryAtAlloc(e.to_string());
    load(ebpf, programs).map_err(wrap)?;
    Ok(Some(AllocMaps::take(ebpf).map_err(wrap)?))
}

/// Loads every probe program (once; attaching comes per library).
fn load(ebpf: &mut Ebpf, programs: &mut Vec<Attached>) -> Result<(), LoadError> {
    for &(name, _) in PROBES {
        let probe: &mut UProbe = program_mut(ebpf, name)?
            .try_into()
            .map_err(program_error(name))?;
        probe.load().map_err(program_error(name))?;
        let id = probe.info().map_err(program_error(name))?.id();
        programs.push(Attached {
            name,
            id,
            link: None,
        });
    }
    Ok(())
}

/// What attaching to one library gave: a handle on its probes, for [`detach`].
#[derive(Debug)]
pub struct Attachment {
    /// Symbols the library does not have (their calls go unseen there).
    pub missing: Vec<&'static str>,
    /// Its events' key in [`Probes`].
    key: u64,
}

/// Where a library's probed calls start in its file.
#[derive(Debug)]
pub struct Exports(HashMap<&'static str, u64>);

impl Exports {
    /// Whether it has the calls the probes cannot account without (the plain
    /// allocation and its free): what makes a file a libcuda, whatever it is called.
    pub fn is_libcuda(&self) -> bool {
        REQUIRED.iter().all(|s| self.0.contains_key(s))
    }
}

/// The probes of every library attached, and the processes that carry them (see
/// [`uprobe_events`]).
#[derive(Default)]
pub struct Probes {
    /// Each library's events, by key.
    libraries: HashMap<u64, Vec<UprobeEvent>>,
    next_key: u64,
    /// The processes carrying the probes, by pid.
    followers: HashMap<u32, Follower>,
    tracefs: Option<PathBuf>,
}

impl Probes {
    pub(super) fn new(tracefs: PathBuf) -> Self {
        uprobe_events::remove_stale(&tracefs);
        let mut probes = Self::default();
        probes.tracefs = Some(tracefs);
        probes
    }

    /// Has process `pid` (started at `start_time`) carry every probe, of the libraries
    /// attached now and of those attached later; a pid followed already, with another
    /// start time, was another process, whose perf events go first. Whether it was not
    /// followed yet. Fails (and follows nothing) if the kernel refuses one: the process
    /// is gone, or the probes' share of the daemon's descriptors is used up (half its
    /// limit: a user forking without end in a capped environment must not take the
    /// descriptors the rest of the daemon needs).
    pub fn follow(&mut self, pid: u32, start_time: u64) -> io::Result<bool> {
        if let Some(old) = self.followers.get(&pid) {
            if old.start_time == start_time {
                return Ok(false);
            }
            self.followers.remove(&pid);
        }
        let wanted: usize = self.libraries.values().map(Vec::len).sum();
        let held: usize = self.followers.values().map(|f| f.events.len()).sum();
        let budget = descriptor_budget();
        if held + wanted > budget {
            return Err(io::Error::other(format!(
                "the probes' share of the daemon's descriptors ({budget}) is in use"
            )));
        }
        let mut follower = Follower::new(start_time);
        for (&key, events) in &self.libraries {
            for event in events {
                follower.events.push((key, event.follow(pid)?));
            }
        }
        self.followers.insert(pid, follower);
        Ok(true)
    }

    /// Process `pid` carries the probes no more.
    pub fn unfollow(&mut self, pid: u32) -> bool {
        self.followers.remove(&pid).is_some()
    }

    /// The processes followed, with their start times.
    pub fn followed(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.followers.iter().map(|(&pid, f)| (pid, f.start_time))
    }

    /// A library's events, carried from now on by every process followed (one that
    /// cannot carry them is followed no more, and said).
    fn add_library(&mut self, key: u64, events: Vec<UprobeEvent>, name: &str) {
        let mut refused = Vec::new();
        for (&pid, follower) in self.followers.iter_mut() {
            for event in &events {
                match event.follow(pid) {
                    Ok(fd) => follower.events.push((key, fd)),
                    Err(e) => {
                        refused.push((pid, e));
                        break;
                    }
                }
            }
        }
        for (pid, e) in refused {
            self.followers.remove(&pid);
            tracing::warn!(
                "--memory-at-alloc: process {pid} cannot carry the probes of {name}: {e}"
            );
        }
        self.libraries.insert(key, events);
    }

    fn tracefs(&self) -> Result<&Path, LoadError> {
        self.tracefs
            .as_deref()
            .ok_or_else(|| LoadError::Object("the libcuda probes are not loaded".into()))
    }
}

/// Half the daemon's descriptor limit (raised to its hard limit at start-up): what the
/// processes' perf events may hold, about 30 a process.
fn descriptor_budget() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    (limit.current.unwrap_or(1 << 20) / 2) as usize
}

impl Drop for Probes {
    /// The processes' perf events first: an event still open on a uprobe keeps it.
    fn drop(&mut self) {
        self.followers.clear();
        self.libraries.clear();
    }
}

/// Attaches every probe to `library` at `exports`, in the processes `probes` follows. A
/// library without the required symbols is refused whole, as is one a probe cannot be
/// attached to (those attached already are taken off again); the others missing are
/// listed.
pub(super) fn attach(
    ebpf: &mut Ebpf,
    probes: &mut Probes,
    library: &Library,
    exports: &Exports,
) -> Result<Attachment, LoadError> {
    use std::os::fd::{AsFd, AsRawFd};
    if let Some(absent) = REQUIRED.iter().find(|s| !exports.0.contains_key(**s)) {
        return Err(LoadError::Library(format!(
            "{}: no {absent} (not a libcuda)",
            library.name
        )));
    }
    let tracefs = probes.tracefs()?.to_owned();
    // The descriptor we hold: the kernel resolves it to the file we read.
    let target = PathBuf::from(format!("/proc/self/fd/{}", library.file.as_raw_fd()));
    let key = probes.next_key;
    probes.next_key += 1;
    let mut missing = Vec::new();
    let mut events = Vec::new();
    for &(name, wanted) in PROBES {
        let side = match probe_mut(ebpf, name)?.kind() {
            ProbeKind::Entry => Side::Entry,
            ProbeKind::Return => Side::Return,
        };
        for (index, &symbol) in wanted.iter().enumerate() {
            let Some(&offset) = exports.0.get(symbol) else {
                if !missing.contains(&symbol) {
                    missing.push(symbol);
                }
                continue;
            };
            let made = probe_mut(ebpf, name).and_then(|probe| {
                let program = probe.fd().map_err(program_error(name))?;
                UprobeEvent::new(
                    &tracefs,
                    format!("{name}_{key}_{index}"),
                    side,
                    &target,
                    offset,
                    program.as_fd(),
                )
                .map_err(|e| LoadError::Program {
                    program: name,
                    message: format!("attaching to {symbol} in {}: {e}", library.name),
                })
            });
            // On an error, the events made so far are dropped: removed again.
            events.push(made?);
        }
    }
    probes.add_library(key, events, &library.name);
    Ok(Attachment { missing, key })
}

/// Takes the probes of one [`attach`] off again: out of every process first, then the
/// events themselves.
pub(super) fn detach(probes: &mut Probes, attachment: Attachment) {
    for follower in probes.followers.values_mut() {
        follower.leave(attachment.key);
    }
    probes.libraries.remove(&attachment.key);
}

fn probe_mut<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut UProbe, LoadError> {
    program_mut(ebpf, name)?
        .try_into()
        .map_err(program_error(name))
}

/// The libraries to probe: `ldconfig`'s `libcuda.so.1`, the one beside NVML (where the
/// daemon loaded NVML from), and those given (`--cuda-lib`). Not resolved or looked at
/// here: a path on a FUSE mount would hold up even a `stat` (see [`Library::open`]). The
/// same file reached twice is attached once (the daemon keeps them by device and inode).
pub fn libraries(given: &[PathBuf], beside_nvml: Option<&Path>) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = given.to_vec();
    found.extend(ldconfig_libcuda());
    if let Some(beside) = beside_nvml.map(|dir| dir.join("libcuda.so.1")) {
        if beside.exists() {
            found.push(beside);
        }
    }
    found
}

/// `libcuda.so.1` in `ldconfig -p`'s cache listing (`\tlibcuda.so.1 (libc6,x86-64) =>
/// /usr/lib/x86_64-linux-gnu/libcuda.so.1`).
fn ldconfig_libcuda() -> Vec<PathBuf> {
    let Ok(output) = std::process::Command::new("ldconfig").arg("-p").output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|l| l.trim_start().starts_with("libcuda.so.1 "))
        .filter_map(|l| l.split("=> ").nth(1))
        .map(|p| PathBuf::from(p.trim()))
        .collect()
}
