//! The executor tells each terminated process's user why, on the process's own
//! terminal: a real pseudo-terminal here, with the target as its session's process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Executor, ExecutorConfig};
use crate::backends::procfs;
use crate::notify::journal::Query;
use crate::notify::tty::tests::{Pty, child_on, pty, shown};
use crate::notify::{Done, Notifier, NotifyMode, Rule};
use crate::report::{Report, Why};
use crate::state::StateDir;

fn executor(notifier: &Arc<Notifier>, kill_after: Option<Duration>) -> Executor {
    Executor::new(ExecutorConfig {
        dry_run: false,
        signals: true,
        kill_after,
    })
    .with_notifier(Arc::clone(notifier))
}

/// A report terminating `pid` on GPU 0, outside any environment; with the rule's
/// reason when `why`.
fn report(pid: u32, why: bool) -> Report {
    let start_time = procfs::stat(pid).unwrap().start_time;
    let mut report = super::tests::report(&[(pid, start_time)]);
    if why {
        let why = Why {
            rule: Rule::NonEnvProcesses,
            gpus: vec![0],
            detached: false,
            env_name: None,
        };
        report.why.insert(pid, why);
    }
    report
}

fn state() -> StateDir {
    StateDir::new("/nonexistent/genv")
}

/// The lines the terminal shows, without the blank ones around each.
fn lines(pty: &Pty) -> Vec<String> {
    shown(pty)
        .split('\n')
        .map(|l| l.trim_matches('\r').to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

fn all() -> Query {
    Query {
        limit: 100,
        ..Query::default()
    }
}

#[test]
fn a_terminated_process_is_told_why_on_its_own_terminal() {
    let notifier = Arc::new(Notifier::new(NotifyMode::Tty));
    let pty = pty();
    let mut child = child_on(&pty, "sleep", &["60"]);
    let pid = child.id();
    executor(&notifier, None).execute(&report(pid, true), &state());
    child.wait().unwrap();
    notifier.flush();
    assert_eq!(
        lines(&pty),
        [format!(
            "genv-enforcer: stopped process \"sleep\" (pid {pid}) on GPU 0: not in a genv environment; run 'genv activate --gpus 1' first"
        )]
    );
    let me = rustix::process::getuid().as_raw();
    let journal = notifier.answer(me, &all());
    assert_eq!(journal.len(), 1);
    assert_eq!(
        (journal[0].pid, journal[0].uid, journal[0].action),
        (pid, me, Done::Terminated)
    );
}

/// A process that ignores SIGTERM is killed after its grace period, and told so.
#[test]
fn the_kill_after_the_grace_period_is_told_too() {
    let notifier = Arc::new(Notifier::new(NotifyMode::Tty));
    let pty = pty();
    let mut child = child_on(
        &pty,
        "sh",
        &["-c", "trap '' TERM; while :; do sleep 1; done"],
    );
    let pid = child.id();
    // Wait until the trap is set: the shell's ignored signals show in its status.
    while !ignores_term(pid) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut executor = executor(&notifier, Some(Duration::from_millis(1)));
    executor.execute(&report(pid, true), &state());
    executor.escalate(Instant::now() + Duration::from_secs(1));
    child.wait().unwrap();
    notifier.flush();
    let lines = lines(&pty);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines[0].starts_with(&format!(
        "genv-enforcer: stopped process \"sh\" (pid {pid})"
    )));
    assert!(lines[1].starts_with(&format!(
        "genv-enforcer: killed process \"sh\" (pid {pid}) on GPU 0"
    )));
}

fn ignores_term(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGTERM - 1)) != 0)
}

/// `usage execute`'s reports carry no reason, and a dry run does nothing: no one is
/// told anything.
#[test]
fn nothing_done_or_no_reason_known_tells_nothing() {
    let notifier = Arc::new(Notifier::new(NotifyMode::Tty));
    let pty = pty();
    let mut child = child_on(&pty, "sleep", &["60"]);
    let pid = child.id();
    let mut dry = Executor::new(ExecutorConfig {
        dry_run: true,
        signals: true,
        kill_after: None,
    })
    .with_notifier(Arc::clone(&notifier));
    dry.execute(&report(pid, true), &state());
    executor(&notifier, None).execute(&report(pid, false), &state());
    child.wait().unwrap();
    notifier.flush();
    assert_eq!(lines(&pty), [] as [String; 0]);
    assert!(notifier.answer(0, &all()).is_empty());
}
