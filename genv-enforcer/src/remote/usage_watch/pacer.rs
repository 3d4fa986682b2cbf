//! When `usage watch` takes its next snapshot.
//!
//! Any user can write genv's world-writable state files, or open a GPU node, in a loop,
//! and each must not cost this root process a snapshot; but genv's own commands write
//! `envs.json` and `devices.json` within milliseconds of each other, often on several
//! hosts at once, and the last of those writes (an attach) is the one a remote enforcer
//! must see soon. So:
//! - **A change is coalesced, not queued.** A write after a quiet spell is snapshotted at
//!   once; writes within [`COALESCE`] of the last snapshot share one snapshot at the
//!   window's end, which covers every write so far, however many came. While the
//!   changes' bucket is empty, the one pending snapshot waits for its next token, and
//!   still covers every write until then: the latest write never waits behind
//!   snapshots for older ones.
//! - **Looks have a bucket of their own.** The looks that follow a GPU open or a listed
//!   process's exit (the process makes its context later; NVML drops it later), and the
//!   poll, take from [`LOOKS`], so that a loop of opens cannot use up what a state change
//!   needs, nor the other way round.
//! - A snapshot taken for either covers both: whatever was pending is done.
//!
//! A write loop costs what it cost before the split: [`CHANGES`] is the old limit (a
//! burst of 5, then one every 100 ms), now per coalesced window instead of per write. A
//! write loop and a loop of GPU opens together cost up to twice that (each bucket pays
//! for its own), against the old limit's once for both: 20 snapshots a second at most.

use std::time::{Duration, Instant};

use crate::limits::{Rate, TokenBucket};

/// Snapshots for changes are this far apart at least: the writes of one genv command
/// (`envs.json`, then `devices.json`) land within it, and cost two snapshots at most.
pub const COALESCE: Duration = Duration::from_millis(2);
/// Snapshots for state changes: a burst of 5, then one every 100 ms.
pub const CHANGES: Rate = Rate {
    burst: 5,
    every: Duration::from_millis(100),
};
/// Snapshots for looks (after opens and exits, and the poll): the same.
pub const LOOKS: Rate = Rate {
    burst: 5,
    every: Duration::from_millis(100),
};

/// The least a snapshot put off for a token waits.
const RETRY: Duration = Duration::from_millis(1);

/// The pending snapshot, if any, and the two buckets.
#[derive(Debug)]
pub struct Pacer {
    changes: TokenBucket,
    looks: TokenBucket,
    /// A change is pending: its snapshot is due then.
    change_due: Option<Instant>,
    /// A look is pending: due then.
    look_due: Option<Instant>,
    /// When the last snapshot was taken.
    last: Option<Instant>,
}

impl Default for Pacer {
    fn default() -> Self {
        Self {
            changes: TokenBucket::full(CHANGES),
            looks: TokenBucket::full(LOOKS),
            change_due: None,
            look_due: None,
            last: None,
        }
    }
}

impl Pacer {
    /// genv's state changed at `now`: a snapshot now, or at the end of the window the
    /// last one opened; none more if one is pending already (it will cover this change).
    pub fn changed(&mut self, now: Instant) {
        let window_end = self.last.map_or(now, |last| last + COALESCE);
        self.change_due.get_or_insert(now.max(window_end));
    }

    /// A look is wanted now (after an open or exit, at a poll).
    pub fn look(&mut self, now: Instant) {
        self.look_due = Some(self.look_due.map_or(now, |at| at.min(now)));
    }

