//! `--memory-at-alloc`'s tests' node: a daemon holding caps at the allocation on the
//! node's own libcuda, and CUDA programs (`cuda-user`) in environments genv made, driven
//! call by call.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};

use crate::events::EventDaemon;
use crate::{DEATH, Genv, Node, artefact, wait_until};

/// genv's `1g`: 10^9 bytes.
pub const CAP: u64 = 1_000_000_000;

pub fn daemon(node: &Node, lib: &Path, mode: &str, extra: &[&str]) -> Option<EventDaemon> {
    let lib = lib.to_str().unwrap();
    let mut args = vec![
        "--memory-at-alloc",
        mode,
        "--cuda-lib",
        lib,
        "--memory-interval",
        "0.5",
    ];
    args.extend_from_slice(extra);
    let daemon = EventDaemon::start(node, &args)?;
    daemon.expect("are held to their environment's gpu_memory");
    Some(daemon)
}

/// A CUDA program in a genv shell: `setup` (genv commands) runs first, then the shell
/// execs `cuda-user`, which keeps its pid.
pub struct CudaUser {
    pub pid: u32,
    pub stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl CudaUser {
    pub fn start(node: &mut Node, cuda_env: &[(String, String)], setup: &str) -> Self {
        let script = format!("{setup}; exec \"$CUDA_USER\"");
        let mut shell = Genv::get().shell_command(node, &script);
        shell.env("CUDA_USER", artefact("cuda-user"));
        Self::spawn(node, cuda_env, shell)
    }

    /// Runs `command` (which ends in `cuda-user`) with the node's CUDA environment,
    /// once it said it is ready.
    pub fn spawn(node: &mut Node, cuda_env: &[(String, String)], mut command: Command) -> Self {
        let mut child = command
            .envs(cuda_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(
            line.starts_with("ready "),
            "cuda-user did not start: {line:?}"
        );
        let pid = node.adopt(child, &[]);
        Self { pid, stdin, stdout }
    }

    /// Sends calls without waiting for their answers.
    pub fn send(&mut self, calls: &[&str]) {
        for call in calls {
            // A process killed meanwhile has closed its end: nothing more to send.
            if writeln!(self.stdin, "{call}").is_err() {
                return;
            }
        }
        let _ = self.stdin.flush();
    }

    /// The next answer; `None` once the process is gone.
    pub fn answer(&mut self) -> Option<String> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) | Err(_) => None,
            Ok(_) => Some(line.trim().to_owned()),
        }
    }

    pub fn call(&mut self, call: &str) -> Option<String> {
        self.send(&[call]);
        self.answer()
    }

    pub fn ok(&mut self, call: &str) -> String {
        let answer = self.call(call);
        match answer {
            Some(a) if a.starts_with("ok ") => a["ok ".len()..].to_owned(),
            other => panic!("{call}: {other:?}"),
        }
    }

    /// `cuInit`, after which the daemon has read the process's CUDA_VISIBLE_DEVICES (a
    /// real program's CUDA start-up takes far longer than that read).
    pub fn init(&mut self, daemon: &EventDaemon, visible: &str) {
        self.ok("init");
        daemon.expect(&format!(
            "Process {} started CUDA with CUDA_VISIBLE_DEVICES={visible}",
            self.pid
        ));
    }
}

/// The environment a CUDA program of a node needs (its libcuda, its ledger).
pub type CudaEnv = Vec<(String, String)>;

/// A node with two GPUs and its own libcuda; the daemon on it, with `mode`.
pub fn setup(mode: &str) -> Option<(Node, CudaEnv, EventDaemon)> {
    let mut node = Node::new(2);
    let (lib, cuda_env) = node.cuda();
    let daemon = daemon(&node, &lib, mode, &[])?;
    Some((node, cuda_env, daemon))
}

