//! Signalling a process without ever hitting the wrong one.
//!
//! A pid is only a number: between the snapshot and the signal the process may exit and
//! the pid be reused. So the signal goes through a pidfd, opened first and then checked
//! against the start time recorded in the snapshot: if `/proc/<pid>` still shows that
//! start time after the pidfd was opened, the pidfd names that very process, and every
//! later signal through it (the SIGKILL escalation too) reaches it or nothing.
//! PID 1, kernel threads, the enforcer and its ancestors are never signalled.

use std::os::fd::OwnedFd;

use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};

use crate::backends::procfs;

/// Processes that must never be signalled whatever a report says.
#[derive(Clone, Debug)]
pub struct Protected {
    /// The enforcer and its ancestors, up to PID 1.
    lineage: Vec<u32>,
}

impl Protected {
    pub fn for_this_process() -> Self {
        Self {
            lineage: procfs::self_and_ancestors(std::process::id()),
        }
    }

    pub fn reason(&self, pid: u32) -> Option<&'static str> {
        match pid {
            0 => Some("pid 0 names no process"),
            1 => Some("it is PID 1"),
            _ if pid == std::process::id() => Some("it is the enforcer itself"),
            _ if self.lineage.contains(&pid) => Some("it is a parent of the enforcer"),
            _ => None,
        }
    }
}

#[derive(Debug)]
pub enum Outcome {
    /// The process exited (or its pid now names another process).
    Gone,
    PermissionDenied,
    Refused(&'static str),
}

/// Opens a pidfd for `pid` and checks it still names the process that started at
/// `start_time` (when known).
pub fn open(pid: u32, start_time: Option<u64>, protected: &Protected) -> Result<OwnedFd, Outcome> {
    open_with(pid, start_time, protected, || {})
}

/// [`open`], running `between` after the pidfd is opened and before the start time is
/// read: the window in which the pid may be reused under it (the tests reuse it there).
pub(super) fn open_with(
    pid: u32,
    start_time: Option<u64>,
    protected: &Protected,
    between: impl FnOnce(),
) -> Result<OwnedFd, Outcome> {
    if let Some(reason) = protected.reason(pid) {
        return Err(Outcome::Refused(reason));
    }
    let raw = i32::try_from(pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or(Outcome::Gone)?;
    let pidfd = pidfd_open(raw, PidfdFlags::empty()).map_err(|_| Outcome::Gone)?;
    between();
    let stat = procfs::stat(pid).map_err(|_| Outcome::Gone)?;
    if stat.is_kernel_thread() {
        return Err(Outcome::Refused("it is a kernel thread"));
    }
    if start_time.is_some_and(|t| t != stat.start_time) {
        return Err(Outcome::Gone); // the pid was reused
    }
    Ok(pidfd)
}

pub fn send(pidfd: &OwnedFd, signal: Signal) -> Result<(), Outcome> {
    pidfd_send_signal(pidfd, signal).map_err(|e| match e {
        Errno::PERM => Outcome::PermissionDenied,
        _ => Outcome::Gone,
    })
}

/// Whether the process behind `pidfd` has exited (a pidfd polls readable then).
pub fn has_exited(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pid_whose_start_time_changed_is_not_signalled() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        let start = procfs::stat(pid).unwrap().start_time;
        let protected = Protected::for_this_process();
        // The snapshot saw another process under this pid: refuse.
        assert!(matches!(
            open(pid, Some(start + 1), &protected),
            Err(Outcome::Gone)
        ));
        assert!(child.try_wait().unwrap().is_none());
        // The same process: the pidfd reaches it.
        let pidfd = open(pid, Some(start), &protected).unwrap();
        assert!(!has_exited(&pidfd));
        send(&pidfd, Signal::KILL).unwrap();
        child.wait().unwrap();
        assert!(has_exited(&pidfd));
        // Once it is gone and reaped, even the same pidfd reaches nothing.
        assert!(matches!(send(&pidfd, Signal::KILL), Err(Outcome::Gone)));
    }
}
