//! The streams of `remote enforce --event-driven`: one `usage watch` per host over its
//! multiplexed connection, each line a snapshot handed to the [`super::engine`] as an
//! [`Update`]. A stream that ends is opened again; a host whose `usage` has no `watch`
//! (Python genv, an older genv-enforcer), or whose stream keeps failing before its
//! first line (sudo allowing only `usage snapshot`), is polled instead, while the stream
//! is still tried now and then.
//!
//! A stream can also go silent: `usage watch` stuck in NVML (whose init hangs on a
//! failed GPU) neither prints nor ends. The watch is asked for a heartbeat (`{}`, see
//! `usage watch --heartbeat`), and a stream without a line for --host-timeout past it
//! (or without its first snapshot) is a hung host: reported as a command past its
//! deadline is, ended, and polled until a fresh stream brings a snapshot again.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::sync::mpsc;
use tokio::time::{Instant, sleep};

use super::fleet::{Fleet, HostFailure, read_snapshot};
use super::ssh::{ANSWER_LIMIT, HostAnswer, SshError};
use crate::snapshot::Snapshot;

/// What the tasks report to the engine.
pub enum Update {
    /// A line of a host's stream.
    Streamed(usize, Result<Snapshot, HostFailure>),
    /// A snapshot asked for (a polled or stale host, or the check after an execute).
    Asked(usize, Result<Snapshot, HostFailure>),
    /// A report executed (or not) on a host.
    Executed(usize, Result<HostAnswer, SshError>),
    /// The host's stream ended or could not start; it is opened again.
    StreamFailed(usize, HostFailure),
    /// The host cannot stream (for now, at least): polled every --interval.
    CannotStream(usize, String),
    /// A stream of a host that was polled brought a snapshot: it is no longer polled.
    Resumed(usize),
}

/// Failed streams in a row, none with a line, after which the host is polled too.
const FAILURES_BEFORE_POLLING: u32 = 3;

/// The longest wait before a failed stream is opened again.
const RETRY_MAX: Duration = Duration::from_secs(10);
/// The longest stderr line of a stream reprinted; the rest is cut.
const STDERR_LINE: u64 = 4096;

