//! `--bpf-log`: the kernel programs' own account of each GPU open they decided about
//! (the identity they found, the environment it names and its owner, the verdict),
//! read from aya-log's ring buffer and printed on stderr as `[BPF] …` lines.
//!
//! The programs write these only when the daemon loaded them with the log level up;
//! otherwise the level is a read-only 0 and the verifier drops the logging code, so the
//! records exist only while someone asked for them.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex};

use aya_log::EbpfLogger;
use rustix::event::{PollFd, PollFlags, poll};

/// The names of the environments the kernel knows by identity, for the lines.
pub type EnvNames = Arc<Mutex<HashMap<u64, String>>>;

/// Reads and prints the log on a thread of its own: a stream of GPU opens keeps aya-log's
/// reader busy for as long as records keep coming, and writing to a stalled stderr
/// blocks; neither may hold up the daemon's event loop.
pub fn spawn(mut logger: EbpfLogger<Printer>) -> io::Result<()> {
    std::thread::Builder::new()
        .name("bpf-log".into())
        .spawn(move || {
            loop {
                let mut fds = [PollFd::new(&logger, PollFlags::IN)];
                match poll(&mut fds, None) {
                    Ok(_) => logger.flush(),
                    Err(rustix::io::Errno::INTR) => {}
                    Err(e) => {
                        tracing::warn!(
                            "--bpf-log: reading the decision log failed ({e}); no more [BPF] lines"
                        );
                        return;
                    }
                }
            }
        })
        .map(drop)
}

/// Prints each record as one `[BPF]` line, naming the environment of an identity the
/// daemon mirrored.
pub struct Printer {
    pub names: EnvNames,
}

impl log::Log for Printer {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = record.args().to_string();
        let names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        tracing::info!(target: "bpf", "{}", with_env_name(&line, &names));
    }

    fn flush(&self) {}
}

/// `identity 1f…` becomes `identity 1f… (env NAME)` where the identity is known.
fn with_env_name(line: &str, names: &HashMap<u64, String>) -> String {
    const KEY: &str = "identity ";
    let Some(at) = line.find(KEY).map(|at| at + KEY.len()) else {
        return line.to_owned();
    };
    let hex: String = line[at..]
        .chars()
        .take_while(char::is_ascii_hexdigit)
        .collect();
    match u64::from_str_radix(&hex, 16)
        .ok()
        .and_then(|id| names.get(&id))
    {
        Some(name) => format!(
            "{}{hex} (env {name:?}){}",
            &line[..at],
            &line[at + hex.len()..]
        ),
        None => line.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_identity_is_named_and_an_unknown_one_left_as_it_is() {
        let names = HashMap::from([(0x1f2e, "alice-env".to_owned())]);
        assert_eq!(
            with_env_name(
                "GPU 0 opened by pid 7 uid 1000: identity 1f2e, its environment",
                &names
            ),
            "GPU 0 opened by pid 7 uid 1000: identity 1f2e (env \"alice-env\"), its environment"
        );
        let line = "GPU 0 opened by pid 7 uid 1000: identity 99, its identity names no active";
        assert_eq!(with_env_name(line, &names), line);
        assert_eq!(
            with_env_name("no identity here", &names),
            "no identity here"
        );
    }
}
