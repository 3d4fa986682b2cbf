//! libcuda copies the daemon was not told about (a container's own, a user's, renamed
//! or not), found in the processes that open GPU nodes and probed from then on.
//!
//! A copy is known by what it is, not by its name: a file a GPU opener maps executable
//! whose dynamic symbols define `cuMemAlloc_v2` and `cuMemFree_v2`. Each file is
//! examined once (by device and inode, again only if its size or times changed); a
//! copy's probes come off once no live process is known to map it, which gives its
//! place in the budget back ([`super::budget`]). Opening stays safe: each file is
//! reached through `/proc/<pid>/map_files` (the very file mapped) as `O_PATH`, refused
//! unopened on FUSE, and read only through that descriptor, a few bounded tables of it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::budget::Budget;
use super::looks::Looks;
use crate::backends::address_space::{self, SpaceFile};
use crate::backends::maps::{self, Mapping};
use crate::backends::procfs;
use crate::kernel::cuda::{FileVersion, Handle, LibraryProbes, Probes};
use crate::state::MountTable;

/// Files examined in one look at most; the rest at another look right after.
const CHECKS_PER_LOOK: usize = 128;
/// Files remembered at most; beyond, those that were no libcuda are forgotten.
const MAX_SEEN: usize = 1 << 16;
/// How long after a budget refusal for a uid another is said.
const SAY_AGAIN: Duration = Duration::from_secs(60);
/// Processes whose last look is remembered; past this (exits lost), all are forgotten,
/// which only has an exec heard of late forget what a look read of the new image.
const MAX_LOOKED: usize = 1 << 16;

/// What a file examined turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum What {
    /// Not a libcuda, or not one that can be probed: examined again only if changed.
    Other,
    /// Probed for as long as the daemon runs (the administrator's, or ldconfig's).
    Given,
    /// A copy probed for processes, while they live.
    Copy,
}

/// A copy probed for processes.
struct Copy {
    attachment: LibraryProbes,
    /// The uid its place in the budget was taken for.
    paid_by: u32,
    /// The live processes seen mapping it, with their start times.
    mappers: HashMap<u32, u64>,
}

#[derive(Default)]
pub(super) struct Copies {
    seen: HashMap<(u64, u64), (FileVersion, What)>,
    copies: HashMap<(u64, u64), Copy>,
    /// The copies each process was seen mapping.
    mapped_by: HashMap<u32, HashSet<(u64, u64)>>,
    looks: Looks,
    budget: Budget,
    /// When a budget refusal was last said, by uid.
    said: HashMap<u32, Instant>,
    /// Processes copies were probed for since [`Self::take_probed`] (the registrar says
    /// the line once the probes are in place).
    probed: Vec<u32>,
    /// Processes whose mappings did not answer in time, said once each.
    held_said: HashSet<u32>,
    /// When each process's mappings were last read (CLOCK_MONOTONIC ns), for its exec.
    looked_at: HashMap<u32, u64>,
}

impl Copies {
    /// A library the daemon probes for its whole life: never examined again.
    pub(super) fn given(&mut self, version: FileVersion) {
        self.seen.insert(version.id(), (version, What::Given));
    }

    /// Whether the file is probed already (given, or a copy).
    pub(super) fn is_probed(&self, id: (u64, u64)) -> bool {
        self.seen
            .get(&id)
            .is_some_and(|(_, what)| *what != What::Other)
    }

    /// `pid` (running as `uid`) opened a GPU node: it is looked at now, or when its gap
    /// ends (see [`Looks`]). `owner` gives the user its looks count against, asked
    /// once per process and uid: it reads the process's user namespace, a cost no GPU
    /// open should pay again.
    pub(super) fn opened(
        &mut self,
        probes: &mut Probes,
        (pid, uid): (u32, u32),
        owner: impl FnOnce() -> u32,
    ) {
        if pid == std::process::id() {
            return;
        }
        let now = Instant::now();
        let user = self.looks.user(pid, uid).unwrap_or_else(owner);
        if self.looks.opened(pid, uid, user, now) {
            self.look(probes, pid, user, now);
        }
    }

    /// The looks owed by now.
    pub(super) fn run_due(&mut self, probes: &mut Probes) {
        let now = Instant::now();
        for (pid, uid) in self.looks.due(now) {
            self.look(probes, pid, uid, now);
        }
    }

