//! `--memory-at-alloc`'s half of the programs: the uprobes on libcuda's memory and
//! context calls (`genv-ebpf/src/cuda.rs`), attached to every libcuda the daemon finds.
//! Their accounting maps are [`super::alloc_maps`]'.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::programs::{ProbeKind, UProbe};

mod holders;
mod library;
mod refusal;
mod registrar;
mod uprobe_events;

pub use library::{FileVersion, Handle, LIBRARY_LIMIT, Library};
pub use refusal::RefusalAtAlloc;
use registrar::{Definition, Registrar, Registration};
use uprobe_events::Side;

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

/// What `--memory-at-alloc` asks of the loader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocProbes {
    Off,
    /// The plain probes (`report`, `kill`).
    Plain,
    /// The refusing forms of the allocation entry probes where the kernel loads them,
    /// else the plain ones (`refuse`).
    Refusing,
}

/// With `--memory-at-alloc`, the probes loaded (not attached yet), their maps, and
/// their registrar: what the `alloc` stage owns from then on.
pub(super) fn load_if(
    asked: AllocProbes,
    ebpf: &mut Ebpf,
    programs: &mut Vec<Attached>,
) -> Result<Option<CudaKernel>, LoadError> {
    let refusal = match asked {
        AllocProbes::Off => return Ok(None),
        AllocProbes::Plain => RefusalAtAlloc::NotAsked,
        AllocProbes::Refusing => refusal::load(ebpf),
    };
    let wrap = |e: LoadError| LoadError::MemoryAtAlloc(e.to_string());
    let loaded = load(ebpf, programs, refusal == RefusalAtAlloc::Loaded).map_err(wrap)?;
    let maps = AllocMaps::take(ebpf).map_err(wrap)?;
    let probes = Probes::new(super::tracefs::ensure_mounted()?, loaded);
    Ok(Some(CudaKernel {
        maps,
        probes,
        refusal,
    }))
}

/// `--memory-at-alloc`'s part of the kernel, handed whole to the `alloc` stage at
/// start-up: the accounting maps, and the probes with their registrar; and whether
/// they refuse calls (the daemon's start says so).
pub struct CudaKernel {
    pub maps: AllocMaps,
    pub probes: Probes,
    pub refusal: RefusalAtAlloc,
}

/// A loaded probe program: its name in the object, whether it runs at the call or at
/// its return, and a hold on it (attaching needs only its descriptor).
struct ProbeProgram {
    name: &'static str,
    side: Side,
    fd: std::sync::Arc<std::os::fd::OwnedFd>,
}

/// Loads every probe program (once; attaching comes per library); `refusing`: the
/// allocation entry probes are their refusing forms, loaded already.
fn load(
    ebpf: &mut Ebpf,
    programs: &mut Vec<Attached>,
    refusing: bool,
) -> Result<Vec<ProbeProgram>, LoadError> {
    use std::os::fd::AsFd;
    let mut loaded = Vec::new();
    for &(plain, _) in PROBES {
        let refusing_form = refusal::refusing_form(plain).filter(|_| refusing);
        let name = refusing_form.unwrap_or(plain);
        let probe = probe_mut(ebpf, name)?;
        if refusing_form.is_none() {
            probe.load().map_err(program_error(name))?;
        }
        let id = probe.info().map_err(program_error(name))?.id();
        let side = match probe.kind() {
            ProbeKind::Entry => Side::Entry,
            ProbeKind::Return => Side::Return,
        };
        let fd = probe
            .fd()
            .map_err(program_error(name))?
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| LoadError::Object(format!("{name}: {e}")))?;
        loaded.push(ProbeProgram {
            name: plain,
            side,
            fd: std::sync::Arc::new(fd),
        });
        programs.push(Attached {
            name,
            id,
            link: None,
        });
    }
    Ok(loaded)
}

/// What attaching to one library gave: a handle on its probes, for [`detach`].
#[derive(Debug)]
pub struct LibraryProbes {
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

/// The probes of every library attached: registered and removed by a thread of their
/// own (see [`registrar`]).
pub struct Probes {
    registrar: Registrar,
    programs: Vec<ProbeProgram>,
    next_key: u64,
}

impl Probes {
    fn new(tracefs: PathBuf, programs: Vec<ProbeProgram>) -> Self {
        uprobe_events::remove_stale(&tracefs);
        Self {
            registrar: Registrar::start(tracefs),
            programs,
            next_key: 0,
        }
    }

    /// Waits, at most `within`, until the registrations sent so far were made or put
    /// off; whether they were.
    pub fn settle(&self, within: std::time::Duration) -> bool {
        self.registrar.settle(within)
    }

    /// Whether a registration has been waiting on the kernel past
    /// [`registrar::SAY_AFTER`].
    pub fn stalled(&self) -> bool {
        self.registrar.stalled()
    }

    /// Has every probe attached to `library` at `exports`, system-wide, by the
    /// registrar; `line(missing)` is said once they are in place. A library without the
    /// required symbols is refused whole here; one a probe cannot be attached to is
    /// refused (and said) by the registrar, which then removes those it made. The other
    /// symbols missing are listed.
    pub fn attach(
        &mut self,
        library: &Library,
        exports: &Exports,
        line: impl FnOnce(&[&'static str]) -> String,
    ) -> Result<LibraryProbes, LoadError> {
        if let Some(absent) = REQUIRED.iter().find(|s| !exports.0.contains_key(**s)) {
            return Err(LoadError::Library(format!(
                "{}: no {absent} (not a libcuda)",
                library.name
            )));
        }
        let key = self.next_key;
        let (definitions, missing) = self.definitions(exports, key);
        let file = library
            .file
            .try_clone()
            .map_err(|e| LoadError::Library(format!("{}: {e}", library.name)))?;
        self.next_key += 1;
        self.registrar.register(Registration {
            key,
            file,
            name: library.name.clone(),
            definitions,
            line: line(&missing),
        });
        Ok(LibraryProbes { missing, key })
    }

    /// The uprobes to make for a library at `exports`, under the library's `key`, and
    /// the calls it does not have.
    fn definitions(&self, exports: &Exports, key: u64) -> (Vec<Definition>, Vec<&'static str>) {
        let mut missing = Vec::new();
        let mut definitions = Vec::new();
        for (program, &(name, wanted)) in self.programs.iter().zip(PROBES) {
            debug_assert_eq!(program.name, name);
            for (index, &symbol) in wanted.iter().enumerate() {
                let Some(&offset) = exports.0.get(symbol) else {
                    if !missing.contains(&symbol) {
                        missing.push(symbol);
                    }
                    continue;
                };
                definitions.push(Definition {
                    name: format!("{name}_{key}_{index}"),
                    side: program.side,
                    offset,
                    program: std::sync::Arc::clone(&program.fd),
                    what: format!("{name} at {symbol}"),
                });
            }
        }
        (definitions, missing)
    }

    /// Takes the probes of one [`Self::attach`] off again, in the background.
    pub fn detach(&mut self, attachment: LibraryProbes) {
        self.registrar.remove(attachment.key);
    }
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
