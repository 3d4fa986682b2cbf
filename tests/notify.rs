//! Users are told, on their own terminals, what the enforcer did to their processes and
//! why, and `why` shows each user their own: real pseudo-terminals, held by an
//! unprivileged user's process as its controlling terminal (a session of its own,
//! `TIOCSCTTY`), as a login shell's job holds its pty.
//!
//! Each test reads what the terminal emulator's side (the pty master) shows once the
//! enforcer has dealt with the line (its exit, a log line, the line itself), never
//! after a sleep.
//!
//! The tests that start daemons run one at a time (`serial`): a `--deny` daemon kills
//! any outsider that opens a test GPU node, whoever's test it is.
//!
//! A tier suite (xtask's `TIER_SUITES`): `tier_` tests depend on the program that sees
//! the open (the kernel refuses or kills it); `any_tier_` ones depend on neither the tier
//! nor the kernel (the executor's terminations, the terminal writer, `why`, the
//! allocation probes).

#[path = "notify/terminal.rs"]
mod terminal;

use genv_enforcer_tests::events::{
    EventDaemon, make_gpu_node, tier_refuses, tier_sees_failed_opens,
};
use genv_enforcer_tests::harness::{PATIENCE, path, serial};
use genv_enforcer_tests::{Node, artefact, device_record, env_record};
use serde_json::json;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use terminal::{Terminal, gpu_process, inert, lines, told};

/// Two unprivileged users (the second needs no passwd entry).
const ALICE: u32 = 65534;
const BOB: u32 = 65533;

fn sleep() -> PathBuf {
    PathBuf::from("/bin/sleep")
}

/// `program ARGS` run by `uid` on `terminal`, its output thrown away.
fn on_terminal(
    terminal: &Terminal,
    uid: u32,
    program: &Path,
    eid: Option<&str>,
) -> std::process::Child {
    let mut command = Command::new(program);
    command
        .arg("600")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    terminal.attach(&mut command, uid);
    if let Some(eid) = eid {
        command.env("GENV_ENVIRONMENT_ID", eid);
    }
    command.spawn().unwrap()
}

/// A node with two GPUs, no environment, and a test node for GPU 0.
fn node_with_gpu() -> (Node, PathBuf) {
    let node = Node::new(2);
    let gpu = make_gpu_node(&node.dir.join("nvidia0"));
    node.write_state(
        json!([]),
        json!([device_record(0, &[]), device_record(1, &[])]),
    );
    (node, gpu)
}

#[test]
fn any_tier_a_terminated_outsider_is_told_once_why_on_its_own_terminal() {
    let mut node = Node::new(2);
    let terminal = Terminal::new(ALICE);
    let pid = node.adopt(on_terminal(&terminal, ALICE, &sleep(), None), &[(1, 100)]);
    let run = node.enforce_once(&["--non-env-processes"]);
    assert!(run.success, "{}", run.stderr);
    assert_eq!(run.terminated(), [pid]);
    assert_eq!(
        lines(&terminal.shown()),
        [format!(
            "genv-enforcer: stopped process \"sleep\" (pid {pid}) on GPU 1: not in a genv environment; run 'genv activate --gpus 1' first"
        )],
        "{}",
        run.stderr
    );
    // The log has it as a record with its fields.
    let record = run
        .stderr
        .lines()
        .find(|l| l.starts_with("[DECISION] "))
        .unwrap_or_else(|| panic!("no decision record: {}", run.stderr));
    for field in [
        "rule=\"non-env-processes\"".to_owned(),
        "action=\"terminated\"".to_owned(),
        format!("pid={pid}"),
        format!("uid={ALICE}"),
        "user=nobody".to_owned(),
        "gpu=1".to_owned(),
    ] {
        assert!(record.contains(&field), "{field} in {record}");
    }
}

