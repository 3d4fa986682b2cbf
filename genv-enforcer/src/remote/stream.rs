//! `remote enforce --event-driven`: one multiplexed stream per host (`usage watch`, a
//! snapshot line whenever that host changes), and the cross-host rules run as soon as
//! any host's line arrives, instead of every `--interval`.
//!
//! The engine never waits on a host: snapshots asked for and reports executed are tasks
//! of their own, whose results come back as [`Update`]s, so one host that hangs holds up
//! nothing but itself. After a report is executed on a host, the rules wait for a
//! snapshot of that host asked for after the execute (a line streamed meanwhile may
//! predate it): judging an older one would act twice on what was just done, and a detach
//! already made would still count against the user on the other hosts. Changes that come
//! meanwhile are judged as soon as it is in. The same report is not executed on a host
//! again within `--interval`; a violation that outlives it is acted on again then, as
//! genv's cycle would. A host that cannot stream (Python genv has no `usage watch`) is
//! polled every `--interval`.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep};

use super::fleet::{Fleet, HostFailure, read_snapshot};
use super::ssh::{ANSWER_LIMIT, Answer, SshError};
use crate::report::Report;
use crate::snapshot::Snapshot;

/// What the tasks report to the engine.
pub enum Update {
    /// A line of a host's stream.
    Streamed(usize, Result<Snapshot, HostFailure>),
    /// A snapshot asked for (a polled host, or after an execute).
    Asked(usize, Result<Snapshot, HostFailure>),
    /// A report executed (or not) on a host.
    Executed(usize, Result<Answer, SshError>),
    /// The host's stream ended or could not start; it is opened again.
    StreamFailed(usize, HostFailure),
    /// `usage watch` is not a command there (Python genv): polled instead.
    CannotStream(usize, String),
}

/// The longest wait before a failed stream is opened again.
const RETRY_MAX: Duration = Duration::from_secs(10);
/// The longest stderr line of a stream reprinted; the rest is cut.
const STDERR_LINE: u64 = 4096;

/// Keeps one host's stream open, for as long as the run lasts.
async fn stream_host(fleet: Arc<Fleet>, host: usize, updates: mpsc::Sender<Update>) {
    let words = fleet.words(&["usage", "watch"]);
    let mut retry = Duration::from_millis(500);
    loop {
        let started = Instant::now();
        let update = match watch_once(&fleet, host, &words, &updates).await {
            Ended::Closed => return,
            Ended::CannotStream(why) => Update::CannotStream(host, why),
            Ended::Failed(failure) => Update::StreamFailed(host, failure),
        };
        let last = matches!(update, Update::CannotStream(..));
        if updates.send(update).await.is_err() || last {
            return;
        }
        if started.elapsed() > RETRY_MAX {
            retry = Duration::from_millis(500);
        }
        // Spread over the fleet: hosts that fell together do not all come back at once.
        let jitter = Duration::from_millis(u64::from(std::process::id() ^ host as u32) % 250);
        sleep(retry + jitter).await;
        retry = (retry * 2).min(RETRY_MAX);
    }
}

enum Ended {
    /// The engine is gone.
    Closed,
    CannotStream(String),
    Failed(HostFailure),
}

