//! The recent decisions, in memory, for `genv-enforcer why`: the last [`CAPACITY`] in
//! all, and at most [`PER_UID`] of any one user, so that one user's loop of refused
//! programs evicts that user's own history, never everyone else's. A user is a
//! decision's `owner` ([`crate::backends::uid_owners`]: a subordinate uid or a user
//! namespace's process counts as its user). When the journal is full, the decision
//! that goes is the oldest of the user holding the most: many users' loops together
//! evict their own, and a user with a few decisions keeps them.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::decision::Decision;

/// Decisions kept in all.
pub const CAPACITY: usize = 4096;
/// Decisions kept about one user's processes.
pub const PER_UID: usize = 512;
/// Decisions one answer holds at most (the whole journal).
pub const MAX_ANSWER: usize = CAPACITY;

/// What `why` asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Query {
    /// Only decisions about this process.
    pub pid: Option<u32>,
    /// Only the caller's own processes, even for root.
    #[serde(default)]
    pub me: bool,
    /// The newest this many (at most [`MAX_ANSWER`]).
    pub limit: usize,
}

#[derive(Debug)]
pub struct Journal {
    /// Oldest first.
    entries: VecDeque<Decision>,
    per_uid: HashMap<u32, usize>,
    capacity: usize,
    per_uid_cap: usize,
}

impl Default for Journal {
    fn default() -> Self {
        Self::with_bounds(CAPACITY, PER_UID)
    }
}

impl Journal {
    pub fn with_bounds(capacity: usize, per_uid_cap: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            per_uid: HashMap::new(),
            capacity: capacity.max(1),
            per_uid_cap: per_uid_cap.clamp(1, capacity.max(1)),
        }
    }

    pub fn push(&mut self, decision: Decision) {
        let uid = decision.owner;
        let own = self.per_uid.get(&uid).copied().unwrap_or(0);
        let evict = if own >= self.per_uid_cap {
            self.entries.iter().position(|d| d.owner == uid)
        } else if self.entries.len() >= self.capacity {
            let most = self.per_uid.values().copied().max().unwrap_or(0);
            let count = |d: &Decision| self.per_uid.get(&d.owner).copied().unwrap_or(0);
            self.entries.iter().position(|d| count(d) == most)
        } else {
            None
        };
        if let Some(gone) = evict.and_then(|at| self.entries.remove(at)) {
            self.forget(gone.owner);
        }
        *self.per_uid.entry(uid).or_default() += 1;
        self.entries.push_back(decision);
    }

    fn forget(&mut self, uid: u32) {
        if let Some(count) = self.per_uid.get_mut(&uid) {
            *count -= 1;
            if *count == 0 {
                self.per_uid.remove(&uid);
            }
        }
    }

    /// What `caller` may see of what it asked: its own processes' decisions, or
    /// everyone's for root; the newest `query.limit`, oldest first.
    pub fn answer(&self, caller: u32, query: &Query) -> Vec<Decision> {
        let everyone = caller == 0 && !query.me;
        let limit = query.limit.min(MAX_ANSWER);
        let mut found: Vec<Decision> = self
            .entries
            .iter()
            .rev()
            .filter(|d| everyone || d.uid == caller)
            .filter(|d| query.pid.is_none_or(|pid| d.pid == pid))
            .take(limit)
            .cloned()
            .collect();
        found.reverse();
        found
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::tests::decision;

    fn all(limit: usize) -> Query {
        Query {
            limit,
            ..Query::default()
        }
    }

    #[test]
    fn a_user_sees_only_their_own_and_root_sees_all() {
        let mut journal = Journal::default();
        journal.push(decision(10, 1000));
        journal.push(decision(11, 1001));
        journal.push(decision(12, 1000));
        let pids = |d: Vec<Decision>| d.iter().map(|d| d.pid).collect::<Vec<_>>();
        assert_eq!(pids(journal.answer(1000, &all(100))), [10, 12]);
        assert_eq!(pids(journal.answer(1001, &all(100))), [11]);
        assert_eq!(pids(journal.answer(1002, &all(100))), [] as [u32; 0]);
        assert_eq!(pids(journal.answer(0, &all(100))), [10, 11, 12]);
        let me = Query {
            me: true,
            ..all(100)
        };
        assert_eq!(pids(journal.answer(0, &me)), [] as [u32; 0]);
        // Another user's pid, asked by pid: nothing.
        let by_pid = |pid| Query {
            pid: Some(pid),
            ..all(100)
        };
        assert_eq!(pids(journal.answer(1000, &by_pid(11))), [] as [u32; 0]);
        assert_eq!(pids(journal.answer(1000, &by_pid(12))), [12]);
        assert_eq!(pids(journal.answer(0, &by_pid(11))), [11]);
        // The newest, in order.
        assert_eq!(pids(journal.answer(0, &all(2))), [11, 12]);
    }

    #[test]
    fn the_journal_is_bounded_and_keeps_the_newest() {
        let mut journal = Journal::with_bounds(100, 100);
        for pid in 0..1000 {
            journal.push(decision(pid, 1000 + pid % 7));
        }
        assert_eq!(journal.len(), 100);
        let answer = journal.answer(0, &all(usize::MAX));
        assert_eq!(answer.first().unwrap().pid, 900);
        assert_eq!(answer.last().unwrap().pid, 999);
    }

    /// Nine uids making 460 decisions each (4,140, past the 4,096 kept) evict their
    /// own: uid 1000's only decision stays.
    #[test]
    fn many_uids_together_cannot_evict_a_users_only_decision() {
        let mut journal = Journal::default();
        journal.push(decision(1, 1000));
        for round in 0..460 {
            for uid in 2000..2009 {
                journal.push(decision(10_000 + round * 9 + uid, uid));
            }
        }
        assert_eq!(journal.len(), CAPACITY);
        assert_eq!(journal.answer(1000, &all(usize::MAX)).len(), 1);
        assert_eq!(journal.per_uid.values().sum::<usize>(), journal.len());
    }

    /// Decisions about a user's subordinate uids count against that user's share.
    #[test]
    fn a_users_subordinate_uids_share_one_bound() {
        let mut journal = Journal::with_bounds(CAPACITY, PER_UID);
        for pid in 0..10 {
            journal.push(decision(pid, 1000));
        }
        for pid in 100..20_000 {
            let mut d = decision(pid, 100_000 + pid % 4096);
            d.owner = 1666;
            journal.push(d);
        }
        assert_eq!(journal.len(), 10 + PER_UID);
        assert_eq!(journal.answer(1000, &all(usize::MAX)).len(), 10);
    }

    /// Mallory's loop of refusals costs Mallory's own history, not Alice's.
    #[test]
    fn one_user_cannot_evict_anothers_history() {
        let mut journal = Journal::with_bounds(CAPACITY, PER_UID);
        for pid in 0..10 {
            journal.push(decision(pid, 1000));
        }
        for pid in 100..100_000 {
            journal.push(decision(pid, 1666));
        }
        assert_eq!(journal.answer(1000, &all(usize::MAX)).len(), 10);
        let mallorys = journal.answer(1666, &all(usize::MAX));
        assert_eq!(mallorys.len(), PER_UID);
        assert_eq!(mallorys.last().unwrap().pid, 99_999);
        assert!(journal.len() <= CAPACITY);
        assert_eq!(journal.per_uid.values().sum::<usize>(), journal.len());
    }
}
