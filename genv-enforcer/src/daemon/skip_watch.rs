//! The daemon's look at the runs the kernel skipped ([`SkippedRuns`]): no event tells of
//! one, so the counts are read, at most every [`LOOK_EVERY`]. A skipped run of an open
//! program is a GPU open nobody decided: with `--deny`, every GPU node's holders outside
//! environments are swept, as after a kill; a skipped exec, fork or exit hook is an
//! identity the kernel did not record. Either way the daemon resynchronises as for lost
//! events, with a full cycle (at most every [`RESYNC_EVERY`]: on a busy preemptible
//! kernel the misses never stop, and a full cycle per look would be the daemon's whole
//! work). Said once with why, then at most every [`SAY_EVERY`] with the totals.

use std::time::{Duration, Instant};

use crate::kernel::{KernelPrograms, SkippedRuns};

/// How often the counts are read (one `bpf()` lookup and info call per program).
const LOOK_EVERY: Duration = Duration::from_millis(250);
/// The shortest time between two full cycles that skipped runs ask for.
const RESYNC_EVERY: Duration = Duration::from_secs(5);
/// The shortest time between two warnings after the first.
const SAY_EVERY: Duration = Duration::from_secs(60);

/// What the last look saw, and when the next look, resync and warning may be.
pub struct SkipWatch {
    seen: SkippedRuns,
    next_look: Instant,
    next_resync: Instant,
    next_say: Option<Instant>,
    /// Skipped since the last full cycle it asked for.
    owed: SkippedRuns,
}

/// What a look found to do.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SkipsFound {
    /// Skipped since the last look.
    pub new: SkippedRuns,
    /// Sweep every GPU node's holders: an open went undecided.
    pub sweep: bool,
    /// Run a full cycle now.
    pub resync: bool,
}

impl SkipWatch {
    /// Counting from what the programs skipped before this daemon looked.
    pub fn new(programs: &KernelPrograms, now: Instant) -> Self {
        Self::from(programs.skipped_runs(), now)
    }

    fn from(seen: SkippedRuns, now: Instant) -> Self {
        SkipWatch {
            seen,
            next_look: now,
            next_resync: now,
            next_say: None,
            owed: SkippedRuns::default(),
        }
    }

    /// Reads the counts if a look is due; what to do about runs skipped since.
    pub fn look(&mut self, programs: &KernelPrograms, now: Instant) -> Option<SkipsFound> {
        if now < self.next_look {
            return None;
        }
        self.next_look = now + LOOK_EVERY;
        self.found(programs.skipped_runs(), now)
    }

    fn found(&mut self, counts: SkippedRuns, now: Instant) -> Option<SkipsFound> {
        let new = counts.since(self.seen);
        self.seen = counts;
        self.owed.open += new.open;
        self.owed.lifecycle += new.lifecycle;
        let resync = self.owed.any() && now >= self.next_resync;
        if !new.any() && !resync {
            return None;
        }
        if resync {
            self.owed = SkippedRuns::default();
            self.next_resync = now + RESYNC_EVERY;
        }
        if new.any() {
            self.say(new, counts, now);
        }
        Some(SkipsFound {
            new,
            sweep: new.open > 0,
            resync,
        })
    }

    fn say(&mut self, new: SkippedRuns, total: SkippedRuns, now: Instant) {
        match self.next_say {
            None => tracing::warn!(
                "The kernel skipped {} run(s) of the GPU-open programs and {} of the exec, fork \
                 and exit hooks: it found the program already running on that CPU (its \
                 recursion guard; on a preemptible kernel, another task preempted inside it). \
                 An open it skipped went undecided: GPU holders outside environments are swept \
                 (--deny) and a full cycle resynchronises. The lsm tier has no such guard \
                 (docs/deny.md)",
                new.open,
                new.lifecycle
            ),
            Some(next) if now < next => return,
            Some(_) => tracing::warn!(
                "The kernel skipped {} more run(s) of the GPU-open programs and {} of the exec, \
                 fork and exit hooks ({} and {} since the daemon started); sweeping and \
                 resynchronising",
                new.open,
                new.lifecycle,
                total.open,
                total.lifecycle
            ),
        }
        self.next_say = Some(now + SAY_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(open: u64, lifecycle: u64) -> SkippedRuns {
        SkippedRuns { open, lifecycle }
    }

    #[test]
    fn nothing_skipped_asks_for_nothing() {
        let start = Instant::now();
        let mut watch = SkipWatch::from(runs(7, 3), start);
        // What was skipped before the daemon looked is not its to answer.
        assert_eq!(watch.found(runs(7, 3), start), None);
    }

    #[test]
    fn a_skipped_open_sweeps_and_resyncs_and_a_skipped_exec_resyncs() {
        let start = Instant::now();
        let mut watch = SkipWatch::from(runs(0, 0), start);
        let found = watch.found(runs(2, 0), start).unwrap();
        assert_eq!(
            (found.new, found.sweep, found.resync),
            (runs(2, 0), true, true)
        );
        let later = start + RESYNC_EVERY;
        let found = watch.found(runs(2, 1), later).unwrap();
        assert_eq!(
            (found.new, found.sweep, found.resync),
            (runs(0, 1), false, true)
        );
    }

    #[test]
    fn skips_that_never_stop_resync_once_per_period_and_owe_none() {
        let start = Instant::now();
        let mut watch = SkipWatch::from(runs(0, 0), start);
        assert!(watch.found(runs(1, 0), start).unwrap().resync);
        // Every open in between is still swept; the full cycle waits its period.
        let soon = start + LOOK_EVERY;
        let found = watch.found(runs(2, 0), soon).unwrap();
        assert!(found.sweep && !found.resync);
        // Nothing new, but a resync is owed: it comes when the period is over.
        assert_eq!(watch.found(runs(2, 0), soon + LOOK_EVERY), None);
        let found = watch.found(runs(2, 0), start + RESYNC_EVERY).unwrap();
        assert!(!found.sweep && found.resync);
        assert_eq!(watch.found(runs(2, 0), start + RESYNC_EVERY * 2), None);
    }
}
