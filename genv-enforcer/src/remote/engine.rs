//! `remote enforce --event-driven`'s engine: runs the cross-host rules whenever a host's
//! snapshot changes, from the [`Update`]s of its tasks.
//!
//! The engine never waits on a host: the streams ([`super::stream`]), the snapshots it
//! asks for and the reports it executes are tasks of their own, whose results come back
//! as updates. One snapshot is in flight per host at a time.
//!
//! After a report is executed on a host, the rules wait for a snapshot of that host taken
//! after the execute (a line streamed, or a poll answered, meanwhile may predate it):
//! judging an older one would act twice on what was just done, and a detach already made
//! would still count against the user on the other hosts. The snapshot asked for after
//! the execute ends the wait; so does a streamed one that shows the report carried out
//! (its processes gone, its detaches made), which the host's `usage watch` sends as soon
//! as the execute writes `devices.json`, long before an answer over a new SSH command:
//! the rules are not held up behind the check while other hosts change (a user's next
//! attach, right after); and one streamed before the execute's answer is back saves the
//! check altogether. That wait has a deadline, past
//! which the host counts as unknown and the others are judged without it. The same
//! actions are not repeated on a host within `--interval`; a violation that outlives it
//! is acted on again then, as genv's cycle would. A host whose state is unknown (its
//! check failed, or it sent a line that could not be used) is asked again every
//! `--interval`, as are hosts that cannot stream.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, sleep_until};

use super::fleet::{Fleet, HostFailure};
use super::stream::{Update, stream_host};
use crate::report::Report;
use crate::snapshot::Snapshot;

/// Where a host is after a report was executed on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Awaiting {
    No,
    /// The execute is running.
    Executing,
    /// A snapshot asked for after the execute is on its way.
    Checking,
    /// Executed, but a snapshot asked for before is still on its way: the check is
    /// asked for once it is back.
    CheckQueued,
}

/// What the engine knows of each host.
struct HostView {
    latest: Option<Snapshot>,
    awaiting: Awaiting,
    /// When the current wait ends at the latest.
    deadline: Option<Instant>,
    /// A snapshot request is in flight, since then.
    asking: bool,
    asked_at: Option<Instant>,
    /// When a report was last sent to it: an answer to an ask made before may predate
    /// what the execute did, and is not taken.
    executed_at: Option<Instant>,
    /// Polled every --interval (it cannot stream).
    polled: bool,
    /// Its state is unknown: asked again every --interval until it answers.
    stale: bool,
    /// The last report executed there, and when.
    last: Option<(Report, Instant)>,
}

impl Default for HostView {
    fn default() -> Self {
        Self {
            latest: None,
            awaiting: Awaiting::No,
            deadline: None,
            asking: false,
            asked_at: None,
            executed_at: None,
            polled: false,
            stale: false,
            last: None,
        }
    }
}

pub struct Engine {
    fleet: Arc<Fleet>,
    views: Vec<HostView>,
    tx: mpsc::Sender<Update>,
    interval: Duration,
    /// Something changed since the rules last ran.
    dirty: bool,
    /// The tasks asking and executing: aborted with the engine.
    tasks: JoinSet<()>,
}

/// Whether two reports do the same (the memory figures they carry may differ, and the
/// order of processes with them).
fn same_actions(a: &Report, b: &Report) -> bool {
    let pids = |r: &Report| {
        let mut pids: Vec<u32> = r.terminate.iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        pids
    };
    let detach = |r: &Report| {
        let mut detach: Vec<(u32, Vec<String>)> = r
            .detach
            .iter()
            .map(|d| {
                let mut eids: Vec<String> = d.envs.iter().map(|e| e.eid.clone()).collect();
                eids.sort();
                (d.index, eids)
            })
            .collect();
        detach.sort();
        detach
    };
    pids(a) == pids(b) && detach(a) == detach(b)
}

