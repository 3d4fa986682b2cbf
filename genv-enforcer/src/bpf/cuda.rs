//! `--memory-at-alloc`'s half of the programs: the uprobes on libcuda's memory and
//! context calls (`genv-ebpf/src/cuda.rs`), attached to every libcuda the daemon finds.
//! Their accounting maps are [`super::alloc_maps`]'.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use aya::Ebpf;
use aya::programs::UProbe;
use aya::programs::uprobe::UProbeScope;

use super::alloc_maps::AllocMaps;
use super::error::{LoadError, chain, program_error};
use super::loader::{Attached, program_mut};

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

/// What attaching to one library gave.
#[derive(Debug, Default)]
pub struct Attachment {
    /// Symbols the library does not have (their calls go unseen there).
    pub missing: Vec<&'static str>,
}

/// The largest library read: a libcuda is tens of MB.
pub const LIBRARY_LIMIT: u64 = 256 << 20;

/// An open library, to be probed. Everything is done through this one descriptor: its
/// type and size are checked, its bytes read, and the probes attached through
/// `/proc/self/fd/N` at offsets found in those bytes, so that nothing is looked up by
/// a path someone else can change between the steps.
pub struct Library {
    file: std::fs::File,
    /// What it is called in messages.
    pub name: String,
}

impl Library {
    /// Opens `path` (reached through the mount namespace `mountinfo` lists) for reading:
    /// first as `O_PATH`, which asks the file system nothing, so that a FUSE mount (any
    /// user's server, which could stall every request) is refused before any open, stat
    /// or read reaches it; then for reading through that descriptor, without blocking
    /// or taking a terminal. A regular file of at most [`LIBRARY_LIMIT`] bytes, else
    /// refused.
    pub fn open(path: &Path, name: String, mountinfo: &str) -> Result<Self, LoadError> {
        use rustix::fs::{Mode, OFlags};
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let refuse = |why: String| LoadError::Library(format!("{name}: {why}"));
        let handle = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| refuse(e.to_string()))?;
        match crate::state::served_by_fuse(&handle, mountinfo) {
            Ok(false) => {}
            Ok(true) => return Err(refuse("on a FUSE file system: not read".into())),
            Err(e) => return Err(refuse(format!("cannot tell its file system: {e}"))),
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(format!("/proc/self/fd/{}", handle.as_raw_fd()))
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
        Ok(Self { file, name })
    }

    /// Its device and inode: the file, whatever path reached it.
    pub fn identity(&self) -> Option<(u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let meta = self.file.metadata().ok()?;
        Some((meta.dev(), meta.ino()))
    }

    /// Whether it starts as an ELF shared object for this machine: a cheap look before
    /// the whole file is read.
    pub fn looks_like_a_library(&self) -> bool {
        use std::os::unix::fs::FileExt;
        let mut header = [0u8; 64];
        if self.file.read_exact_at(&mut header, 0).is_err() {
            return false;
        }
        header.starts_with(b"\x7fELF")
            && header[4] == 2 // 64-bit
            && header[16] == 3 // ET_DYN
    }
}

/// Attaches every probe to `library`. A library without the required symbols, or for
/// another architecture, is refused whole; the others missing are listed.
pub(super) fn attach(ebpf: &mut Ebpf, library: &Library) -> Result<Attachment, LoadError> {
    use std::os::fd::AsRawFd;
    let offsets = symbol_offsets(library)?;
    if let Some(absent) = REQUIRED.iter().find(|s| !offsets.contains_key(**s)) {
        return Err(LoadError::Library(format!(
            "{}: no {absent} (not a libcuda)",
            library.name
        )));
    }
    // The descriptor we hold: the kernel resolves it to the file we read.
    let target = PathBuf::from(format!("/proc/self/fd/{}", library.file.as_raw_fd()));
    let mut attachment = Attachment::default();
    for &(name, wanted) in PROBES {
        let probe: &mut UProbe = program_mut(ebpf, name)?
            .try_into()
            .map_err(program_error(name))?;
        for &symbol in wanted {
            let Some(&offset) = offsets.get(symbol) else {
                if !attachment.missing.contains(&symbol) {
                    attachment.missing.push(symbol);
                }
                continue;
            };
            probe
                .attach(offset, &target, UProbeScope::AllProcesses)
                .map_err(|e| LoadError::Program {
                    program: name,
                    message: format!("attaching to {symbol} in {}: {}", library.name, chain(&e)),
                })?;
        }
    }
    Ok(attachment)
}

/// The file offsets of the dynamic symbols a library defines, read from its bytes
/// (through the descriptor, bounded).
fn symbol_offsets(library: &Library) -> Result<HashMap<String, u64>, LoadError> {
    use object::{Object, ObjectSection, ObjectSymbol};
    use std::io::Read;
    let refuse = |why: String| LoadError::Library(format!("{}: {why}", library.name));
    let mut bytes = Vec::new();
    (&library.file)
        .take(LIBRARY_LIMIT + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| refuse(e.to_string()))?;
    if bytes.len() as u64 > LIBRARY_LIMIT {
        return Err(refuse(format!("over {LIBRARY_LIMIT} bytes")));
    }
    let file = object::File::parse(&*bytes).map_err(|e| refuse(e.to_string()))?;
    // ldconfig lists the 32-bit library too: its calls pass arguments elsewhere, so the
    // probes would read other registers as sizes.
    if file.architecture() != host_architecture() {
        return Err(refuse(format!(
            "built for {:?}, not this machine's {:?}",
            file.architecture(),
            host_architecture()
        )));
    }
    let mut offsets = HashMap::new();
    for symbol in file.dynamic_symbols().filter(|s| s.is_definition()) {
        let (Ok(name), Some(index)) = (symbol.name(), symbol.section_index()) else {
            continue;
        };
        // A symbol's file offset: where its section's bytes sit in the file, plus its
        // distance from the section's start in memory.
        let offset = file.section_by_index(index).ok().and_then(|section| {
            let (start, _) = section.file_range()?;
            Some(start + symbol.address().checked_sub(section.address())?)
        });
        if let Some(offset) = offset {
            offsets.insert(name.to_owned(), offset);
        }
    }
    Ok(offsets)
}

fn host_architecture() -> object::Architecture {
    match std::env::consts::ARCH {
        "x86_64" => object::Architecture::X86_64,
        "aarch64" => object::Architecture::Aarch64,
        "powerpc64" => object::Architecture::PowerPc64,
        _ => object::Architecture::Unknown,
    }
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
