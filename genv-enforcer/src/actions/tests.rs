//! The executor in a pid-reuse storm: thousands of processes die and their pids go, at
//! once, to bystanders, while the executor carries out reports naming the dead ones by
//! (pid, start time) as a snapshot recorded them. No bystander may get a signal; every
//! target still alive when signalled must get its signal.
//!
//! Reuse is forced, not hoped for: the storm runs as pid 1 of a pid namespace of its own
//! (with its own `/proc`, so the executor sees the namespace's pids), where writing
//! `P - 1` to `/proc/sys/kernel/ns_last_pid` makes the next fork get pid `P`, as CRIU
//! does. Nothing else forks in there, so each bystander lands exactly on the pid it is
//! meant to take.
//!
//! `/proc/<pid>/stat`'s start time counts clock ticks (10 ms): a pid reused within the
//! tick its first process started in would carry the same (pid, start time), and no
//! check of it could tell the two apart. Outside a namespace driven like this one, that
//! takes a pid space wrap (`pid_max` forks) in 10 ms. The storm reuses a pid only once
//! the tick its first process started in has passed, and checks that it did.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Barrier, mpsc};
use std::time::{Duration, Instant};

use rustix::process::Signal;

use super::kill::{self, Protected};
use super::{Executor, ExecutorConfig};
use crate::backends::procfs;
use crate::report::Report;
use crate::snapshot::{GpuProcess, Usage};
use crate::state::StateDir;

/// Set for the storm's own run, in its namespace.
const INNER_ENV: &str = "GENV_ENFORCER_PID_STORM";
const INNER_TEST: &str = "actions::tests::storm_inside_its_own_pid_namespace";
/// Only a hang gets this far: the storm takes seconds.
const HANG: Duration = Duration::from_secs(300);

