//! How many lines a terminal and a user get: a token bucket each, so that a loop of
//! refused programs (`while :; do python train.py; done`) prints a few lines, then one
//! now and then, and never floods a terminal. A line is written only when both its
//! user's bucket and its terminal's have a token; the lines held back are counted, and
//! the next line written to that terminal says how many `why` has.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

pub use crate::limits::Rate;
use crate::limits::TokenBucket;

/// Per terminal: 3 lines at once, then one every 10 s.
pub const PER_TERMINAL: Rate = Rate {
    burst: 3,
    every: Duration::from_secs(10),
};
/// Per user, over all their terminals: 10 at once, then one every 5 s.
pub const PER_USER: Rate = Rate {
    burst: 10,
    every: Duration::from_secs(5),
};
/// Keys kept per map: users and terminals are far fewer on a node; past this, the
/// buckets that are full again (as good as new) are forgotten first.
const MAX_KEYS: usize = 4096;

/// Token buckets by key.
#[derive(Debug)]
pub struct Buckets<K> {
    rate: Rate,
    buckets: HashMap<K, TokenBucket>,
}

impl<K: Eq + Hash + Copy> Buckets<K> {
    pub fn new(rate: Rate) -> Self {
        Self {
            rate,
            buckets: HashMap::new(),
        }
    }

    /// Whether `key` has a token now (without taking it).
    pub fn has(&self, key: K, now: Instant) -> bool {
        self.buckets.get(&key).is_none_or(|b| b.has(now))
    }

    /// Takes a token from `key`'s bucket (the caller checked [`Self::has`]).
    pub fn take(&mut self, key: K, now: Instant) {
        if !self.buckets.contains_key(&key) && self.buckets.len() >= MAX_KEYS {
            self.forget_full(now);
        }
        let rate = self.rate;
        let bucket = self.buckets.entry(key).or_insert(TokenBucket::full(rate));
        bucket.take(now);
    }

    /// Drops buckets that have refilled (nothing to remember), or all of them when
    /// none has: a flood of new keys then costs its own keys their history, not memory.
    fn forget_full(&mut self, now: Instant) {
        let before = self.buckets.len();
        self.buckets.retain(|_, b| !b.is_full(now));
        if self.buckets.len() == before {
            self.buckets.clear();
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.buckets.len()
    }
}

/// The two limits a line passes: its user's and its terminal's.
#[derive(Debug)]
pub struct Limits {
    users: Buckets<u32>,
    terminals: Buckets<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Self::new(PER_USER, PER_TERMINAL)
    }
}

impl Limits {
    pub fn new(user: Rate, terminal: Rate) -> Self {
        Self {
            users: Buckets::new(user),
            terminals: Buckets::new(terminal),
        }
    }

    /// Whether a line for `uid` may go to terminal `rdev` now; takes from both buckets
    /// when it may, from neither when it may not.
    pub fn allow(&mut self, uid: u32, rdev: u64, now: Instant) -> bool {
        if !(self.users.has(uid, now) && self.terminals.has(rdev, now)) {
            return false;
        }
        self.users.take(uid, now);
        self.terminals.take(rdev, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_of_refusals_gets_a_burst_then_one_line_per_period() {
        let mut limits = Limits::default();
        let start = Instant::now();
        let allowed: usize = (0..100)
            .filter(|i| limits.allow(1000, 34816, start + Duration::from_millis(*i)))
            .count();
        assert_eq!(allowed, PER_TERMINAL.burst as usize);
        // One period later, one more line; not two.
        let later = start + PER_TERMINAL.every + Duration::from_millis(100);
        assert!(limits.allow(1000, 34816, later));
        assert!(!limits.allow(1000, 34816, later));
    }

    #[test]
    fn a_user_on_many_terminals_is_bounded_by_the_users_bucket() {
        let mut limits = Limits::default();
        let now = Instant::now();
        let allowed = (0..50u64)
            .filter(|tty| limits.allow(1000, 34816 + tty, now))
            .count();
        assert_eq!(allowed, PER_USER.burst as usize);
        // Another user's lines are not held back by the first one's flood.
        assert!(limits.allow(1001, 1, now));
    }

    #[test]
    fn a_refused_line_takes_no_token_from_the_other_bucket() {
        let mut limits = Limits::new(
            Rate {
                burst: 1,
                every: Duration::from_secs(3600),
            },
            PER_TERMINAL,
        );
        let now = Instant::now();
        assert!(limits.allow(1, 10, now));
        // User 1 is out; terminal 10's bucket must not pay for the refusal.
        assert!(!limits.allow(1, 10, now));
        assert!(!limits.allow(1, 10, now));
        assert!(limits.allow(2, 10, now));
        assert!(limits.allow(3, 10, now));
        assert!(!limits.allow(4, 10, now), "the terminal's burst is 3");
    }

    #[test]
    fn keys_are_bounded() {
        let mut buckets = Buckets::new(PER_USER);
        let now = Instant::now();
        for key in 0..(MAX_KEYS as u32 * 3) {
            buckets.take(key, now);
        }
        assert!(buckets.len() <= MAX_KEYS);
    }
}
