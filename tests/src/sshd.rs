//! Simulated GPU hosts reachable over real SSH, for remote enforcement.
//!
//! Each host is a network namespace of its own (a veth pair to this one, a /30 of
//! 10.77.0.0/16) running Debian's real `sshd`, with key-based login for root, and a
//! [`Node`] of its own: its own genv state directory and fake NVML. The host's sshd also
//! runs in a mount namespace of its own, where `/etc/sudoers` is the host's: `sudo` keeps
//! the host's `GENV_TMPDIR` and fake NVML (which sshd sets for every session) and finds
//! the host's tools first on its `secure_path`: `genv-enforcer`, or Python genv and the
//! mock `nvidia-smi`, or a `genv` that is genv-enforcer behind a wrapper. Its
//! `/etc/passwd` is its own too: this machine's, and the [`USERS`], each with a uid of
//! its own on each host ([`SshHost::uid`]), as across a fleet with no shared directory.
//!
//! The client side is an ssh_config file (the key, the hosts' keys as known hosts, root
//! as the login), given to genv-enforcer with `--ssh-config` and to genv's own `ssh`
//! through a wrapper on its PATH.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::{Genv, Node, artefact, wait_for_or, workspace_root};

/// What a host runs as `genv` / `genv-enforcer` behind sudo.
#[derive(Clone, Debug)]
pub enum Runs {
    /// genv-enforcer, and a `genv` that runs it (for genv's own `remote`).
    Enforcer,
    /// Python genv 1.4.3 and the mock nvidia-smi.
    PythonGenv,
    /// A script standing in for genv-enforcer (bad answers); it is given the arguments.
    Script(String),
}

/// Users every simulated host knows besides this machine's own. Their processes are
/// the test's, run with the uid the host gives them: the hosts share this machine's
/// kernel, and differ only in the names their user databases give uids.
pub const USERS: [&str; 3] = ["alice", "bob", "mallory"];

/// The uid of [`USERS`]`[user]` on host `host`: another on each host.
fn user_uid(host: u32, user: usize) -> u32 {
    64_700 + 100 * host + user as u32
}

pub struct SshHost {
    /// The host's address, as `-H` names it and as its lines are prefixed.
    pub name: String,
    pub node: Node,
    netns: String,
    /// This side's end of the veth pair.
    link: String,
    sshd: Child,
    /// The host's own tools, first on sudo's path.
    pub bin: PathBuf,
    /// Its place in the fleet, which decides its users' uids.
    index: u32,
}

pub struct SshFleet {
    pub dir: PathBuf,
    /// The client's ssh_config.
    pub config: PathBuf,
    pub hosts: Vec<SshHost>,
    /// A directory with an `ssh` that reads [`Self::config`], for genv's `remote`.
    client_bin: PathBuf,
}

fn sh(command: &str) {
    let status = Command::new("sh").args(["-c", command]).status().unwrap();
    assert!(status.success(), "{command} failed: {status}");
}

/// Whether this machine can run the fleet; the test fails with the reason otherwise
/// (`cargo xtask test` installs openssh-server and sudo).
fn require_tools() {
    for tool in [
        "/usr/sbin/sshd",
        "/usr/bin/ssh",
        "/usr/bin/ssh-keygen",
        "/usr/bin/sudo",
    ] {
        assert!(
            Path::new(tool).exists(),
            "{tool} is missing: install openssh-server, openssh-client and sudo (cargo xtask test does)"
        );
    }
}

