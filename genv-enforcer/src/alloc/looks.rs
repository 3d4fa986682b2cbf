//! When a process that opens GPU nodes has its mappings looked at for a libcuda copy.
//!
//! Every GPU open asks for a look, since the opens that matter (CUDA's, in `cuInit`
//! and at each context, after the library is loaded) may come long after others (NVML
//! opens every GPU node at its init, which a program may do before it loads CUDA).
//! A look is at once unless the process had one less than its gap ago; then it is
//! made when the gap ends, never dropped. The gap doubles with each look, up to
//! [`MAX_GAP`], so that a process opening nodes in a loop costs a look every few
//! seconds, and comes back to [`FIRST_GAP`] at exec.

use std::collections::HashMap;
use std::time::{Duration, Instant};

const FIRST_GAP: Duration = Duration::from_millis(50);
const MAX_GAP: Duration = Duration::from_secs(2);
/// Processes kept track of at most; beyond, the longest idle are forgotten (a
/// forgotten process starts again at the first gap).
const MAX_PROCESSES: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
struct LookSchedule {
    uid: u32,
    /// Whose budget its looks count against: the uid's owner, looked up once per
    /// process and uid ([`crate::backends::uid_owners`]), not at every open.
    user: u32,
    /// No look before this.
    next: Instant,
    gap: Duration,
    /// An open came within the gap: a look is owed at `next`.
    owed: bool,
}

#[derive(Debug, Default)]
pub(super) struct Looks {
    by_pid: HashMap<u32, LookSchedule>,
}

impl Looks {
    /// The user `pid`, running as `uid`, counts as, where known already.
    pub(super) fn user(&self, pid: u32, uid: u32) -> Option<u32> {
        let schedule = self.by_pid.get(&pid)?;
        (schedule.uid == uid).then_some(schedule.user)
    }

    /// `pid` (running as `uid`, counting as `user`) opened a GPU node: whether to look
    /// at it now (else a look is owed when its gap ends).
    pub(super) fn opened(&mut self, pid: u32, uid: u32, user: u32, now: Instant) -> bool {
        if self.by_pid.len() >= MAX_PROCESSES && !self.by_pid.contains_key(&pid) {
            self.forget_idle(now);
        }
        let schedule = self.by_pid.entry(pid).or_insert(LookSchedule {
            uid,
            user,
            next: now,
            gap: FIRST_GAP / 2,
            owed: false,
        });
        (schedule.uid, schedule.user) = (uid, user);
        if now < schedule.next {
            schedule.owed = true;
            return false;
        }
        Self::looked(schedule, now);
        true
    }

    /// The processes owed a look by `now`, with their users; their gaps restart.
    pub(super) fn due(&mut self, now: Instant) -> Vec<(u32, u32)> {
        let mut due = Vec::new();
        for (&pid, schedule) in &mut self.by_pid {
            if schedule.owed && schedule.next <= now {
                Self::looked(schedule, now);
                due.push((pid, schedule.user));
            }
        }
        due
    }

    /// A look stopped before it was through (its budget for the moment): another is
    /// owed at `at`.
    pub(super) fn again_at(&mut self, pid: u32, at: Instant) {
        if let Some(schedule) = self.by_pid.get_mut(&pid) {
            schedule.next = at;
            schedule.owed = true;
        }
    }

    /// When the next owed look is due.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.by_pid
            .values()
            .filter(|s| s.owed)
            .map(|s| s.next)
            .min()
    }

    /// `pid` exec'ed or exited.
    pub(super) fn forget(&mut self, pid: u32) {
        self.by_pid.remove(&pid);
    }

    fn looked(schedule: &mut LookSchedule, now: Instant) {
        schedule.gap = (schedule.gap * 2).min(MAX_GAP);
        schedule.next = now + schedule.gap;
        schedule.owed = false;
    }

    fn forget_idle(&mut self, now: Instant) {
        self.by_pid.retain(|_, s| s.owed || s.next > now);
        if self.by_pid.len() >= MAX_PROCESSES {
            self.by_pid.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process's user is kept with its schedule: known at its next open (not looked up
    /// again), and not for a uid it no longer runs as; owed looks carry the user.
    #[test]
    fn a_processs_user_is_kept_for_its_uid() {
        let mut looks = Looks::default();
        let t0 = Instant::now();
        assert_eq!(looks.user(7, 100_000), None);
        assert!(looks.opened(7, 100_000, 1000, t0));
        assert_eq!(looks.user(7, 100_000), Some(1000));
        assert_eq!(looks.user(7, 100_001), None, "setuid since");
        assert!(!looks.opened(7, 100_000, 1000, t0));
        assert_eq!(looks.due(t0 + MAX_GAP), [(7, 1000)]);
    }

    /// NVML's opens of every GPU node come at once: one look then, and one when the
    /// gap ends. CUDA's open, once the program loaded it, gets a look of its own however
    /// many opens came before.
    #[test]
    fn opens_within_the_gap_owe_one_look_at_its_end() {
        let t0 = Instant::now();
        let mut looks = Looks::default();
        assert!(looks.opened(7, 1000, 1000, t0));
        assert!(
            (0..7).all(|_| !looks.opened(7, 1000, 1000, t0)),
            "within the gap"
        );
        assert_eq!(looks.next_due(), Some(t0 + FIRST_GAP));
        assert!(looks.due(t0 + FIRST_GAP / 2).is_empty());
        assert_eq!(looks.due(t0 + FIRST_GAP), vec![(7, 1000)]);
        assert_eq!(looks.next_due(), None, "nothing owed");
        // CUDA's open, later: looked at once.
        let later = t0 + Duration::from_secs(60);
        assert!(looks.opened(7, 1000, 1000, later));
    }

    #[test]
    fn the_gap_doubles_up_to_its_most_and_restarts_at_exec() {
        let t0 = Instant::now();
        let mut looks = Looks::default();
        let mut at = t0;
        let mut gaps = Vec::new();
        for _ in 0..8 {
            assert!(looks.opened(7, 0, 0, at));
            assert!(!looks.opened(7, 0, 0, at));
            let next = looks.next_due().unwrap();
            gaps.push(next - at);
            at = next;
            assert_eq!(looks.due(at), vec![(7, 0)]);
            at += MAX_GAP;
        }
        assert_eq!(gaps[0], FIRST_GAP);
        assert_eq!(gaps[1], 4 * FIRST_GAP, "the owed look counted too");
        assert_eq!(*gaps.last().unwrap(), MAX_GAP);
        looks.forget(7);
        assert!(looks.opened(7, 0, 0, at));
        assert!(!looks.opened(7, 0, 0, at));
        assert_eq!(looks.next_due(), Some(at + FIRST_GAP));
    }

    #[test]
    fn a_look_cut_short_is_owed_again() {
        let t0 = Instant::now();
        let mut looks = Looks::default();
        assert!(looks.opened(7, 0, 0, t0));
        looks.again_at(7, t0);
        assert_eq!(looks.due(t0), vec![(7, 0)]);
        looks.again_at(8, t0);
        assert_eq!(
            looks.next_due(),
            None,
            "an unknown process is not looked at"
        );
    }
}
