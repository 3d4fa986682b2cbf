//! What the kernel decided about a GPU open, said the way genv says things: a
//! genv-style line for each refusal or kill, at most so many a user and second.

use crate::backends::users;
use crate::intake::{GpuOpen, Verdict};

/// genv-style line for an in-kernel decision (stdout, like genv's own lines).
pub fn decision_line(open: &GpuOpen) -> Option<String> {
    let user = users::display_name(open.uid);
    let pid = open.pid;
    let index = open.index;
    match open.verdict {
        Verdict::Refused => Some(format!(
            "Refused process {pid} of user {user} access to GPU {index}: it is not running in a GPU environment"
        )),
        Verdict::Killed => Some(format!(
            "Killed process {pid} of user {user} when it opened GPU {index}: it is not running in a GPU environment"
        )),
        _ => None,
    }
}

/// At most `BURST` decision lines per user and second: a loop of refused attempts must
/// not flood the log. What was held back is counted in the next line said for that user
/// (and in `genv-enforcer status` either way). A user is the uid's owner
/// ([`crate::backends::uid_owners`]), so that one with 65,536 subordinate uids still
/// gets one share.
#[derive(Debug, Default)]
pub struct LineLimiter {
    /// user → the start of its current second, lines said in it, and lines held back.
    said: std::collections::HashMap<u32, Window>,
}

#[derive(Debug)]
struct Window {
    start: std::time::Instant,
    said: u32,
    held: u64,
}

impl LineLimiter {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(1);
    const BURST: u32 = 20;
    /// Users remembered at most (uids come from every process that opens a GPU).
    const MAX_USERS: usize = 4096;

    /// The line to print for this decision now, if any; `user` says whose share it
    /// takes (asked only when there is a line).
    pub fn line(
        &mut self,
        open: &GpuOpen,
        user: impl FnOnce() -> u32,
        now: std::time::Instant,
    ) -> Option<String> {
        let line = decision_line(open)?;
        let user = user();
        if self.said.len() >= Self::MAX_USERS && !self.said.contains_key(&user) {
            self.said.clear();
        }
        let window = self.said.entry(user).or_insert(Window {
            start: now,
            said: 0,
            held: 0,
        });
        if now.duration_since(window.start) >= Self::EVERY {
            window.start = now;
            window.said = 0;
        }
        if window.said >= Self::BURST {
            window.held += 1;
            return None;
        }
        window.said += 1;
        Some(match std::mem::take(&mut window.held) {
            0 => line,
            n => format!("{line} ({n} more decisions about this user's processes not shown)"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::Tier;

    #[test]
    fn decisions_are_reported_with_pid_user_and_gpu() {
        let open = GpuOpen {
            pid: 42,
            tid: 43,
            major: 195,
            minor: 1,
            index: 1,
            tier: Tier::Lsm,
            uid: 0,
            verdict: Verdict::Refused,
            at_ns: 0,
            subject: None,
        };
        assert_eq!(
            decision_line(&open).unwrap(),
            "Refused process 42 of user root access to GPU 1: it is not running in a GPU environment"
        );
        let killed = GpuOpen {
            verdict: Verdict::Killed,
            uid: 4_000_000,
            ..open
        };
        assert_eq!(
            decision_line(&killed).unwrap(),
            "Killed process 42 of user 4000000 when it opened GPU 1: it is not running in a GPU environment"
        );
        let seen = GpuOpen {
            verdict: Verdict::Outside,
            ..open
        };
        assert_eq!(decision_line(&seen), None);
    }

    #[test]
    fn a_burst_of_decisions_about_one_user_is_cut_and_counted() {
        let open = GpuOpen {
            pid: 42,
            tid: 42,
            major: 195,
            minor: 0,
            index: 0,
            tier: Tier::Fentry,
            uid: 0,
            verdict: Verdict::Killed,
            at_ns: 0,
            subject: None,
        };
        let mut limiter = LineLimiter::default();
        let start = std::time::Instant::now();
        let said = (0..100)
            .filter(|_| limiter.line(&open, || open.uid, start).is_some())
            .count();
        assert_eq!(said, LineLimiter::BURST as usize);
        let other = GpuOpen { uid: 1000, ..open };
        assert!(
            limiter.line(&other, || other.uid, start).is_some(),
            "another user is said"
        );
        let later = limiter
            .line(
                &open,
                || open.uid,
                start + std::time::Duration::from_secs(1),
            )
            .unwrap();
        assert!(
            later.ends_with("(80 more decisions about this user's processes not shown)"),
            "{later}"
        );
        let seen = GpuOpen {
            verdict: Verdict::Outside,
            ..open
        };
        assert_eq!(
            limiter.line(&seen, || seen.uid, start),
            None,
            "only decisions are said"
        );
    }
}
