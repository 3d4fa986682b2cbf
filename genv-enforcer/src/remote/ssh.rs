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
pub struct HostAnswer {
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
    /// Without a place for the control sockets, every command connects anew (said once).
    pub fn new(options: SshOptions) -> Self {
        let control_dir = match options.multiplex {
            true => ControlDir::create()
                .inspect_err(|e| {
                    tracing::warn!(
                        "No directory for SSH control sockets ({e}); one connection per command"
                    )
                })
                .ok(),
            false => None,
        };
        Self {
            options,
            control_dir,
        }
    }

    /// Where the control sockets are (none without multiplexing).
    pub fn control_dir(&self) -> Option<&std::path::Path> {
        self.control_dir.as_ref().map(|d| d.0.as_path())
    }

    /// `ssh … HOST WORDS…`, with stdout and stderr piped.
    fn command(&self, host: &Host, words: &[String]) -> Command {
        let mut command = Command::new(&self.options.program);
        command.args(["-T", "-o", "BatchMode=yes"]);
        self.connection_options(&mut command, host);
        if let Some(timeout) = self.options.connect_timeout {
            command.args(["-o", &format!("ConnectTimeout={timeout}")]);
        }
        if self.control_dir.is_some() {
            command.args(["-o", "ControlMaster=auto", "-o", PERSIST]);
        }
        // A connection that stops answering (host down, network cut) ends within 15 s.
        // It matters on the command that opens the shared connection, which may be any.
        command.args(["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]);
        // Names were checked not to start with '-'; `--` says so to ssh as well.
        command.arg("--").arg(&host.name).args(words);
        command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    /// `-F`, `-l` and the control socket: what names one host's connection.
    fn connection_options(&self, command: &mut Command, host: &Host) {
        if let Some(config) = &self.options.config {
            command.arg("-F").arg(config);
        }
        if let Some(user) = &host.user {
            command.args(["-l", user]);
        }
        if let Some(dir) = &self.control_dir {
            command.arg("-o").arg(dir.control_path(host));
        }
    }

    /// Runs WORDS on HOST, feeding it `stdin`, within `deadline`.
    pub async fn run(
        &self,
        host: &Host,
        words: &[String],
        stdin: Option<&[u8]>,
        deadline: Duration,
    ) -> Result<HostAnswer, SshError> {
        let mut command = self.command(host, words);
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
        let mut command = self.command(host, words);
        command.stdin(Stdio::piped());
        self.spawn(&mut command)
    }

    fn spawn(&self, command: &mut Command) -> Result<Child, SshError> {
        command.spawn().map_err(|source| SshError::Spawn {
            program: self.options.program.display().to_string(),
            source,
        })
    }

    /// Ends the multiplexed connections (`ssh -O exit`), all at once, at the end of a
    /// run.
    pub async fn close(&self, hosts: &[Host]) {
        if self.control_dir.is_none() {
            return;
        }
        let mut exits = tokio::task::JoinSet::new();
        for host in hosts {
            let mut command = Command::new(&self.options.program);
            self.connection_options(&mut command, host);
            command
                .args(["-O", "exit", "--"])
                .arg(&host.name)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true);
            exits.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(2), command.status()).await;
            });
        }
        exits.join_all().await;
    }
}

/// Writes stdin, reads stdout and stderr (bounded), and waits.
async fn converse(child: &mut Child, stdin: Option<&[u8]>) -> Result<HostAnswer, SshError> {
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
    let read_err = read_tail(&mut stderr, STDERR_LIMIT);
    let ((), out, err) = tokio::join!(write, read_out, read_err);
    let (out, err) = (out?, err?);
    if out.len() as u64 > ANSWER_LIMIT {
        let _ = child.start_kill();
        return Err(SshError::TooLong);
    }
    let status = child.wait().await?;
    Ok(HostAnswer {
        status,
        stdout: out,
        stderr: String::from_utf8_lossy(&err).trim().to_owned(),
    })
}

/// Reads to the end, keeping the last `limit` bytes: a host's stderr is read for as
/// long as it writes (a pipe left full would stall its stdout too), and only its end is
/// kept for the error line.
pub async fn read_tail(
    reader: &mut (impl tokio::io::AsyncRead + Unpin),
    limit: u64,
) -> io::Result<Vec<u8>> {
    let limit = limit as usize;
    let mut kept = Vec::new();
    let mut chunk = vec![0u8; 8192];
    loop {
        let n = reader.read(&mut chunk).await?;
        if n == 0 {
            return Ok(kept);
        }
        kept.extend_from_slice(&chunk[..n]);
        if kept.len() > 2 * limit {
            kept.drain(..kept.len() - limit);
        }
    }
}

