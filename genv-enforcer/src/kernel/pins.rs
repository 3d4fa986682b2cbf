//! Pinned programs and maps in bpffs (`--keep-pinned`), so that the kernel keeps
//! deciding while the daemon restarts or is upgraded.
//!
//! Each run pins under its own generation, `<root>/<pid>/{links,maps}`. A daemon that
//! starts while an older generation is pinned loads and arms its own programs first and
//! only then removes the older pins: for a moment both decide (the same policy), and
//! there is no gap. `genv-enforcer unpin` removes everything under the root.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aya::Ebpf;
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::{RawTracePoint, TracePoint};

use super::attached::{Attached, LinkId, program_mut};
use super::error::{LoadError, chain};

/// Where pins go by default.
pub const DEFAULT_ROOT: &str = "/sys/fs/bpf/genv-enforcer";
const BPFFS: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Makes sure bpffs is mounted where `root` lives, and returns this run's generation
/// directory under it (emptied if a previous owner of this pid left one).
pub fn prepare_generation(root: &Path) -> io::Result<PathBuf> {
    ensure_bpffs()?;
    let generation = root.join(std::process::id().to_string());
    if generation.exists() {
        std::fs::remove_dir_all(&generation)?;
    }
    std::fs::create_dir_all(&generation)?;
    Ok(generation)
}

fn ensure_bpffs() -> io::Result<()> {
    let is_bpffs = |path: &str| {
        rustix::fs::statfs(path).is_ok_and(|fs| {
            // f_type's width differs between platforms.
            #[allow(clippy::unnecessary_cast)]
            let magic = fs.f_type as i64;
            magic == BPF_FS_MAGIC
        })
    };
    if is_bpffs(BPFFS) {
        return Ok(());
    }
    std::fs::create_dir_all(BPFFS)?;
    rustix::mount::mount(
        "bpf",
        BPFFS,
        "bpf",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .map_err(io::Error::from)
}

/// Generations under `root` other than `own`.
pub fn other_generations(root: &Path, own: Option<&Path>) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir() && Some(p.as_path()) != own)
        .collect()
}

/// What a removal took away.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    pub links: usize,
    pub maps: usize,
    /// The removed links' ids and their programs', read before removal.
    pub attached: Vec<LinkIds>,
}

/// One pinned link's id and its program's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkIds {
    pub link: u32,
    pub program: u32,
}

/// Removes a generation's pins: its links detach as their last reference goes. That is
/// not when this returns: bpffs drops a removed pin's reference only after an RCU grace
/// period, from a work queue, so the programs may decide for a while longer
/// ([`wait_detached`] waits it out).
pub fn remove_generation(generation: &Path) -> io::Result<Removed> {
    let count =
        |sub: &str| std::fs::read_dir(generation.join(sub)).map_or(0, |entries| entries.count());
    let attached = pinned_links(&generation.join("links"));
    let removed = Removed {
        links: count("links"),
        maps: count("maps"),
        attached,
    };
    std::fs::remove_dir_all(generation)?;
    Ok(removed)
}

/// The links pinned in `dir` (one that cannot be read is skipped: it is removed all
/// the same, only not waited for). No descriptor of them is kept.
fn pinned_links(dir: &Path) -> Vec<LinkIds> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| PinnedLink::from_pin(entry.path()).ok())
        .filter_map(|link| {
            let info = FdLink::from(link).info().ok()?;
            Some(LinkIds {
                link: info.id(),
                program: info.program_id(),
            })
        })
        .collect()
}

/// How long `unpin` waits for the kernel to let go of the programs.
pub const DETACH_WAIT: Duration = Duration::from_secs(5);

