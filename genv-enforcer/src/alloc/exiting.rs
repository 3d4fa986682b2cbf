//! Exits whose charges wait: the driver frees a process's GPU memory as its descriptors
//! close, late in its exit, so its charges stay until then (taken off early, another
//! process could be let through while the memory is still held).

use std::collections::HashMap;

use crate::backends::procfs;
use crate::kernel::alloc_maps::AllocMaps;

/// Processes that began exiting but are not gone yet, with their start times.
#[derive(Default)]
pub(super) struct Exiting(HashMap<u32, u64>);

impl Exiting {
    pub(super) fn insert(&mut self, pid: u32, started: u64) {
        self.0.insert(pid, started);
    }

    /// The exiting processes now gone have their charges taken off; whether some are
    /// still exiting.
    pub(super) fn settle(&mut self, maps: &mut AllocMaps) -> bool {
        self.0.retain(|&pid, &mut started| {
            let gone = !still_exiting(pid, started);
            if gone {
                maps.process_exited(pid);
            }
            !gone
        });
        !self.0.is_empty()
    }
}

/// Whether the process that started at `started` is still there with a thread that has
/// not finished exiting (its descriptors, the GPU's among them, are closed by then). Its
/// leader may be a zombie already: one that called `pthread_exit` exits first, and the
/// exit event comes from the group's last thread, before that thread closes anything.
fn still_exiting(pid: u32, started: u64) -> bool {
    procfs::stat(pid).is_ok_and(|st| {
        st.start_time == started && (!st.is_zombie() || procfs::has_other_threads(pid))
    })
}

#[cfg(test)]
mod tests {
    use super::still_exiting;
    use crate::backends::procfs;

    /// Charges stay while any thread of the process may still hold the GPU's
    /// descriptors, a zombie leader notwithstanding; they come off once it is gone, and
    /// never for another process given its pid.
    #[test]
    fn a_process_is_exiting_until_its_last_thread_is_gone() {
        let mut child = procfs::leader_exited_first();
        let pid = child.id();
        let started = procfs::stat(pid).unwrap().start_time;
        assert!(
            still_exiting(pid, started),
            "a zombie leader with a live thread"
        );
        assert!(
            !still_exiting(pid, started + 1),
            "another process with that pid"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!still_exiting(pid, started));
    }
}