/// A directory of this run's own for the control sockets: made fresh (never one that
/// exists, so never one another user prepared), mode 0700, removed at the end.
struct ControlDir(PathBuf);

impl ControlDir {
    /// A socket path has room for 107 bytes, and ssh adds 17 to it while it sets one up:
    /// the directory must leave room for that and a host's number.
    const MAX_DIR: usize = 107 - 17 - 8;

    fn create() -> io::Result<Self> {
        Self::create_in(std::env::temp_dir())
    }

    /// In `temp`, or in `/tmp` where `temp` is too long a path.
    fn create_in(temp: PathBuf) -> io::Result<Self> {
        // ssh_config's syntax splits ControlPath at spaces and quotes: plain paths only.
        let plain = temp.to_str().is_some_and(|t| {
            t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/._-".contains(&b))
        });
        let base = match plain && temp.as_os_str().len() + 20 <= Self::MAX_DIR {
            true => temp,
            false => PathBuf::from("/tmp"),
        };
        let mut last = None;
        for attempt in 0..16u32 {
            let dir = base.join(format!("genv-ssh.{:010x}", nonce(attempt) & 0xff_ffff_ffff));
            if dir.as_os_str().len() > Self::MAX_DIR {
                return Err(io::Error::other(format!(
                    "{} is too long a directory for SSH control sockets",
                    dir.display()
                )));
            }
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(Self(dir)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no control directory")))
    }

    /// `ControlPath=DIR/N`, N the host's place in the fleet; `%` (ssh's escape) doubled.
    fn control_path(&self, host: &Host) -> String {
        let dir = self.0.display().to_string().replace('%', "%%");
        format!("ControlPath={dir}/{}", host.id)
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
    (now.as_nanos() as u64) ^ (u64::from(std::process::id()) << 20) ^ (u64::from(attempt) << 36)
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
    fn control_sockets_fit_a_socket_path_and_are_one_per_host() {
        let long = std::env::temp_dir().join("x".repeat(100));
        std::fs::create_dir_all(&long).unwrap();
        let dir = ControlDir::create_in(long.clone()).unwrap();
        assert!(dir.path().starts_with("/tmp"), "{}", dir.path().display());
        assert!(dir.path().as_os_str().len() <= ControlDir::MAX_DIR);
        let _ = std::fs::remove_dir(&long);
        // Two entries reaching one name (through different ssh_config routes) never
        // share a connection: the socket is the entry's, not the name's (`%C`).
        let host = |id| Host {
            id,
            name: "gpu.internal".into(),
            user: None,
        };
        assert_ne!(dir.control_path(&host(0)), dir.control_path(&host(1)));
        assert!(!dir.control_path(&host(0)).contains("%C"));
    }

    #[test]
    fn a_temporary_directory_ssh_would_split_is_not_used() {
        let spaced = std::env::temp_dir().join("a dir");
        std::fs::create_dir_all(&spaced).unwrap();
        let dir = ControlDir::create_in(spaced.clone()).unwrap();
        assert!(dir.path().starts_with("/tmp") && !dir.path().starts_with(&spaced));
        let _ = std::fs::remove_dir(&spaced);
    }

    #[test]
    fn only_the_end_of_a_long_stderr_is_kept_and_all_of_it_is_read() {
        let text: Vec<u8> = (0..300_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let kept = runtime
            .block_on(read_tail(&mut text.as_slice(), 1000))
            .unwrap();
        assert!(kept.len() >= 1000 && kept.len() <= 2000);
        assert!(text.ends_with(&kept));
    }

    #[test]
    fn the_host_comes_after_every_option() {
        let ssh = Ssh::new(SshOptions {
            program: "ssh".into(),
            config: Some("/etc/fleet.conf".into()),
            connect_timeout: Some(3),
            multiplex: true,
        });
        let host = Host {
            id: 3,
            name: "gpu1".into(),
            user: Some("admin".into()),
        };
        let words = ["sudo".to_owned(), "genv-enforcer".to_owned()];
        let command = ssh.command(&host, &words);
        let args: Vec<String> = command
            .as_std()
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let host_at = args.iter().position(|a| a == "gpu1").unwrap();
        assert_eq!(args[host_at - 1], "--");
        assert_eq!(&args[host_at + 1..], ["sudo", "genv-enforcer"]);
        let control = format!(
            "ControlPath={}/3",
            ssh.control_dir.as_ref().unwrap().path().display()
        );
        for option in [
            "BatchMode=yes",
            "ConnectTimeout=3",
            "ControlMaster=auto",
            &control,
        ] {
            assert!(args[..host_at].iter().any(|a| a == option), "{args:?}");
        }
        assert!(args.windows(2).any(|w| w == ["-l", "admin"]));
        assert!(args.windows(2).any(|w| w == ["-F", "/etc/fleet.conf"]));
    }
}
