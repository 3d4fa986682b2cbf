//! The system's OpenSSH client, as genv uses it (`ssh [-l USER] [-o ConnectTimeout=T]
//! HOST sudo genv …`), plus what a loop that talks to every host every few seconds
//! needs: connection multiplexing (one handshake per host, then a round trip per
//! command), `BatchMode` (a daemon cannot type a password; a prompt would hang the
//! host), a deadline per command, and bounded reads of what a host answers.

use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use super::hosts::Host;

/// The most a host's answer to one command may hold: a snapshot of thousands of
/// processes is a few MiB.
pub const ANSWER_LIMIT: u64 = 64 << 20;
/// The most of a host's stderr kept for its error line.
const STDERR_LIMIT: u64 = 64 << 10;
/// How long an idle multiplexed connection stays up after the last command.
const PERSIST: &str = "ControlPersist=120";

#[derive(Clone, Debug)]
pub struct SshOptions {
    /// The client (`ssh` on PATH).
    pub program: PathBuf,
    /// `-F FILE`: a config file of the admin's (keys, known hosts, jump hosts).
    pub config: Option<PathBuf>,
    /// `-t`: ssh's `ConnectTimeout`, as genv passes it.
    pub connect_timeout: Option<u32>,
    /// One multiplexed connection per host (ControlMaster).
    pub multiplex: bool,
}

pub struct Ssh {
    options: SshOptions,
    /// The control sockets' directory (private to this run), when multiplexing.
    control_dir: Option<ControlDir>,
}

/// What a host answered.
#[derive(Debug)]
pub struct Answer {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SshError {
    #[error("cannot run {program}: {source}")]
    Spawn { program: String, source: io::Error },
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
    #[error("answered more than {ANSWER_LIMIT} bytes")]
    TooLong,
    #[error("talking to ssh: {0}")]
    Io(#[from] io::Error),
}

impl Ssh {
    pub fn new(options: SshOptions) -> io::Result<Self> {
        let control_dir = match options.multiplex {
            true => Some(ControlDir::create()?),
            false => None,
        };
        Ok(Self {
            options,
            control_dir,
        })
    }

