//! Telling users what the enforcer did to their processes, and why.
//!
//! Each decision (a termination, a kill, a refusal at the open, a kill inside an
//! allocation) becomes one [`Decision`]: sanitised, with the line its user sees
//! ([`message`]). The [`Notifier`] then
//! - writes that line to the process's controlling terminal, if it has one that is
//!   its user's (`--notify tty`, the default; [`tty`], from a thread of its own,
//!   [`writer`], rate-limited per user and per terminal, [`ratelimit`]);
//! - keeps it in a bounded [`journal`] that `genv-enforcer why` reads over a Unix
//!   socket which answers each user about their own processes only ([`server`],
//!   [`client`]);
//! - logs it as a structured record (target `decision`: rule, action, pid, uid, user,
//!   environment, GPUs as fields), so that the system journal can answer "what happened
//!   to alice today" ([`logger`], from a thread of its own: the user's name may take a
//!   directory's time to look up).
//!
//! Nothing here decides anything: the rules say why, the executor and the kernel's side
//! report what they did. So it sits low, right above the snapshot.

pub mod client;
pub mod decision;
pub mod journal;
pub mod logger;
pub mod message;
mod progress;
pub mod ratelimit;
pub mod relay;
pub mod rule;
pub mod sanitize;
pub mod server;
pub mod subject;
pub mod told_file;
pub mod tty;
pub mod writer;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::backends::uid_owners::UidOwners;
use crate::clock::unix_now;
pub use decision::{Decision, Facts};
use journal::Journal;
use logger::Logger;
use relay::{Relay, RelayedTo};
pub use rule::{Done, Rule};
pub use subject::Subject;
pub use tty::Rdev;
use writer::{Line, TtyWriter};

/// `--notify`: where users are told.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum NotifyMode {
    /// Nowhere but the journal `why` reads and the log.
    None,
    /// On the process's controlling terminal as well.
    #[default]
    Tty,
}

/// Where a process's line may go: its controlling terminal and the uid that must own
/// it, as found before the process was signalled (a killed process has no `/proc`
/// left to look in), by [`Subject::of_process`] or by the kernel at its decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Terminal {
    pub rdev: Rdev,
    pub uid: u32,
}

/// The log records one user's decisions may make: a loop of refused programs must not
/// flood the log (20 at once, then 10 a second; `why` keeps them all, within its bounds).
const LOG_RATE: ratelimit::Rate = ratelimit::Rate {
    burst: 20,
    every: Duration::from_millis(100),
};

/// What the notifier did, for `status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ToldCounts {
    /// Decisions recorded (in the journal `why` reads).
    pub decisions: u64,
    /// Log records held back by [`LOG_RATE`], or dropped with the logger behind.
    pub logs_held_back: u64,
    /// The terminal lines.
    #[serde(flatten)]
    pub terminals: writer::LineCounts,
}

/// The decisions' one way out.
pub struct Notifier {
    writer: Option<TtyWriter>,
    logger: Option<Logger>,
    /// `--notify tty`; SIGHUP may change it.
    to_terminals: AtomicBool,
    journal: Arc<Mutex<Journal>>,
    /// Whose each uid is: the bounds are per user, not per uid.
    owners: Arc<UidOwners>,
    logs: Mutex<ratelimit::Buckets<u32>>,
    decisions: AtomicU64,
    logs_held_back: AtomicU64,
    /// Where decisions made elsewhere go (`usage execute --with-reasons`), instead of
    /// this process's journal and log.
    relay: Option<Relay>,
}

impl Notifier {
    /// Starts the terminal writer's thread (where that fails, the lines go to the
    /// journal and the log only, as said); `mode` says whether it is used.
    pub fn new(mode: NotifyMode) -> Self {
        let logger = Logger::spawn()
            .inspect_err(|e| tracing::warn!("Cannot start the decisions' logger: {e}"))
            .ok();
        Self::with_logger(mode, logger, None)
    }