#[test]
fn pid_reuse_storm_never_signals_the_wrong_process() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: a pid namespace and its ns_last_pid need root");
        return;
    }
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([INNER_TEST, "--exact", "--include-ignored", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(INNER_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: the hook makes only async-signal-safe system calls.
    unsafe { command.pre_exec(enter_a_new_pid_namespace) };
    let child = command
        .spawn()
        .expect("the storm starts in a new pid namespace");
    let pid = child.id() as i32;
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || sender.send(child.wait_with_output()));
    let Ok(output) = receiver.recv_timeout(HANG) else {
        // SAFETY: our own child; its namespace's pid 1 dies with it (parent-death signal).
        unsafe { libc::kill(pid, libc::SIGKILL) };
        panic!("the pid storm hung for {HANG:?}");
    };
    let output = output.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    for line in stdout.lines().filter(|l| l.starts_with("pid storm")) {
        println!("{line}");
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let tail = |text: &str| text.lines().rev().take(40).collect::<Vec<_>>().join("\n");
    assert!(
        output.status.success() && stdout.contains("pid storm: done"),
        "the pid storm failed ({}):\n{}\n--- stderr, last lines first:\n{}",
        output.status,
        stdout
            .lines()
            .filter(|l| l.starts_with("pid storm") || l.contains("panicked"))
            .collect::<Vec<_>>()
            .join("\n"),
        tail(&stderr)
    );
}

/// Between `Command`'s fork and its exec: what is exec'd becomes pid 1 of a new pid
/// namespace, in a private mount namespace with that pid namespace's `/proc`. The
/// process in between waits for it and exits as it did.
fn enter_a_new_pid_namespace() -> io::Result<()> {
    // SAFETY: async-signal-safe system calls only, in the child `Command` forked.
    unsafe {
        if libc::unshare(libc::CLONE_NEWPID | libc::CLONE_NEWNS) != 0 {
            return Err(io::Error::last_os_error());
        }
        match libc::fork() {
            -1 => Err(io::Error::last_os_error()),
            0 => {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                let none = std::ptr::null();
                let private = libc::MS_REC | libc::MS_PRIVATE;
                let proc_flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
                if libc::mount(none, c"/".as_ptr(), none, private, none.cast()) != 0
                    || libc::mount(
                        c"proc".as_ptr(),
                        c"/proc".as_ptr(),
                        c"proc".as_ptr(),
                        proc_flags,
                        none.cast(),
                    ) != 0
                {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            }
            init => {
                // Closing `Command`'s exec-error pipe lets `spawn` return at the exec.
                libc::syscall(libc::SYS_close_range, 3, libc::c_uint::MAX, 0);
                let mut status = 0;
                while libc::waitpid(init, &mut status, 0) < 0
                    && *libc::__errno_location() == libc::EINTR
                {}
                libc::_exit(if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else {
                    128 + libc::WTERMSIG(status)
                })
            }
        }
    }
}

#[test]
#[ignore = "the storm itself, run by pid_reuse_storm_never_signals_the_wrong_process"]
fn storm_inside_its_own_pid_namespace() {
    if std::env::var_os(INNER_ENV).is_none() || std::process::id() != 1 {
        eprintln!("not in the storm's own pid namespace: it would reuse this machine's pids");
        return;
    }
    type Phase = (&'static str, fn() -> Tally);
    let phases: [Phase; 5] = [
        ("reused before the report is carried out", || {
            reused_before_the_report(20, 100)
        }),
        ("reused while the executor signals", || {
            reused_while_the_executor_signals(20, 100)
        }),
        (
            "reused between the pidfd's open and the start time's check",
            || reused_inside_open(200),
        ),
        ("reused between the check and the signal", || {
            reused_before_the_signal(200)
        }),
        ("reused before the SIGKILL escalation", || {
            reused_before_the_escalation(200)
        }),
    ];
    let mut failed = Vec::new();
    for (phase, run) in phases {
        let tally = run();
        println!("pid storm: {phase}: {tally}");
        if tally.wrong > 0 || tally.right != tally.expected_right {
            failed.push(phase);
        }
    }
    assert!(failed.is_empty(), "wrong or missed signals: {failed:?}");
    println!("pid storm: done");
}

/// What a phase saw.
#[derive(Debug, Default)]
struct Tally {
    /// Pids that went from a target to a bystander.
    reused: usize,
    /// Bystanders that were signalled.
    wrong: usize,
    /// Targets that got the executor's signal, and how many should have.
    right: usize,
    expected_right: usize,
    /// Targets the storm ended before the executor reached them.
    ended_first: usize,
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} pids reused, {} wrong-process signals, {} of {} live targets signalled",
            self.reused, self.wrong, self.right, self.expected_right
        )?;
        if self.ended_first > 0 {
            write!(f, " ({} ended by the storm first)", self.ended_first)?;
        }
        Ok(())
    }
}

impl Tally {
    /// A bystander's end: any signal is a wrong-process signal.
    fn bystander(&mut self, pid: u32) {
        self.reused += 1;
        if reap(pid) != End::Clean {
            self.wrong += 1;
        }
    }

    /// A live target's end: it must have been ended by `signal`.
    fn target(&mut self, pid: u32, signal: i32) {
        self.expected_right += 1;
        if reap(pid) == End::Signal(signal) {
            self.right += 1;
        }
    }
}

/// Batches of targets recorded as a snapshot would; four in five exit and their pids go
/// to bystanders; then the executor carries out a report naming all of them.
fn reused_before_the_report(batches: usize, per_batch: usize) -> Tally {
    let mut executor = executor(None);
    let mut tally = Tally::default();
    for _ in 0..batches {
        let gate = Gate::new();
        let targets = fork_targets(&gate, per_batch);
        let report = report(&targets);
        let (live, dying): (Vec<_>, Vec<_>) =
            targets.iter().enumerate().partition(|(i, _)| i % 5 == 0);
        for (_, target) in &dying {
            kill_and_reap(target.0);
        }
        wait_past(&targets);
        let bystanders: Vec<u32> = dying.iter().map(|(_, t)| fork_onto(t, &gate)).collect();
        executor.execute(&report, &state_dir());
        gate.open();
        for (_, target) in live {
            tally.target(target.0, libc::SIGTERM);
        }
        for pid in bystanders {
            tally.bystander(pid);
        }
    }
    tally
}

/// The executor works through a report of live targets while another thread kills them
/// one by one, from the other end, and forks a bystander onto each pid.
fn reused_while_the_executor_signals(rounds: usize, per_round: usize) -> Tally {
    let mut executor = executor(None);
    let mut tally = Tally::default();
    for _ in 0..rounds {
        let gate = Gate::new();
        let targets = fork_targets(&gate, per_round);
        wait_past(&targets);
        let report = report(&targets);
        let start = Barrier::new(2);
        let storm = std::thread::scope(|scope| {
            let storm = scope.spawn(|| {
                start.wait();
                let reuse = |t: &(u32, u64)| {
                    // SAFETY: our own child, not yet reaped.
                    unsafe { libc::kill(t.0 as i32, libc::SIGKILL) };
                    (reap(t.0), fork_onto(t, &gate))
                };
                targets.iter().rev().map(reuse).collect::<Vec<_>>()
            });
            start.wait();
            executor.execute(&report, &state_dir());
            storm.join().unwrap()
        });
        gate.open();
        for (end, bystander) in storm {
            match end {
                End::Signal(libc::SIGTERM) => tally.right += 1,
                End::Signal(libc::SIGKILL) => tally.ended_first += 1,
                other => panic!("a target ended {other:?}"),
            }
            tally.bystander(bystander);
        }
    }
    tally.expected_right = rounds * per_round - tally.ended_first;
    tally
}

/// `kill::open` as the executor calls it, with every other target's pid reused right
/// after the pidfd is opened and before the start time is checked; then, as the
/// executor does, SIGTERM through whatever pidfd it returned.
fn reused_inside_open(targets: usize) -> Tally {
    let protected = Protected::for_this_process();
    let mut tally = Tally::default();
    let gate = Gate::new();
    let targets = fork_targets(&gate, targets);
    wait_past(&targets);
    let mut bystanders = Vec::new();
    let mut live = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        let reuse = i % 2 == 1;
        let between = || {
            if reuse {
                kill_and_reap(target.0);
                bystanders.push(fork_onto(target, &gate));
            }
        };
        if let Ok(pidfd) = kill::open_with(target.0, Some(target.1), &protected, between) {
            let _ = kill::send(&pidfd, Signal::TERM);
        }
        if !reuse {
            live.push(target.0);
        }
    }
    gate.open();
    live.into_iter()
        .for_each(|pid| tally.target(pid, libc::SIGTERM));
    bystanders.into_iter().for_each(|pid| tally.bystander(pid));
    tally
}