async fn watch_once(
    fleet: &Fleet,
    host: usize,
    words: &[String],
    updates: &mpsc::Sender<Update>,
) -> Ended {
    let mut child = match fleet.ssh.stream(&fleet.hosts[host], words) {
        Ok(child) => child,
        Err(e) => return Ended::Failed(e.into()),
    };
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let name = fleet.hosts[host].name.clone();
    let errors = tokio::spawn(reprint_stderr(name, stderr));
    let mut lines = BufReader::new(stdout);
    let mut seen = false;
    loop {
        let mut line = Vec::new();
        let read = (&mut lines)
            .take(ANSWER_LIMIT + 1)
            .read_until(b'\n', &mut line)
            .await;
        match read {
            Ok(0) => break,
            Ok(n) if n as u64 > ANSWER_LIMIT => {
                let _ = child.start_kill();
                return Ended::Failed(SshError::TooLong.into());
            }
            Ok(_) => {}
            Err(e) => return Ended::Failed(SshError::Io(e).into()),
        }
        seen = true;
        let update = Update::Streamed(host, read_snapshot(&line));
        if updates.send(update).await.is_err() {
            return Ended::Closed;
        }
    }
    let status = child.wait().await;
    let last_error = errors.await.unwrap_or_default();
    match status {
        // genv's argument parser: `usage` has no `watch` there.
        Ok(status)
            if !seen && status.code() == Some(2) && last_error.contains("invalid choice") =>
        {
            Ended::CannotStream(last_error)
        }
        Ok(status) => Ended::Failed(HostFailure::Command(format!(
            "the snapshot stream ended ({status}){}",
            match last_error.is_empty() {
                true => String::new(),
                false => format!(": {last_error}"),
            }
        ))),
        Err(e) => Ended::Failed(SshError::Io(e).into()),
    }
}

/// Reprints a stream's stderr, each line with the host's prefix, for as long as it
/// writes (a full pipe would stall the stream itself); returns its last line.
async fn reprint_stderr(name: String, stderr: tokio::process::ChildStderr) -> String {
    let mut reader = BufReader::new(stderr);
    let mut last = String::new();
    loop {
        let mut line = Vec::new();
        match (&mut reader)
            .take(STDERR_LINE)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => return last,
            Ok(_) => {
                last = String::from_utf8_lossy(&line).trim_end().to_owned();
                eprintln!("[{name}] {last}");
            }
        }
    }
}

/// What the engine knows of each host.
#[derive(Default)]
struct HostView {
    latest: Option<Snapshot>,
    /// A report is being executed there, or its snapshot after is awaited.
    awaiting: bool,
    /// A snapshot request is in flight (one at a time).
    asking: bool,
    /// Polled every --interval instead of streamed.
    polled: bool,
    /// The last report executed there, and when.
    last: Option<(Report, Instant)>,
}

/// Whether two reports do the same (the memory figures they carry may differ).
fn same_actions(a: &Report, b: &Report) -> bool {
    let pids = |r: &Report| r.terminate.iter().map(|p| p.pid).collect::<Vec<_>>();
    let detach = |r: &Report| {
        r.detach
            .iter()
            .map(|d| {
                (
                    d.index,
                    d.envs.iter().map(|e| e.eid.clone()).collect::<Vec<_>>(),
                )
            })
            .collect::<Vec<_>>()
    };
    pids(a) == pids(b) && detach(a) == detach(b)
}

struct Engine {
    fleet: Arc<Fleet>,
    views: Vec<HostView>,
    tx: mpsc::Sender<Update>,
    interval: Duration,
    /// Something changed since the rules last ran.
    dirty: bool,
}

/// The engine: runs the rules whenever a host's snapshot changes.
pub async fn run(fleet: Arc<Fleet>, interval: Duration) -> anyhow::Result<()> {
    let (tx, mut rx) = mpsc::channel(1024);
    for host in 0..fleet.hosts.len() {
        tokio::spawn(stream_host(Arc::clone(&fleet), host, tx.clone()));
    }
    let mut engine = Engine {
        views: (0..fleet.hosts.len())
            .map(|_| HostView::default())
            .collect(),
        fleet,
        tx,
        interval,
        dirty: false,
    };
    let mut tick = tokio::time::interval(interval);
    tick.tick().await;
    loop {
        tokio::select! {
            update = rx.recv() => {
                let Some(update) = update else { return Ok(()) };
                engine.apply(update)?;
                while let Ok(update) = rx.try_recv() {
                    engine.apply(update)?;
                }
            }
            _ = tick.tick() => engine.tick(),
        }
        if engine.dirty && engine.views.iter().all(|v| !v.awaiting) {
            engine.dirty = false;
            engine.judge();
        }
    }
}