/// Runs until the channel closes (never, while the streams live) or `-e` ends it. The
/// streams and every task end with it.
pub async fn run(fleet: Arc<Fleet>, interval: Duration) -> anyhow::Result<()> {
    let (tx, mut rx) = mpsc::channel(1024);
    let mut streams = JoinSet::new();
    for host in 0..fleet.hosts.len() {
        streams.spawn(stream_host(Arc::clone(&fleet), host, tx.clone()));
    }
    let mut engine = Engine {
        views: (0..fleet.hosts.len())
            .map(|_| HostView::default())
            .collect(),
        fleet,
        tx,
        interval,
        dirty: false,
        tasks: JoinSet::new(),
    };
    let mut tick = tokio::time::interval(interval);
    tick.tick().await;
    loop {
        let deadline = engine.views.iter().filter_map(|v| v.deadline).min();
        tokio::select! {
            update = rx.recv() => {
                let Some(update) = update else { return Ok(()) };
                engine.apply(update)?;
                while let Ok(update) = rx.try_recv() {
                    engine.apply(update)?;
                }
            }
            _ = tick.tick() => engine.tick(),
            _ = sleep_until(deadline.unwrap_or_else(Instant::now)), if deadline.is_some() => {
                engine.expire();
            }
            Some(_) = engine.tasks.join_next(), if !engine.tasks.is_empty() => {}
        }
        if engine.dirty && engine.views.iter().all(|v| v.awaiting == Awaiting::No) {
            engine.dirty = false;
            engine.judge();
        }
    }
}

impl Engine {
    fn apply(&mut self, update: Update) -> anyhow::Result<()> {
        match update {
            Update::Streamed(host, Ok(snapshot)) => {
                self.shown_done(host, &snapshot);
                // A good line makes a host known again, however it was lost.
                self.views[host].stale = false;
                self.take(host, snapshot);
            }
            Update::Streamed(host, Err(failure)) | Update::StreamFailed(host, failure) => {
                self.lost(host, &failure)?;
            }
            Update::Asked(host, taken) => self.asked(host, taken)?,
            Update::Executed(host, answer) => {
                let ran = self.fleet.executed(host, answer)?;
                let view = &mut self.views[host];
                // Streamed while it ran, a snapshot may show it done already: no check
                // then (one more SSH command, on a host just asked to do work).
                let shown = (view.latest.as_ref())
                    .zip(view.last.as_ref())
                    .is_some_and(|(snapshot, (report, _))| report.done_in(snapshot));
                match (ran, view.asking) {
                    (false, _) => self.settle(host),
                    (true, _) if shown => {
                        self.settle(host);
                        self.dirty = true;
                    }
                    (true, true) => view.awaiting = Awaiting::CheckQueued,
                    (true, false) => {
                        view.awaiting = Awaiting::Checking;
                        self.ask(host);
                    }
                }
            }
            Update::CannotStream(host, why) => {
                let name = &self.fleet.hosts[host].name;
                tracing::info!(
                    "[{name}] Cannot stream snapshots ({why}); polling it every --interval, as genv does"
                );
                self.views[host].polled = true;
                self.ask(host);
            }
            Update::Resumed(host) => {
                let name = &self.fleet.hosts[host].name;
                tracing::info!("[{name}] Its snapshot stream is back; no longer polling it");
                self.views[host].polled = false;
            }
        }
        Ok(())
    }

    /// A snapshot asked for came back.
    fn asked(&mut self, host: usize, taken: Result<Snapshot, HostFailure>) -> anyhow::Result<()> {
        let view = &mut self.views[host];
        view.asking = false;
        let before_execute = matches!((view.asked_at, view.executed_at),
            (Some(asked), Some(executed)) if asked < executed);
        match view.awaiting {
            // Asked before the execute: it may predate it, so only the check counts.
            Awaiting::CheckQueued => {
                view.awaiting = Awaiting::Checking;
                self.ask(host);
                return Ok(());
            }
            Awaiting::Checking => {
                self.settle(host);
                // Judged even if unchanged: a violation that stands is acted on again
                // once its --interval has passed.
                self.dirty = true;
            }
            Awaiting::No | Awaiting::Executing => {}
        }
        if before_execute {
            // Settled since by a streamed snapshot that showed the execute done (or a
            // newer execute is running): this answer may predate it, and would undo it.
            return Ok(());
        }
        match taken {
            Ok(snapshot) => {
                self.views[host].stale = false;
                self.take(host, snapshot);
                Ok(())
            }
            Err(failure) => self.lost(host, &failure),
        }
    }

    /// A streamed snapshot that shows the report executed there carried out ends the
    /// wait after it, as the check would (whose answer, when it comes, is only a
    /// snapshot then).
    fn shown_done(&mut self, host: usize, snapshot: &Snapshot) {
        let view = &self.views[host];
        let after_execute = matches!(view.awaiting, Awaiting::Checking | Awaiting::CheckQueued);
        if after_execute && view.last.as_ref().is_some_and(|(r, _)| r.done_in(snapshot)) {
            self.settle(host);
            self.dirty = true;
        }
    }