/// `--notify none`: the terminal is left alone; the log still has the decision.
#[test]
fn any_tier_notify_none_writes_to_no_terminal() {
    let mut node = Node::new(1);
    let terminal = Terminal::new(ALICE);
    let pid = node.adopt(on_terminal(&terminal, ALICE, &sleep(), None), &[(0, 100)]);
    let run = node.enforce_once(&["--non-env-processes", "--notify", "none"]);
    assert_eq!(run.terminated(), [pid]);
    assert!(run.stderr.contains(&format!("pid={pid}")), "{}", run.stderr);
    assert_eq!(lines(&terminal.shown()), [] as [String; 0]);
}

/// An environment named to clear the screen and fake a prompt, and a program named to
/// retitle the window, break the line and send CSI to an 8-bit terminal: the terminal
/// gets one line, printable ASCII only, the names escaped, quoted and labelled.
#[test]
fn any_tier_hostile_names_never_reach_the_terminal_raw() {
    let mut node = Node::new(2);
    let shell = node.spawn_with(None, &[], &[], Some(ALICE));
    let mut env = env_record("e1", ALICE, "alice", None, shell);
    env["config"]["name"] = json!("\u{1b}[2J\u{1b}[1;1Hroot's env\r\n$ sudo \u{9b}31m");
    node.write_state(
        json!([env]),
        json!([device_record(0, &["e1"]), device_record(1, &[])]),
    );
    // A copy of sleep whose name (its comm) holds an OSC title, a clear-screen, a
    // line break, and `Û` (c3 9b: 0x9B is CSI to a terminal not in UTF-8 mode).
    let hostile = node.dir.join("\u{1b}]0;pw\u{7}\u{1b}[2J\nx\u{db}");
    std::fs::copy(sleep(), &hostile).unwrap();
    let terminal = Terminal::new(ALICE);
    let child = on_terminal(&terminal, ALICE, &hostile, Some("e1"));
    let pid = node.adopt(child, &[(1, 100)]);
    let run = node.enforce_once(&[]);
    assert_eq!(run.terminated(), [pid], "{}", run.stderr);
    let shown = terminal.shown();
    // Printable ASCII only: no control, and no byte an 8-bit terminal reads as one.
    assert!(inert(&shown), "{:?}", String::from_utf8_lossy(&shown));
    assert!(!shown.contains(&0x9b), "{shown:?}");
    let lines = lines(&shown);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(&format!(
            "stopped process \"\\u{{1b}}]0;pw\\u{{7}}\\u{{1b}}[2J\\u{{a}}x\\u{{db}}\" (pid {pid}) on GPU 1: environment named \"\\u{{1b}}[2J\\u{{1b}}[1;1Hroot's env\\u{{d}}\\u{{a}}$ sud...\" in envs.json is not attached to GPU 1; run 'genv attach --index 1' first"
        )),
        "{}",
        lines[0]
    );
    // Nor the log raw.
    let record = run
        .stderr
        .lines()
        .find(|l| l.starts_with("[DECISION] "))
        .unwrap();
    assert!(!record.contains('\u{1b}'), "{record:?}");
}

/// Alice's process runs on a terminal that is not hers (as after `su alice` in root's
/// terminal): nothing is written to it. The daemon says why in its log, which is how
/// this test knows the line was dealt with.
#[test]
fn any_tier_a_terminal_of_another_user_gets_nothing() {
    let mut node = Node::new(1);
    let roots = Terminal::new(0);
    let pid = node.adopt(on_terminal(&roots, ALICE, &sleep(), None), &[(0, 100)]);
    let run = node.enforce_once(&["--non-env-processes"]);
    assert_eq!(run.terminated(), [pid]);
    assert!(
        run.stderr.contains(&format!(
            "Not telling process {pid} on its terminal: the terminal belongs to another user"
        )),
        "{}",
        run.stderr
    );
    assert_eq!(lines(&roots.shown()), [] as [String; 0]);
}

