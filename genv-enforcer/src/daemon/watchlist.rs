//! Processes that just opened a GPU node. Opening is a hint, not proof: a process
//! breaks a rule only once it has a compute context, which CUDA creates some time after
//! the open. Each is checked at once, then again at growing intervals for a window;
//! one still without a context then is checked every second until it has one or exits
//! (a program may load its data for minutes before it touches the GPU).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::intake::GpuOpen;

/// How long a process is checked quickly after its last GPU open. CUDA creates its
/// context within a second or two of opening the nodes.
pub const WINDOW: Duration = Duration::from_secs(10);
const FIRST_STEP: Duration = Duration::from_millis(2);
const MAX_STEP: Duration = Duration::from_millis(50);
/// After the window, for a process seen with no compute context yet.
pub const SLOW_STEP: Duration = Duration::from_secs(1);

struct Watch {
    /// The first open of this watch, for the reaction time.
    first: GpuOpen,
    until: Instant,
    next: Instant,
    step: Duration,
    /// Seen with a compute context: the full cycle and the memory poll follow it once
    /// the window ends.
    computing: bool,
}

#[derive(Default)]
pub struct Watchlist {
    watches: HashMap<u32, Watch>,
}

impl Watchlist {
    /// Watches `open.pid` from now; a new open restarts its window and its quick checks.
    pub fn add(&mut self, open: GpuOpen, now: Instant) {
        let watch = self.watches.entry(open.pid).or_insert(Watch {
            first: open,
            until: now,
            next: now,
            step: FIRST_STEP,
            computing: false,
        });
        watch.until = now + WINDOW;
        watch.next = now;
        watch.step = FIRST_STEP;
    }

    pub fn remove(&mut self, pid: u32) {
        self.watches.remove(&pid);
    }

    /// `pid` has a compute context (a check saw it): its watch ends with its window.
    pub fn computing(&mut self, pid: u32) {
        if let Some(watch) = self.watches.get_mut(&pid) {
            watch.computing = true;
        }
    }

    /// The open that started watching `pid`.
    pub fn first_open(&self, pid: u32) -> Option<&GpuOpen> {
        self.watches.get(&pid).map(|w| &w.first)
    }

    /// If any watch is due, every watched pid (one snapshot serves them all), and the
    /// due ones move to their next step. Expired watches end.
    pub fn due(&mut self, now: Instant) -> Option<HashSet<u32>> {
        self.watches.retain(|_, w| w.until > now || !w.computing);
        if !self.watches.values().any(|w| w.next <= now) {
            return None;
        }
        for watch in self.watches.values_mut().filter(|w| w.next <= now) {
            let quick = watch.until > now;
            watch.next = now + if quick { watch.step } else { SLOW_STEP };
            watch.step = (watch.step * 2).min(MAX_STEP);
        }
        Some(self.watches.keys().copied().collect())
    }

    pub fn next_wake(&self) -> Option<Instant> {
        self.watches
            .values()
            .map(|w| match w.computing {
                true => w.next.min(w.until),
                false => w.next,
            })
            .min()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.watches.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::Tier;

    fn open(pid: u32) -> GpuOpen {
        GpuOpen {
            pid,
            tid: pid,
            major: 195,
            minor: 0,
            index: 0,
            tier: Tier::Tracepoint,
            uid: 0,
            verdict: crate::intake::Verdict::Outside,
            at_ns: 0,
            subject: None,
        }
    }

    #[test]
    fn checks_at_once_then_backs_off_then_expires() {
        let t0 = Instant::now();
        let mut list = Watchlist::default();
        list.add(open(7), t0);
        assert_eq!(list.due(t0), Some(HashSet::from([7])));
        assert_eq!(list.due(t0), None, "not due again before its step");
        assert_eq!(list.next_wake(), Some(t0 + FIRST_STEP));
        let mut at = t0;
        for _ in 0..20 {
            at = list.next_wake().unwrap();
            assert!(list.due(at).is_some());
        }
        assert!(list.next_wake().unwrap() - at <= MAX_STEP);
        list.computing(7);
        assert_eq!(list.due(t0 + WINDOW), None);
        assert_eq!(list.len(), 0);
    }

    #[test]
    fn a_process_without_a_context_after_the_window_is_checked_every_second() {
        let t0 = Instant::now();
        let mut list = Watchlist::default();
        list.add(open(7), t0);
        let after = t0 + WINDOW + Duration::from_millis(1);
        assert_eq!(list.due(after), Some(HashSet::from([7])));
        assert_eq!(list.next_wake(), Some(after + SLOW_STEP));
        assert_eq!(list.due(after + SLOW_STEP / 2), None);
        let later = t0 + WINDOW * 30;
        assert_eq!(
            list.due(later),
            Some(HashSet::from([7])),
            "until it has one"
        );
        list.computing(7);
        assert_eq!(list.due(later + SLOW_STEP), None);
        assert_eq!(list.len(), 0);
    }

    #[test]
    fn a_new_open_restarts_the_quick_checks() {
        let t0 = Instant::now();
        let mut list = Watchlist::default();
        list.add(open(7), t0);
        for _ in 0..10 {
            let at = list.next_wake().unwrap();
            list.due(at);
        }
        let later = t0 + Duration::from_secs(1);
        list.add(open(7), later);
        assert_eq!(list.next_wake(), Some(later));
        list.remove(7);
        assert_eq!(list.next_wake(), None);
    }
}