impl SshFleet {
    /// One host per entry, each with `gpus` GPUs.
    pub fn start(kinds: &[Runs], gpus: u32) -> Self {
        require_tools();
        let slot = crate::unique() as u32;
        let tag = (std::process::id() ^ (slot << 10)) & 0xffff;
        let dir = std::env::temp_dir().join(format!("genv-fleet-{}-{slot}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all("/run/sshd").unwrap();
        let key = dir.join("client_key");
        sh(&format!(
            "ssh-keygen -q -t ed25519 -N '' -f {}",
            key.display()
        ));
        std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys")).unwrap();
        let octet = 100 + (std::process::id() + slot) % 150;
        let mut known_hosts = String::new();
        let mut hosts = Vec::new();
        for (i, kind) in kinds.iter().enumerate() {
            let host = SshHost::start(&dir, tag, octet, i as u32, kind, gpus);
            let public = std::fs::read_to_string(host.dir().join("host_key.pub")).unwrap();
            known_hosts.push_str(&format!("{} {}", host.name, public));
            hosts.push(host);
        }
        std::fs::write(dir.join("known_hosts"), known_hosts).unwrap();
        let config = dir.join("ssh_config");
        std::fs::write(
            &config,
            format!(
                "Host *\n  User root\n  IdentityFile {}\n  IdentitiesOnly yes\n  UserKnownHostsFile {}\n  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  LogLevel ERROR\n",
                key.display(),
                dir.join("known_hosts").display()
            ),
        )
        .unwrap();
        let client_bin = dir.join("client-bin");
        std::fs::create_dir_all(&client_bin).unwrap();
        write_script(
            &client_bin.join("ssh"),
            &format!("exec /usr/bin/ssh -F {} \"$@\"\n", config.display()),
        );
        let fleet = Self {
            dir,
            config,
            hosts,
            client_bin,
        };
        for host in &fleet.hosts {
            fleet.wait_for_login(host);
        }
        fleet
    }

    fn wait_for_login(&self, host: &SshHost) {
        let said = std::cell::RefCell::new(String::new());
        let login = || {
            let out = Command::new("ssh")
                .args(["-F"])
                .arg(&self.config)
                .args(["-o", "BatchMode=yes", &host.name, "true"])
                .stdin(Stdio::null())
                .output()
                .unwrap();
            *said.borrow_mut() = String::from_utf8_lossy(&out.stderr).into_owned();
            out.status.success().then_some(())
        };
        wait_for_or(
            format_args!("sshd on {} to let us in", host.name),
            Duration::from_secs(20),
            login,
            || said.take(),
        );
    }

    /// `-H` for every host.
    pub fn hosts_arg(&self) -> String {
        let names: Vec<&str> = self.hosts.iter().map(|h| h.name.as_str()).collect();
        names.join(",")
    }

    /// `genv-enforcer remote --ssh-config … -H <all> ARGS`.
    pub fn remote(&self, args: &[&str]) -> Command {
        let mut command = Command::new(artefact("genv-enforcer"));
        command
            .arg("remote")
            .arg("--ssh-config")
            .arg(&self.config)
            .args(["-H", &self.hosts_arg()])
            .args(args);
        command
    }

    /// genv 1.4.3's own `genv remote -H <all> ARGS`, its `ssh` reading the fleet's config.
    pub fn genv_remote(&self, args: &[&str]) -> Command {
        let genv = Genv::get();
        let mut command = Command::new(genv.bin());
        command
            .env(
                "PATH",
                format!("{}:{}", self.client_bin.display(), genv.path()),
            )
            .env("PYTHONUNBUFFERED", "1")
            .args(["remote", "-H", &self.hosts_arg()])
            .args(args);
        command
    }

    /// The host's network goes away: its end of the link is taken down.
    pub fn take_down(&self, host: usize) {
        sh(&format!("ip link set {} down", self.hosts[host].link));
    }

    /// The host's sshd stops answering (SIGSTOP): connections open, nothing comes back.
    pub fn hang(&self, host: usize) {
        // SAFETY: kill(2) takes no pointer; the sshd is this harness's child.
        unsafe { libc::kill(self.hosts[host].sshd.id() as i32, libc::SIGSTOP) };
    }
}

impl SshHost {
    fn start(fleet: &Path, tag: u32, octet: u32, i: u32, kind: &Runs, gpus: u32) -> Self {
        let node = Node::new(gpus);
        let netns = format!("genv-fleet-{tag:04x}-{i}");
        let link = format!("gvr{tag:04x}{i:02x}");
        let peer = format!("gvp{tag:04x}{i:02x}");
        let (near, far) = (
            format!("10.77.{octet}.{}", 4 * i + 1),
            format!("10.77.{octet}.{}", 4 * i + 2),
        );
        sh(&format!(
            "ip netns add {netns} && ip link add {link} type veth peer name {peer} && \
             ip link set {peer} netns {netns} && ip addr add {near}/30 dev {link} && \
             ip link set {link} up && ip -n {netns} addr add {far}/30 dev {peer} && \
             ip -n {netns} link set {peer} up && ip -n {netns} link set lo up"
        ));
        let dir = node.dir.join("host");
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        install_tools(&bin, kind);
        sh(&format!(
            "ssh-keygen -q -t ed25519 -N '' -f {}",
            dir.join("host_key").display()
        ));
        // The host's own run directory: the hosts share this machine's /run.
        let run_dir = dir.join("run");
        std::fs::create_dir_all(&run_dir).unwrap();
        let mut env = format!(
            "GENV_TMPDIR={} GENV_FAKE_NVML_CONFIG={} GENV_ENFORCER_NVML_LIB={} GENV_ENFORCER_RUN_DIR={}",
            node.state.display(),
            node.config_path().display(),
            artefact("libnvidia_ml_fake.so").display(),
            run_dir.display()
        );
        // Where `cargo xtask test` found the checkout one root may not run binaries
        // from (it says so), the hosts' root runs them all the same.
        if let Ok(allow) = std::env::var("GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY") {
            env.push_str(&format!(" GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY={allow}"));
        }
        std::fs::write(
            dir.join("sshd_config"),
            format!(
                "ListenAddress {far}\nHostKey {}\nPidFile none\nAuthorizedKeysFile {}\n\
                 PermitRootLogin prohibit-password\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n\
                 MaxSessions 100\nMaxStartups 200\nLogLevel ERROR\nSetEnv {env}\n",
                dir.join("host_key").display(),
                fleet.join("authorized_keys").display()
            ),
        )
        .unwrap();
        let sudoers = dir.join("sudoers");
        std::fs::write(
            &sudoers,
            format!(
                "Defaults env_reset\n\
                 Defaults env_keep += \"GENV_TMPDIR GENV_FAKE_NVML_CONFIG GENV_ENFORCER_NVML_LIB GENV_ENFORCER_RUN_DIR GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY\"\n\
                 Defaults secure_path=\"{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\"\n\
                 root ALL=(ALL:ALL) NOPASSWD: ALL\n",
                bin.display()
            ),
        )
        .unwrap();
        sh(&format!(
            "chown root:root {0} && chmod 0440 {0}",
            sudoers.display()
        ));
        let passwd = dir.join("passwd");
        let mut users = std::fs::read_to_string("/etc/passwd").unwrap();
        for (k, name) in USERS.iter().enumerate() {
            let uid = user_uid(i, k);
            users.push_str(&format!(
                "{name}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin\n"
            ));
        }
        std::fs::write(&passwd, users).unwrap();
        let sshd = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .args([
                "--",
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
            ])
            .arg(format!(
                "mount --bind {} /etc/sudoers && mount --bind {} /etc/passwd && {} exec /usr/sbin/sshd -D -e -f {}",
                sudoers.display(),
                passwd.display(),
                QUIET_SHELL,
                dir.join("sshd_config").display()
            ))
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Self {
            name: far,
            node,
            netns,
            link,
            sshd,
            bin,
            index: i,
        }
    }

    /// The uid `name` (one of [`USERS`]) has on this host.
    pub fn uid(&self, name: &str) -> u32 {
        let user = USERS.iter().position(|u| *u == name).expect("one of USERS");
        user_uid(self.index, user)
    }

    /// A shell of `name` (one of [`USERS`]) on this host, as genv records it among an
    /// environment's `pids`: alive, running as the user's uid here, not a GPU process.
    pub fn shell_of(&mut self, name: &str) -> u32 {
        let uid = self.uid(name);
        self.node.spawn_with(None, &[], &[], Some(uid))
    }

    fn dir(&self) -> PathBuf {
        self.node.dir.join("host")
    }

    /// Replaces the last line of the host's sudoers (`root ALL=(ALL:ALL) NOPASSWD: ALL`)
    /// with `rule`, in place (the file is bind-mounted into the host's namespace).
    pub fn restrict_sudo(&self, rule: &str) {
        let sudoers = self.dir().join("sudoers");
        let text = std::fs::read_to_string(&sudoers).unwrap();
        let text = text.replace("root ALL=(ALL:ALL) NOPASSWD: ALL\n", &format!("{rule}\n"));
        std::fs::write(&sudoers, text).unwrap();
    }

    /// The host's `--run-dir` (`GENV_ENFORCER_RUN_DIR` in its sessions).
    pub fn run_dir(&self) -> PathBuf {
        self.dir().join("run")
    }

    /// Whether a `usage watch` runs for this host (its stream is open).
    pub fn watching(&self) -> bool {
        self.running("watch") > 0
    }

    /// How many `usage SUB` (`watch`, `snapshot`, `execute`) run for this host, not
    /// counting the `sudo` above each.
    pub fn running(&self, sub: &str) -> usize {
        self.commands(sub).len()
    }

    /// The command lines of the `usage SUB` that run for this host (not their `sudo`).
    pub fn commands(&self, sub: &str) -> Vec<Vec<String>> {
        let wanted = format!("GENV_TMPDIR={}", self.node.state.display());
        let flat = std::fs::read_dir("/proc").unwrap().flatten();
        flat.filter_map(|entry| {
            let dir = entry.path();
            let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
            let words: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            let runs = words
                .windows(2)
                .any(|w| w == [&b"usage"[..], sub.as_bytes()]);
            let ours = runs
                && !words.iter().any(|w| *w == b"sudo")
                && std::fs::read(dir.join("environ"))
                    .unwrap_or_default()
                    .split(|b| *b == 0)
                    .any(|v| v == wanted.as_bytes());
            ours.then(|| {
                let words = words
                    .iter()
                    .map(|w| String::from_utf8_lossy(w).into_owned());
                words.collect()
            })
        })
        .collect()
    }

    /// Lines a [`Runs::Script`] host logged, one per invocation (its arguments).
    pub fn script_calls(&self) -> String {
        std::fs::read_to_string(self.dir().join("calls")).unwrap_or_default()
    }
}

/// sshd runs each command through root's bash, which on Debian reads `~/.bashrc` even
/// without a terminal: this machine's own (pyenv's shims, rehashed under a lock at every
/// shell) has no place on a simulated host, whose root gets empty ones.
const QUIET_SHELL: &str = "for rc in /root/.bashrc /etc/bash.bashrc /root/.profile; do \
     [ -f $rc ] && mount --bind /dev/null $rc; done;";

fn install_tools(bin: &Path, kind: &Runs) {
    let enforcer = artefact("genv-enforcer");
    match kind {
        Runs::Enforcer => {
            std::os::unix::fs::symlink(&enforcer, bin.join("genv-enforcer")).unwrap();
            write_script(
                &bin.join("genv"),
                &format!("exec {} \"$@\"\n", enforcer.display()),
            );
        }
        Runs::PythonGenv => {
            std::os::unix::fs::symlink(Genv::get().bin(), bin.join("genv")).unwrap();
            std::os::unix::fs::symlink(
                workspace_root().join("tests/support/nvidia-smi"),
                bin.join("nvidia-smi"),
            )
            .unwrap();
        }
        Runs::Script(body) => {
            let calls = bin.parent().unwrap().join("calls");
            write_script(
                &bin.join("genv-enforcer"),
                &format!("echo \"$*\" >> {}\n{body}\n", calls.display()),
            );
        }
    }
}

fn write_script(path: &Path, body: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

impl Drop for SshHost {
    fn drop(&mut self) {
        // SAFETY: kill(2) takes no pointer; the sshd is this harness's child.
        unsafe { libc::kill(self.sshd.id() as i32, libc::SIGCONT) };
        let _ = self.sshd.kill();
        let _ = self.sshd.wait();
        // Sessions still open (a `usage watch`) are the sshd's children in the namespace.
        let _ = Command::new("ip")
            .args(["netns", "pids", &self.netns])
            .output()
            .map(|out| {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>() {
                        // SAFETY: kill(2) takes no pointer; these are the test sshd's
                        // own sessions, by pgrep.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            });
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
    }
}

impl Drop for SshFleet {
    fn drop(&mut self) {
        self.hosts.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