/// A node, its daemon in `mode`, and a CUDA program in the environment `eid` (1g on
/// GPU 0, made by genv), CUDA started and on device 0: where most tests begin.
pub fn ready(mode: &str, eid: &str) -> Option<(Node, EventDaemon, CudaUser)> {
    let (mut node, cuda_env, daemon) = setup(mode)?;
    let mut user = capped(&mut node, &cuda_env, &daemon, eid, &[0]);
    user.init(&daemon, "0");
    user.ok("ctx 0");
    Some((node, daemon, user))
}

/// The environment `eid` with a cap of 1g, on `gpus`, made by genv in the shell that
/// then runs the program; the daemon has the cap in the kernel when this returns.
pub fn capped(
    node: &mut Node,
    cuda_env: &[(String, String)],
    daemon: &EventDaemon,
    eid: &str,
    gpus: &[u32],
) -> CudaUser {
    let attach: Vec<String> = gpus
        .iter()
        .map(|i| format!("genv attach --index {i}"))
        .collect();
    let setup = format!(
        "genv activate --id {eid}; genv config gpu-memory 1g; {}",
        attach.join("; ")
    );
    let user = CudaUser::start(node, cuda_env, &setup);
    daemon.expect(&format!("caps held at the allocation: {eid} 1g"));
    // Read at its exec (woken at once) or when the cap came, whichever was last: a real
    // program's CUDA start takes far longer than that.
    daemon.expect(&format!("Process {} is held at its allocations", user.pid));
    user
}

/// `call` takes its process past the cap: it never returns, the process dies of SIGKILL,
/// and the daemon says so. Its line.
pub fn killed_at(node: &mut Node, daemon: &EventDaemon, user: &mut CudaUser, call: &str) -> String {
    let answer = user.call(call);
    if answer.is_some() {
        let lines = daemon.lines();
        let last = &lines[lines.len().saturating_sub(40)..];
        panic!("{call} returned {answer:?}; the daemon's last lines: {last:#?}");
    }
    assert_eq!(node.wait_exit(user.pid, DEATH), Some(libc::SIGKILL));
    daemon.expect(&format!("killed process {} at the allocation", user.pid))
}

pub fn ledger_total(node: &Node, pids: &[u32], gpu: u32) -> u64 {
    node.cuda_ledger()
        .iter()
        .filter(|((pid, index), _)| pids.contains(pid) && *index == gpu)
        .map(|(_, bytes)| *bytes)
        .sum()
}

/// The fake NVML's gates: [`Self::hold`] makes the daemon's next call of an entry point
/// wait, and returns once it waits; [`Self::release`] lets it go on.
pub struct NvmlGates(std::path::PathBuf);

/// Where an enumeration starts (before the fake reads its ledger), and a later call.
pub const ENUMERATION: &str = "nvmlDeviceGetCount_v2";
pub const PROCESSES: &str = "nvmlDeviceGetComputeRunningProcesses_v3";

impl NvmlGates {
    pub fn install(node: &Node) -> Self {
        let gates = Self(node.dir.clone());
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(node.config_path()).unwrap()).unwrap();
        config["gates"] = serde_json::json!({
            ENUMERATION: gates.file(ENUMERATION),
            PROCESSES: gates.file(PROCESSES),
        });
        node.write_nvml(config);
        gates
    }

    fn file(&self, call: &str) -> std::path::PathBuf {
        self.0.join(format!("gate-{call}"))
    }

    pub fn waiting(&self, call: &str, there: bool) {
        let marker = self.0.join(format!("gate-{call}.waiting"));
        let state = if there { "waiting" } else { "passed" };
        wait_until(format_args!("the gate at {call} {state}"), DEATH, || {
            marker.exists() == there
        });
    }

    /// The next call of `call` will wait (without waiting for it).
    pub fn close(&self, call: &str) {
        std::fs::write(self.file(call), b"").unwrap();
    }

    pub fn hold(&self, call: &str) {
        self.close(call);
        self.waiting(call, true);
    }

    pub fn release(&self, call: &str) {
        std::fs::remove_file(self.file(call)).unwrap();
        self.waiting(call, false);
    }
}
