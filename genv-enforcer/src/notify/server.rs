//! The `why` socket: `<run-dir>/why.sock`, a Unix stream socket any local user may
//! connect to. Whom it answers is the kernel's word, not the client's: the peer's uid
//! from `SO_PEERCRED` (its uid when it connected, as this daemon's user namespace sees
//! it). A user gets the decisions about their own processes; root gets everyone's.
//!
//! It runs on a thread and runtime of its own, so that no client, however slow or
//! many, costs the event loop anything but the journal's lock, held to copy at most
//! [`MAX_ANSWER`](super::journal::MAX_ANSWER) records. Each connection sends one
//! request line (at most [`REQUEST_BYTES`]) within [`READ_WITHIN`] and takes its answer
//! within [`WRITE_WITHIN`], else it is closed; at most [`PER_UID`] connections of one
//! user and [`CONNECTIONS`] in all are open (past the first, the user's oldest is
//! closed; past the second, the oldest of the user holding the most); and a user's
//! requests are rate-limited ([`REQUESTS`]). A user is the peer uid's owner
//! ([`crate::backends::uid_owners`]): a user's subordinate uids, or the processes of
//! a user namespace they made, share that user's bounds.
//!
//! Root may also hand the daemon a decision made elsewhere, to keep and tell as its own
//! ([`WhyRequest::Record`]): a remote stop carried out on this host by `usage execute
//! --with-reasons` ([`super::relay`]), so that the user's terminal is told under the
//! daemon's limits and `why` finds it in the daemon's journal. Only a peer the kernel
//! says is root (uid 0) may; anyone else's record is refused.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::time::{Instant, timeout, timeout_at};

use super::Terminal;
use super::decision::Decision;
use super::journal::{CAPACITY, Journal, Query};
use super::ratelimit::{Buckets, Rate};
use crate::backends::uid_owners::UidOwners;
use crate::limits::Connections;

/// The socket's name in the run directory.
pub const SOCKET: &str = "why.sock";
/// Connections open at once, in all.
const CONNECTIONS: usize = 64;
/// Connections open at once from one uid.
const PER_UID: usize = 4;
/// From the accept to the end of the request line.
const READ_WITHIN: Duration = Duration::from_secs(1);
/// To write the answer.
const WRITE_WITHIN: Duration = Duration::from_secs(5);
/// A request is a line of JSON of a few dozen bytes.
pub const REQUEST_BYTES: u64 = 512;
/// Root's record carries a decision and its line: a few hundred bytes.
pub const RECORD_BYTES: u64 = 16 << 10;
/// Requests one uid may make: 20 at once, then 10 a second.
const REQUESTS: Rate = Rate {
    burst: 20,
    every: Duration::from_millis(100),
};

/// What a connection asks, one line of JSON.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum WhyRequest {
    /// Root's: keep and tell this decision as the daemon's own.
    Record {
        record: Decision,
        #[serde(default)]
        terminal: Option<Terminal>,
    },
    /// Anyone's: what was done to my processes.
    Query(Query),
}

/// Keeps and tells a decision handed over by root ([`super::Notifier::record`]).
pub type Recorder = Arc<dyn Fn(Decision, Option<Terminal>) + Send + Sync>;

/// The daemon's answer, one line of JSON.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Answer {
    #[serde(default)]
    pub decisions: Vec<Decision>,
    /// How many decisions the journal keeps in all.
    #[serde(default)]
    pub kept: usize,
    /// Why the request was not answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A record was kept (a daemon without records answers without it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recorded: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error(
        "{0} is not root's alone (owner uid {1}, mode {2:o}): another user could replace the socket"
    )]
    UnsafeDir(PathBuf, u32, u32),
    #[error("{0}: {1}")]
    Io(PathBuf, io::Error),
}

/// Binds `<run_dir>/why.sock` for every user to connect to. The run directory must be
/// this daemon's user's and writable by no one else: the stale socket is removed and
/// the new one made there by name.
pub fn listen(run_dir: &Path) -> Result<std::os::unix::net::UnixListener, ListenError> {
    let io_error = |e| ListenError::Io(run_dir.to_owned(), e);
    let meta = std::fs::symlink_metadata(run_dir).map_err(io_error)?;
    let me = rustix::process::geteuid().as_raw();
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
        return Err(ListenError::UnsafeDir(
            run_dir.to_owned(),
            meta.uid(),
            meta.mode() & 0o7777,
        ));
    }
    let path = run_dir.join(SOCKET);
    let io_error = |e| ListenError::Io(path.clone(), e);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_error(e)),
        _ => {}
    }
    let listener = std::os::unix::net::UnixListener::bind(&path).map_err(io_error)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(io_error)?;
    listener.set_nonblocking(true).map_err(io_error)?;
    Ok(listener)
}

