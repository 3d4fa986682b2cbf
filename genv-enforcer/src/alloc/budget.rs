//! What files first seen in processes may cost the daemon. Every file a process that
//! opens GPU nodes maps executable is examined once (its symbol tables read, to tell a
//! libcuda copy by what it exports), and a copy found is probed (its uprobes attached,
//! which holds its inode in the kernel). A user can map file after file, so both are
//! bounded, per uid (root's only in all) and in all:
//!
//! - examinations by token buckets that refill over time;
//! - probed copies by how many are probed at once, which comes back as the processes
//!   that map a copy exit (its probes come off then), and by a token bucket that
//!   refills over time, so that mapping, opening and exiting in a loop cannot keep the
//!   daemon attaching.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Examinations: a uid's at once, and one more every so often; all uids' likewise.
const CHECKS_PER_UID: Bucket = Bucket::full(512, Duration::from_millis(100));
const CHECKS_ALL: Bucket = Bucket::full(2048, Duration::from_millis(20));
/// Copies probed at once, for one uid's processes and for all of them.
const LIVE_PER_UID: usize = 4;
const LIVE_ALL: usize = 64;
/// New copies probed: a uid's at once, and one more every so often; all likewise.
const PROBES_PER_UID: Bucket = Bucket::full(8, Duration::from_secs(30));
const PROBES_ALL: Bucket = Bucket::full(64, Duration::from_secs(1));
/// Uids kept track of at most; beyond, those with nothing owed are forgotten.
const MAX_UIDS: usize = 4096;

/// Tokens: up to `capacity`, one more every `every`.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: u32,
    capacity: u32,
    every: Duration,
    /// When the last token was credited (`None`: full since it was made).
    since: Option<Instant>,
}

impl Bucket {
    const fn full(capacity: u32, every: Duration) -> Self {
        Self {
            tokens: capacity,
            capacity,
            every,
            since: None,
        }
    }

    fn refill(&mut self, now: Instant) {
        let Some(since) = self.since else {
            return;
        };
        let earned = now.saturating_duration_since(since).as_nanos() / self.every.as_nanos();
        let earned = u32::try_from(earned).unwrap_or(u32::MAX);
        self.tokens = self.tokens.saturating_add(earned).min(self.capacity);
        self.since = match self.tokens == self.capacity {
            true => None,
            false => Some(since + self.every * earned),
        };
    }

    fn take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        self.since.get_or_insert(now);
        true
    }

    /// A token taken that was not used after all.
    fn give_back(&mut self) {
        self.tokens = (self.tokens + 1).min(self.capacity);
    }

    fn is_full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.tokens == self.capacity
    }
}

/// What one uid (or all of them) has used.
#[derive(Clone, Copy, Debug)]
struct Allowance {
    checks: Bucket,
    probes: Bucket,
    live: usize,
}

impl Allowance {
    const fn uid() -> Self {
        Self {
            checks: CHECKS_PER_UID,
            probes: PROBES_PER_UID,
            live: 0,
        }
    }
}

/// Why a copy is not probed now (it is at a later look, once the budget allows).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum Refusal {
    #[error("{0} copies are probed for uid {1}'s live processes already")]
    LiveForUid(usize, u32),
    #[error("{0} copies are probed for live processes already")]
    Live(usize),
    #[error("uid {0} had {1} copies probed lately")]
    RateForUid(u32, u32),
    #[error("{0} copies were probed lately")]
    Rate(u32),
}

#[derive(Debug)]
pub(super) struct Budget {
    uids: HashMap<u32, Allowance>,
    all: Allowance,
}

impl Default for Budget {
    fn default() -> Self {
        Self {
            uids: HashMap::new(),
            all: Allowance {
                checks: CHECKS_ALL,
                probes: PROBES_ALL,
                live: 0,
            },
        }
    }
}

impl Budget {
    /// Whether a file of a process of `uid` may be examined now (counted if so).
    pub(super) fn may_check(&mut self, uid: u32, now: Instant) -> bool {
        if !self.all.checks.take(now) {
            return false;
        }
        if uid == 0 {
            return true;
        }
        let taken = self.uid_mut(uid, now).checks.take(now);
        if !taken {
            self.all.checks.give_back();
        }
        taken
    }

    /// Whether a copy found in a process of `uid` may be probed now (counted as live
    /// until [`Self::released`]).
    pub(super) fn may_probe(&mut self, uid: u32, now: Instant) -> Result<(), Refusal> {
        if self.all.live >= LIVE_ALL {
            return Err(Refusal::Live(LIVE_ALL));
        }
        if uid != 0 {
            let mine = self.uid_mut(uid, now);
            if mine.live >= LIVE_PER_UID {
                return Err(Refusal::LiveForUid(LIVE_PER_UID, uid));
            }
            if !mine.probes.take(now) {
                return Err(Refusal::RateForUid(uid, PROBES_PER_UID.capacity));
            }
        }
        if !self.all.probes.take(now) {
            if uid != 0 {
                self.uid_mut(uid, now).probes.give_back();
            }
            return Err(Refusal::Rate(PROBES_ALL.capacity));
        }
        self.all.live += 1;
        if uid != 0 {
            self.uid_mut(uid, now).live += 1;
        }
        Ok(())
    }

    /// A copy probed for `uid` came off (its processes are gone).
    pub(super) fn released(&mut self, uid: u32) {
        self.all.live = self.all.live.saturating_sub(1);
        if let Some(mine) = self.uids.get_mut(&uid) {
            mine.live = mine.live.saturating_sub(1);
        }
    }

    fn uid_mut(&mut self, uid: u32, now: Instant) -> &mut Allowance {
        if self.uids.len() >= MAX_UIDS && !self.uids.contains_key(&uid) {
            self.uids
                .retain(|_, a| a.live > 0 || !a.checks.is_full(now) || !a.probes.is_full(now));
        }
        self.uids.entry(uid).or_insert_with(Allowance::uid)
    }
}

#[cfg(test)]
mod tests;