    fn settle(&mut self, host: usize) {
        self.views[host].awaiting = Awaiting::No;
        self.views[host].deadline = None;
    }

    fn take(&mut self, host: usize, snapshot: Snapshot) {
        let view = &mut self.views[host];
        if view.latest.as_ref() != Some(&snapshot) {
            view.latest = Some(snapshot);
            self.dirty = true;
        }
    }

    /// The host's state is unknown until it answers again: nothing is decided from an
    /// old snapshot of it, and it is asked again every --interval.
    fn lost(&mut self, host: usize, failure: &HostFailure) -> anyhow::Result<()> {
        self.views[host].latest = None;
        self.views[host].stale = true;
        self.fleet.failed(host, failure)
    }

    /// Every --interval: hosts polled or stale are asked; violations acted on and still
    /// standing are judged again.
    fn tick(&mut self) {
        for host in 0..self.views.len() {
            if self.views[host].polled || self.views[host].stale {
                self.ask(host);
            }
        }
        if self.views.iter().any(|v| v.last.is_some()) {
            self.dirty = true;
        }
    }

    /// Waits past their deadline: the host counts as unknown, the others are judged.
    fn expire(&mut self) {
        let now = Instant::now();
        for host in 0..self.views.len() {
            if self.views[host].deadline.is_some_and(|at| at <= now) {
                let name = &self.fleet.hosts[host].name;
                tracing::warn!(
                    "[{name}] No snapshot after acting on it within {:?}; judging the other hosts without it",
                    self.wait_limit()
                );
                self.settle(host);
                self.views[host].latest = None;
                self.views[host].stale = true;
                self.dirty = true;
            }
        }
    }

    /// The longest wait for a host after acting on it: its execute, then its check.
    fn wait_limit(&self) -> Duration {
        self.fleet.host_timeout * 2 + Duration::from_secs(5)
    }

    /// A snapshot of the host, unless one is already on its way. A check after an
    /// execute does not queue behind polls of hung hosts.
    fn ask(&mut self, host: usize) {
        let view = &mut self.views[host];
        if view.asking {
            return;
        }
        view.asking = true;
        view.asked_at = Some(Instant::now());
        let check = view.awaiting == Awaiting::Checking;
        let (fleet, tx) = (Arc::clone(&self.fleet), self.tx.clone());
        self.tasks.spawn(async move {
            let taken = match check {
                true => fleet.check(host).await,
                false => fleet.snapshot(host).await,
            };
            let _ = tx.send(Update::Asked(host, taken)).await;
        });
    }

    fn judge(&mut self) {
        let now = Instant::now();
        // A tick's re-judge lands a little short of a whole interval after the last.
        let again_after = self.interval.mul_f64(0.9);
        let taken: Vec<(usize, &Snapshot)> = self
            .views
            .iter()
            .enumerate()
            .filter_map(|(host, view)| view.latest.as_ref().map(|s| (host, s)))
            .collect();
        let views = &self.views;
        let standing = std::cell::RefCell::new(Vec::new());
        let reports = self.fleet.judge_where(&taken, |host, report| {
            let again = matches!(&views[host].last,
                Some((last, at)) if same_actions(last, report) && now - *at < again_after);
            if again {
                standing.borrow_mut().push(host);
            }
            !again
        });
        let standing = standing.into_inner();
        if self.fleet.verbose {
            tracing::info!(
                "Judged {} of {} hosts (the others unknown): {} reports to execute, {} standing violations already acted on within --interval",
                taken.len(),
                self.views.len(),
                reports.len(),
                standing.len()
            );
        }
        // A host with nothing to do any more forgets its last report.
        for (host, view) in self.views.iter_mut().enumerate() {
            if !standing.contains(&host) {
                view.last = None;
            }
        }
        let deadline = now + self.wait_limit();
        for (host, report) in reports {
            let view = &mut self.views[host];
            view.awaiting = Awaiting::Executing;
            view.executed_at = Some(now);
            view.deadline = Some(deadline);
            view.last = Some((report.clone(), now));
            let (fleet, tx) = (Arc::clone(&self.fleet), self.tx.clone());
            self.tasks.spawn(async move {
                let answer = fleet.execute_one(host, &report).await;
                let _ = tx.send(Update::Executed(host, answer)).await;
            });
        }
    }
}
