//! Users are told, on their own terminals, what the enforcer did to their processes and
//! why: real pseudo-terminals, held by an unprivileged user's process as its controlling
//! terminal (a session of its own, `TIOCSCTTY`), as a login shell's job holds its pty.
//!
//! Each test reads what the terminal emulator's side (the pty master) would show, after
//! the enforcer said it dealt with the line (its exit, or a log line), never after a
//! sleep.

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use genv_enforcer_tests::events::{EventDaemon, make_gpu_node};
use genv_enforcer_tests::{Node, device_record, env_record};
use serde_json::json;

/// Two unprivileged users (no passwd entry needed for the second).
const ALICE: u32 = 65534;

/// A pseudo-terminal whose slave belongs to `owner`, as login gives one to its user.
struct Terminal {
    master: OwnedFd,
    slave: OwnedFd,
}

impl Terminal {
    fn new(owner: u32) -> Self {
        let (mut master, mut slave) = (-1, -1);
        // SAFETY: openpty writes two descriptors; no name buffer, no settings.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both are ours, just opened.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        rustix::fs::fchown(
            &slave,
            Some(rustix::fs::Uid::from_raw(owner)),
            Some(rustix::fs::Gid::from_raw(owner)),
        )
        .unwrap();
        rustix::fs::fcntl_setfl(&master, rustix::fs::OFlags::NONBLOCK).unwrap();
        Self { master, slave }
    }

    /// Everything written to the terminal so far, raw.
    fn shown(&self) -> Vec<u8> {
        let mut file = std::fs::File::from(self.master.try_clone().unwrap());
        let mut bytes = Vec::new();
        let mut chunk = [0u8; 4096];
        while let Ok(n) = file.read(&mut chunk) {
            if n == 0 {
                break;
            }
            bytes.extend_from_slice(&chunk[..n]);
        }
        bytes
    }

    /// Waits (generously: a noisy machine) for a line containing `needle`; returns all
    /// that was shown. The master wakes the wait when the daemon writes.
    fn wait_for(&self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut shown = Vec::new();
        loop {
            shown.extend(self.shown());
            let text = String::from_utf8_lossy(&shown).into_owned();
            if text.contains(needle) {
                return text;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no {needle:?} on the terminal: {text:?}");
            let mut fds = [rustix::event::PollFd::new(
                &self.master,
                rustix::event::PollFlags::IN,
            )];
            let timeout = rustix::event::Timespec::try_from(left).unwrap();
            let _ = rustix::event::poll(&mut fds, Some(&timeout));
        }
    }

    /// Fills the terminal's output until it takes no more: a terminal nobody reads.
    fn fill(&self) {
        let path = std::fs::read_link(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&self.slave)
        ))
        .unwrap();
        let flags =
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOCTTY;
        let writer = rustix::fs::open(&path, flags, rustix::fs::Mode::empty()).unwrap();
        let block = [b'.'; 4096];
        loop {
            match rustix::io::write(&writer, &block) {
                Ok(_) => {}
                Err(rustix::io::Errno::AGAIN) => return,
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
    }

    /// `gpu-process ARGS` run by `uid` on this terminal (as [`Self::run`]), once it said
    /// it is ready (its opens done).
    fn gpu_process(&self, uid: u32, args: &[&str]) -> std::process::Child {
        let mut command = Command::new(genv_enforcer_tests::artefact("gpu-process"));
        command
            .args(args)
            .stdin(Stdio::from(self.slave.try_clone().unwrap()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .env_remove("GENV_ENVIRONMENT_ID")
            .uid(uid)
            .gid(uid);
        in_session_of(&mut command);
        let mut child = command.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "gpu-process did not start");
        child
    }

    /// `program ARGS` run by `uid`, in a session of its own with this terminal as its
    /// controlling terminal and its standard input.
    fn run(
        &self,
        uid: u32,
        program: &Path,
        args: &[&str],
        env: Option<&str>,
    ) -> std::process::Child {
        let mut command = Command::new(program);
        command
            .args(args)
            .stdin(Stdio::from(self.slave.try_clone().unwrap()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .env_remove("GENV_ENVIRONMENT_ID")
            .uid(uid)
            .gid(uid);
        if let Some(eid) = env {
            command.env("GENV_ENVIRONMENT_ID", eid);
        }
        in_session_of(&mut command);
        command.spawn().unwrap()
    }
}

/// Makes `command` start a session of its own with its stdin as the controlling
/// terminal.
fn in_session_of(command: &mut Command) {
    // SAFETY: setsid and ioctl are async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

/// The lines of `bytes` with text on them.
fn lines(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .split('\n')
        .map(|l| l.trim_matches('\r').to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// Nothing a terminal acts on: only printable text, and the line breaks around it.
fn inert(bytes: &[u8]) -> bool {
    String::from_utf8_lossy(bytes)
        .chars()
        .all(|c| c == '\r' || c == '\n' || !c.is_control())
}

fn sleep() -> PathBuf {
    PathBuf::from("/bin/sleep")
}

#[test]
fn a_terminated_outsider_is_told_once_why_on_its_own_terminal() {
    let mut node = Node::new(2);
    let terminal = Terminal::new(ALICE);
    let child = terminal.run(ALICE, &sleep(), &["600"], None);
    let pid = node.adopt(child, &[(1, 100)]);
    let run = node.enforce_once(&["--non-env-processes"]);
    assert!(run.success, "{}", run.stderr);
    assert_eq!(run.terminated(), [pid]);
    let shown = terminal.shown();
    assert_eq!(
        lines(&shown),
        [format!(
            "genv-enforcer: stopped sleep (pid {pid}) on GPU 1: not in a genv environment; run 'genv activate --gpus 1' first"
        )],
        "{}",
        run.stderr
    );
    // The log has it as a record with its fields.
    let record = run
        .stderr
        .lines()
        .find(|l| l.starts_with("[DECISION] "))
        .unwrap_or_else(|| panic!("no decision record: {}", run.stderr));
    for field in [
        "rule=\"non-env-processes\"".to_owned(),
        "action=\"terminated\"".to_owned(),
        format!("pid={pid}"),
        format!("uid={ALICE}"),
        "gpu=1".to_owned(),
    ] {
        assert!(record.contains(&field), "{field} in {record}");
    }
}

/// `--notify none`: the terminal is left alone; the log still has the decision.
#[test]
fn notify_none_writes_to_no_terminal() {
    let mut node = Node::new(1);
    let terminal = Terminal::new(ALICE);
    let child = terminal.run(ALICE, &sleep(), &["600"], None);
    let pid = node.adopt(child, &[(0, 100)]);
    let run = node.enforce_once(&["--non-env-processes", "--notify", "none"]);
    assert_eq!(run.terminated(), [pid]);
    assert!(run.stderr.contains(&format!("pid={pid}")), "{}", run.stderr);
    assert_eq!(lines(&terminal.shown()), [] as [String; 0]);
}

/// An environment named to clear the screen and fake a prompt, and a program named to
/// retitle the window and break the line: the terminal gets one line, with neither.
#[test]
fn hostile_names_never_reach_the_terminal_raw() {
    let mut node = Node::new(2);
    let shell = node.spawn_with(None, &[], &[], Some(ALICE));
    let mut env = env_record("e1", ALICE, "alice", None, shell);
    env["config"]["name"] = json!("\u{1b}[2J\u{1b}[1;1Hroot's env\r\n$ sudo \u{9b}31m");
    node.write_state(
        json!([env]),
        json!([device_record(0, &["e1"]), device_record(1, &[])]),
    );
    // A copy of sleep whose name (its comm) holds an OSC title, a clear-screen and a
    // line break.
    let hostile = node.dir.join("\u{1b}]0;pw\u{7}\u{1b}[2J\nx");
    std::fs::copy(sleep(), &hostile).unwrap();
    let terminal = Terminal::new(ALICE);
    let child = terminal.run(ALICE, &hostile, &["600"], Some("e1"));
    let pid = node.adopt(child, &[(1, 100)]);
    let run = node.enforce_once(&[]);
    assert_eq!(run.terminated(), [pid], "{}", run.stderr);
    let shown = terminal.shown();
    assert!(inert(&shown), "{:?}", String::from_utf8_lossy(&shown));
    let lines = lines(&shown);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(&format!(
            "stopped  x (pid {pid}) on GPU 1: environment 'root's env  $ sudo ' is not attached to GPU 1; run 'genv attach --index 1' first"
        )),
        "{}",
        lines[0]
    );
    // Nor the log raw.
    let record = run
        .stderr
        .lines()
        .find(|l| l.starts_with("[DECISION] "))
        .unwrap();
    assert!(!record.contains('\u{1b}'), "{record:?}");
}

/// Alice's process runs on a terminal that is not hers (as after `su alice` in root's
/// terminal): nothing is written to it. The daemon says why in its log, which is how
/// this test knows the line was dealt with.
#[test]
fn a_terminal_of_another_user_gets_nothing() {
    let mut node = Node::new(1);
    let roots = Terminal::new(0);
    let child = roots.run(ALICE, &sleep(), &["600"], None);
    let pid = node.adopt(child, &[(0, 100)]);
    let run = node.enforce_once(&["--non-env-processes"]);
    assert_eq!(run.terminated(), [pid]);
    assert!(
        run.stderr.contains(&format!(
            "Not telling process {pid} on its terminal: the terminal belongs to another user"
        )),
        "{}",
        run.stderr
    );
    assert_eq!(lines(&roots.shown()), [] as [String; 0]);
}

/// A process with no controlling terminal (a batch job, its output in a file) is
/// written nothing; its decision is still logged.
#[test]
fn a_process_without_a_terminal_gets_nothing() {
    let mut node = Node::new(1);
    let out = node.dir.join("job.out");
    let mut command = Command::new(sleep());
    command
        .arg("600")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .uid(ALICE);
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        command.pre_exec(|| match libc::setsid() {
            -1 => Err(std::io::Error::last_os_error()),
            _ => Ok(()),
        })
    };
    let pid = node.adopt(command.spawn().unwrap(), &[(0, 100)]);
    let run = node.enforce_once(&["--non-env-processes"]);
    assert_eq!(run.terminated(), [pid]);
    assert!(run.stderr.contains(&format!("pid={pid}")), "{}", run.stderr);
    assert_eq!(std::fs::read(&out).unwrap(), b"");
}

/// Alice's terminal is full (nobody reads it): her process is terminated all the same,
/// the writer drops her line at once, and the next process, on a terminal that reads,
/// is terminated and told. A write that waited would hold the writer on the first
/// terminal for ever, and the second line would never come.
#[test]
fn any_tier_a_terminal_nobody_reads_holds_up_nothing() {
    let mut node = Node::new(2);
    let gpu = make_gpu_node(&node.dir.join("nvidia0"));
    node.write_state(
        json!([]),
        json!([device_record(0, &[]), device_record(1, &[])]),
    );
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let gpu = gpu.to_str().unwrap();
    let stalled = Terminal::new(ALICE);
    stalled.fill();
    let first = stalled.gpu_process(ALICE, &["--open", gpu]);
    let first = node.adopt(first, &[(0, 100)]);
    daemon.expect(&format!(
        "Not telling process {first} on its terminal: the terminal is not reading"
    ));
    let reading = Terminal::new(ALICE);
    let second = reading.gpu_process(ALICE, &["--open", gpu]);
    let second = node.adopt(second, &[(0, 100)]);
    reading.wait_for(&format!(
        "genv-enforcer: stopped gpu-process (pid {second}) on GPU 0"
    ));
    assert_eq!(
        node.wait_exit(first, Duration::from_secs(30)),
        Some(libc::SIGTERM)
    );
    assert_eq!(
        node.wait_exit(second, Duration::from_secs(30)),
        Some(libc::SIGTERM)
    );
}