/// A process with no controlling terminal (a batch job, its output in a file) is
/// written nothing; its decision is still logged.
#[test]
fn any_tier_a_process_without_a_terminal_gets_nothing() {
    let mut node = Node::new(1);
    let out = node.dir.join("job.out");
    let mut command = Command::new(sleep());
    command
        .arg("600")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap());
    std::os::unix::process::CommandExt::uid(&mut command, ALICE);
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || match libc::setsid() {
            -1 => Err(std::io::Error::last_os_error()),
            _ => Ok(()),
        })
    };
    let pid = node.adopt(command.spawn().unwrap(), &[(0, 100)]);
    let run = node.enforce_once(&["--non-env-processes"]);
    assert_eq!(run.terminated(), [pid]);
    assert!(run.stderr.contains(&format!("pid={pid}")), "{}", run.stderr);
    assert_eq!(std::fs::read(&out).unwrap(), b"");
}

/// Alice's terminal is full and stopped (nobody reads it): her process is terminated
/// all the same, the writer drops her line at once, and the next process, on a terminal
/// that reads, is terminated and told. A write that waited would hold the writer on the
/// first terminal for ever, and the second line would never come.
#[test]
fn any_tier_a_terminal_nobody_reads_holds_up_nothing() {
    let _serial = serial();
    let (mut node, gpu) = node_with_gpu();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let open = ["--open", path(&gpu)];
    let stalled = Terminal::new(ALICE);
    stalled.stall();
    let first = node.adopt(gpu_process(&stalled, ALICE, None, &open), &[(0, 100)]);
    daemon.expect(&format!(
        "Not telling process {first} on its terminal: the terminal is not reading"
    ));
    let reading = Terminal::new(ALICE);
    let second = node.adopt(gpu_process(&reading, ALICE, None, &open), &[(0, 100)]);
    reading.wait_for(&format!(
        "genv-enforcer: stopped process \"gpu-process\" (pid {second}) on GPU 0"
    ));
    assert_eq!(node.wait_exit(first, PATIENCE), Some(libc::SIGTERM));
    assert_eq!(node.wait_exit(second, PATIENCE), Some(libc::SIGTERM));
}

/// Under `--deny`, an outsider's open is refused (lsm, fmod_ret) or the outsider killed
/// in it (fentry, tracepoint): either way, its terminal gets one line saying so, from
/// what the program read at its decision (a killed process is gone by then).
#[test]
fn each_tier_a_refused_or_killed_opener_is_told_once_why() {
    let _serial = serial();
    let (mut node, gpu) = node_with_gpu();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes", "--deny"]) else {
        return;
    };
    daemon.expect("GPU opens outside any environment are ");
    let terminal = Terminal::new(ALICE);
    let args = ["--wait-stdin", "--open", path(&gpu)];
    let pid = node.adopt(gpu_process(&terminal, ALICE, None, &args), &[]);
    node.attempt(pid);
    let expected = match tier_refuses(&daemon.tier) {
        true => format!(
            "genv-enforcer: refused GPU 0 to process \"gpu-process\" (pid {pid}): not in a genv environment; run 'genv activate --gpus 1' first"
        ),
        false => {
            assert_eq!(node.wait_exit(pid, PATIENCE), Some(libc::SIGKILL));
            format!(
                "genv-enforcer: killed process \"gpu-process\" (pid {pid}) on GPU 0: not in a genv environment; run 'genv activate --gpus 1' first"
            )
        }
    };
    let shown = terminal.wait_for(&expected);
    daemon.expect(&format!("pid={pid}"));
    assert_eq!(told(shown.as_bytes()), [expected]);
}

/// On the kill tiers SIGKILL reaches the opener's thread group only: a process sharing
/// its file table (`clone(CLONE_FILES)`) keeps the GPU until the daemon's sweep kills it
/// too, and its user is told of that kill as well, from what was read of it before.
/// (Where the tier sees failed opens, the test node's open fails, nothing is shared,
/// and only the opener is told.)
#[test]
fn each_tier_a_process_sharing_a_killed_openers_descriptors_is_told_too() {
    let _serial = serial();
    let (mut node, gpu) = node_with_gpu();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes", "--deny"]) else {
        return;
    };
    daemon.expect("GPU opens outside any environment are ");
    let terminal = Terminal::new(ALICE);
    let args = ["--wait-stdin", "--open-clone-files", path(&gpu)];
    let sharer = node.adopt(gpu_process(&terminal, ALICE, None, &args), &[]);
    node.attempt(sharer);
    if tier_sees_failed_opens() {
        let shown = terminal.wait_for("genv-enforcer: ");
        assert!(node.alive(sharer), "it holds nothing: left alone");
        assert!(!shown.contains(&format!("(pid {sharer})")), "{shown:?}");
        return;
    }
    assert_eq!(node.wait_exit(sharer, PATIENCE), Some(libc::SIGKILL));
    terminal.wait_for(&format!(
        "genv-enforcer: killed process \"gpu-process\" (pid {sharer}) on GPU 0: not in a genv environment; run 'genv activate --gpus 1' first"
    ));
}