/// Waits, up to `limit`, until none of `attached` is attached any more (each link
/// freed, which detaches it) and then until their programs are unloaded (the detach
/// done: a link's id goes just before it detaches). Returns the links still there at
/// the limit: something other than the pins holds them (a descriptor another process
/// keeps), and they still decide. A program that outlives its link is held the same
/// way but attached nowhere, and is not waited for past the limit.
pub fn wait_detached(attached: &[LinkIds], limit: Duration) -> Vec<u32> {
    use super::trampoline::{link_exists, program_loaded};
    let deadline = Instant::now() + limit;
    let mut waiting: Vec<LinkIds> = attached.to_vec();
    loop {
        waiting.retain(|ids| link_exists(ids.link) || program_loaded(ids.program));
        if waiting.is_empty() || Instant::now() >= deadline {
            return waiting
                .iter()
                .filter(|ids| link_exists(ids.link))
                .map(|ids| ids.link)
                .collect();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `genv-enforcer unpin`: every generation under `root`, and `root` itself.
pub fn unpin_all(root: &Path) -> io::Result<Removed> {
    let mut total = Removed::default();
    for generation in other_generations(root, None) {
        let removed = remove_generation(&generation)?;
        total.links += removed.links;
        total.maps += removed.maps;
        total.attached.extend(removed.attached);
    }
    match std::fs::remove_dir(root) {
        Ok(()) => Ok(total),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(total),
        Err(e) => Err(e),
    }
}

/// Exempts `pid` in an earlier generation's pinned maps, whose programs keep deciding
/// until this run takes over: without it, a new daemon's first NVML call (which opens
/// the GPU nodes) would be refused or killed by its predecessor's programs. A
/// generation pinned before `EXEMPT_PIDS` existed allowed the enforcer by executable
/// instead; there, `exe` (this binary's key) is added to its allow-list.
pub fn exempt_in_generation(
    generation: &Path,
    pid: u32,
    start_time: u64,
    exe: genv_ebpf_common::ExeKey,
) -> Result<(), String> {
    use aya::maps::{HashMap, Map, MapData};
    let maps = generation.join("maps");
    let open = |name: &str| -> Result<Map, String> {
        let path = maps.join(name);
        let data = MapData::from_pin(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Map::from_map_data(data).map_err(|e| format!("{}: {e}", path.display()))
    };
    let exempt_map = maps.join(genv_ebpf_common::EXEMPT_PIDS_MAP);
    if exempt_map.exists() {
        let mut map: HashMap<MapData, u32, u64> =
            HashMap::try_from(open(genv_ebpf_common::EXEMPT_PIDS_MAP)?)
                .map_err(|e| e.to_string())?;
        return map.insert(pid, start_time, 0).map_err(|e| e.to_string());
    }
    let mut map: HashMap<MapData, genv_ebpf_common::ExeKey, u8> =
        HashMap::try_from(open(genv_ebpf_common::ALLOWED_EXES_MAP)?).map_err(|e| e.to_string())?;
    map.insert(exe, 1, 0).map_err(|e| e.to_string())
}

/// Pins every link under `dir/links` and every map under `dir/maps` (a bpffs
/// directory): the programs then stay attached, deciding from these maps, after the
/// daemon exits, until the pins are removed (`genv-enforcer unpin`, or the next daemon
/// taking over). A pinned link is not held: dropping it closes our descriptor, and the
/// pin keeps the link.
pub(super) fn pin_all(
    ebpf: &mut Ebpf,
    programs: &mut [Attached],
    dir: &std::path::Path,
) -> Result<(), LoadError> {
    let (links, maps) = (dir.join("links"), dir.join("maps"));
    for sub in [&links, &maps] {
        std::fs::create_dir_all(sub).map_err(|e| LoadError::Pin {
            path: sub.clone(),
            message: e.to_string(),
        })?;
    }
    for attached in programs.iter_mut() {
        let Some(link) = attached.link.take() else {
            continue; // pinned already
        };
        pin_link(ebpf, attached.name, link, &links.join(attached.name))?;
    }
    // The object's own sections (.rodata, .bss) are not the daemon's interface.
    for (name, map) in ebpf.maps().filter(|(name, _)| !name.starts_with('.')) {
        let path = maps.join(name);
        map.pin(&path).map_err(|e| LoadError::Pin {
            path: path.clone(),
            message: chain(&e),
        })?;
    }
    Ok(())
}

/// Pins one program's link at `path`, through aya's descriptor of it (or, for the
/// trampoline tiers' programs, which aya does not hold, through their own).
fn pin_link(
    ebpf: &mut Ebpf,
    name: &'static str,
    link: LinkId,
    path: &Path,
) -> Result<(), LoadError> {
    let error = |message: String| LoadError::Pin {
        path: path.to_path_buf(),
        message,
    };
    let fd_link: FdLink = match link {
        LinkId::Trampoline(link) => return link.pin(path).map_err(|e| error(e.to_string())),
        LinkId::TracePoint(id) => {
            let p: &mut TracePoint = program_mut(ebpf, name)?
                .try_into()
                .map_err(|e| error(chain(&e)))?;
            let link = p.take_link(id).map_err(|e| error(chain(&e)))?;
            FdLink::try_from(link).map_err(|e| error(chain(&e)))?
        }
        LinkId::RawTracePoint(id) => {
            let p: &mut RawTracePoint = program_mut(ebpf, name)?
                .try_into()
                .map_err(|e| error(chain(&e)))?;
            p.take_link(id).map_err(|e| error(chain(&e)))?.into()
        }
    };
    fd_link.pin(path).map_err(|e| error(chain(&e)))?;
    Ok(())
}