    fn with_logger(mode: NotifyMode, logger: Option<Logger>, relay: Option<Relay>) -> Self {
        let writer = TtyWriter::spawn()
            .inspect_err(|e| tracing::warn!("Cannot start the terminal writer: {e}"))
            .ok();
        Self {
            writer,
            logger,
            to_terminals: AtomicBool::new(mode == NotifyMode::Tty),
            journal: Arc::default(),
            owners: Arc::default(),
            logs: Mutex::new(ratelimit::Buckets::new(LOG_RATE)),
            decisions: AtomicU64::new(0),
            logs_held_back: AtomicU64::new(0),
            relay,
        }
    }

    /// For a remote stop carried out here (`usage execute --with-reasons`): each
    /// decision goes to the daemon answering at `run_dir`, which keeps and tells it
    /// under its own limits; with none there, this process tells the terminal and keeps
    /// the decision in the uid's file ([`told_file`]). Nothing is logged: this
    /// process's output goes back to the admin's terminal as genv's lines.
    pub fn relaying(run_dir: &Path) -> Self {
        Self::with_logger(NotifyMode::Tty, None, Some(Relay::new(run_dir)))
    }

    /// `--notify` read again (SIGHUP).
    pub fn set_mode(&self, mode: NotifyMode) {
        self.to_terminals
            .store(mode == NotifyMode::Tty, Ordering::Relaxed);
    }

    /// Serves `genv-enforcer why` at `<run_dir>/why.sock` from a thread of its own, and
    /// keeps the decisions root hands over there as this daemon's own.
    pub fn serve_why(self: &Arc<Self>, run_dir: &Path) -> anyhow::Result<()> {
        let listener = server::listen(run_dir)?;
        let notifier = Arc::clone(self);
        let recorder: server::Recorder = Arc::new(move |decision, terminal| {
            notifier.record(decision, terminal);
        });
        server::start(
            listener,
            Arc::clone(&self.journal),
            Arc::clone(&self.owners),
            Some(recorder),
        )?;
        Ok(())
    }

    /// Logs, keeps and tells one decision; `terminal` is where the process's line
    /// goes, if anywhere. Never waits on a terminal.
    pub fn decided(&self, facts: Facts<'_>, terminal: Option<Terminal>) -> Decision {
        let decision = Decision::new(facts, unix_now());
        match &self.relay {
            Some(relay) => self.relayed(relay, decision, terminal),
            None => self.record(decision, terminal),
        }
    }

    /// A decision of a remote stop: the daemon here keeps and tells it, else this
    /// process tells the terminal and the uid's file keeps it.
    fn relayed(
        &self,
        relay: &Relay,
        mut decision: Decision,
        terminal: Option<Terminal>,
    ) -> Decision {
        // The terminal's limits are per user here too.
        decision.owner = self.owners.owner(decision.uid, Some(decision.pid));
        match relay.keep(&decision, terminal) {
            RelayedTo::ByDaemon => return decision,
            RelayedTo::InFile { readable: true, .. } => {}
            RelayedTo::InFile { path, .. } => tracing::warn!(
                "{}: kept for root only (the file system keeps no ACLs), so `genv-enforcer why` cannot show it to uid {}",
                path.display(),
                decision.uid
            ),
            RelayedTo::Nowhere(e) => tracing::warn!(
                "Cannot keep the decision about process {} for `genv-enforcer why`: {e}",
                decision.pid
            ),
        }
        self.tell_terminal(&decision, terminal);
        decision
    }

    /// Keeps, logs and tells a decision as this daemon's own: one it made, or one root
    /// handed over ([`server::WhyRequest::Record`]).
    pub fn record(&self, mut decision: Decision, terminal: Option<Terminal>) -> Decision {
        decision.owner = self.owners.owner(decision.uid, Some(decision.pid));
        self.decisions.fetch_add(1, Ordering::Relaxed);
        // Kept first: once its log record or its line is out, `why` has it too.
        self.journal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(decision.clone());
        self.tell_terminal(&decision, terminal);
        if !self.may_log(decision.owner) {
            self.logs_held_back.fetch_add(1, Ordering::Relaxed);
        } else if let Some(logger) = &self.logger {
            logger.send(decision.clone());
        } else {
            // No thread to look the name up from: the uid alone, now.
            logger::log(&decision, "");
        }
        decision
    }

