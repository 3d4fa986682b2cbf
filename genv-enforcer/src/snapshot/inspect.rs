//! What a snapshot reads of processes from `/proc`: behind a trait, so that assembly can
//! be tested on made-up processes, and with `stat` read through handles kept between
//! cycles (in parallel on large nodes).

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;

use crate::backends::devmap::DeviceMap;
use crate::backends::proc_events::ProcEvents;
use crate::backends::procfs::{self, EnvironError, ProcStat, StatFile};

/// What the snapshot reads of processes; a trait so assembly can be tested on made-up
/// processes.
pub trait ProcessInspector: Sync {
    fn stat(&self, pid: u32) -> io::Result<ProcStat>;
    /// `stat`, through a handle kept between cycles where the inspector has one.
    fn stat_cached(&self, pid: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
        let _ = handle;
        self.stat(pid)
    }
    fn environment_id(&self, pid: u32) -> Result<Option<String>, EnvironError>;
    /// The identity the kernel recorded for `pid` at its exec (`genv_ebpf_common::
    /// identity`), where kernel programs run: unlike `/proc/<pid>/environ`, a process
    /// cannot write over it (`setproctitle` does, in Ray or gunicorn). `None` without
    /// programs, or for a process the kernel has no record of.
    fn kernel_identity(&self, pid: u32) -> Option<u64> {
        let _ = pid;
        None
    }
    fn real_uid(&self, pid: u32) -> io::Result<u32>;
    /// A subscription to the kernel's exec, exit and uid events of these processes,
    /// where there is one: with it, a process with no event since it was read need not
    /// be read again. `None` (the default) re-reads every process each cycle.
    fn process_events(&self) -> Option<ProcEvents> {
        None
    }
    /// Processes holding GPU nodes open (by `map`), with the GPU indices they hold.
    fn gpu_node_holders(&self, map: &DeviceMap) -> io::Result<Vec<(u32, Vec<u32>)>>;
    /// [`Self::gpu_node_holders`] among `pids` only.
    fn gpu_node_holders_among(&self, map: &DeviceMap, pids: &[u32]) -> Vec<(u32, Vec<u32>)> {
        let mut holders = self.gpu_node_holders(map).unwrap_or_default();
        holders.retain(|(pid, _)| pids.contains(pid));
        holders
    }
}

/// The real `/proc`.
pub struct Procfs {
    pub root: PathBuf,
}

impl Default for Procfs {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/proc"),
        }
    }
}

impl ProcessInspector for Procfs {
    fn stat(&self, pid: u32) -> io::Result<ProcStat> {
        procfs::stat(pid)
    }
    fn stat_cached(&self, pid: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
        if let Some(stat) = handle.as_ref().and_then(|h| h.read().ok()) {
            return Ok(stat);
        }
        // First sight, or the process the handle named is gone (its pid may now name
        // another): open afresh.
        let file = StatFile::open(pid)?;
        let stat = file.read();
        *handle = Some(file);
        stat
    }
    fn environment_id(&self, pid: u32) -> Result<Option<String>, EnvironError> {
        procfs::environment_id(pid)
    }
    fn real_uid(&self, pid: u32) -> io::Result<u32> {
        procfs::real_uid(pid)
    }
    fn process_events(&self) -> Option<ProcEvents> {
        ProcEvents::subscribe()
            .inspect_err(|e| {
                tracing::info!(
                    "No process events from the kernel ({e}): each cycle reads every GPU process's /proc/<pid>/stat"
                )
            })
            .ok()
    }
    fn gpu_node_holders(&self, map: &DeviceMap) -> io::Result<Vec<(u32, Vec<u32>)>> {
        procfs::gpu_node_holders(&self.root, &|major, minor| map.index_of(major, minor))
    }
    fn gpu_node_holders_among(&self, map: &DeviceMap, pids: &[u32]) -> Vec<(u32, Vec<u32>)> {
        procfs::gpu_node_holders_among(&self.root, pids, &|major, minor| map.index_of(major, minor))
    }
}

/// Below this many processes one thread reads every `stat`; above it the reads (each a
/// few microseconds of kernel formatting) are spread over the machine's cores.
const PARALLEL_STATS: usize = 256;

/// How many `stat` handles the table may keep: half the soft descriptor limit, so that
/// reading past the budget (by path, which opens and closes) always finds a descriptor.
pub(super) fn handle_budget() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    limit.current.map_or(usize::MAX, |n| (n / 2) as usize)
}

