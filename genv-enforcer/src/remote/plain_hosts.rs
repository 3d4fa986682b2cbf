//! Which hosts take a report with reasons (`usage execute --with-reasons`,
//! [`crate::report::reasons`]) and which only genv's report.
//!
//! A host is asked with reasons until it refuses the flag, then sent genv's report alone
//! for the rest of the run. The refusal is recognised by what both parsers do with a
//! flag they do not know: exit status 2, naming it, before anything is read or done
//! (genv's argparse: "unrecognized arguments"; an older genv-enforcer's clap:
//! "unexpected argument"). So a host running genv costs one more command, once, and a
//! report is never carried out twice.

use std::sync::atomic::{AtomicBool, Ordering};

use super::ssh::HostAnswer;

/// The flag asked for.
pub const FLAG: &str = "--with-reasons";

#[derive(Debug, Default)]
pub struct PlainHosts(Vec<AtomicBool>);

impl PlainHosts {
    pub fn new(hosts: usize) -> Self {
        Self((0..hosts).map(|_| AtomicBool::new(false)).collect())
    }

    /// Whether `host` refused the flag before.
    pub fn is_plain(&self, host: usize) -> bool {
        self.0.get(host).is_some_and(|h| h.load(Ordering::Relaxed))
    }

    pub fn mark(&self, host: usize) {
        if let Some(h) = self.0.get(host) {
            h.store(true, Ordering::Relaxed);
        }
    }
}

/// Whether `answer` is the host's command refusing [`FLAG`] as unknown.
pub fn refused_flag(answer: &HostAnswer) -> bool {
    let unknown = answer.stderr.contains("unrecognized arguments")
        || answer.stderr.contains("unexpected argument");
    answer.status.code() == Some(2) && unknown && answer.stderr.contains(FLAG)
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
    fn only_a_parsers_refusal_of_the_flag_counts() {
        let genv = "usage: genv [-h] SUBCOMMAND ...\ngenv: error: unrecognized arguments: --with-reasons\n";
        let clap = "error: unexpected argument '--with-reasons' found\n";
        assert!(refused_flag(&answer(2, genv)) && refused_flag(&answer(2, clap)));
        assert!(!refused_flag(&answer(1, genv)), "another failure");
        assert!(!refused_flag(&answer(
            2,
            "error: unexpected argument '--other' found"
        )));
        let hosts = PlainHosts::new(2);
        hosts.mark(1);
        assert!(!hosts.is_plain(0) && hosts.is_plain(1) && !hosts.is_plain(7));
    }
}
