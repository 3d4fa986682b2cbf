//! Work handed to a thread of the notifier, and how much of it the thread has done: a
//! one-shot run waits on it (bounded) before it exits, so that what it decided is
//! written and logged.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
pub struct Progress {
    sent: AtomicU64,
    done: Mutex<u64>,
    changed: Condvar,
}

impl Progress {
    /// One more item was queued.
    pub fn sent(&self) {
        self.sent.fetch_add(1, Relaxed);
    }

    /// The thread dealt with one more item.
    pub fn done(&self) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.changed.notify_all();
    }

    /// Waits until every item queued so far was dealt with, or `within` passed.
    pub fn wait(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let sent = self.sent.load(Relaxed);
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while *done < sent {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            done = match self.changed.wait_timeout(done, left) {
                Ok((done, _)) => done,
                Err(e) => e.into_inner().0,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn a_wait_ends_when_the_work_is_done_or_at_its_bound() {
        let progress = Arc::new(Progress::default());
        progress.sent();
        progress.sent();
        let theirs = Arc::clone(&progress);
        let worker = std::thread::spawn(move || {
            theirs.done();
            theirs.done();
        });
        progress.wait(Duration::from_secs(600));
        assert_eq!(*progress.done.lock().unwrap(), 2);
        worker.join().unwrap();
        // Nothing will do the third: the wait ends at its bound.
        progress.sent();
        progress.wait(Duration::from_millis(1));
    }
}