    /// The processes copies were probed for since the last call.
    pub(super) fn take_probed(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.probed)
    }

    pub(super) fn next_look(&self) -> Option<Instant> {
        self.looks.next_due()
    }

    /// `pid`'s mappings were read at `stamp`.
    fn read_at(&mut self, pid: u32, stamp: u64) {
        if self.looked_at.len() >= MAX_LOOKED && !self.looked_at.contains_key(&pid) {
            self.looked_at.clear();
        }
        self.looked_at.insert(pid, stamp);
    }

    /// `pid` exec'ed at `at_ns`: as [`Self::gone`], unless its mappings were read since
    /// (an open of the old image's handled after the exec looks at the new image): they
    /// are the new image's, and stay. Its looks start again either way.
    pub(super) fn execed(&mut self, probes: &mut Probes, pid: u32, at_ns: u64) {
        if self
            .looked_at
            .get(&pid)
            .is_some_and(|looked| *looked > at_ns)
        {
            self.looks.forget(pid);
            return;
        }
        self.gone(probes, pid);
    }

    /// `pid` exec'ed or exited: its mappings are gone, and with the last process
    /// mapping a copy, the copy's probes.
    pub(super) fn gone(&mut self, probes: &mut Probes, pid: u32) {
        self.looks.forget(pid);
        self.looked_at.remove(&pid);
        self.held_said.remove(&pid);
        for id in self.mapped_by.remove(&pid).unwrap_or_default() {
            let unmapped = self.copies.get_mut(&id).is_some_and(|copy| {
                copy.mappers.remove(&pid);
                copy.mappers.is_empty()
            });
            if unmapped {
                self.unprobe(probes, id);
            }
        }
    }

    /// Looks at the files `pid` maps executable: a libcuda copy not probed yet is
    /// probed, within the budget. What it maps is read on a worker with a deadline
    /// ([`open_mapped`]): its owner can keep its address space from answering.
    fn look(&mut self, probes: &mut Probes, pid: u32, uid: u32, now: Instant) {
        let Ok(stat) = procfs::stat(pid) else {
            return; // gone
        };
        // Stamped before the read (an exec between the two counts as after it), kept
        // once the read answered.
        let stamp = crate::clock::monotonic_ns();
        let started = stat.start_time;
        let process = stat.image_of(pid);
        let opened = match address_space::read(process, SpaceFile::Maps, move || open_mapped(pid)) {
            Ok(Ok(opened)) => {
                self.read_at(pid, stamp);
                opened
            }
            Ok(Err(e)) => {
                if let Some(e) = e {
                    tracing::warn!(
                        "--memory-at-alloc: cannot look at process {pid}'s libraries: {e}"
                    );
                }
                return;
            }
            Err(e) => {
                if self.held_said.insert(pid) {
                    tracing::warn!(
                        "--memory-at-alloc: cannot look at process {pid}'s libraries: {e}; looked at again at its next open (said once per process)"
                    );
                }
                return;
            }
        };
        let mut checked = 0;
        for handle in opened {
            let Some(version) = handle.version() else {
                continue;
            };
            if self.known(version, pid, started) {
                continue;
            }
            if checked == CHECKS_PER_LOOK {
                self.looks.again_at(pid, now);
                return;
            }
            if !self.budget.may_check(uid, now) {
                return; // the rest at its next open
            }
            checked += 1;
            self.examine(probes, handle, version, (pid, uid, started), now);
        }
    }

    /// Whether `version` was examined already (then recorded as mapped by `pid`, if a
    /// copy). A probed file is never probed twice, whatever changed in it: its probes
    /// are on its inode.
    fn known(&mut self, version: FileVersion, pid: u32, started: u64) -> bool {
        let id = version.id();
        match self.seen.get(&id) {
            Some((_, What::Copy)) => {
                if let Some(copy) = self.copies.get_mut(&id) {
                    copy.mappers.insert(pid, started);
                    self.mapped_by.entry(pid).or_default().insert(id);
                }
                true
            }
            Some((_, What::Given)) => true,
            Some((seen, What::Other)) => *seen == version,
            None => false,
        }
    }

    /// Reads what a file exports; a libcuda is probed if the budget allows.
    fn examine(
        &mut self,
        probes: &mut Probes,
        handle: Handle,
        version: FileVersion,
        (pid, uid, started): (u32, u32, u64),
        now: Instant,
    ) {
        let id = version.id();
        let found = handle.open().and_then(|library| {
            let exports = library.exports()?;
            Ok((library, exports))
        });
        let (library, exports) = match found {
            Ok((library, exports)) if exports.is_libcuda() => (library, exports),
            _ => {
                self.remember(id, version, What::Other);
                return;
            }
        };
        if let Err(why) = self.budget.may_probe(uid, now) {
            self.prune_mappers(probes);
            if self.said.get(&uid).is_none_or(|at| now >= *at + SAY_AGAIN) {
                tracing::warn!(
                    "--memory-at-alloc: not probing the libcuda copy {} (uid {uid}) for now: {why}; give it with --cuda-lib",
                    library.name
                );
                self.said.insert(uid, now);
            }
            return; // looked at again at its next open
        }
        let line = format!(
            "--memory-at-alloc: process {pid} maps a libcuda not probed yet ({}, device {}, inode {}); allocations through it are held to their environment's gpu_memory",
            library.name, id.0, id.1
        );
        match probes.attach(&library, &exports, |_| line) {
            Ok(attachment) => {
                self.probed.push(pid);
                let mappers = HashMap::from([(pid, started)]);
                let copy = Copy {
                    attachment,
                    paid_by: uid,
                    mappers,
                };
                self.copies.insert(id, copy);
                self.mapped_by.entry(pid).or_default().insert(id);
                self.remember(id, version, What::Copy);
            }
            Err(e) => {
                tracing::warn!("--memory-at-alloc: not probing {e}");
                self.budget.released(uid);
                self.remember(id, version, What::Other);
            }
        }
    }

    fn remember(&mut self, id: (u64, u64), version: FileVersion, what: What) {
        if self.seen.len() >= MAX_SEEN {
            self.seen.retain(|_, (_, what)| *what != What::Other);
        }
        self.seen.insert(id, (version, what));
    }

    /// Takes a copy's probes off; its place in the budget comes back.
    fn unprobe(&mut self, probes: &mut Probes, id: (u64, u64)) {
        let Some(copy) = self.copies.remove(&id) else {
            return;
        };
        self.seen.remove(&id);
        probes.detach(copy.attachment);
        self.budget.released(copy.paid_by);
        tracing::info!(
            "--memory-at-alloc: no live process maps the libcuda copy (device {}, inode {}) any more; its probes are off",
            id.0,
            id.1
        );
    }

    /// Mappers whose exits were not seen (events lost) are let go of, and their copies
    /// with them: done when the budget is short.
    fn prune_mappers(&mut self, probes: &mut Probes) {
        let gone: Vec<u32> = self
            .copies
            .values()
            .flat_map(|copy| copy.mappers.iter())
            .filter(|(pid, started)| {
                procfs::stat(**pid).map(|s| s.start_time).ok() != Some(**started)
            })
            .map(|(pid, _)| *pid)
            .collect();
        for pid in gone {
            self.gone(probes, pid);
        }
    }
}

