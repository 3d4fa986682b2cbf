//! Runs of the programs the kernel skipped. A trampoline program (the lsm tier's
//! excepted) and a tracepoint's are guarded against recursion by a per-CPU count: a
//! program the kernel finds already running on that CPU is not run again, and the
//! kernel counts the miss (`recursion_misses`). Where programs run preemptibly (a
//! `PREEMPT_LAZY` or full-preemption kernel: Debian's 7.x), a task preempted inside the
//! program leaves it "running", and the next task on that CPU to hit the same hook goes
//! through unseen: measured in the VM on 7.3, the fentry tier missed 768 of the opens
//! in a loop of 10,000 forks and let 2 to 8 of those GPU opens return (the lsm tier,
//! which has no such guard, none). No event tells of a skipped run; the daemon looks at
//! these counts ([`crate::daemon`]'s skip watch) and reacts as to lost events.

/// Runs skipped so far (or since an earlier look): of the programs that decide GPU
/// opens, and of the exec, fork and exit hooks that record identities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SkippedRuns {
    pub open: u64,
    pub lifecycle: u64,
}

impl SkippedRuns {
    /// What was skipped since `earlier` (a count that went down, a program replaced,
    /// counts from zero again).
    pub fn since(self, earlier: SkippedRuns) -> SkippedRuns {
        let grew = |now: u64, then: u64| if now >= then { now - then } else { now };
        SkippedRuns {
            open: grew(self.open, earlier.open),
            lifecycle: grew(self.lifecycle, earlier.lifecycle),
        }
    }

    pub fn any(self) -> bool {
        self.open > 0 || self.lifecycle > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_was_skipped_since_a_look_is_the_growth_and_a_reset_counts_from_zero() {
        let then = SkippedRuns {
            open: 5,
            lifecycle: 2,
        };
        let now = SkippedRuns {
            open: 9,
            lifecycle: 2,
        };
        assert_eq!(
            now.since(then),
            SkippedRuns {
                open: 4,
                lifecycle: 0
            }
        );
        assert!(now.since(then).any());
        assert!(!then.since(then).any());
        // A program loaded again counts from zero.
        let reset = SkippedRuns {
            open: 1,
            lifecycle: 0,
        };
        assert_eq!(
            reset.since(then),
            SkippedRuns {
                open: 1,
                lifecycle: 0
            }
        );
    }
}