/// `kill::open` succeeds on a live target; every other target's pid is then reused
/// before the signal goes through the pidfd.
fn reused_before_the_signal(targets: usize) -> Tally {
    let protected = Protected::for_this_process();
    let mut tally = Tally::default();
    let gate = Gate::new();
    let targets = fork_targets(&gate, targets);
    wait_past(&targets);
    let mut bystanders = Vec::new();
    let mut live = Vec::new();
    for (i, target) in targets.iter().enumerate() {
        let pidfd = kill::open(target.0, Some(target.1), &protected);
        if i % 2 == 1 {
            kill_and_reap(target.0);
            bystanders.push(fork_onto(target, &gate));
        } else {
            live.push(target.0);
        }
        if let Ok(pidfd) = pidfd {
            let _ = kill::send(&pidfd, Signal::TERM);
        }
    }
    gate.open();
    live.into_iter()
        .for_each(|pid| tally.target(pid, libc::SIGTERM));
    bystanders.into_iter().for_each(|pid| tally.bystander(pid));
    tally
}

/// Targets that ignore SIGTERM are terminated with a grace period; every other one
/// exits and its pid is reused before the grace period ends; the escalation must
/// SIGKILL the ones still running and nothing else.
fn reused_before_the_escalation(targets: usize) -> Tally {
    let mut executor = executor(Some(Duration::from_secs(3600)));
    let mut tally = Tally::default();
    let gate = Gate::new();
    // SAFETY: the storm's own process; targets inherit the disposition at the fork.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    let targets = fork_targets(&gate, targets);
    // SAFETY: restores the default disposition the storm's own process had; signal(2)
    // only changes that disposition.
    unsafe { libc::signal(libc::SIGTERM, libc::SIG_DFL) };
    executor.execute(&report(&targets), &state_dir());
    wait_past(&targets);
    let (live, exiting): (Vec<_>, Vec<_>) =
        targets.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let bystanders: Vec<u32> = exiting
        .into_iter()
        .map(|(_, target)| {
            kill_and_reap(target.0);
            fork_onto(target, &gate)
        })
        .collect();
    executor.escalate(Instant::now() + Duration::from_secs(7200));
    assert_eq!(
        executor.next_deadline(),
        None,
        "every target was dealt with"
    );
    gate.open();
    live.into_iter()
        .for_each(|(_, t)| tally.target(t.0, libc::SIGKILL));
    bystanders.into_iter().for_each(|pid| tally.bystander(pid));
    tally
}

fn executor(kill_after: Option<Duration>) -> Executor {
    Executor::new(ExecutorConfig {
        dry_run: false,
        signals: true,
        kill_after,
    })
}