/// Serves `listener` on a thread of its own.
pub fn start(
    listener: std::os::unix::net::UnixListener,
    journal: Arc<Mutex<Journal>>,
    owners: Arc<UidOwners>,
    recorder: Option<Recorder>,
) -> io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()?;
    std::thread::Builder::new()
        .name("notify-why".into())
        .spawn(move || {
            runtime.block_on(async move {
                match tokio::net::UnixListener::from_std(listener) {
                    Ok(listener) => {
                        let served = Served { journal, recorder };
                        accept_loop(listener, Arc::new(served), &owners).await
                    }
                    Err(e) => tracing::warn!("genv-enforcer why: cannot serve: {e}"),
                }
            })
        })
        .map(drop)
}

/// Serves connections; the bounds are kept per user (a uid's owner, from the peer's
/// credentials as the kernel gave them at connect), not per uid.
async fn accept_loop(listener: tokio::net::UnixListener, served: Arc<Served>, owners: &UidOwners) {
    let mut open = Connections::new(PER_UID, CONNECTIONS);
    let mut requests = Buckets::new(REQUESTS);
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // Out of descriptors, mostly: wait rather than spin.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(cred) = stream.peer_cred() else {
            continue;
        };
        let uid = cred.uid();
        let pid = cred.pid().and_then(|p| u32::try_from(p).ok());
        let user = owners.owner(uid, pid);
        let accepted = Instant::now();
        // Root is not limited: its records are a remote report's decisions, as many as
        // the report stops.
        let allowed = uid == 0 || requests.has(user, accepted.into_std());
        if allowed && uid != 0 {
            requests.take(user, accepted.into_std());
        }
        if let Some(oldest) = open.make_room(user) {
            oldest.abort();
        }
        let task = tokio::spawn(serve(stream, accepted, uid, allowed, Arc::clone(&served)));
        open.add(user, task.abort_handle());
    }
}

/// What the connections are answered from.
struct Served {
    journal: Arc<Mutex<Journal>>,
    recorder: Option<Recorder>,
}

async fn serve(
    mut stream: UnixStream,
    accepted: Instant,
    uid: u32,
    allowed: bool,
    served: Arc<Served>,
) {
    let limit = if uid == 0 {
        RECORD_BYTES
    } else {
        REQUEST_BYTES
    };
    let request = timeout_at(accepted + READ_WITHIN, read_request(&mut stream, limit)).await;
    let request = match request {
        Ok(Ok(request)) => request,
        // Too slow, or gone: nothing to answer.
        _ => return,
    };
    let answer = match request {
        _ if !allowed => refusal("too many requests; try again in a second"),
        Ok(WhyRequest::Query(query)) => Answer {
            decisions: served
                .journal
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .answer(uid, &query),
            kept: CAPACITY,
            ..Answer::default()
        },
        Ok(WhyRequest::Record { record, terminal }) => match (&served.recorder, uid) {
            (Some(recorder), 0) => {
                recorder(record, terminal);
                Answer {
                    recorded: true,
                    ..Answer::default()
                }
            }
            (_, 0) => refusal("this daemon keeps no records"),
            _ => refusal("only root may record a decision"),
        },
        Err(e) => refusal(&e),
    };
    let mut text = serde_json::to_vec(&answer).unwrap_or_default();
    text.push(b'\n');
    let _ = timeout(WRITE_WITHIN, async {
        stream.write_all(&text).await?;
        stream.shutdown().await
    })
    .await;
}

fn refusal(why: &str) -> Answer {
    Answer {
        error: Some(why.to_owned()),
        ..Answer::default()
    }
}

/// One line, at most `limit` bytes, as a [`WhyRequest`].
async fn read_request(
    stream: &mut UnixStream,
    limit: u64,
) -> io::Result<Result<WhyRequest, String>> {
    let mut line = Vec::new();
    let mut reader = BufReader::new(stream.take(limit));
    reader.read_until(b'\n', &mut line).await?;
    if !line.ends_with(b"\n") && line.len() as u64 >= limit {
        return Ok(Err(format!(
            "a request is one line of at most {limit} bytes"
        )));
    }
    Ok(serde_json::from_slice(&line).map_err(|e| format!("not a request: {e}")))
}

#[cfg(test)]
mod tests;