/// The files a look examines, those named like a libcuda first (a look may stop before
/// the end, see [`CHECKS_PER_LOOK`]); a copy is told by its contents all the same.
/// The files `pid` maps executable, likely libcudas first, each opened `O_PATH` through
/// `/proc/<pid>/map_files` (both wait on its address space: run on a worker). Files on
/// FUSE are left unopened; `Err(None)` when the process is gone.
fn open_mapped(pid: u32) -> Result<Vec<Handle>, Option<String>> {
    let files = maps::executable_files(pid).map_err(|_| None)?;
    let mountinfo = format!("/proc/{pid}/mountinfo");
    let table = MountTable::read(&mountinfo).map_err(|e| Some(e.to_string()))?;
    Ok(likely_first(files)
        .into_iter()
        // Refused unopened: nothing of a FUSE mount is touched.
        .filter(|mapping| !table.is_fuse_device(mapping.dev))
        .filter_map(|mapping| {
            let name = format!("{:?} (mapped by process {pid})", mapping.path);
            // FUSE, unlisted, or unmapped since: skipped.
            Handle::new(&mapping.link, name, &table).ok()
        })
        .collect())
}

fn likely_first(mut files: Vec<Mapping>) -> Vec<Mapping> {
    files.sort_by_key(|m| {
        let name = m.path.rsplit('/').next().unwrap_or_default();
        !name.contains("cuda")
    });
    files
}
