//! The decisions' log records, written from a thread of their own: a record names the
//! user, and the passwd database may be a directory (LDAP, sssd) that takes its time to
//! answer a uid it has not been asked before. The event loop only queues the decision
//! (a full queue drops it, counted); this thread looks the name up and logs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Duration;

use super::decision::Decision;
use super::progress::Progress;
use super::sanitize::{NAME_CHARS, clean_str};
use crate::backends::users;
use crate::snapshot::join_indices;

/// Records waiting for the thread, at most.
const QUEUE: usize = 1024;
/// How long the thread waits for a user's name it has not looked up before (a lookup
/// that takes longer goes on, and the record names the uid alone).
const NAME_WAIT: Duration = Duration::from_secs(2);

pub struct Logger {
    queue: SyncSender<Decision>,
    progress: Arc<Progress>,
    dropped: AtomicU64,
}

impl Logger {
    pub fn spawn() -> std::io::Result<Self> {
        let (queue, records) = sync_channel(QUEUE);
        let progress = Arc::new(Progress::default());
        let theirs = Arc::clone(&progress);
        std::thread::Builder::new()
            .name("notify-log".into())
            .spawn(move || serve(&records, &theirs))?;
        Ok(Self {
            queue,
            progress,
            dropped: AtomicU64::new(0),
        })
    }

    /// Queues `decision`'s record; never waits. False when it was dropped.
    pub fn send(&self, decision: Decision) -> bool {
        match self.queue.try_send(decision) {
            Ok(()) => {
                self.progress.sent();
                true
            }
            Err(_) => {
                self.dropped.fetch_add(1, Relaxed);
                false
            }
        }
    }

    /// Records dropped because the thread was behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }

    /// Waits until every record queued so far was logged, or `within` passed.
    pub fn flush(&self, within: Duration) {
        self.progress.wait(within);
    }
}

fn serve(records: &Receiver<Decision>, progress: &Progress) {
    while let Ok(decision) = records.recv() {
        let user = users::name_within(decision.uid, NAME_WAIT);
        log(&decision, user.as_deref().unwrap_or(""));
        progress.done();
    }
}

/// The structured record: `[DECISION] …` in text logs, fields in JSON ones.
pub fn log(d: &Decision, user: &str) {
    tracing::info!(
        target: "decision",
        rule = d.rule.name(),
        action = d.action.word(),
        pid = d.pid,
        uid = d.uid,
        user = %clean_str(user, NAME_CHARS),
        env = d.env.as_deref().unwrap_or(""),
        gpu = %join_indices(d.gpus.iter().copied()),
        comm = %d.comm,
        "{}",
        d.line
    );
}
