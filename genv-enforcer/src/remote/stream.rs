//! `remote enforce --event-driven`: one multiplexed stream per host
//! (`usage watch`, a snapshot line whenever that host changes), and the cross-host
//! rules run as soon as any host's line arrives, instead of every `--interval`.
//!
//! After a report is executed on a host, the rules wait for that host's next snapshot
//! (or its deadline) before they run again: judging its old one would act twice on what
//! was just done, and a detach already made would still count against the user on the
//! other hosts. A host that cannot stream (Python genv has no `usage watch`) is polled
//! every `--interval`, as genv polls.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep, sleep_until};

use super::fleet::{Fleet, HostFailure, read_snapshot};
use super::ssh::{ANSWER_LIMIT, SshError};
use crate::snapshot::Snapshot;

/// What a host's task reports to the engine.
pub enum Update {
    Snapshot(usize, Snapshot),
    Failed(usize, HostFailure),
    /// `usage watch` exited without a line, and not for an SSH error: polled instead.
    CannotStream(usize, String),
}

/// The longest wait before a failed stream is opened again.
const RETRY_MAX: Duration = Duration::from_secs(10);

/// Keeps one host's stream open, for as long as the run lasts.
pub async fn stream_host(fleet: Arc<Fleet>, host: usize, updates: mpsc::Sender<Update>) {
    let words = fleet.words(&["usage", "watch"]);
    let mut retry = Duration::from_millis(500);
    loop {
        let started = Instant::now();
        match watch_once(&fleet, host, &words, &updates).await {
            Ended::Closed => return,
            Ended::CannotStream(why) => {
                let _ = updates.send(Update::CannotStream(host, why)).await;
                return;
            }
            Ended::Failed(failure) => {
                if updates.send(Update::Failed(host, failure)).await.is_err() {
                    return;
                }
            }
        }
        if started.elapsed() > RETRY_MAX {
            retry = Duration::from_millis(500);
        }
        sleep(retry).await;
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
    let errors = tokio::spawn(async move {
        let mut text = Vec::new();
        let _ = stderr.take(64 << 10).read_to_end(&mut text).await;
        String::from_utf8_lossy(&text).trim().to_owned()
    });
    let mut lines = BufReader::new(stdout);
    let mut seen = false;
    let mut line = Vec::new();
    loop {
        line.clear();
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
        let update = match read_snapshot(&line) {
            Ok(snapshot) => Update::Snapshot(host, snapshot),
            Err(failure) => Update::Failed(host, failure),
        };
        if updates.send(update).await.is_err() {
            return Ended::Closed;
        }
    }
    let status = child.wait().await;
    let stderr = errors.await.unwrap_or_default();
    match status {
        // ssh's own failures exit 255: the host may stream once it is back.
        Ok(status) if !seen && status.code().is_some_and(|c| c != 255) => {
            Ended::CannotStream(format!("{status}: {stderr}"))
        }
        Ok(status) => Ended::Failed(HostFailure::Command(format!(
            "the snapshot stream ended ({status}){}",
            if stderr.is_empty() {
                String::new()
            } else {
                format!(": {stderr}")
            }
        ))),
        Err(e) => Ended::Failed(SshError::Io(e).into()),
    }
}

/// What the engine knows of each host.
#[derive(Default)]
struct HostView {
    latest: Option<Snapshot>,
    /// A report was executed from `latest`: the rules wait for a newer snapshot until
    /// then (after which the host is asked once).
    awaiting: Option<Instant>,
    polled: bool,
}

/// The engine: runs the rules whenever a host's snapshot changes.
pub async fn run(fleet: Arc<Fleet>, interval: Duration) -> anyhow::Result<()> {
    let (tx, mut rx) = mpsc::channel(1024);
    for host in 0..fleet.hosts.len() {
        tokio::spawn(stream_host(Arc::clone(&fleet), host, tx.clone()));
    }
    let mut views: Vec<HostView> = (0..fleet.hosts.len())
        .map(|_| HostView::default())
        .collect();
    let mut tick = tokio::time::interval(interval);
    tick.tick().await;
    loop {
        let deadline = views.iter().filter_map(|v| v.awaiting).min();
        let mut changed = false;
        tokio::select! {
            update = rx.recv() => {
                let Some(update) = update else { return Ok(()) };
                changed |= apply(&fleet, &mut views, update)?;
                while let Ok(update) = rx.try_recv() {
                    changed |= apply(&fleet, &mut views, update)?;
                }
            }
            _ = tick.tick() => poll(&fleet, &views, &tx),
            _ = sleep_until(deadline.unwrap_or_else(far_future)), if deadline.is_some() => {
                expire(&fleet, &mut views, &tx);
            }
        }
        if changed && views.iter().all(|v| v.awaiting.is_none()) {
            judge(&fleet, &mut views).await?;
        }
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86400)
}

/// Takes in one update; whether the rules should run again.
fn apply(fleet: &Fleet, views: &mut [HostView], update: Update) -> anyhow::Result<bool> {
    match update {
        Update::Snapshot(host, snapshot) => {
            let view = &mut views[host];
            let changed = view.latest.as_ref() != Some(&snapshot) || view.awaiting.is_some();
            view.latest = Some(snapshot);
            view.awaiting = None;
            Ok(changed)
        }
        Update::Failed(host, failure) => {
            views[host].latest = None;
            views[host].awaiting = None;
            fleet.failed(host, &failure)?;
            Ok(false)
        }
        Update::CannotStream(host, why) => {
            let name = &fleet.hosts[host].name;
            eprintln!(
                "[INFO] [{name}] Cannot stream snapshots (usage watch: {why}); polling it every --interval, as genv does"
            );
            views[host].polled = true;
            Ok(false)
        }
    }
}

/// The hosts that cannot stream: a snapshot each, as genv takes them.
fn poll(fleet: &Arc<Fleet>, views: &[HostView], tx: &mpsc::Sender<Update>) {
    let hosts = (0..views.len()).filter(|h| views[*h].polled);
    ask(fleet, hosts.collect(), tx);
}

/// Hosts acted on that sent nothing newer in time are asked once.
fn expire(fleet: &Arc<Fleet>, views: &mut [HostView], tx: &mpsc::Sender<Update>) {
    let now = Instant::now();
    let mut late = Vec::new();
    for (host, view) in views.iter_mut().enumerate() {
        if view.awaiting.is_some_and(|at| at <= now) {
            view.awaiting = None;
            late.push(host);
        }
    }
    ask(fleet, late, tx);
}

fn ask(fleet: &Arc<Fleet>, hosts: Vec<usize>, tx: &mpsc::Sender<Update>) {
    if hosts.is_empty() {
        return;
    }
    let (fleet, tx) = (Arc::clone(fleet), tx.clone());
    tokio::spawn(async move {
        for (host, taken) in fleet.snapshots(hosts).await {
            let update = match taken {
                Ok(snapshot) => Update::Snapshot(host, snapshot),
                Err(failure) => Update::Failed(host, failure),
            };
            let _ = tx.send(update).await;
        }
    });
}

async fn judge(fleet: &Arc<Fleet>, views: &mut [HostView]) -> anyhow::Result<()> {
    let taken: Vec<(usize, &Snapshot)> = views
        .iter()
        .enumerate()
        .filter_map(|(host, view)| view.latest.as_ref().map(|s| (host, s)))
        .collect();
    let reports = fleet.judge(&taken);
    if reports.is_empty() {
        return Ok(());
    }
    let acted: Vec<usize> = reports.iter().map(|(host, _)| *host).collect();
    let started = std::time::Instant::now();
    fleet.execute(reports).await?;
    if fleet.verbose {
        eprintln!(
            "[INFO] Executed on {} hosts in {:.1} ms",
            acted.len(),
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    let until = Instant::now() + fleet.host_timeout;
    for host in acted {
        views[host].awaiting = Some(until);
    }
    Ok(())
}