    /// Sends the decision's line to the process's terminal, under `--notify`.
    fn tell_terminal(&self, decision: &Decision, terminal: Option<Terminal>) {
        let to_terminals = self.to_terminals.load(Ordering::Relaxed);
        if let (Some(writer), Some(terminal), true) = (&self.writer, terminal, to_terminals) {
            // The terminal must be the process's user's, whoever's it was found as.
            if terminal.uid == decision.uid {
                writer.send(Line {
                    pid: decision.pid,
                    text: decision.line.clone(),
                    uid: decision.uid,
                    owner: decision.owner,
                    rdev: terminal.rdev,
                });
            }
        }
    }

    /// The user `uid` (of process `pid`, where known) counts as, for the bounds kept
    /// per user ([`crate::backends::uid_owners`]).
    pub fn owner(&self, uid: u32, pid: Option<u32>) -> u32 {
        self.owners.owner(uid, pid)
    }

    /// What `caller` may see of the journal ([`journal::Journal::answer`]).
    pub fn answer(&self, caller: u32, query: &journal::Query) -> Vec<Decision> {
        self.journal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .answer(caller, query)
    }

    /// Whether `owner`'s records may be logged now (a user's, over all their uids).
    fn may_log(&self, owner: u32) -> bool {
        let mut logs = self.logs.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        let allowed = logs.has(owner, now);
        if allowed {
            logs.take(owner, now);
        }
        allowed
    }

    /// What was recorded, logged and written so far.
    pub fn counts(&self) -> ToldCounts {
        ToldCounts {
            decisions: self.decisions.load(Ordering::Relaxed),
            logs_held_back: self.logs_held_back.load(Ordering::Relaxed)
                + self.logger.as_ref().map_or(0, Logger::dropped),
            terminals: self
                .writer
                .as_ref()
                .map(TtyWriter::counts)
                .unwrap_or_default(),
        }
    }

    /// For a one-shot run: lets the lines queued reach their terminals and the log, for
    /// at most [`FLUSH_WAIT`] each. The waits end as soon as the queues are empty; the
    /// bound is for a thread that cannot finish (a user-name lookup that hangs is cut at
    /// its own two seconds), not the usual case, so it is generous: a loaded machine's
    /// one-shot run must not drop the line that tells a user why.
    pub fn flush(&self) {
        if let Some(writer) = &self.writer {
            writer.flush(FLUSH_WAIT);
        }
        if let Some(logger) = &self.logger {
            logger.flush(FLUSH_WAIT);
        }
    }
}

/// How long a one-shot run waits for its notices and decision records at most.
const FLUSH_WAIT: Duration = Duration::from_secs(5);

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::notify::tty::tests::{pty, shown};

    /// `--notify none` (here, as SIGHUP sets it) writes nothing and still keeps the
    /// decision; `tty` again writes.
    #[test]
    fn the_mode_decides_whether_terminals_are_written() {
        let notifier = Notifier::new(NotifyMode::None);
        let pty = pty();
        let me = rustix::process::getuid().as_raw();
        let terminal = Terminal {
            rdev: pty.rdev,
            uid: me,
        };
        let facts = |pid| facts(pid, me);
        notifier.decided(facts(1), Some(terminal));
        notifier.set_mode(NotifyMode::Tty);
        notifier.decided(facts(2), Some(terminal));
        notifier.flush();
        let text = shown(&pty);
        assert!(
            !text.contains("(pid 1)") && text.contains("(pid 2)"),
            "{text}"
        );
        let all = journal::Query {
            me: true,
            limit: 10,
            ..Default::default()
        };
        assert_eq!(notifier.answer(me, &all).len(), 2);
    }

    /// Process `pid` of `uid`, a `python` outside any environment, refused GPU 0.
    pub(crate) fn facts(pid: u32, uid: u32) -> Facts<'static> {
        Facts {
            pid,
            uid,
            comm: b"python",
            env: None,
            gpus: vec![0],
            rule: Rule::NonEnvProcesses,
            action: Done::Refused,
        }
    }

    /// [`facts`], decided at a fixed time.
    pub(crate) fn decision(pid: u32, uid: u32) -> Decision {
        Decision::new(facts(pid, uid), 1_700_000_000)
    }

    /// A number unique in this test process, for scratch names.
    pub(crate) fn unique() -> u32 {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }
}
