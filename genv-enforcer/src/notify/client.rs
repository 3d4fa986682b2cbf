//! `genv-enforcer why [PID | --me]`: asks the running daemon over `<run-dir>/why.sock`
//! what it did to the caller's processes, and prints it. Run by any user; the daemon
//! decides what the caller may see (see [`super::server`]).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::Terminal;
use super::decision::Decision;
use super::journal::Query;
use super::sanitize::{NAME_CHARS, clean_line, clean_str};
use super::server::{Answer, SOCKET, WhyRequest};
use crate::snapshot::join_indices;

/// How long the daemon has to answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);
/// How long a record may take: `usage execute` must not hang on a daemon that does not
/// answer (it keeps the decision in a file instead).
const RECORD_WITHIN: Duration = Duration::from_secs(2);
/// The largest answer read: the whole journal, with room to spare.
const ANSWER_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum WhyError {
    #[error(
        "no genv-enforcer is answering at {0} ({1}): the daemon is not running, or runs with another --run-dir (genv-enforcer status tells)"
    )]
    NotRunning(PathBuf, std::io::Error),
    #[error("asking the daemon at {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("the daemon's answer is not one this version reads: {0}")]
    BadAnswer(serde_json::Error),
    #[error("the daemon refused: {0}")]
    Refused(String),
}

/// Asks the daemon whose run directory is `run_dir`.
pub fn ask(run_dir: &Path, query: &Query) -> Result<Vec<Decision>, WhyError> {
    let answer = exchange(run_dir, &WhyRequest::Query(query.clone()), ANSWER_WITHIN)?;
    match answer.error {
        Some(error) => Err(WhyError::Refused(clean_str(&error, 200))),
        None => Ok(answer.decisions),
    }
}

/// Hands `decision` to the daemon whose run directory is `run_dir`, to keep and tell as
/// its own (root only, [`WhyRequest::Record`]).
pub fn record(
    run_dir: &Path,
    decision: &Decision,
    terminal: Option<Terminal>,
) -> Result<(), WhyError> {
    let request = WhyRequest::Record {
        record: decision.clone(),
        terminal,
    };
    let answer = exchange(run_dir, &request, RECORD_WITHIN)?;
    match (answer.error, answer.recorded) {
        (Some(error), _) => Err(WhyError::Refused(clean_str(&error, 200))),
        (None, true) => Ok(()),
        (None, false) => Err(WhyError::Refused(
            "the daemon answered without keeping the record (a version without records)".into(),
        )),
    }
}

/// One request, one answer.
fn exchange(run_dir: &Path, request: &WhyRequest, within: Duration) -> Result<Answer, WhyError> {
    let path = run_dir.join(SOCKET);
    let mut stream = connect(&path)?;
    let io = |e| WhyError::Io(path.clone(), e);
    stream.set_read_timeout(Some(within)).map_err(io)?;
    stream.set_write_timeout(Some(within)).map_err(io)?;
    let mut request = serde_json::to_vec(request).expect("a request serializes");
    request.push(b'\n');
    stream.write_all(&request).map_err(io)?;
    let mut text = Vec::new();
    stream
        .take(ANSWER_BYTES)
        .read_to_end(&mut text)
        .map_err(io)?;
    serde_json::from_slice(&text).map_err(WhyError::BadAnswer)
}

/// Connects without waiting: a blocking connect to a socket whose backlog is full waits
/// for room for ever, and any user can fill it (`usage execute` relays its decisions
/// holding genv's lock).
fn connect(path: &Path) -> Result<UnixStream, WhyError> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let flags = SocketFlags::NONBLOCK | SocketFlags::CLOEXEC;
    let io = |e: std::io::Error| WhyError::Io(path.to_owned(), e);
    let socket = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, flags, None)
        .map_err(|e| io(e.into()))?;
    let address = SocketAddrUnix::new(path).map_err(|e| io(e.into()))?;
    match rustix::net::connect(&socket, &address) {
        Ok(()) => {}
        Err(rustix::io::Errno::AGAIN) => {
            return Err(io(std::io::Error::other(
                "the daemon's socket takes no more connections now (its backlog is full)",
            )));
        }
        Err(e) => return Err(WhyError::NotRunning(path.to_owned(), e.into())),
    }
    rustix::io::ioctl_fionbio(&socket, false).map_err(|e| io(e.into()))?;
    Ok(UnixStream::from(socket))
}

/// The decisions as `why` prints them: a header, a row each and the line its user saw
/// below it; `with_user` adds the uid's name (root's view of everyone).
pub fn render(decisions: &[Decision], with_user: Option<&dyn Fn(u32) -> String>) -> String {
    let mut out = String::new();
    let user_head = if with_user.is_some() { "USER" } else { "" };
    let head = format!(
        "{:<19}  {:>7}  {:<16}  {:<4}  {:<20}  {:<20}  {user_head}",
        "TIME", "PID", "COMMAND", "GPU", "RULE", "ACTION"
    );
    out.push_str(head.trim_end());
    out.push('\n');
    for d in decisions {
        let user = with_user.map(|name| clean_str(&name(d.uid), NAME_CHARS));
        let row = format!(
            "{:<19}  {:>7}  {:<16}  {:<4}  {:<20}  {:<20}  {}",
            local_time(d.time),
            d.pid,
            clean_str(&d.comm, 16),
            join_indices(d.gpus.iter().copied()),
            d.rule.name(),
            d.action.word(),
            user.unwrap_or_default()
        );
        out.push_str(row.trim_end());
        out.push('\n');
        out.push_str(&format!("    {}\n", clean_line(&d.line, 1000)));
    }
    out
}

/// `2026-11-25 14:52:35` in the local time zone.
fn local_time(secs: u64) -> String {
    let t = libc::time_t::try_from(secs).unwrap_or(0);
    // SAFETY: all zeroes is a valid `tm` (integers, and a null zone name).
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: localtime_r reads `t` and writes into `tm` only.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return secs.to_string();
    }
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::{Done, Facts, Rule};

    #[test]
    fn no_daemon_is_said_naming_the_socket() {
        let dir = std::env::temp_dir().join(format!("genv-why-none-{}", std::process::id()));
        let err = ask(&dir, &Query::default()).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, WhyError::NotRunning(..)), "{text}");
        assert!(
            text.contains(&dir.join(SOCKET).display().to_string()),
            "{text}"
        );
        assert!(text.contains("not running"), "{text}");
    }

    #[test]
    fn a_row_shows_what_the_user_saw() {
        let mut d = Decision::new(
            Facts {
                pid: 1234,
                uid: 1000,
                comm: b"python",
                env: None,
                gpus: vec![1],
                rule: Rule::NonEnvProcesses,
                action: Done::Terminated,
            },
            1_700_000_000,
        );
        // A forged answer cannot put controls on the caller's terminal either.
        d.comm = "py\x1b[2Jthon".into();
        let text = render(&[d], Some(&|uid| format!("user{uid}")));
        assert!(
            text.bytes()
                .all(|b| b == b'\n' || (0x20..0x7f).contains(&b)),
            "{text}"
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[0].starts_with("TIME") && lines[0].ends_with("USER"));
        assert!(
            lines[1].contains("   1234  py\\u{1b}[2Jthon"),
            "{}",
            lines[1]
        );
        assert!(lines[1].contains("non-env-processes") && lines[1].ends_with("user1000"));
        assert!(
            lines[2]
                .trim_start()
                .starts_with("genv-enforcer: stopped process \"python\" (pid 1234)")
        );
    }
}
