use std::sync::Barrier;
use std::sync::atomic::AtomicBool;

use super::*;
use crate::notify::ratelimit::PER_TERMINAL;
use crate::notify::tty::tests::{Pty, pty, shown};

fn line(text: &str, pty: &Pty) -> Line {
    Line {
        pid: 1,
        text: text.to_owned(),
        uid: rustix::process::getuid().as_raw(),
        owner: rustix::process::getuid().as_raw(),
        rdev: pty.rdev,
    }
}

#[test]
fn a_line_reaches_the_terminal_on_a_line_of_its_own() {
    let pty = pty();
    let writer = TtyWriter::spawn().unwrap();
    assert!(writer.send(line("genv-enforcer: hello", &pty)));
    writer.flush(Duration::from_secs(60));
    let shown = shown(&pty);
    let lines: Vec<&str> = shown
        .split('\n')
        .map(|l| l.trim_matches('\r'))
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(lines, ["genv-enforcer: hello"]);
    assert_eq!(writer.counts().written, 1);
}

#[test]
fn a_flood_for_one_terminal_is_held_back_and_counted() {
    let pty = pty();
    let writer = TtyWriter::spawn().unwrap();
    for i in 0..20 {
        assert!(writer.send(line(&format!("genv-enforcer: line {i}"), &pty)));
    }
    writer.flush(Duration::from_secs(60));
    let shown = shown(&pty);
    let burst = PER_TERMINAL.burst as usize;
    assert_eq!(shown.matches("genv-enforcer:").count(), burst, "{shown}");
    let counts = writer.counts();
    assert_eq!(
        (counts.written, counts.held_back),
        (burst as u64, 20 - burst as u64)
    );
}

#[test]
fn the_next_line_says_how_many_were_held_back() {
    assert_eq!(with_held_back("x", 0), "\r\nx\r\n");
    assert_eq!(
        with_held_back("x", 4),
        "\r\nx (4 more not shown: genv-enforcer why)\r\n"
    );
}

/// The thread is stuck on a terminal (an open that does not return): the queue fills,
/// and sending still never waits; the excess is counted as dropped.
#[test]
fn a_stuck_terminal_never_makes_the_sender_wait() {
    let pty = pty();
    let entered = Arc::new(Barrier::new(2));
    let release = Arc::new(Barrier::new(2));
    let first = Arc::new(AtomicBool::new(true));
    let (e, r) = (Arc::clone(&entered), Arc::clone(&release));
    let open: Opener = Box::new(move |rdev, uid| {
        if first.swap(false, Relaxed) {
            e.wait();
            r.wait();
        }
        tty::open(rdev, uid)
    });
    let writer = TtyWriter::spawn_with(Limits::default(), open).unwrap();
    assert!(writer.send(line("first", &pty)));
    entered.wait(); // the thread holds the first line, stuck in its open
    let sent = (0..QUEUE + 50)
        .filter(|i| writer.send(line(&format!("l{i}"), &pty)))
        .count();
    assert_eq!(sent, QUEUE);
    assert_eq!(writer.counts().queue_full, 50);
    release.wait();
    writer.flush(Duration::from_secs(60));
    assert_eq!(writer.counts().held_back, QUEUE as u64 + 1 - 3);
}
