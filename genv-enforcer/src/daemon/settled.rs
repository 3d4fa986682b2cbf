//! Processes a check terminated, or the kernel killed, left out of the narrow checks for
//! a moment: a process dying of SIGTERM must not be judged, and signalled, again.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long a process terminated by a narrow check is left out of the next ones.
const SETTLE: Duration = Duration::from_secs(2);

#[derive(Default)]
pub struct Settled(HashMap<u32, Instant>);

impl Settled {
    pub fn insert(&mut self, pid: u32, at: Instant) {
        self.0.insert(pid, at);
    }

    /// `pid` is gone: its pid may name another process next.
    pub fn remove(&mut self, pid: u32) {
        self.0.remove(&pid);
    }

    /// The processes still settling at `now`.
    pub fn at(&mut self, now: Instant) -> HashSet<u32> {
        self.0.retain(|_, at| now.duration_since(*at) < SETTLE);
        self.0.keys().copied().collect()
    }
}
