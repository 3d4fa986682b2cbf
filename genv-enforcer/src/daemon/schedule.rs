//! The event-driven daemon's timers: the full cycle, the memory poll and the status file,
//! each with its own period, and the next instant the daemon must wake for any of them.

use std::time::{Duration, Instant};

/// How often the status file is rewritten at most.
const STATUS_EVERY: Duration = Duration::from_secs(1);

pub(super) struct Schedule {
    interval: Duration,
    memory_interval: Duration,
    next_full: Instant,
    next_memory: Instant,
    next_status: Instant,
}

impl Schedule {
    /// The first full cycle and status are due at once; the memory poll one period later
    /// (the full cycle covers memory too).
    pub(super) fn new(now: Instant, interval: Duration, memory_interval: Duration) -> Self {
        Self {
            interval,
            memory_interval,
            next_full: now,
            next_memory: now + memory_interval,
            next_status: now,
        }
    }

    /// New periods (SIGHUP), counted from `now`.
    pub(super) fn set_periods(&mut self, now: Instant, interval: Duration, memory: Duration) {
        self.interval = interval;
        self.memory_interval = memory;
        self.next_full = now;
        self.next_memory = now + memory;
    }

    pub(super) fn full_due(&self, now: Instant) -> bool {
        now >= self.next_full
    }

    /// A full cycle ran at `now`: the next one is an interval away, and the memory poll
    /// starts its period afresh, since the cycle just applied the memory rule.
    pub(super) fn full_done(&mut self, now: Instant) {
        self.next_full = now + self.interval;
        self.next_memory = now + self.memory_interval;
    }

    /// Something (a state change, lost or unreadable events) calls for a full cycle
    /// at the next turn of the loop.
    pub(super) fn full_now(&mut self, now: Instant) {
        self.next_full = now;
    }

    pub(super) fn memory_due(&self, now: Instant) -> bool {
        now >= self.next_memory
    }

    pub(super) fn memory_done(&mut self, now: Instant) {
        self.next_memory = now + self.memory_interval;
    }

    pub(super) fn status_due(&self, now: Instant) -> bool {
        now >= self.next_status
    }

    pub(super) fn status_done(&mut self, now: Instant) {
        self.next_status = now + STATUS_EVERY;
    }

    /// The earliest of the timers and of `others` (deadlines kept elsewhere).
    pub(super) fn next_wake(&self, others: impl IntoIterator<Item = Option<Instant>>) -> Instant {
        others
            .into_iter()
            .flatten()
            .chain([self.next_full, self.next_memory, self.next_status])
            .min()
            .expect("the full cycle is always scheduled")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_cycle_restarts_the_memory_period_and_any_trigger_brings_it_forward() {
        let start = Instant::now();
        let second = Duration::from_secs(1);
        let mut schedule = Schedule::new(start, 10 * second, 2 * second);
        assert!(schedule.full_due(start) && schedule.status_due(start));
        assert!(!schedule.memory_due(start));
        schedule.full_done(start);
        schedule.status_done(start);
        assert_eq!(schedule.next_wake([]), start + second);
        assert!(schedule.memory_due(start + 2 * second));
        schedule.memory_done(start + 2 * second);
        schedule.status_done(start + 2 * second);
        assert_eq!(schedule.next_wake([]), start + 3 * second);
        assert_eq!(
            schedule.next_wake([None, Some(start + second / 2)]),
            start + second / 2
        );
        schedule.full_now(start + 3 * second);
        assert!(schedule.full_due(start + 3 * second));
        schedule.full_done(start + 3 * second);
        assert!(
            !schedule.memory_due(start + 4 * second),
            "the cycle covered memory"
        );
    }
}
