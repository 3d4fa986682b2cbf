//! Which hosts take a report with reasons (`usage execute --with-reasons`,
//! [`crate::report::reasons`]) and which only genv's report.
//!
//! A host is asked with reasons until it refuses the flag, then sent genv's report alone
//! for [`ASK_AGAIN`] (it may be upgraded meanwhile). A refusal is recognised only where
//! nothing ran:
//! - the parsers' answer to a flag they do not know: exit status 2, naming it, before
//!   anything is read or done (genv's argparse: "unrecognized arguments"; an older
//!   genv-enforcer's clap: "unexpected argument");
//! - sudo's, exit status 1, where the host's sudoers allows `usage execute` exactly, as
//!   an older version of the docs advised: sudo runs nothing it does not allow.
//!
//! So such a host costs one more command every few minutes, and a report is never
//! carried out twice.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::ssh::HostAnswer;

/// The flag asked for.
pub const FLAG: &str = "--with-reasons";
/// How long a host that refused is sent genv's report alone.
pub const ASK_AGAIN: Duration = Duration::from_secs(600);

#[derive(Debug, Default)]
pub struct PlainHosts(Mutex<Vec<Option<Instant>>>);

impl PlainHosts {
    pub fn new(hosts: usize) -> Self {
        Self(Mutex::new(vec![None; hosts]))
    }

    /// Whether `host` refused the flag less than [`ASK_AGAIN`] before `now`.
    pub fn is_plain(&self, host: usize, now: Instant) -> bool {
        let refused = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let at = refused.get(host).copied().flatten();
        at.is_some_and(|at| now.duration_since(at) < ASK_AGAIN)
    }

    /// `host` refused the flag at `now`.
    pub fn mark(&self, host: usize, now: Instant) {
        let mut refused = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(at) = refused.get_mut(host) {
            *at = Some(now);
        }
    }
}

/// Whether `answer` is the host's command refusing [`FLAG`] before running anything.
pub fn refused_flag(answer: &HostAnswer) -> bool {
    let said = &answer.stderr;
    let unknown = said.contains("unrecognized arguments") || said.contains("unexpected argument");
    let by_parser = answer.status.code() == Some(2) && unknown && said.contains(FLAG);
    // sudo's own lines start `sudo: ` (a password asked for where NOPASSWD does not
    // cover the command) or name the command refused.
    let by_sudo = answer.status.code() == Some(1)
        && ((said.contains("is not allowed to execute") && said.contains(FLAG))
            || said.contains("sudo: a password is required")
            || said.contains("sudo: a terminal is required"));
    by_parser || by_sudo
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn answer(code: i32, stderr: &str) -> HostAnswer {
        HostAnswer {
            status: std::process::ExitStatus::from_raw(code << 8),
            stdout: Vec::new(),
            stderr: stderr.to_owned(),
        }
    }

    #[test]
    fn only_a_refusal_before_anything_ran_counts() {
        let genv = "usage: genv [-h] SUBCOMMAND ...\ngenv: error: unrecognized arguments: --with-reasons\n";
        let clap = "error: unexpected argument '--with-reasons' found\n";
        let sudo = "Sorry, user genvadmin is not allowed to execute '/usr/local/bin/genv-enforcer usage execute --with-reasons' as root on node1.\n";
        for refusal in [answer(2, genv), answer(2, clap), answer(1, sudo)] {
            assert!(refused_flag(&refusal), "{refusal:?}");
        }
        assert!(refused_flag(&answer(1, "sudo: a password is required\n")));
        assert!(!refused_flag(&answer(1, genv)), "another failure");
        assert!(!refused_flag(&answer(
            2,
            "error: unexpected argument '--other' found"
        )));
        assert!(!refused_flag(&answer(1, "Cannot detach environment a")));
    }

    #[test]
    fn a_host_that_refused_is_asked_again_later() {
        let hosts = PlainHosts::new(2);
        let t0 = Instant::now();
        hosts.mark(1, t0);
        assert!(!hosts.is_plain(0, t0) && hosts.is_plain(1, t0) && !hosts.is_plain(7, t0));
        assert!(!hosts.is_plain(1, t0 + ASK_AGAIN));
    }
}
