//! Pseudo-terminals for the notify suite: a pty pair whose slave belongs to a user, and
//! processes started with it as their controlling terminal, as a login shell's jobs
//! have theirs.

use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

/// A pseudo-terminal whose slave belongs to `owner`, as login gives one to its user.
pub struct Terminal {
    master: OwnedFd,
    slave: OwnedFd,
}

impl Terminal {
    pub fn new(owner: u32) -> Self {
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

    fn path(&self) -> PathBuf {
        std::fs::read_link(format!("/proc/self/fd/{}", self.slave.as_raw_fd())).unwrap()
    }

    /// Everything written to the terminal since the last look, raw.
    pub fn shown(&self) -> Vec<u8> {
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

    /// Waits (generously: a noisy machine) for `needle` on the terminal; returns all
    /// that was shown meanwhile. The master wakes the wait when the daemon writes.
    pub fn wait_for(&self, needle: &str) -> String {
        let deadline = Instant::now() + genv_enforcer_tests::harness::PATIENCE;
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

    /// A terminal nobody reads, its output stopped (as `^S` stops it): its output is
    /// filled until it takes no more, and stopped, so that the kernel cannot make room
    /// by moving what was written to the reader's side. Every write to it now waits,
    /// or, non-blocking, fails with EAGAIN.
    pub fn stall(&self) {
        self.fill();
        // SAFETY: tcflow only acts on the descriptor.
        let rc = unsafe { libc::tcflow(self.slave.as_raw_fd(), libc::TCOOFF) };
        assert_eq!(rc, 0, "tcflow: {}", std::io::Error::last_os_error());
    }

    /// Fills the terminal's output until it takes no more.
    fn fill(&self) {
        use rustix::fs::OFlags;
        let flags = OFlags::WRONLY | OFlags::NONBLOCK | OFlags::NOCTTY;
        let path = self.path();
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

    /// Makes `command` run as `uid` in a session of its own with this terminal as its
    /// controlling terminal (its standard streams are the caller's to choose).
    pub fn attach(&self, command: &mut Command, uid: u32) {
        let slave = self.slave.as_raw_fd();
        command.uid(uid).gid(uid).env_remove("GENV_ENVIRONMENT_ID");
        // SAFETY: setsid and ioctl are async-signal-safe; `slave` is open in the child
        // until its exec.
        unsafe {
            command.pre_exec(move || {
                if libc::setsid() < 0 || libc::ioctl(slave, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            })
        };
    }
}

/// `gpu-process ARGS` run by `uid` on `terminal`, once it said it is ready; its stdin
/// and stdout are pipes (for `--wait-stdin`).
pub fn gpu_process(terminal: &Terminal, uid: u32, eid: Option<&str>, args: &[&str]) -> Child {
    let mut command = Command::new(genv_enforcer_tests::artefact("gpu-process"));
    command
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    terminal.attach(&mut command, uid);
    if let Some(eid) = eid {
        command.env("GENV_ENVIRONMENT_ID", eid);
    }
    let mut child = command.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready", "gpu-process did not start");
    child
}

/// The lines of `bytes` with text on them.
pub fn lines(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .split('\n')
        .map(|l| l.trim_matches('\r').to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The enforcer's lines among them.
pub fn told(bytes: &[u8]) -> Vec<String> {
    lines(bytes)
        .into_iter()
        .filter(|l| l.contains("genv-enforcer:"))
        .collect()
}

/// Nothing a terminal acts on: only printable text, and the line breaks around it.
pub fn inert(bytes: &[u8]) -> bool {
    bytes
        .iter()
        .all(|&b| b == b'\r' || b == b'\n' || (0x20..0x7f).contains(&b))
}
