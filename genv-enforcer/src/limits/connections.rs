//! The connections a server holds open, by peer (a user on a unix socket, an address on
//! TCP): one peer holds at most so many, and all of them at most so many more, so that
//! a flood of connections from one peer closes its own oldest, not another's; and when
//! all are taken, the one closed is the oldest of the peer holding the most, so that
//! many peers flooding together still close their own before a peer's only one.

use std::collections::VecDeque;

use tokio::task::AbortHandle;

/// The connections being served, oldest first.
pub struct Connections<P> {
    open: VecDeque<(P, AbortHandle)>,
    per_peer: usize,
    all: usize,
}

impl<P: PartialEq + Copy> Connections<P> {
    pub fn new(per_peer: usize, all: usize) -> Self {
        Self {
            open: VecDeque::new(),
            per_peer,
            all,
        }
    }

    /// Before a connection from `peer` is added: forgets those that ended, and takes
    /// out the one to close, if any: `peer`'s oldest when it has its share, else, when
    /// they are all there may be, the oldest of the peer holding the most.
    pub fn make_room(&mut self, peer: P) -> Option<AbortHandle> {
        self.open.retain(|(_, task)| !task.is_finished());
        let held = |who: P| self.open.iter().filter(|(p, _)| *p == who).count();
        let index = if held(peer) >= self.per_peer {
            self.open.iter().position(|(p, _)| *p == peer)
        } else if self.open.len() >= self.all {
            let most = self.open.iter().map(|(p, _)| held(*p)).max().unwrap_or(0);
            self.open.iter().position(|(p, _)| held(*p) == most)
        } else {
            None
        };
        index
            .and_then(|i| self.open.remove(i))
            .map(|(_, task)| task)
    }

    pub fn add(&mut self, peer: P, task: AbortHandle) {
        self.open.push_back((peer, task));
    }

    /// Whether `task` is among the connections held (for tests).
    #[cfg(test)]
    pub fn holds(&self, task: &AbortHandle) -> bool {
        self.open.iter().any(|(_, t)| t.id() == task.id())
    }

    /// Whether none is held (for tests).
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}