/// Keeps one host's stream open, for as long as the run lasts.
pub async fn stream_host(fleet: Arc<Fleet>, host: usize, updates: mpsc::Sender<Update>) {
    let words = fleet.watch_words();
    let mut retry = Duration::from_millis(500);
    let mut failures = 0;
    let mut polled = false;
    loop {
        let started = Instant::now();
        let sent = match watch_once(&fleet, host, &words, &updates, &mut polled).await {
            Ended::Closed => return,
            Ended::NoWatch(why) => {
                let _ = updates.send(Update::CannotStream(host, why)).await;
                return;
            }
            Ended::Failed { failure, seen } => {
                failures = if seen { 0 } else { failures + 1 };
                stream_failed(host, failure, failures, &mut polled, &updates).await
            }
        };
        if !sent {
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

/// Reports a failed stream; a host whose stream went silent, or failed before a line
/// too often, is polled from then on (said once). `false` once the engine is gone.
async fn stream_failed(
    host: usize,
    failure: HostFailure,
    failures: u32,
    polled: &mut bool,
    updates: &mpsc::Sender<Update>,
) -> bool {
    let hung = matches!(failure, HostFailure::Ssh(SshError::TimedOut(_)));
    let why = match hung {
        true => format!("its stream went silent: {failure}"),
        false => format!("{FAILURES_BEFORE_POLLING} streams failed before a line: {failure}"),
    };
    if updates
        .send(Update::StreamFailed(host, failure))
        .await
        .is_err()
    {
        return false;
    }
    if !*polled && (hung || failures >= FAILURES_BEFORE_POLLING) {
        *polled = true;
        return updates.send(Update::CannotStream(host, why)).await.is_ok();
    }
    true
}

enum Ended {
    /// The engine is gone.
    Closed,
    /// `usage` has no `watch` there.
    NoWatch(String),
    Failed {
        failure: HostFailure,
        seen: bool,
    },
}

/// One stream, until it ends, goes silent or the engine goes; `polled` is the host's
/// state, cleared (and said) when this stream brings a snapshot.
async fn watch_once(
    fleet: &Fleet,
    host: usize,
    words: &[String],
    updates: &mpsc::Sender<Update>,
    polled: &mut bool,
) -> Ended {
    let mut child = match fleet.ssh.stream(&fleet.hosts[host], words) {
        Ok(child) => child,
        Err(e) => return Ended::failed(e.into(), false),
    };
    let stdout = child.stdout.take().expect("stdout is piped");
    let stderr = child.stderr.take().expect("stderr is piped");
    let name = fleet.hosts[host].name.clone();
    let errors = tokio::spawn(reprint_stderr(name.clone(), stderr));
    let mut lines = BufReader::new(stdout);
    let mut seen = false;
    let limit = fleet.silence_limit();
    let (mut heard, mut last_snapshot) = (Instant::now(), Instant::now());
    loop {
        // Heartbeats keep a stream alive only once it brought a snapshot.
        let line = match read_line(&mut lines, heard + limit, limit).await {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => {
                let _ = child.start_kill();
                return Ended::failed(e.into(), seen);
            }
        };
        fleet.heard(host);
        let now = Instant::now();
        if is_heartbeat(&line) {
            heard = if seen { now } else { heard };
            continue;
        }
        if fleet.verbose {
            say_snapshot(&name, line.len(), now - last_snapshot, seen);
        }
        (heard, last_snapshot, seen) = (now, now, true);
        if std::mem::take(polled) && updates.send(Update::Resumed(host)).await.is_err() {
            return Ended::Closed;
        }
        let snapshot = read_snapshot(&line);
        if snapshot.is_ok() {
            fleet.answered(host);
        }
        if updates
            .send(Update::Streamed(host, snapshot))
            .await
            .is_err()
        {
            return Ended::Closed;
        }
    }
    let status = child.wait().await;
    ended(status, errors.await.unwrap_or_default(), seen)
}

/// `--verbose`: a snapshot came from host `name`, `since` its last one.
fn say_snapshot(name: &str, bytes: usize, since: std::time::Duration, seen: bool) {
    tracing::info!(
        "[{name}] Stream: a snapshot ({bytes} bytes), {:.1} s after its last one{}",
        since.as_secs_f64(),
        if seen { "" } else { " (connected)" }
    );
}

/// The next line, by `deadline`; `None` at the end of the stream.
async fn read_line(
    lines: &mut BufReader<tokio::process::ChildStdout>,
    deadline: Instant,
    limit: Duration,
) -> Result<Option<Vec<u8>>, SshError> {
    let mut line = Vec::new();
    let mut limited = lines.take(ANSWER_LIMIT + 1);
    let read = limited.read_until(b'\n', &mut line);
    match tokio::time::timeout_at(deadline, read).await {
        Err(_) => Err(SshError::TimedOut(limit)),
        Ok(Ok(0)) => Ok(None),
        Ok(Ok(n)) if n as u64 > ANSWER_LIMIT => Err(SshError::TooLong),
        Ok(Ok(_)) => Ok(Some(line)),
        Ok(Err(e)) => Err(SshError::Io(e)),
    }
}

/// What a stream that ended with `status` and `last_error` (its stderr's last line) was.
fn ended(
    status: std::io::Result<std::process::ExitStatus>,
    last_error: String,
    seen: bool,
) -> Ended {
    match status {
        Ok(_) if !seen && says_no_watch(&last_error) => Ended::NoWatch(last_error),
        Ok(status) => Ended::failed(
            HostFailure::Command(format!(
                "the snapshot stream ended ({status}){}",
                match last_error.is_empty() {
                    true => String::new(),
                    false => format!(": {last_error}"),
                }
            )),
            seen,
        ),
        Err(e) => Ended::failed(SshError::Io(e).into(), seen),
    }
}

/// `usage watch`'s heartbeat line, which carries nothing.
fn is_heartbeat(line: &[u8]) -> bool {
    line.trim_ascii() == crate::remote::usage_watch::HEARTBEAT_LINE.as_bytes()
}

impl Ended {
    fn failed(failure: HostFailure, seen: bool) -> Self {
        Self::Failed { failure, seen }
    }
}

/// What a host's `usage` says when it has no `watch`: genv's argument parser (Python
/// genv), or clap's (a genv-enforcer without it). An older genv-enforcer's `usage
/// watch` has no --heartbeat: polled, rather than streamed without a way to tell it
/// hung.
fn says_no_watch(line: &str) -> bool {
    let no_watch = [
        "invalid choice",
        "unrecognized subcommand",
        "unexpected argument '--heartbeat'",
    ];
    no_watch.iter().any(|w| line.contains(w))
}

/// Reprints a stream's stderr, each line with the host's prefix, for as long as it
/// writes (a full pipe would stall the stream itself); returns the line saying it has
/// no `watch` if one did (clap says it first, then its usage), else its last line.
async fn reprint_stderr(name: String, stderr: tokio::process::ChildStderr) -> String {
    let mut reader = BufReader::new(stderr);
    let (mut last, mut why) = (String::new(), None);
    loop {
        let mut line = Vec::new();
        match (&mut reader)
            .take(STDERR_LINE)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => return why.unwrap_or(last),
            Ok(_) => {
                last = String::from_utf8_lossy(&line).trim_end().to_owned();
                crate::genv_lines::eprint(&format!("[{name}] {last}"));
                if why.is_none() && says_no_watch(&last) {
                    why = Some(last.clone());
                }
            }
        }
    }
}
