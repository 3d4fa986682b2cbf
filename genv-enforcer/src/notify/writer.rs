//! The terminal writer: a thread of its own, fed through a bounded queue. Opening a
//! terminal and writing to it are system calls on a device a user controls; none of
//! them may hold up the daemon's event loop, so the loop only queues the line (and
//! drops it, counted, when the queue is full), and this thread does the rest: the rate
//! limits, the checked open, the one non-blocking write.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::progress::Progress;
use super::ratelimit::Limits;
use super::tty::{self, Rdev, TtyRefusal};

/// Lines waiting for the thread, at most.
pub const QUEUE: usize = 256;
/// Terminals whose held-back lines are counted, at most.
const MAX_HELD: usize = 4096;

/// A line for a terminal.
#[derive(Clone, Debug)]
pub struct Line {
    /// The process it is about (for the log).
    pub pid: u32,
    /// Sanitised, without a line break.
    pub text: String,
    /// Whose terminal it must be.
    pub uid: u32,
    /// The user whose share of lines it takes (the uid's owner).
    pub owner: u32,
    pub rdev: Rdev,
}

/// What became of the lines, since the start.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineCounts {
    pub written: u64,
    /// Over a user's or a terminal's rate.
    pub held_back: u64,
    /// The queue was full: the thread was behind.
    pub queue_full: u64,
    /// The terminal's output was full or stopped.
    pub terminal_full: u64,
    /// Not the process's user's terminal, not a terminal, gone, or failed.
    pub refused: u64,
}

#[derive(Default)]
struct Counters {
    written: AtomicU64,
    held_back: AtomicU64,
    queue_full: AtomicU64,
    terminal_full: AtomicU64,
    refused: AtomicU64,
    /// Lines queued and dealt with, for [`TtyWriter::flush`].
    progress: Progress,
}

type Opener = Box<dyn Fn(Rdev, u32) -> Result<OwnedFd, TtyRefusal> + Send>;

pub struct TtyWriter {
    queue: SyncSender<Line>,
    counters: Arc<Counters>,
}

impl TtyWriter {
    pub fn spawn() -> std::io::Result<Self> {
        Self::spawn_with(Limits::default(), Box::new(tty::open))
    }

    pub(super) fn spawn_with(limits: Limits, open: Opener) -> std::io::Result<Self> {
        let (queue, lines) = sync_channel(QUEUE);
        let counters = Arc::new(Counters::default());
        let theirs = Arc::clone(&counters);
        std::thread::Builder::new()
            .name("notify-tty".into())
            .spawn(move || serve(&lines, limits, &open, &theirs))?;
        Ok(Self { queue, counters })
    }

    /// Queues `line`; never waits. False when it was dropped.
    pub fn send(&self, line: Line) -> bool {
        match self.queue.try_send(line) {
            Ok(()) => {
                self.counters.progress.sent();
                true
            }
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counters.queue_full.fetch_add(1, Relaxed);
                false
            }
        }
    }

    pub fn counts(&self) -> LineCounts {
        let c = &self.counters;
        LineCounts {
            written: c.written.load(Relaxed),
            held_back: c.held_back.load(Relaxed),
            queue_full: c.queue_full.load(Relaxed),
            terminal_full: c.terminal_full.load(Relaxed),
            refused: c.refused.load(Relaxed),
        }
    }

    /// Waits until every line queued so far was dealt with, or `within` passed: for a
    /// one-shot run, before it exits.
    pub fn flush(&self, within: Duration) {
        self.counters.progress.wait(within);
    }
}

/// The thread: each line through the limits, then to its terminal.
fn serve(lines: &Receiver<Line>, mut limits: Limits, open: &Opener, counters: &Counters) {
    let mut held: HashMap<Rdev, u64> = HashMap::new();
    while let Ok(line) = lines.recv() {
        let counter = if limits.allow(line.owner, line.rdev, Instant::now()) {
            let text = with_held_back(&line.text, held.remove(&line.rdev).unwrap_or(0));
            let written = open(line.rdev, line.uid).and_then(|fd| write(&fd, &text));
            if let Err(refusal) = written {
                tracing::debug!(
                    "Not telling process {} on its terminal: {refusal}",
                    line.pid
                );
            }
            match written {
                Ok(()) => &counters.written,
                Err(TtyRefusal::Full) => &counters.terminal_full,
                Err(_) => &counters.refused,
            }
        } else {
            if held.len() >= MAX_HELD && !held.contains_key(&line.rdev) {
                held.clear();
            }
            *held.entry(line.rdev).or_default() += 1;
            &counters.held_back
        };
        counter.fetch_add(1, Relaxed);
        counters.progress.done();
    }
}

/// The line as written: on a line of its own (the cursor may be anywhere, the
/// terminal in raw mode), saying how many lines were held back before it.
fn with_held_back(text: &str, held: u64) -> String {
    match held {
        0 => format!("\r\n{text}\r\n"),
        n => format!("\r\n{text} ({n} more not shown: genv-enforcer why)\r\n"),
    }
}

fn write(fd: &OwnedFd, text: &str) -> Result<(), TtyRefusal> {
    tty::write_once(fd, text.as_bytes()).map(drop)
}

#[cfg(test)]
mod tests;
