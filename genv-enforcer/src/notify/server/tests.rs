use std::io::{Read, Write};
use std::os::unix::net::UnixStream as StdStream;

use tokio::task::AbortHandle;

use super::*;
use crate::notify::tests::decision;

fn run_dir(mode: u32) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "genv-why-{}-{}",
        std::process::id(),
        crate::notify::tests::unique()
    ));
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
    dir
}

fn me() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// A server over a journal of decisions about this user's processes (pids 1 and 3)
/// and another user's (pid 2).
fn server() -> PathBuf {
    let dir = run_dir(0o755);
    let mut journal = Journal::default();
    journal.push(decision(1, me()));
    journal.push(decision(2, me() + 1));
    journal.push(decision(3, me()));
    start(
        listen(&dir).unwrap(),
        Arc::new(Mutex::new(journal)),
        Arc::default(),
        None,
    )
    .unwrap();
    dir
}

fn ask(dir: &Path, request: &[u8]) -> Answer {
    let mut stream = StdStream::connect(dir.join(SOCKET)).unwrap();
    stream.write_all(request).unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn pids(answer: &Answer) -> Vec<u32> {
    answer.decisions.iter().map(|d| d.pid).collect()
}

#[test]
fn the_caller_gets_its_own_processes_decisions() {
    let dir = server();
    let mine = ask(&dir, b"{\"me\": true, \"limit\": 100}\n");
    assert_eq!(pids(&mine), [1, 3]);
    let by_pid = ask(&dir, b"{\"pid\": 2, \"me\": true, \"limit\": 100}\n");
    assert_eq!(pids(&by_pid), [] as [u32; 0]);
    // Without `me`, root sees every user's; anyone else still only their own.
    let all = ask(&dir, b"{\"limit\": 100}\n");
    match me() {
        0 => assert_eq!(pids(&all), [1, 2, 3]),
        _ => assert_eq!(pids(&all), [1, 3]),
    }
    let mode = std::fs::metadata(dir.join(SOCKET)).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o666, "every user may connect");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_malformed_or_oversized_request_is_answered_with_an_error() {
    let dir = server();
    let bad = ask(&dir, b"give me everything\n");
    assert!(bad.error.unwrap().starts_with("not a request"));
    assert!(bad.decisions.is_empty());
    // Root's requests may be records, of a larger bound.
    let limit = if me() == 0 {
        RECORD_BYTES
    } else {
        REQUEST_BYTES
    };
    let mut huge = vec![b' '; limit as usize * 4];
    huge.push(b'\n');
    let mut stream = StdStream::connect(dir.join(SOCKET)).unwrap();
    // The server stops reading at its bound and answers, then closes with the rest
    // unread: the answer, or a reset where the kernel drops it for that.
    let _ = stream.write_all(&huge);
    let mut text = String::new();
    match stream.read_to_string(&mut text) {
        Ok(_) => {
            let answer: Answer = serde_json::from_str(&text).unwrap();
            assert!(answer.error.unwrap().contains("at most"), "{text}");
        }
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
    }
    // And it goes on answering.
    assert_eq!(pids(&ask(&dir, b"{\"me\": true, \"limit\": 9}\n")), [1, 3]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Root hands the daemon a decision: the recorder gets it, and the answer says so; a
/// server without one says it keeps none. (Another user's record is refused: the
/// notify suite's remote-stop test, as a real other uid.)
#[test]
fn roots_record_goes_to_the_recorder() {
    let dir = run_dir(0o755);
    let kept = Arc::new(Mutex::new(Vec::new()));
    let into = Arc::clone(&kept);
    let recorder: Recorder = Arc::new(move |decision: Decision, _| {
        into.lock().unwrap().push(decision.pid);
    });
    start(
        listen(&dir).unwrap(),
        Arc::default(),
        Arc::default(),
        Some(recorder),
    )
    .unwrap();
    let record = serde_json::json!({"record": decision(77, 1000)}).to_string() + "\n";
    let answer = ask(&dir, record.as_bytes());
    assert!(answer.recorded && answer.error.is_none(), "{answer:?}");
    assert_eq!(*kept.lock().unwrap(), [77]);
    let plain = server();
    let answer = ask(&plain, record.as_bytes());
    assert!(!answer.recorded && answer.error.is_some(), "{answer:?}");
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(&plain).unwrap();
}

/// Clients that connect and say nothing cannot keep an answer from another: past its
/// bound, a uid's oldest connection is closed.
#[test]
fn silent_clients_cannot_hold_the_socket() {
    let dir = server();
    let silent: Vec<StdStream> = (0..PER_UID * 3)
        .map(|_| StdStream::connect(dir.join(SOCKET)).unwrap())
        .collect();
    let answer = ask(&dir, b"{\"me\": true, \"limit\": 100}\n");
    assert_eq!(pids(&answer), [1, 3]);
    drop(silent);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_run_directory_others_can_write_is_refused() {
    let dir = run_dir(0o777);
    let err = listen(&dir).unwrap_err();
    assert!(matches!(err, ListenError::UnsafeDir(..)), "{err}");
    assert!(!dir.join(SOCKET).exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `check` in a runtime of its own, with fresh connections held open for ever,
/// and the bounds the server keeps.
fn with_connections(check: impl FnOnce(&dyn Fn() -> AbortHandle, Connections<u32>)) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let pending = || tokio::spawn(std::future::pending::<()>()).abort_handle();
        check(&pending, Connections::new(PER_UID, CONNECTIONS));
    });
}

#[test]
fn connections_past_a_uids_bound_close_its_oldest() {
    with_connections(|pending, mut open| {
        let other = pending();
        open.add(7, other.clone());
        let first = pending();
        open.add(8, first.clone());
        for _ in 1..PER_UID {
            assert!(open.make_room(8).is_none());
            open.add(8, pending());
        }
        assert_eq!(open.make_room(8).unwrap().id(), first.id());
        assert!(open.make_room(7).is_none(), "uid 7 is under its bound");
    });
}

/// Sixteen uids holding their four connections each fill the 64: a real user's one
/// connection, the oldest of all, is not the one closed; the flooders' own are.
#[test]
fn a_flood_from_many_uids_closes_their_own_not_a_users_only_connection() {
    with_connections(|pending, mut open| {
        let alices = pending();
        open.add(1000, alices.clone());
        for round in 0..10 {
            for uid in 61_001..61_017u32 {
                if let Some(closed) = open.make_room(uid) {
                    assert_ne!(closed.id(), alices.id(), "round {round}, uid {uid}");
                }
                open.add(uid, pending());
            }
        }
        assert!(open.holds(&alices));
    });
}