/// `/proc/<pid>/stat` of every pid, in order: through the handles kept between cycles,
/// and new ones while `budget` allows; beyond it, by path.
pub(super) fn read_stats(
    pids: &[u32],
    inspector: &dyn ProcessInspector,
    files: &mut HashMap<u32, Option<StatFile>>,
    budget: usize,
) -> Vec<io::Result<ProcStat>> {
    let mut spare = budget.saturating_sub(files.values().filter(|f| f.is_some()).count());
    // (pid, its handle, whether it may keep one)
    let mut work: Vec<(u32, Option<StatFile>, bool)> = pids
        .iter()
        .map(|pid| {
            let handle = files.remove(pid).flatten();
            let keep = handle.is_some() || spare > 0;
            if handle.is_none() && keep {
                spare -= 1;
            }
            (*pid, handle, keep)
        })
        .collect();
    let read = |chunk: &mut [(u32, Option<StatFile>, bool)]| -> Vec<io::Result<ProcStat>> {
        chunk
            .iter_mut()
            .map(|(pid, handle, keep)| match keep {
                true => inspector.stat_cached(*pid, handle),
                false => inspector.stat(*pid),
            })
            .collect()
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    let stats = if pids.len() < PARALLEL_STATS || threads == 1 {
        read(&mut work)
    } else {
        let chunk = work.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let handles: Vec<_> = work
                .chunks_mut(chunk)
                .map(|part| scope.spawn(move || read(part)))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a stat reader panicked"))
                .collect()
        })
    };
    files.extend(work.into_iter().map(|(pid, handle, _)| (pid, handle)));
    retry_out_of_descriptors(pids, inspector, files, stats)
}

/// Whether a read failed for want of a descriptor (this process's or the system's), not
/// because the process is gone.
pub(super) fn out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// The kept handles are only a cache: where a read found no descriptor to open, they are
/// all closed and those processes read again by path. Without this, a process whose
/// `stat` could not be opened would leave the cycle as if it were gone: out of every
/// rule for as long as the descriptors stay short.
fn retry_out_of_descriptors(
    pids: &[u32],
    inspector: &dyn ProcessInspector,
    files: &mut HashMap<u32, Option<StatFile>>,
    mut stats: Vec<io::Result<ProcStat>>,
) -> Vec<io::Result<ProcStat>> {
    if !stats
        .iter()
        .any(|s| s.as_ref().is_err_and(out_of_descriptors))
    {
        return stats;
    }
    files.clear();
    for (pid, stat) in pids.iter().zip(stats.iter_mut()) {
        if stat.as_ref().is_err_and(out_of_descriptors) {
            *stat = inspector.stat(*pid);
        }
    }
    stats
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real handles (on this test's own `stat`), to see how many the table keeps; or,
    /// `short_of_descriptors`, none to be had (EMFILE) while a read by path works.
    struct Handles {
        short_of_descriptors: bool,
    }

    const HANDLES: Handles = Handles {
        short_of_descriptors: false,
    };

    impl ProcessInspector for Handles {
        fn stat(&self, _: u32) -> io::Result<ProcStat> {
            procfs::stat(std::process::id())
        }
        fn stat_cached(&self, _: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
            if self.short_of_descriptors {
                return Err(io::Error::from_raw_os_error(libc::EMFILE));
            }
            let file = StatFile::open(std::process::id())?;
            let stat = file.read();
            *handle = Some(file);
            stat
        }
        fn environment_id(&self, _: u32) -> Result<Option<String>, EnvironError> {
            Ok(None)
        }
        fn real_uid(&self, _: u32) -> io::Result<u32> {
            Ok(0)
        }
        fn gpu_node_holders(&self, _: &DeviceMap) -> io::Result<Vec<(u32, Vec<u32>)>> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn a_stat_handle_that_finds_no_descriptor_gives_way_to_a_read_by_path() {
        let mut files = HashMap::new();
        files.insert(7, Some(StatFile::open(std::process::id()).unwrap()));
        let pids: Vec<u32> = (100..103).collect();
        let short = Handles {
            short_of_descriptors: true,
        };
        let stats = read_stats(&pids, &short, &mut files, 8);
        assert!(stats.iter().all(Result::is_ok), "{stats:?}");
        assert!(
            files.values().all(Option::is_none),
            "the kept handles are closed to free descriptors"
        );
    }

    #[test]
    fn keeps_stat_handles_within_the_budget_and_reads_the_rest_by_path() {
        let mut files = HashMap::new();
        let pids: Vec<u32> = (100..110).collect();
        let stats = read_stats(&pids, &HANDLES, &mut files, 4);
        assert!(stats.iter().all(Result::is_ok), "every process is read");
        assert_eq!(files.values().filter(|f| f.is_some()).count(), 4);
        // Next cycle: the four handles stay, no new ones are opened.
        let stats = read_stats(&pids, &HANDLES, &mut files, 4);
        assert!(stats.iter().all(Result::is_ok));
        assert_eq!(files.values().filter(|f| f.is_some()).count(), 4);
    }
}