/// Terminations only: the state directory is never read.
fn state_dir() -> StateDir {
    StateDir::new("/nonexistent/genv")
}

/// A report terminating each (pid, start time), as the rules would for GPU processes.
pub(super) fn report(targets: &[(u32, u64)]) -> Report {
    let terminate = targets
        .iter()
        .map(|&(pid, start_time)| GpuProcess {
            pid,
            start_time: Some(start_time),
            used_gpu_memory: vec![Usage {
                index: 0,
                bytes: Some(1 << 20),
            }],
            eid: None,
        })
        .collect();
    Report {
        terminate,
        detach: Vec::new(),
        why: Default::default(),
    }
}

/// Forks `count` processes waiting on `gate`, each with its start time as the snapshot
/// reads it.
fn fork_targets(gate: &Gate, count: usize) -> Vec<(u32, u64)> {
    (0..count)
        .map(|_| {
            let pid = gate.fork();
            (pid, procfs::stat(pid).unwrap().start_time)
        })
        .collect()
}

/// Forks a bystander onto the pid of `target` (exited and reaped), and checks it took
/// that pid with a later start time.
fn fork_onto(&(pid, start_time): &(u32, u64), gate: &Gate) -> u32 {
    std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
    let bystander = gate.fork();
    assert_eq!(bystander, pid, "ns_last_pid did not hand out the pid");
    let now = procfs::stat(bystander).unwrap().start_time;
    assert!(now > start_time, "pid {pid} reused within its start tick");
    bystander
}

/// Waits until a process forked now would start in a later clock tick than any of
/// `targets` (the module's note says why).
fn wait_past(targets: &[(u32, u64)]) {
    let last = targets.iter().map(|t| t.1).max().unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u128;
    loop {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        let nanos = now.tv_sec as u128 * 1_000_000_000 + now.tv_nsec as u128;
        if nanos * per_second / 1_000_000_000 > u128::from(last) {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[derive(Debug, PartialEq, Eq)]
enum End {
    Clean,
    Signal(i32),
}

fn reap(pid: u32) -> End {
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child.
        let got = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        if got == pid as i32 {
            break;
        }
        let error = io::Error::last_os_error();
        assert_eq!(
            error.kind(),
            io::ErrorKind::Interrupted,
            "waitpid {pid}: {error}"
        );
    }
    match (libc::WIFEXITED(status), libc::WIFSIGNALED(status)) {
        (true, _) if libc::WEXITSTATUS(status) == 0 => End::Clean,
        (_, true) => End::Signal(libc::WTERMSIG(status)),
        _ => panic!("process {pid} ended with status {status:#x}"),
    }
}

/// The storm itself ends a target (not the executor: SIGKILL, and reaped at once).
fn kill_and_reap(pid: u32) {
    // SAFETY: our own child, not yet reaped.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(reap(pid), End::Signal(libc::SIGKILL));
}

/// A pipe the storm's processes wait on: they exit 0 when the gate opens (its write
/// end closes), so any other end is a signal.
struct Gate {
    read: OwnedFd,
    write: Option<OwnedFd>,
}

impl Gate {
    fn new() -> Self {
        let mut fds = [0; 2];
        // SAFETY: a two-int array for pipe2 to fill.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: pipe2 just made both descriptors, owned by nothing else.
        unsafe {
            Self {
                read: OwnedFd::from_raw_fd(fds[0]),
                write: Some(OwnedFd::from_raw_fd(fds[1])),
            }
        }
    }

    /// Forks a process that waits for the gate to open, then exits 0.
    fn fork(&self) -> u32 {
        let read = self.read.as_raw_fd();
        // SAFETY: the child (of a multithreaded process) makes only async-signal-safe
        // system calls: it closes every other descriptor (the gate's write end and any
        // other gate's included), blocks reading, and exits.
        unsafe {
            match libc::fork() {
                -1 => panic!("fork: {}", io::Error::last_os_error()),
                0 => {
                    libc::syscall(libc::SYS_close_range, 3, read - 1, 0);
                    libc::syscall(libc::SYS_close_range, read + 1, libc::c_uint::MAX, 0);
                    let mut byte = 0u8;
                    while libc::read(read, (&raw mut byte).cast(), 1) < 0 {}
                    libc::_exit(0)
                }
                pid => pid as u32,
            }
        }
    }

    /// Lets every process waiting on the gate exit.
    fn open(mut self) {
        self.write.take();
    }
}
