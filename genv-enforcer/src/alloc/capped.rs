//! The processes of capped environments, as the kernel recorded their environments (at
//! their exec, or inherited at their fork).
//!
//! The libcuda probes are registered system-wide and return at once for any other
//! process (see `crate::kernel::cuda::registrar`), so nothing is placed in a process:
//! what the daemon does for one of these is read what CUDA will read of its
//! environment (its device numbering, and the cap it was started with), when its exec
//! or fork reaches the daemon, well before its CUDA start (loading the runtime and
//! libcuda takes far longer than that). At every full cycle the set is caught up with
//! the kernel's identities: a cap came or went, an exec was lost.

use std::collections::HashMap;

use crate::backends::procfs;
use crate::kernel::policy_maps::IdentityReader;

use super::caps::Caps;

/// The processes of capped environments read so far, with their start times.
#[derive(Default)]
pub(super) struct Capped {
    read: HashMap<u32, u64>,
}

impl Capped {
    /// `pid` exec'd or was forked: its start time if its environment has a cap (what
    /// CUDA will read of it is to be read now), `None` otherwise.
    pub(super) fn placed(
        &mut self,
        identities: &IdentityReader,
        caps: &Caps,
        pid: u32,
    ) -> Option<u64> {
        let capped = identities
            .get(pid)
            .is_some_and(|identity| caps.holds(identity));
        if !capped {
            self.read.remove(&pid);
            return None;
        }
        let started = procfs::stat(pid).ok()?.start_time;
        self.read.insert(pid, started);
        Some(started)
    }

    /// The processes of the capped environments not read yet, as the kernel knows
    /// them now, with their start times; the others are forgotten.
    pub(super) fn caught_up(
        &mut self,
        identities: &IdentityReader,
        caps: &Caps,
    ) -> Vec<(u32, u64)> {
        let wanted: HashMap<u32, ()> = identities
            .all()
            .into_iter()
            .filter(|&(_, identity)| caps.holds(identity))
            .map(|(pid, _)| (pid, ()))
            .collect();
        self.read.retain(|pid, _| wanted.contains_key(pid));
        let mut new = Vec::new();
        for pid in wanted.into_keys() {
            if self.read.contains_key(&pid) {
                continue;
            }
            if let Ok(stat) = procfs::stat(pid) {
                self.read.insert(pid, stat.start_time);
                new.push((pid, stat.start_time));
            }
        }
        new
    }

    /// `pid` exited.
    pub(super) fn forget(&mut self, pid: u32) {
        self.read.remove(&pid);
    }
}