    /// `ssh … HOST WORDS…`, with stdout and stderr piped.
    fn command(&self, host: &Host, words: &[String], stream: bool) -> Command {
        let mut command = Command::new(&self.options.program);
        command.args(["-T", "-o", "BatchMode=yes"]);
        if let Some(config) = &self.options.config {
            command.arg("-F").arg(config);
        }
        if let Some(user) = &host.user {
            command.args(["-l", user]);
        }
        if let Some(timeout) = self.options.connect_timeout {
            command.args(["-o", &format!("ConnectTimeout={timeout}")]);
        }
        if let Some(dir) = &self.control_dir {
            command.args(["-o", "ControlMaster=auto", "-o", PERSIST, "-o"]);
            command.arg(format!("ControlPath={}/%C", dir.0.display()));
        }
        if stream {
            // A stream that stops answering (host down, network cut) ends within 15 s,
            // and is opened again.
            command.args(["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]);
        }
        // Names were checked not to start with '-'; `--` says so to ssh as well.
        command.arg("--").arg(&host.name).args(words);
        command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    /// Runs WORDS on HOST, feeding it `stdin`, within `deadline`.
    pub async fn run(
        &self,
        host: &Host,
        words: &[String],
        stdin: Option<&[u8]>,
        deadline: Duration,
    ) -> Result<Answer, SshError> {
        let mut command = self.command(host, words, false);
        command.stdin(match stdin {
            Some(_) => Stdio::piped(),
            None => Stdio::null(),
        });
        let mut child = self.spawn(&mut command)?;
        match tokio::time::timeout(deadline, converse(&mut child, stdin)).await {
            Ok(answer) => answer,
            Err(_) => {
                let _ = child.start_kill();
                Err(SshError::TimedOut(deadline))
            }
        }
    }

    /// Starts WORDS on HOST as a stream: stdout piped for reading, stdin a pipe kept
    /// open (the remote end sees it close when this side goes away).
    pub fn stream(&self, host: &Host, words: &[String]) -> Result<Child, SshError> {
        let mut command = self.command(host, words, true);
        command.stdin(Stdio::piped());
        self.spawn(&mut command)
    }

    fn spawn(&self, command: &mut Command) -> Result<Child, SshError> {
        command.spawn().map_err(|source| SshError::Spawn {
            program: self.options.program.display().to_string(),
            source,
        })
    }

    /// Ends the multiplexed connections (`ssh -O exit`), at the end of a run.
    pub async fn close(&self, hosts: &[Host]) {
        let Some(dir) = &self.control_dir else {
            return;
        };
        for host in hosts {
            let mut command = Command::new(&self.options.program);
            if let Some(config) = &self.options.config {
                command.arg("-F").arg(config);
            }
            if let Some(user) = &host.user {
                command.args(["-l", user]);
            }
            command
                .args(["-O", "exit", "-o"])
                .arg(format!("ControlPath={}/%C", dir.0.display()))
                .arg("--")
                .arg(&host.name)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true);
            let _ = tokio::time::timeout(Duration::from_secs(2), command.status()).await;
        }
    }
}

/// Writes stdin, reads stdout and stderr (bounded), and waits.
async fn converse(child: &mut Child, stdin: Option<&[u8]>) -> Result<Answer, SshError> {
    let input = child.stdin.take();
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let write = async {
        if let (Some(mut pipe), Some(bytes)) = (input, stdin) {
            // A host that does not read its input is its own failure: the answer says.
            let _ = pipe.write_all(bytes).await;
        }
    };
    let read_out = async {
        let mut out = Vec::new();
        (&mut stdout)
            .take(ANSWER_LIMIT + 1)
            .read_to_end(&mut out)
            .await
            .map(|_| out)
    };
    let read_err = async {
        let mut err = Vec::new();
        (&mut stderr)
            .take(STDERR_LIMIT)
            .read_to_end(&mut err)
            .await
            .map(|_| err)
    };
    let ((), out, err) = tokio::join!(write, read_out, read_err);
    let (out, err) = (out?, err?);
    if out.len() as u64 > ANSWER_LIMIT {
        let _ = child.start_kill();
        return Err(SshError::TooLong);
    }
    let status = child.wait().await?;
    Ok(Answer {
        status,
        stdout: out,
        stderr: String::from_utf8_lossy(&err).trim().to_owned(),
    })
}

/// A directory of this run's own for the control sockets: made fresh (never one that
/// exists, so never one another user prepared), mode 0700, removed at the end.
struct ControlDir(PathBuf);

impl ControlDir {
    fn create() -> io::Result<Self> {
        let base = std::env::var_os("XDG_RUNTIME_DIR")
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
            .unwrap_or_else(std::env::temp_dir);
        let mut last = None;
        for attempt in 0..16u32 {
            let dir = base.join(format!(
                "genv-enforcer-ssh.{}.{}",
                std::process::id(),
                nonce(attempt)
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(Self(dir)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no control directory")))
    }

    #[cfg(test)]
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

fn nonce(attempt: u32) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (now.as_nanos() as u64) ^ (u64::from(attempt) << 48)
}

impl Drop for ControlDir {
    fn drop(&mut self) {
        // Sockets of masters still exiting may remain: remove what is there.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn the_control_directory_is_private_and_fresh() {
        let a = ControlDir::create().unwrap();
        let b = ControlDir::create().unwrap();
        assert_ne!(a.path(), b.path());
        let mode = std::fs::metadata(a.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        let path = a.path().to_owned();
        drop(a);
        assert!(!path.exists());
    }

    #[test]
    fn the_host_comes_after_every_option() {
        let ssh = Ssh::new(SshOptions {
            program: "ssh".into(),
            config: Some("/etc/fleet.conf".into()),
            connect_timeout: Some(3),
            multiplex: true,
        })
        .unwrap();
        let host = Host {
            name: "gpu1".into(),
            user: Some("admin".into()),
        };
        let words = ["sudo".to_owned(), "genv-enforcer".to_owned()];
        let command = ssh.command(&host, &words, false);
        let args: Vec<String> = command
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let host_at = args.iter().position(|a| a == "gpu1").unwrap();
        assert_eq!(args[host_at - 1], "--");
        assert_eq!(&args[host_at + 1..], ["sudo", "genv-enforcer"]);
        for option in ["BatchMode=yes", "ConnectTimeout=3", "ControlMaster=auto"] {
            assert!(args[..host_at].iter().any(|a| a == option), "{args:?}");
        }
        assert!(args.windows(2).any(|w| w == ["-l", "admin"]));
        assert!(args.windows(2).any(|w| w == ["-F", "/etc/fleet.conf"]));
    }
}
