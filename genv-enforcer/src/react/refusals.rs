//! How often a process's refused allocations are said (`--memory-at-alloc refuse`). A
//! refused program lives, and often tries again at once: PyTorch's allocator frees its
//! cache and retries, a batch-size finder halves and retries, a script catches the
//! error in a loop. Each refusal is counted (status, metrics); the line, the
//! `[DECISION]` record and the user's terminal get the first one of a process at once,
//! then at most one every [`EVERY`], which says how many were held back since.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::intake::{AllocOutcome, OverCap};

/// After a process's refusal is said, its next ones are held back this long.
pub const EVERY: Duration = Duration::from_secs(10);
/// Processes remembered; past this, those whose quiet time is over are forgotten, then
/// all (a flood of processes then gets a line each, which the terminals' and the log's
/// own limits still bound).
const MAX_PROCESSES: usize = 4096;

/// Whether an allocation past a cap is said now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Paced {
    /// Now, with the process's refusals held back since its last line.
    Now { held_back: u64 },
    /// Held back (counted, not said).
    HeldBack,
}

#[derive(Debug, Default)]
pub struct Refusals {
    by_pid: HashMap<u32, LastSaid>,
}

/// When a process's refusal was last said, and how many came since.
#[derive(Clone, Copy, Debug)]
struct LastSaid {
    at: Instant,
    held_back: u64,
}

impl Refusals {
    /// Whether `over` is said at `now`: a kill or a report always; a refusal as the
    /// process's pace allows.
    pub fn say(&mut self, over: &OverCap, now: Instant) -> Paced {
        if over.outcome != AllocOutcome::Refused {
            return Paced::Now { held_back: 0 };
        }
        // The kernel reports one a second per process, with those it held back.
        match self.refused(over.pid, now, over.held_back) {
            Some(held_back) => Paced::Now {
                held_back: held_back + over.held_back,
            },
            None => Paced::HeldBack,
        }
    }

    /// Whether a refusal of `pid`'s at `now` (with `also` more the kernel held back
    /// before it) is said: `Some(n)`, `n` refusals having been held back here since the
    /// last one said; `None`: held back.
    fn refused(&mut self, pid: u32, now: Instant, also: u64) -> Option<u64> {
        if let Some(said) = self.by_pid.get_mut(&pid) {
            if now.saturating_duration_since(said.at) < EVERY {
                said.held_back += 1 + also;
                return None;
            }
            let held_back = said.held_back;
            *said = LastSaid {
                at: now,
                held_back: 0,
            };
            return Some(held_back);
        }
        if self.by_pid.len() >= MAX_PROCESSES {
            self.by_pid
                .retain(|_, said| now.saturating_duration_since(said.at) < EVERY);
            if self.by_pid.len() >= MAX_PROCESSES {
                self.by_pid.clear();
            }
        }
        self.by_pid.insert(
            pid,
            LastSaid {
                at: now,
                held_back: 0,
            },
        );
        Some(0)
    }

    /// The process's image is gone (exec or exit): a pid reused is said afresh. The
    /// refusals held back since its last line, if any.
    pub fn forget(&mut self, pid: u32) -> Option<u64> {
        let held_back = self.by_pid.remove(&pid)?.held_back;
        (held_back > 0).then_some(held_back)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retrying_process_is_said_once_then_once_every_ten_seconds_with_the_count() {
        let mut refusals = Refusals::default();
        let start = Instant::now();
        assert_eq!(refusals.refused(7, start, 0), Some(0));
        for ms in 1..=1000 {
            let at = start + Duration::from_millis(ms);
            assert_eq!(refusals.refused(7, at, 0), None);
        }
        let other = refusals.refused(8, start, 0);
        assert_eq!(other, Some(0), "another process is its own");
        assert_eq!(refusals.refused(7, start + EVERY, 0), Some(1000));
        // The kernel's own held-back count adds to this one's.
        assert_eq!(refusals.refused(7, start + EVERY, 4), None);
        assert_eq!(refusals.forget(7), Some(5), "said when the process goes");
        assert_eq!(
            refusals.refused(7, start + EVERY, 0),
            Some(0),
            "a pid reused"
        );
        assert_eq!(refusals.forget(7), None, "nothing held back");
    }

    #[test]
    fn a_flood_of_processes_stays_bounded() {
        let mut refusals = Refusals::default();
        let now = Instant::now();
        for pid in 0..3 * MAX_PROCESSES as u32 {
            assert_eq!(refusals.refused(pid, now, 0), Some(0));
            assert!(refusals.by_pid.len() <= MAX_PROCESSES);
        }
    }
}
