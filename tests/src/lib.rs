//! The test harness: a simulated GPU node on a machine without a GPU.
//!
//! A [`Node`] is a private genv state directory plus a fake-NVML configuration that lists
//! real processes (the `gpu-process` helper) as compute contexts. The enforcer runs as
//! its real binary against it, loading the fake NVML through `--nvml-lib`'s environment
//! variable, exactly as it loads the real library. [`Genv`] runs the real genv 1.4.3
//! (installed from PyPI into a private venv) against the same node, through a mock
//! `nvidia-smi` that reads the same configuration. [`events`] adds what the
//! event-driven tests need: a device node that opens without a driver, and the daemon
//! started with its kernel programs.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};

pub mod cuda;
pub mod deny;
pub mod events;
pub mod harness;
pub mod metrics;
pub mod mounts;
pub mod pins;
pub mod running;
pub mod sshd;
pub mod stall;

pub use harness::{DEATH, PATIENCE, path, serial, wait_for, wait_for_or, wait_until, xtask};

pub const MIB: u64 = 1024 * 1024;

/// `target/debug` (or whichever profile built this test).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    let dir = exe.parent().expect("deps dir");
    let dir = if dir.ends_with("deps") {
        dir.parent().unwrap()
    } else {
        dir
    };
    dir.to_owned()
}