/// `--memory-at-alloc kill`: Alice's program, in her environment capped at 1g, is
/// killed inside the allocation that would cross the cap, and told so on its terminal.
#[test]
fn any_tier_a_process_killed_in_an_allocation_is_told_why() {
    let _serial = serial();
    let mut node = Node::new(2);
    let (lib, cuda_env) = node.cuda();
    let shell = node.spawn_with(None, &[], &[], Some(ALICE));
    node.write_state(
        json!([env_record("alpha", ALICE, "alice", Some("1g"), shell)]),
        json!([device_record(0, &["alpha"]), device_record(1, &[])]),
    );
    let args = ["--memory-at-alloc", "kill", "--cuda-lib", path(&lib)];
    let Some(daemon) = EventDaemon::start(&node, &args) else {
        return;
    };
    daemon.expect("caps held at the allocation: alpha 1g");
    let terminal = Terminal::new(ALICE);
    let mut command = Command::new(artefact("cuda-user"));
    command
        .envs(cuda_env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    terminal.attach(&mut command, ALICE);
    command
        .env("GENV_ENVIRONMENT_ID", "alpha")
        .env("CUDA_VISIBLE_DEVICES", "0");
    let mut child = command.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut ready = String::new();
    stdout.read_line(&mut ready).unwrap();
    assert!(
        ready.starts_with("ready "),
        "cuda-user did not start: {ready:?}"
    );
    let pid = node.adopt(child, &[]);
    let mut call = |call: &str| {
        writeln!(stdin, "{call}").unwrap();
        let mut answer = String::new();
        stdout.read_line(&mut answer).unwrap();
        answer
    };
    // Woken by its exec, the daemon reads what CUDA will read of it (a real program's CUDA
    // start takes far longer than that).
    daemon.expect(&format!("Process {pid} is held at its allocations"));
    assert!(call("init").starts_with("ok"));
    daemon.expect(&format!(
        "Process {pid} started CUDA with CUDA_VISIBLE_DEVICES=0"
    ));
    assert!(call("ctx 0").starts_with("ok"));
    assert!(call("alloc 600").starts_with("ok"));
    assert_eq!(call("alloc 600"), "", "the allocation returned");
    assert_eq!(node.wait_exit(pid, PATIENCE), Some(libc::SIGKILL));
    let expected = format!(
        "genv-enforcer: killed process \"cuda-user\" (pid {pid}) in a memory allocation on GPU 0: the allocation would take environment with id \"alpha\" in envs.json to 1258m, over its gpu_memory of 1g"
    );
    let shown = terminal.wait_for(&expected);
    assert_eq!(told(shown.as_bytes()).len(), 1, "{shown:?}");
}

/// `genv-enforcer why`, run by `uid`.
fn why(uid: u32, run_dir: &Path, args: &[&str]) -> Output {
    let mut command = Command::new(artefact("genv-enforcer"));
    command.arg("why").args(args).arg("--run-dir").arg(run_dir);
    std::os::unix::process::CommandExt::uid(&mut command, uid);
    std::os::unix::process::CommandExt::gid(&mut command, uid);
    command.output().unwrap()
}

fn stdout(output: &Output) -> String {
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Alice sees what was done to her processes and nothing of Bob's, and Bob the other
/// way round; root sees both. With no daemon, `why` says so.
#[test]
fn any_tier_why_shows_each_user_their_own_decisions_and_root_all() {
    let _serial = serial();
    let (mut node, gpu) = node_with_gpu();
    let run_dir = node.dir.join("run");
    let none = why(ALICE, &run_dir, &[]);
    assert_eq!(none.status.code(), Some(3), "{none:?}");
    let said = String::from_utf8_lossy(&none.stderr);
    assert!(said.contains("no genv-enforcer is answering at"), "{said}");
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let open = ["--open", path(&gpu)];
    let (alices, bobs) = (Terminal::new(ALICE), Terminal::new(BOB));
    let alice = node.adopt(gpu_process(&alices, ALICE, None, &open), &[(0, 100)]);
    let bob = node.adopt(gpu_process(&bobs, BOB, None, &open), &[(0, 100)]);
    for pid in [alice, bob] {
        assert_eq!(node.wait_exit(pid, PATIENCE), Some(libc::SIGTERM));
        daemon.expect(&format!("pid={pid}"));
    }
    let (of_alice, of_bob) = (format!("(pid {alice})"), format!("(pid {bob})"));
    let seen = stdout(&why(ALICE, &run_dir, &[]));
    assert!(
        seen.contains(&of_alice) && !seen.contains(&of_bob),
        "{seen}"
    );
    assert!(
        seen.contains("non-env-processes") && seen.contains("terminated"),
        "{seen}"
    );
    let seen = stdout(&why(BOB, &run_dir, &[]));
    assert!(
        seen.contains(&of_bob) && !seen.contains(&of_alice),
        "{seen}"
    );
    // Asking for the other's pid shows nothing either.
    let seen = stdout(&why(ALICE, &run_dir, &[&bob.to_string()]));
    assert!(!seen.contains(&of_bob), "{seen}");
    let seen = stdout(&why(0, &run_dir, &[]));
    assert!(seen.contains(&of_alice) && seen.contains(&of_bob), "{seen}");
    let seen = stdout(&why(0, &run_dir, &["--me"]));
    assert!(
        !seen.contains(&of_alice) && !seen.contains(&of_bob),
        "{seen}"
    );
}

/// What `why` shows root: its decisions' rows (each row is followed by its line).
fn rows_for_root(run_dir: &Path) -> usize {
    stdout(&why(0, run_dir, &["--limit", "100000"]))
        .lines()
        .filter(|l| l.starts_with("    genv-enforcer: "))
        .count()
}

/// Nine uids whose programs are killed at the open, 460 times each and on until the
/// journal is full (an event the ring buffer loses on a loaded machine makes no
/// decision), cannot evict another user's only decision: the journal, when full,
/// evicts the oldest of whoever holds the most, and Alice's one decision is still in
/// her `why`. (Evicting the oldest of all, as before, lost it.)
#[test]
fn any_tier_many_uids_deciding_together_leave_a_users_only_decision_in_why() {
    let _serial = serial();
    let (mut node, gpu) = node_with_gpu();
    let run_dir = node.dir.join("run");
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes", "--deny"]) else {
        return;
    };
    daemon.expect("GPU opens outside any environment are ");
    let terminal = Terminal::new(ALICE);
    let args = ["--wait-stdin", "--open", path(&gpu)];
    let alice = node.adopt(gpu_process(&terminal, ALICE, None, &args), &[]);
    node.attempt(alice);
    assert_eq!(node.wait_exit(alice, PATIENCE), Some(libc::SIGKILL));
    daemon.expect(&format!("pid={alice}"));
    let stop = node.dir.join("stop-the-loops");
    // 460 each at least; past that, on until told to stop (4,000 each at most).
    let script = "i=0; while [ $i -lt 460 ] || { [ ! -e \"$S\" ] && [ $i -lt 4000 ]; }; do \
                  \"$P\" --open \"$G\"; i=$((i+1)); done";
    let loops: Vec<_> = (0..9u32)
        .map(|n| {
            let mut command = Command::new("sh");
            command
                .args(["-c", script])
                .env("P", artefact("gpu-process"))
                .env("G", &gpu)
                .env("S", &stop)
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            std::os::unix::process::CommandExt::uid(&mut command, 61_001 + n);
            std::os::unix::process::CommandExt::gid(&mut command, 61_001 + n);
            command.spawn().unwrap()
        })
        .collect();
    genv_enforcer_tests::wait_for_or(
        "the journal full (4,096 decisions)",
        PATIENCE * 4,
        || (rows_for_root(&run_dir) >= 4096).then_some(()),
        || format!("{} decisions", rows_for_root(&run_dir)),
    );
    std::fs::write(&stop, b"").unwrap();
    for mut child in loops {
        child.wait().unwrap();
    }
    let seen = stdout(&why(ALICE, &run_dir, &[]));
    assert!(seen.contains(&format!("(pid {alice})")), "{seen}");
}

/// A remote stop carried out here (`usage execute --with-reasons`, as genv-enforcer's
/// `remote enforce` runs it on each host) while a daemon runs: the daemon keeps it, so
/// that its `why` shows it to the user, and tells the terminal once, under its own
/// limits; nothing goes to the file kept when no daemon runs. A user's record is
/// refused: only root may hand the daemon a decision.
#[test]
fn any_tier_a_remote_stop_carried_out_here_is_kept_and_told_by_the_running_daemon() {
    let _serial = serial();
    let (mut node, _gpu) = node_with_gpu();
    let run_dir = node.dir.join("run");
    let Some(daemon) = EventDaemon::start(&node, &["--env-memory"]) else {
        return;
    };
    genv_enforcer_tests::wait_until("the why socket", PATIENCE, || {
        run_dir.join("why.sock").exists()
    });
    let terminal = Terminal::new(ALICE);
    let pid = node.adopt(on_terminal(&terminal, ALICE, &sleep(), None), &[(1, 100)]);
    let report = json!({
        "terminate": {"processes": [{"pid": pid, "used_gpu_memory": [{"index": 1, "gpu_memory": "100mi"}], "eid": null}]},
        "detach": {},
        "reasons": {pid.to_string(): {"rule": "non-env-processes", "gpus": [1]}},
    });
    let mut execute = node
        .enforcer()
        .args([
            "usage",
            "execute",
            "--with-reasons",
            "--run-dir",
            path(&run_dir),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (execute.stdin.take().unwrap())
        .write_all(report.to_string().as_bytes())
        .unwrap();
    let executed = execute.wait_with_output().unwrap();
    assert!(executed.status.success(), "{executed:?}");
    assert_eq!(node.wait_exit(pid, PATIENCE), Some(libc::SIGTERM));
    let expected = format!(
        "genv-enforcer: stopped process \"sleep\" (pid {pid}) on GPU 1: not in a genv environment; run 'genv activate --gpus 1' first"
    );
    let shown = terminal.wait_for(&expected);
    daemon.expect(&format!("pid={pid}"));
    assert_eq!(told(shown.as_bytes()), [expected], "{shown:?}");
    let seen = stdout(&why(ALICE, &run_dir, &[]));
    assert!(seen.contains(&format!("(pid {pid})")), "{seen}");
    assert!(!run_dir.join("told").exists(), "the daemon kept it");
    // alice hands the daemon a made-up decision: refused, and nothing kept.
    let forged = format!(
        "import json, socket; s = socket.socket(socket.AF_UNIX); s.connect({:?}); \
         s.sendall(json.dumps({{'record': json.loads({:?})}}).encode() + b'\\n'); \
         print(s.makefile().read())",
        path(&run_dir.join("why.sock")),
        stdout(&why(ALICE, &run_dir, &["--json"]))
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .replace(&pid.to_string(), "4242"),
    );
    let mut python = Command::new("python3");
    python.args(["-c", &forged]);
    std::os::unix::process::CommandExt::uid(&mut python, ALICE);
    let answer = python.output().unwrap();
    let answer = String::from_utf8_lossy(&answer.stdout);
    assert!(answer.contains("only root may record"), "{answer}");
    let seen = stdout(&why(0, &run_dir, &[]));
    assert!(!seen.contains("(pid 4242)"), "{seen}");
}
