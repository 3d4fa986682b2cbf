//! The process a decision is about, as its line needs it: its name, its user, and its
//! controlling terminal. Read before the process is signalled: a killed process has no
//! `/proc` entry left to read, often before the daemon gets to it.

use std::io::Read;

use super::Terminal;
use super::tty::rdev_of_tty_nr;
use crate::backends::procfs;

/// `comm` is at most 16 bytes; a little room for a kernel that gives more.
const COMM_BYTES: u64 = 64;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subject {
    /// Its real uid.
    pub uid: u32,
    /// `comm`, raw.
    pub comm: Vec<u8>,
    pub terminal: Option<Terminal>,
}

impl Subject {
    /// Process `pid`, if it is still the one that started at `start_time` (when given).
    /// Its stat file's descriptor stays bound to the process it was opened for, so what
    /// is read by path between two of its reads is that process's, even if the pid is
    /// reused meanwhile: a reused pid reads ESRCH there.
    pub fn of_process(pid: u32, start_time: Option<u64>) -> Option<Self> {
        let file = procfs::StatFile::open(pid).ok()?;
        let stat = file.read().ok()?;
        if start_time.is_some_and(|t| t != stat.start_time) {
            return None;
        }
        let uid = procfs::real_uid(pid).ok()?;
        let comm = comm(pid).unwrap_or_default();
        let again = file.read().ok()?;
        (again.start_time == stat.start_time).then(|| Self {
            uid,
            comm,
            terminal: rdev_of_tty_nr(stat.tty_nr).map(|rdev| Terminal { rdev, uid }),
        })
    }
}

fn comm(pid: u32) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(format!("/proc/{pid}/comm"))?
        .take(COMM_BYTES)
        .read_to_end(&mut bytes)?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    use super::*;
    use crate::notify::tty::tests::{await_exec, child_on, pty};

    fn me() -> u32 {
        rustix::process::getuid().as_raw()
    }

    #[test]
    fn a_process_is_found_on_its_controlling_terminal_and_no_other() {
        let pty = pty();
        let mut child = child_on(&pty, "sleep", &["60"]);
        let pid = child.id();
        let start = procfs::stat(pid).unwrap().start_time;
        let expected = Subject {
            uid: me(),
            comm: b"sleep".to_vec(),
            terminal: Some(Terminal {
                rdev: pty.rdev,
                uid: me(),
            }),
        };
        assert_eq!(
            Subject::of_process(pid, Some(start)),
            Some(expected.clone())
        );
        assert_eq!(Subject::of_process(pid, None), Some(expected));
        // Another process under this pid (another start time): nothing.
        assert_eq!(Subject::of_process(pid, Some(start + 1)), None);
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(Subject::of_process(pid, Some(start)), None);
    }

    #[test]
    fn a_process_without_a_terminal_has_none() {
        let mut command = Command::new("sleep");
        command.arg("60").stdin(Stdio::null());
        // SAFETY: setsid is async-signal-safe.
        unsafe {
            command.pre_exec(|| match libc::setsid() {
                -1 => Err(std::io::Error::last_os_error()),
                _ => Ok(()),
            })
        };
        let mut detached = command.spawn().unwrap();
        await_exec(detached.id(), "sleep");
        let subject = Subject::of_process(detached.id(), None).unwrap();
        assert_eq!(subject.terminal, None);
        assert_eq!(subject.comm, b"sleep");
        detached.kill().unwrap();
        detached.wait().unwrap();
    }
}