/// A workspace artefact; built by `cargo build --workspace` (which `cargo xtask test` runs).
///
/// `GENV_BENCH_ARTEFACTS` names another build's directory instead: `cargo xtask bench
/// --compare` runs this harness against the build of an earlier commit.
pub fn artefact(name: &str) -> PathBuf {
    let dir = std::env::var_os("GENV_BENCH_ARTEFACTS").map_or_else(target_dir, PathBuf::from);
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace` first (`cargo xtask test` does)",
        path.display()
    );
    path
}

/// The Rust sources under `dir`, every folder down, sorted.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// A simulated GPU node.
pub struct Node {
    pub dir: PathBuf,
    pub state: PathBuf,
    config: PathBuf,
    gpus: Vec<Value>,
    contexts: Vec<Value>,
    children: HashMap<u32, Child>,
    /// Processes started by scripts rather than by the node; killed on drop too.
    foreign: Vec<u32>,
    /// Device nodes the fake NVML opens at init, as the real one opens `/dev/nvidia*`.
    nvml_opens: Vec<String>,
    /// The fake libcuda's ledger directory, which the fake NVML reports (see
    /// [`Node::cuda`]).
    ledger: Option<PathBuf>,
    /// Fake-NVML entry points held while a file exists (see [`Node::nvml_gate`]).
    gates: HashMap<String, PathBuf>,
    /// The enforcer binary the node runs (default: the workspace's), and extra
    /// environment for it.
    pub enforcer_binary: Option<PathBuf>,
    pub enforcer_env: Vec<(String, String)>,
    /// Run in the enforcer's process before it execs (a private mount namespace, see
    /// [`mounts`]).
    pub before_exec: Option<mounts::BeforeExec>,
}

impl Node {
    /// A node with `gpus` GPUs of 16 GiB. Minor numbers are deliberately not the indices.
    pub fn new(gpus: u32) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "genv-enforcer-test-{}-{}",
            std::process::id(),
            unique()
        ));
        let state = dir.join("genv");
        std::fs::create_dir_all(&state).unwrap();
        let mut node = Self {
            config: dir.join("nvml.json"),
            dir,
            state,
            gpus: (0..gpus)
                .map(|i| json!({"uuid": format!("GPU-fake-{i}"), "minor": 7 - i, "total_memory": 16384 * MIB}))
                .collect(),
            contexts: Vec::new(),
            children: HashMap::new(),
            foreign: Vec::new(),
            nvml_opens: Vec::new(),
            ledger: None,
            gates: HashMap::new(),
            enforcer_binary: None,
            enforcer_env: Vec::new(),
            before_exec: None,
        };
        node.write_config();
        node
    }

    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// Replaces the fake NVML configuration atomically (the library re-reads it).
    fn write_config(&mut self) {
        self.write_nvml(json!({
            "devices": self.gpus,
            "processes": self.contexts,
            "open_on_init": self.nvml_opens,
            "ledger": self.ledger,
            "gates": self.gates,
        }));
    }

    /// Makes the fake NVML's `entry` wait while `file` exists (a minute at most), as a
    /// driver hangs on a failed GPU.
    pub fn nvml_gate(&mut self, entry: &str, file: &Path) {
        self.gates.insert(entry.to_owned(), file.to_owned());
        self.write_config();
    }

    /// A libcuda for this node: a copy of the fake one (`tests/fake-cuda`) of its own,
    /// so that the uprobes of this node's daemon see this node's processes only, and
    /// whose allocations the fake NVML reports as the driver would. Its path, and the
    /// environment a CUDA program of the node needs.
    pub fn cuda(&mut self) -> (PathBuf, Vec<(String, String)>) {
        let lib = self.dir.join("libcuda.so.1");
        std::fs::copy(artefact("libcuda_fake.so"), &lib).unwrap();
        let ledger = self.dir.join("cuda-ledger");
        std::fs::create_dir_all(&ledger).unwrap();
        self.ledger = Some(ledger.clone());
        self.write_config();
        let env = vec![
            (
                "GENV_FAKE_CUDA_LIB".to_owned(),
                lib.to_str().unwrap().to_owned(),
            ),
            (
                "GENV_FAKE_CUDA_LEDGER".to_owned(),
                ledger.to_str().unwrap().to_owned(),
            ),
        ];
        (lib, env)
    }

    /// The fake libcuda's ledger directory, once [`Node::cuda`] made it.
    pub fn cuda_ledger_dir(&self) -> Option<PathBuf> {
        self.ledger.clone()
    }

    /// What the fake driver says each process holds: `(pid, NVML index) → bytes`.
    pub fn cuda_ledger(&self) -> HashMap<(u32, u32), u64> {
        let Some(dir) = &self.ledger else {
            return HashMap::new();
        };
        let mut held = HashMap::new();
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let name = entry.file_name().into_string().unwrap();
            let Some((pid, gpu)) = name.split_once('-') else {
                continue;
            };
            let (Ok(pid), Ok(gpu)) = (pid.parse(), gpu.parse()) else {
                continue;
            };
            if let Ok(text) = std::fs::read_to_string(entry.path()) {
                held.insert((pid, gpu), text.trim().parse().unwrap_or(0));
            }
        }
        held
    }

    /// Makes the fake NVML open these device nodes at init, as the real library does.
    pub fn nvml_opens(&mut self, nodes: &[&Path]) {
        self.nvml_opens = nodes
            .iter()
            .map(|p| p.to_str().unwrap().to_owned())
            .collect();
        self.write_config();
    }

    /// Writes a raw fake-NVML configuration (for failure injection).
    pub fn write_nvml(&self, config: Value) {
        harness::write_atomically(&self.config, &config.to_string()).unwrap();
    }

    /// Writes genv's state files as genv writes them.
    pub fn write_state(&self, envs: Value, devices: Value) {
        self.write_file(
            "envs.json",
            &serde_json::to_string_pretty(&json!({"envs": envs})).unwrap(),
        );
        self.write_file(
            "devices.json",
            &serde_json::to_string_pretty(&json!({"devices": devices})).unwrap(),
        );
    }

    pub fn write_file(&self, name: &str, text: &str) {
        std::fs::write(self.state.join(name), text).unwrap();
    }

    pub fn read_file(&self, name: &str) -> String {
        std::fs::read_to_string(self.state.join(name)).unwrap()
    }

    /// Devices attached to `eid`, as `devices.json` says now.
    pub fn attached(&self, eid: &str) -> Vec<u64> {
        self.try_attached(eid)
            .expect("devices.json is not JSON (being rewritten?)")
    }

    /// [`Self::attached`] for a poll: `None` while the file is being rewritten (genv and
    /// the enforcer truncate it and write it in place, under genv's lock).
    pub fn try_attached(&self, eid: &str) -> Option<Vec<u64>> {
        let devices: Value = serde_json::from_str(&self.read_file("devices.json")).ok()?;
        let attached = devices["devices"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| {
                d["attachments"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|a| a["eid"] == eid)
            })
            .map(|d| d["index"].as_u64().unwrap())
            .collect();
        Some(attached)
    }

    /// Starts a helper process; it is listed on the given GPUs with the given MiB.
    pub fn spawn(&mut self, eid: Option<&str>, usage: &[(u32, u64)]) -> u32 {
        self.spawn_with(eid, usage, &[], None)
    }

    /// Starts a helper process with extra arguments and, optionally, another uid.
    pub fn spawn_with(
        &mut self,
        eid: Option<&str>,
        usage: &[(u32, u64)],
        args: &[&str],
        uid: Option<u32>,
    ) -> u32 {
        let mut command = Command::new(artefact("gpu-process"));
        command
            .args(args)
            .stdout(Stdio::piped())
            .stdin(Stdio::piped())
            .env_remove("GENV_ENVIRONMENT_ID");
        if let Some(eid) = eid {
            command.env("GENV_ENVIRONMENT_ID", eid);
        }
        if let Some(uid) = uid {
            std::os::unix::process::CommandExt::uid(&mut command, uid);
        }
        let mut child = command.spawn().expect("spawning gpu-process");
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "gpu-process did not start");
        self.adopt(child, usage)
    }

    /// Lets a helper started with `--wait-stdin` do its opens; returns once it has.
    pub fn release(&mut self, pid: u32) {
        let lines = self.attempt(pid);
        assert_eq!(
            lines.last().map(String::as_str),
            Some("opened"),
            "gpu-process did not open: {lines:?}"
        );
    }

    /// Lets a helper started with `--wait-stdin` do its opens, without waiting.
    pub fn tell(&mut self, pid: u32) {
        let child = self.children.get_mut(&pid).expect("a process of this node");
        let stdin = child.stdin.as_mut().expect("started with a piped stdin");
        stdin.write_all(b"go\n").unwrap();
    }

    /// The node's own process `pid` (to time its end finely).
    pub fn child(&mut self, pid: u32) -> &mut Child {
        self.children.get_mut(&pid).expect("a process of this node")
    }

    /// Lets a helper started with `--wait-stdin` do its opens, and returns what it
    /// printed until it said `opened` or its output ended (it died): one `returned …`
    /// line per open that returned to it.
    pub fn attempt(&mut self, pid: u32) -> Vec<String> {
        let child = self.children.get_mut(&pid).expect("a process of this node");
        child
            .stdin
            .as_mut()
            .expect("started with a piped stdin")
            .write_all(b"go\n")
            .unwrap();
        let mut lines = Vec::new();
        let mut reader = BufReader::new(child.stdout.as_mut().unwrap());
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return lines;
            }
            let done = line.trim() == "opened";
            lines.push(line.trim().to_owned());
            if done {
                return lines;
            }
        }
    }

    /// Lists an already-running process (started by the test itself) as a compute
    /// context; the node reaps and kills it like its own.
    pub fn adopt(&mut self, child: Child, usage: &[(u32, u64)]) -> u32 {
        let pid = child.id();
        self.children.insert(pid, child);
        self.list(pid, usage);
        pid
    }

    /// Lists `pid` on each (GPU, MiB) of `usage`, in one configuration write.
    fn list(&mut self, pid: u32, usage: &[(u32, u64)]) {
        for (gpu, mib) in usage {
            self.contexts
                .push(json!({"pid": pid, "gpu": gpu, "used_memory": mib * MIB}));
        }
        self.write_config();
    }

    /// Lists `pid` (a process of this node, or one started by a script) on a GPU.
    pub fn add_context(&mut self, pid: u32, gpu: u32, mib: u64) {
        if !self.children.contains_key(&pid) && !self.foreign.contains(&pid) {
            self.foreign.push(pid);
        }
        self.list(pid, &[(gpu, mib)]);
    }

    /// A character node `major:minor` named `name` in the node's directory (`mknod`,
    /// which needs root): a device recognised by its number, whatever its path.
    pub fn make_char_node(&self, name: &str, major: u32, minor: u32) -> PathBuf {
        let path = self.dir.join(name);
        harness::mknod_char(&path, (major, minor))
            .unwrap_or_else(|e| panic!("mknod {} (needs root): {e}", path.display()));
        path
    }

    /// Marker for a polling daemon run with `--non-env-processes`: a process outside any
    /// environment on GPU 0, and the line terminating it, from a cycle that judged every
    /// other process too. Every line seen meanwhile.
    pub fn mark_cycle(&mut self, daemon: &Daemon) -> Vec<String> {
        let outsider = self.spawn(None, &[(0, 100)]);
        daemon.expect_line(
            &format!("Process {outsider} is not running in a GPU environment"),
            Duration::from_secs(20),
        )
    }

    /// An environment's activating shell: alive, but not a GPU process.
    pub fn shell(&mut self) -> u32 {
        self.spawn(None, &[])
    }

    /// Whether the process still runs (reaping it if it exited).
    pub fn alive(&mut self, pid: u32) -> bool {
        match self.children.get_mut(&pid) {
            Some(child) => child.try_wait().unwrap().is_none(),
            // A script's process: alive while /proc shows it and it is not a zombie.
            None => std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                !matches!(
                    stat[stat.rfind(')').unwrap() + 2..].chars().next(),
                    Some('Z' | 'X')
                )
            }),
        }
    }

    /// Waits up to `timeout` for the process to exit; returns the signal that ended it.
    pub fn wait_exit(&mut self, pid: u32, timeout: Duration) -> Option<i32> {
        let child = self.children.get_mut(&pid).expect("a process of this node");
        harness::wait_exit(child, timeout)
            .map(|status| std::os::unix::process::ExitStatusExt::signal(&status).unwrap_or(0))
    }

    /// The enforcer binary, pointed at this node.
    pub fn enforcer(&self) -> Command {
        let binary = self
            .enforcer_binary
            .clone()
            .unwrap_or_else(|| artefact("genv-enforcer"));
        let mut command = Command::new(binary);
        command
            .env("GENV_TMPDIR", &self.state)
            .env("GENV_FAKE_NVML_CONFIG", &self.config)
            .env("GENV_ENFORCER_NVML_LIB", artefact("libnvidia_ml_fake.so"))
            .env_remove("GENV_TERMINATE_PROCESSES")
            .envs(self.enforcer_env.iter().cloned());
        if let Some(hook) = self.before_exec.clone() {
            // SAFETY: the hooks make system calls alone (`mounts::private_namespace`).
            unsafe { std::os::unix::process::CommandExt::pre_exec(&mut command, move || hook()) };
        }
        command
    }

    /// Runs `genv-enforcer enforce --interval 0 ARGS` and returns its output.
    pub fn enforce_once(&self, args: &[&str]) -> Run {
        let output = self
            .enforcer()
            .args(["enforce", "--interval", "0"])
            .args(args)
            .output()
            .unwrap();
        Run::from(output)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for pid in &self.foreign {
            // SAFETY: kill(2) takes no pointer; these are processes the test started.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
        for child in self.children.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A number no other call in this process returns (scratch names).
pub fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Runs `command` with `stdin` written to it; returns its output.
pub fn run_with_stdin(command: &mut Command, stdin: &str) -> Output {
    use std::io::Write;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

/// A finished command's output, split into lines.
#[derive(Debug)]
pub struct Run {
    pub success: bool,
    pub stdout: Vec<String>,
    pub stderr: String,
}

impl From<Output> for Run {
    fn from(output: Output) -> Self {
        Self {
            success: output.status.success(),
            stdout: String::from_utf8_lossy(&output.stdout)
                .lines()
                .map(str::to_owned)
                .collect(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }
}

impl Run {
    /// Pids named in `Terminating process N ...` lines.
    pub fn terminated(&self) -> Vec<u32> {
        self.stdout
            .iter()
            .filter_map(|l| {
                l.strip_prefix("Terminating process ")?
                    .split(' ')
                    .next()?
                    .parse()
                    .ok()
            })
            .collect()
    }
}

/// The real genv 1.4.3, in a private venv under the target directory.
pub struct Genv {
    bin: PathBuf,
    path: String,
}

impl Genv {
    /// Installs genv once per target directory (serialised across test binaries).
    pub fn get() -> &'static Genv {
        static GENV: OnceLock<Genv> = OnceLock::new();
        GENV.get_or_init(|| {
            let venv = target_dir().join("genv-venv");
            let bin = venv.join("bin/genv");
            let lock = std::fs::File::create(target_dir().join("genv-venv.lock")).unwrap();
            rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
            if !bin.exists() {
                let ok = |c: &mut Command| assert!(c.status().unwrap().success(), "{c:?} failed");
                ok(Command::new("python3").args(["-m", "venv"]).arg(&venv));
                ok(Command::new(venv.join("bin/pip")).args(["install", "-q", "genv==1.4.3"]));
            }
            let support = workspace_root().join("tests/support");
            let path = format!(
                "{}:{}:{}",
                support.display(),
                venv.join("bin").display(),
                std::env::var("PATH").unwrap_or_default()
            );
            Genv { bin, path }
        })
    }

    /// genv's executable.
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// The PATH genv runs with: the mock nvidia-smi, then the venv.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The environment a genv user's shell would have, for scripts the test runs itself.
    pub fn shell_command(&self, node: &Node, script: &str) -> Command {
        let mut command = Command::new("bash");
        command
            .args([
                "-c",
                &format!("set -e; eval \"$(genv shell --init)\"; {script}"),
            ])
            .env("PATH", &self.path)
            .env("GENV_TMPDIR", &node.state)
            .env("GENV_FAKE_NVML_CONFIG", node.config_path());
        command
    }

    pub fn command(&self, node: &Node) -> Command {
        let mut command = Command::new(&self.bin);
        command
            .env("PATH", &self.path)
            .env("GENV_TMPDIR", &node.state)
            .env("GENV_FAKE_NVML_CONFIG", node.config_path())
            .env("PYTHONUNBUFFERED", "1");
        command
    }

    /// Runs a bash script after genv's shell integration, as a genv user would.
    pub fn bash(&self, node: &Node, script: &str) -> Run {
        let output = Command::new("bash")
            .args([
                "-c",
                &format!("set -e; eval \"$(genv shell --init)\"; {script}"),
            ])
            .env("PATH", &self.path)
            .env("GENV_TMPDIR", &node.state)
            .env("GENV_FAKE_NVML_CONFIG", node.config_path())
            .output()
            .unwrap();
        Run::from(output)
    }

    /// `genv enforce --interval 0 ARGS` with signalling off, so the same processes can
    /// then face genv-enforcer. State files are restored afterwards (genv detaches).
    pub fn enforce_dry(&self, node: &Node, args: &[&str]) -> Run {
        let devices = node.read_file("devices.json");
        let envs = node.read_file("envs.json");
        let output = self
            .command(node)
            .args(["enforce", "--interval", "0"])
            .args(args)
            .env("GENV_TERMINATE_PROCESSES", "0")
            .output()
            .unwrap();
        node.write_file("devices.json", &devices);
        node.write_file("envs.json", &envs);
        let run = Run::from(output);
        assert!(run.success, "genv enforce failed: {}", run.stderr);
        run
    }
}

/// An environment record as genv writes it.
pub fn env_record(
    eid: &str,
    uid: u32,
    username: &str,
    gpu_memory: Option<&str>,
    shell: u32,
) -> Value {
    json!({"eid": eid, "uid": uid, "creation": "22/11/2026 02:28:47", "username": username,
           "config": {"name": null, "gpu_memory": gpu_memory, "gpus": null},
           "pids": [shell], "kernel_ids": []})
}

/// A device record with the given environments attached.
pub fn device_record(index: u32, eids: &[&str]) -> Value {
    json!({"index": index, "total_memory": "16384mi",
           "attachments": eids.iter().map(|e| json!({"eid": e, "gpu_memory": null, "time": "22/11/2026 02:28:47"})).collect::<Vec<_>>()})
}

/// A running `genv-enforcer enforce` daemon, stopped (SIGTERM) and reaped on drop.
pub struct Daemon {
    child: Child,
    pub output: std::sync::mpsc::Receiver<String>,
}

impl Daemon {
    pub fn start(node: &Node, args: &[&str]) -> Self {
        let mut child = node
            .enforcer()
            .arg("enforce")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = harness::lines_of(&mut child, None);
        Self { child, output }
    }

    /// Waits (generously) for a line containing `needle`; returns every line seen.
    pub fn expect_line(&self, needle: &str, timeout: Duration) -> Vec<String> {
        match harness::until_line(&self.output, &[needle], timeout) {
            Ok((line, mut seen)) => {
                seen.push(line);
                seen
            }
            Err(seen) => panic!("no line containing {needle:?} within {timeout:?}; saw {seen:#?}"),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and waits up to `timeout` for the daemon to exit.
    pub fn stop(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        // SAFETY: kill(2) takes no pointer; the daemon is this harness's child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        harness::wait_exit(&mut self.child, timeout)
    }
}

impl Drop for Daemon {
    /// SIGTERM; a daemon that has not stopped 30 s later (stuck where a test caught it,
    /// in a FUSE wait only SIGKILL ends) is killed, so that the suite never hangs on it.
    fn drop(&mut self) {
        if self.stop(Duration::from_secs(30)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
