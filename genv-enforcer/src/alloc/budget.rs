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

use crate::limits::{Rate, TokenBucket};

/// Examinations: a uid's at once, and one more every so often; all uids' likewise.
const CHECKS_PER_UID: Rate = rate(512, Duration::from_millis(100));
const CHECKS_ALL: Rate = rate(2048, Duration::from_millis(20));
/// Copies probed at once, for one uid's processes and for all of them.
const LIVE_PER_UID: usize = 4;
const LIVE_ALL: usize = 64;
/// New copies probed: a uid's at once, and one more every so often; all likewise.
const PROBES_PER_UID: Rate = rate(8, Duration::from_secs(30));
const PROBES_ALL: Rate = rate(64, Duration::from_secs(1));
/// Uids kept track of at most; beyond, those with nothing owed are forgotten.
const MAX_UIDS: usize = 4096;

const fn rate(burst: u32, every: Duration) -> Rate {
    Rate { burst, every }
}

/// What one uid (or all of them) has used.
#[derive(Clone, Copy, Debug)]
struct Allowance {
    checks: TokenBucket,
    probes: TokenBucket,
    live: usize,
}

impl Allowance {
    const fn uid() -> Self {
        Self {
            checks: TokenBucket::full(CHECKS_PER_UID),
            probes: TokenBucket::full(PROBES_PER_UID),
            live: 0,
        }
    }
}

/// Why a copy is not probed now (it is at a later look, once the budget allows).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(super) enum BudgetRefusal {
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
                checks: TokenBucket::full(CHECKS_ALL),
                probes: TokenBucket::full(PROBES_ALL),
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
    pub(super) fn may_probe(&mut self, uid: u32, now: Instant) -> Result<(), BudgetRefusal> {
        if self.all.live >= LIVE_ALL {
            return Err(BudgetRefusal::Live(LIVE_ALL));
        }
        if uid != 0 {
            let mine = self.uid_mut(uid, now);
            if mine.live >= LIVE_PER_UID {
                return Err(BudgetRefusal::LiveForUid(LIVE_PER_UID, uid));
            }
            if !mine.probes.take(now) {
                return Err(BudgetRefusal::RateForUid(uid, PROBES_PER_UID.burst));
            }
        }
        if !self.all.probes.take(now) {
            if uid != 0 {
                self.uid_mut(uid, now).probes.give_back();
            }
            return Err(BudgetRefusal::Rate(PROBES_ALL.burst));
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