impl Engine {
    fn apply(&mut self, update: Update) -> anyhow::Result<()> {
        match update {
            Update::Streamed(host, Ok(snapshot)) => self.take(host, snapshot),
            Update::Asked(host, taken) => {
                let view = &mut self.views[host];
                view.asking = false;
                view.awaiting = false;
                match taken {
                    Ok(snapshot) => {
                        // After an execute, judged even if unchanged: a violation that
                        // persists is acted on again once its --interval has passed.
                        self.dirty = true;
                        self.take(host, snapshot);
                    }
                    Err(failure) => self.lost(host, &failure)?,
                }
            }
            Update::Streamed(host, Err(failure)) | Update::StreamFailed(host, failure) => {
                self.lost(host, &failure)?;
            }
            Update::Executed(host, answer) => {
                if self.fleet.executed(host, answer)? {
                    self.ask(host);
                } else {
                    self.views[host].awaiting = false;
                }
            }
            Update::CannotStream(host, why) => {
                let name = &self.fleet.hosts[host].name;
                eprintln!(
                    "[INFO] [{name}] Cannot stream snapshots (usage watch: {why}); polling it every --interval, as genv does"
                );
                self.views[host].polled = true;
                self.ask(host);
            }
        }
        Ok(())
    }

    fn take(&mut self, host: usize, snapshot: Snapshot) {
        let view = &mut self.views[host];
        if view.latest.as_ref() != Some(&snapshot) {
            view.latest = Some(snapshot);
            self.dirty = true;
        }
    }

    /// The host's state is unknown until it answers again: nothing is decided from an
    /// old snapshot of it.
    fn lost(&mut self, host: usize, failure: &HostFailure) -> anyhow::Result<()> {
        self.views[host].latest = None;
        self.fleet.failed(host, failure)
    }

    /// Every --interval: the hosts that cannot stream are asked; violations acted on
    /// and still standing are judged again.
    fn tick(&mut self) {
        for host in 0..self.views.len() {
            if self.views[host].polled {
                self.ask(host);
            }
        }
        if self.views.iter().any(|v| v.last.is_some()) {
            self.dirty = true;
        }
    }

    /// A snapshot of the host, unless one is already on its way.
    fn ask(&mut self, host: usize) {
        let view = &mut self.views[host];
        if view.asking {
            return;
        }
        view.asking = true;
        let (fleet, tx) = (Arc::clone(&self.fleet), self.tx.clone());
        tokio::spawn(async move {
            let taken = fleet.snapshot(host).await;
            let _ = tx.send(Update::Asked(host, taken)).await;
        });
    }

    fn judge(&mut self) {
        let now = Instant::now();
        let interval = self.interval;
        let taken: Vec<(usize, &Snapshot)> = self
            .views
            .iter()
            .enumerate()
            .filter_map(|(host, view)| view.latest.as_ref().map(|s| (host, s)))
            .collect();
        let views = &self.views;
        let standing = std::cell::RefCell::new(Vec::new());
        let reports = self.fleet.judge_where(&taken, |host, report| {
            let again = matches!(&views[host].last, Some((last, at)) if same_actions(last, report) && now - *at < interval);
            if again {
                standing.borrow_mut().push(host);
            }
            !again
        });
        let standing = standing.into_inner();
        let acting: Vec<usize> = reports.iter().map(|(host, _)| *host).collect();
        // A host with nothing to do any more forgets its last report.
        for (host, view) in self.views.iter_mut().enumerate() {
            if !standing.contains(&host) {
                view.last = None;
            }
        }
        for (host, report) in reports {
            let view = &mut self.views[host];
            view.awaiting = true;
            view.last = Some((report.clone(), now));
            let (fleet, tx) = (Arc::clone(&self.fleet), self.tx.clone());
            tokio::spawn(async move {
                let answer = fleet.execute_one(host, &report).await;
                let _ = tx.send(Update::Executed(host, answer)).await;
            });
        }
        if self.fleet.verbose && !acting.is_empty() {
            eprintln!("[INFO] Acting on {} hosts", acting.len());
        }
    }
}