    /// When to wake for the pending snapshot, if one is pending.
    pub fn wake_at(&self) -> Option<Instant> {
        match (self.change_due, self.look_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether a snapshot is to be taken at `now`. When one is due but its bucket is
    /// empty, it is put off to the bucket's next token (and stays one).
    pub fn take(&mut self, now: Instant) -> bool {
        let change_ready = self.change_due.is_some_and(|at| at <= now);
        let look_ready = self.look_due.is_some_and(|at| at <= now);
        if (change_ready && self.changes.take(now)) || (look_ready && self.looks.take(now)) {
            // One snapshot covers whatever else was pending.
            self.change_due = None;
            self.look_due = None;
            self.last = Some(now);
            return true;
        }
        // Never `now` again: a bucket a hair short of a token would wake at once, and
        // again, for as long as the float says not yet.
        if change_ready {
            self.change_due = Some(self.changes.next_at(now).max(now + RETRY));
        }
        if look_ready {
            self.look_due = Some(self.looks.next_at(now).max(now + RETRY));
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `pacer` until `end`, waking when it says; the snapshots' times.
    fn snapshots(pacer: &mut Pacer, from: Instant, end: Instant) -> Vec<Instant> {
        let mut taken = Vec::new();
        let mut now = from;
        while let Some(at) = pacer.wake_at() {
            now = now.max(at);
            if now > end {
                break;
            }
            if pacer.take(now) {
                taken.push(now);
            }
        }
        taken
    }

    /// The first write of a burst is snapshotted at once; the 49 after it, within the
    /// window, make one pending snapshot, taken after the last of them.
    #[test]
    fn a_burst_of_writes_is_one_pending_snapshot_that_includes_the_last() {
        let mut pacer = Pacer::default();
        let t0 = Instant::now();
        pacer.changed(t0);
        assert!(pacer.take(t0), "a write after a quiet spell: at once");
        for i in 1..50 {
            let now = t0 + Duration::from_micros(i * 20);
            pacer.changed(now);
            assert!(!pacer.take(now), "not before the window ends");
        }
        let last_write = t0 + Duration::from_micros(49 * 20);
        let taken = snapshots(&mut pacer, last_write, t0 + Duration::from_secs(1));
        assert_eq!(taken, [t0 + COALESCE], "one snapshot, after the last write");
        assert_eq!(pacer.wake_at(), None, "nothing left pending");
    }

    #[test]
    fn with_the_bucket_empty_the_latest_write_waits_for_one_token_not_a_queue() {
        let mut pacer = Pacer::default();
        let mut now = Instant::now();
        // Use up the burst with separate writes.
        for _ in 0..CHANGES.burst {
            now += COALESCE;
            pacer.changed(now);
            assert!(pacer.take(now));
        }
        // Three more writes, 1 ms apart: one snapshot, at the next token, covering all.
        let first = now;
        for i in 0..3 {
            pacer.changed(first + Duration::from_millis(i));
        }
        let taken = snapshots(&mut pacer, first, first + Duration::from_secs(1));
        assert_eq!(taken.len(), 1, "{taken:?}");
        assert!(
            taken[0] > first + Duration::from_millis(2),
            "after the last write"
        );
        assert!(taken[0] <= first + CHANGES.every, "within one token's time");
    }

    #[test]
    fn a_write_loop_costs_no_more_snapshots_than_the_old_limit() {
        // Writes every 100 µs for 10 s: the old limit allowed 5 + 10 a second.
        let mut pacer = Pacer::default();
        let t0 = Instant::now();
        let mut taken = 0;
        for i in 0..100_000u32 {
            let now = t0 + Duration::from_micros(u64::from(i) * 100);
            pacer.changed(now);
            if pacer.take(now) {
                taken += 1;
            }
        }
        assert!(taken <= 5 + 100, "{taken} snapshots");
        assert!(taken >= 95, "still one every 100 ms: {taken}");
    }

    #[test]
    fn looks_do_not_use_up_what_a_change_needs() {
        let mut pacer = Pacer::default();
        let t0 = Instant::now();
        // A loop of opens: looks until their bucket is empty, and past it.
        let mut now = t0;
        for _ in 0..100 {
            pacer.look(now);
            pacer.take(now);
            now += Duration::from_micros(100);
        }
        // A write now still gets its snapshot, at once.
        now += COALESCE;
        pacer.changed(now);
        let taken = snapshots(&mut pacer, now, now + COALESCE);
        assert_eq!(taken, [now]);
    }
}
