//! The holders of a GPU node the kernel killed an opener of. On the fentry and
//! tracepoint tiers `bpf_send_signal` reaches the opener's thread group only: a process
//! sharing its file table (`clone(CLONE_FILES)`), which may also have `dup`ed the
//! descriptor away, keeps the GPU. After each kill, every process still holding that
//! node is found in `/proc` and, if the kernel's own maps put it outside any
//! environment, killed too, through a pidfd checked against its start time.
//!
//! Until this sweep runs (milliseconds), such a sharer can use the descriptor: only the
//! refusal tiers (lsm, fmod_ret) close that window.

use std::collections::HashSet;
use std::path::Path;

use rustix::process::Signal;

use crate::actions::kill::{self, Protected};
use crate::backends::devmap::DeviceMap;
use crate::backends::{procfs, users};
use crate::kernel::policy_maps::PolicyMaps;
use crate::notify::Subject;
use crate::sync::allowlist;

/// A holder the sweep killed: its pid, uid and the GPUs it held, and (read before the
/// kill, for the user told of it) its name and terminal.
#[derive(Debug, PartialEq, Eq)]
pub struct Killed {
    pub pid: u32,
    pub uid: u32,
    pub gpus: Vec<u32>,
    pub subject: Option<Subject>,
}

/// Kills every process outside any environment that holds one of `gpus` open (any GPU
/// node, for `None`; root's only when `deny_root`), but those `spared` (the openers the
/// kernel killed, dying already); the enforcer, its ancestors, allow-listed tools and
/// environments' processes are left alone.
pub fn sweep(
    maps: &PolicyMaps,
    device_map: &DeviceMap,
    (gpus, spared): (Option<&HashSet<u32>>, &HashSet<u32>),
    deny_root: bool,
) -> Vec<Killed> {
    let index_of = |major, minor| {
        device_map
            .index_of(major, minor)
            .filter(|i| gpus.is_none_or(|gpus| gpus.contains(i)))
    };
    let Ok(holders) = procfs::gpu_node_holders(Path::new("/proc"), &index_of) else {
        return Vec::new();
    };
    let protected = Protected::for_this_process();
    let mut killed = Vec::new();
    for (pid, held) in holders {
        if spared.contains(&pid) {
            continue; // killed in its open already (not reaped yet, so its pid is its own)
        }
        // The start time first: the pidfd opened below must name this very process.
        let (Ok(stat), Ok(uid)) = (procfs::stat(pid), procfs::real_uid(pid)) else {
            continue; // gone
        };
        let allowed = allowlist::exe_key(&Path::new("/proc").join(pid.to_string()).join("exe"))
            .is_ok_and(|key| maps.allows_exe(&key));
        if (uid == 0 && !deny_root) || allowed || maps.in_environment(pid, uid) {
            continue;
        }
        let Ok(pidfd) = kill::open(pid, Some(stat.start_time), &protected) else {
            continue;
        };
        let subject = Subject::of_process(pid, Some(stat.start_time));
        if kill::send(&pidfd, Signal::KILL).is_ok() {
            killed.push(Killed {
                pid,
                uid,
                gpus: held,
                subject,
            });
        }
    }
    killed
}

impl Killed {
    /// genv-style, on stdout like the kernel's own decisions.
    pub fn line(&self) -> String {
        let gpus: Vec<String> = self.gpus.iter().map(u32::to_string).collect();
        format!(
            "Killed process {} of user {}, which held GPU(s) {} opened by a process the kernel killed: it is not running in a GPU environment",
            self.pid,
            users::display_name(self.uid),
            gpus.join(",")
        )
    }
}
