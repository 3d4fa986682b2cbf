//! A process whose address space its own user holds locked (through FUSE, as any user
//! with `fusermount3` can): the harness that makes one, checked against the kernel.
//! Whatever waits for such a process's `mmap_lock` (a read of its `environ`) waits
//! until the user's server lets go, or dies.
//!
//! Needs root (the server's mount; the holder runs as nobody).

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::events::{EventDaemon, make_gpu_node};
use genv_enforcer_tests::harness::{KillOnDrop, wait_exit};
use genv_enforcer_tests::stall::{StallFuse, blocks_reading, hold_lock_in, holder_command};
use genv_enforcer_tests::{Genv, Node, device_record, env_record, path, serial, wait_for_or};
use serde_json::json;

const NOBODY: u32 = 65534;

/// A holder of `fuse`'s lock, running as nobody.
fn holder(fuse: &StallFuse) -> KillOnDrop {
    let mut command = holder_command(fuse, &[]);
    command.uid(NOBODY).gid(NOBODY);
    KillOnDrop(hold_lock_in(&mut command))
}

fn environ(holder: &KillOnDrop) -> PathBuf {
    PathBuf::from(format!("/proc/{}/environ", holder.0.id()))
}

#[test]
fn stall_harness_holds_and_releases() {
    // Declared before the server, so dropped after it: a holder cannot finish dying
    // while its READ is held.
    let mut holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    holder = self::holder(&fuse);
    let environ = environ(&holder);
    assert!(
        blocks_reading(&environ, Duration::from_secs(1)),
        "root read the holder's environ while its user held its mmap_lock"
    );
    drop(fuse);
    assert!(
        !blocks_reading(&environ, Duration::from_secs(5)),
        "the holder's environ still cannot be read 5 s after its FUSE server died"
    );
    holder.0.kill().unwrap();
    let status = wait_exit(&mut holder.0, Duration::from_secs(5));
    assert!(
        status.is_some(),
        "the holder was not reaped 5 s after SIGKILL"
    );
}

#[test]
fn stall_harness_answering_after_releases_by_itself() {
    // Dropped after the server, as above.
    let held: KillOnDrop;
    let fuse = StallFuse::answering_after(NOBODY, Duration::from_secs(2));
    held = holder(&fuse);
    let environ = environ(&held);
    // The READ came before `held`; its answer comes 2 s after it.
    assert!(
        blocks_reading(&environ, Duration::from_millis(500)),
        "root read the holder's environ while its READ was unanswered"
    );
    assert!(
        !blocks_reading(&environ, Duration::from_secs(10)),
        "the holder's environ still cannot be read 10 s after its READ came (answered \
         after 2 s)"
    );
}

// The enforcer against a user who holds their own address space.

/// The grace an unreadable GPU process gets before it counts as outside any environment
/// (`snapshot::unreadable::GRACE`), and what a check may add to it.
const GRACE: Duration = Duration::from_secs(10);
const CHECK: Duration = Duration::from_secs(10);

/// A node whose GPU 0 is `gpu`, with the environment `E` of nobody attached to it.
fn node_with_nobodys_e() -> (Node, PathBuf) {
    let mut node = Node::new(2);
    let gpu = make_gpu_node(&node.dir.join("nvidia0"));
    let shell = node.shell();
    node.write_state(
        json!([env_record("E", NOBODY, "nobody", None, shell)]),
        json!([device_record(0, &["E"]), device_record(1, &[])]),
    );
    (node, gpu)
}

/// A holder of `fuse`'s lock as nobody, in environment `eid` (or none), listed by NVML
/// on GPU 0: a GPU process whose environment block cannot be read.
fn gpu_holder(node: &mut Node, fuse: &StallFuse, eid: Option<&str>) -> KillOnDrop {
    let mut command = holder_command(fuse, &[]);
    command
        .uid(NOBODY)
        .gid(NOBODY)
        .env_remove("GENV_ENVIRONMENT_ID");
    if let Some(eid) = eid {
        command.env("GENV_ENVIRONMENT_ID", eid);
    }
    let holder = KillOnDrop(hold_lock_in(&mut command));
    node.add_context(holder.0.id(), 0, 100);
    holder
}

/// A holder of `fuse`'s lock as nobody that maps `library` as a program maps a library.
fn library_holder(fuse: &StallFuse, library: &std::path::Path) -> KillOnDrop {
    let mut command = holder_command(fuse, &[]);
    command
        .args(["--map", path(library)])
        .uid(NOBODY)
        .gid(NOBODY);
    KillOnDrop(hold_lock_in(&mut command))
}

/// The daemon started after a user began holding a GPU process's lock reaches its
/// watching state within a bound (the process's identity unresolved, said), and
/// enforces: an outsider's open is answered. (Before, its start read every process's
/// environment block on the main thread, and never got past that one.)
#[test]
fn the_event_driven_daemon_starts_and_enforces_while_a_user_holds_their_lock() {
    let _serial = serial();
    let (mut node, gpu) = node_with_nobodys_e();
    let _holder: KillOnDrop; // dropped after the server (see above)
    let fuse = StallFuse::new(NOBODY);
    _holder = gpu_holder(&mut node, &fuse, Some("E"));
    let started = Instant::now();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "started in {:?}",
        started.elapsed()
    );
    daemon.expect("did not answer in time (their owners hold their address spaces: pid");
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", path(&gpu)], None);
    assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGTERM));
}

/// A GPU process outside any environment that keeps its own block unreadable gains
/// nothing: once it has been so for the grace period, it is judged as outside any
/// environment and terminated. (Before, the daemon never started.)
#[test]
fn an_unreadable_gpu_process_outside_any_environment_is_terminated_after_the_grace() {
    let _serial = serial();
    let (mut node, _gpu) = node_with_nobodys_e();
    let mut holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    holder = gpu_holder(&mut node, &fuse, None);
    let pid = holder.0.id();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes", "--interval", "2"])
    else {
        return;
    };
    let started = Instant::now();
    daemon.expect(&format!("leaving process {pid} alone for now"));
    let line = wait_for_or(
        "the unreadable process to be terminated",
        GRACE + CHECK + CHECK,
        || {
            daemon
                .lines()
                .into_iter()
                .find(|l| l.contains(&format!("Terminating process {pid} ")))
        },
        || format!("{:#?}", daemon.lines()),
    );
    assert!(line.contains("environment N/A"), "{line}");
    assert!(
        // The daemon's first look may come a little before its start is seen here.
        started.elapsed() >= GRACE - Duration::from_secs(3),
        "terminated before the grace: {:?}",
        started.elapsed()
    );
    daemon.expect(&format!(
        "process {pid}'s environment block has not been readable for"
    ));
    // Its threads wait on the server; once it is gone, the signal ends it.
    drop(fuse);
    let status = wait_exit(&mut holder.0, DEATH).expect("the holder exits");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGTERM)
    );
}

/// A brief hold (a core dump, a burst of `mmap`) gets no process of an environment
/// terminated: its block does not answer at the daemon's start (held for 2 s or more,
/// until the daemon has said so), then does, and it is judged by it. (This guards the
/// grace's other side.)
#[test]
fn a_process_in_an_environment_whose_lock_is_held_for_seconds_is_not_terminated() {
    let _serial = serial();
    let (mut node, _gpu) = node_with_nobodys_e();
    let holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    fuse.release_after(Duration::from_secs(60));
    holder = gpu_holder(&mut node, &fuse, Some("E"));
    let held_since = Instant::now();
    let pid = holder.0.id();
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes", "--interval", "2"])
    else {
        return;
    };
    daemon.expect(&format!(
        "their owners hold their address spaces: pid {pid}"
    ));
    // Held for 2 s at least (a core dump's while), seen by the daemon, then let go.
    std::thread::sleep(Duration::from_secs(2).saturating_sub(held_since.elapsed()));
    drop(fuse);
    // Read again once it answers, at a full cycle; then judged as in E, on E's GPU.
    daemon.expect("Identities resynchronised: 1 read from /proc");
    let cycles = daemon.count("full_cycles");
    daemon.wait_count_at_least("full_cycles", cycles + 3);
    assert!(
        !daemon
            .lines()
            .iter()
            .any(|l| l.contains(&format!("Terminating process {pid} "))),
        "{:#?}",
        daemon.lines()
    );
    assert_eq!(daemon.status()["counts"]["terminated"], 0);
    assert!(
        !blocks_reading(&PathBuf::from(format!("/proc/{pid}/environ")), DEATH),
        "the hold never ended"
    );
}

/// `usage snapshot` (what remote enforcement runs on each host) answers within its
/// bound while a GPU process's block does not: that process is left out, and said.
#[test]
fn usage_snapshot_answers_while_a_user_holds_their_lock() {
    let _serial = serial();
    let (mut node, _gpu) = node_with_nobodys_e();
    let _holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    _holder = gpu_holder(&mut node, &fuse, Some("E"));
    let pid = _holder.0.id();
    let mut snapshot = node
        .enforcer()
        .args(["usage", "snapshot"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_exit(&mut snapshot, Duration::from_secs(10));
    if status.is_none() {
        let _ = snapshot.kill();
        let _ = snapshot.wait();
        panic!("usage snapshot waited 10 s on the held process");
    }
    let output = snapshot.wait_with_output().unwrap();
    assert!(output.status.success(), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("leaving process {pid} alone")),
        "{stderr}"
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["processes"]["processes"], json!([]), "{json}");
}

/// With `--memory-at-alloc kill`, a capped environment's exec, fork and exit while a user
/// holds the lock of a process that maps the probed libcuda leave no `fork()` on the
/// node waiting over a second, and the daemon's status stays fresh. (Before, each made
/// the daemon open per-process perf events on the probes, a registration that
/// write-locks every address space mapping libcuda under the lock `fork()` takes.)
#[test]
fn a_capped_environments_lifecycle_stalls_no_fork_while_a_user_holds_their_lock() {
    let _serial = serial();
    let (mut node, _gpu) = node_with_nobodys_e();
    let (lib, _cuda_env) = node.cuda();
    let args = ["--memory-at-alloc", "kill", "--cuda-lib", path(&lib)];
    let Some(daemon) = EventDaemon::start(&node, &args) else {
        return;
    };
    daemon.expect("are held to their environment's gpu_memory");
    let _holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    fuse.release_after(Duration::from_secs(60));
    _holder = library_holder(&fuse, &lib);

    let made = Genv::get().bash(
        &node,
        "genv activate --id mu; genv config gpu-memory 1g; genv attach --index 1",
    );
    assert!(made.success, "{}", made.stderr);
    daemon.expect("caps held at the allocation: mu 1g");

    // Execs, forks and exits in mu, each lasting long enough for the daemon to see it.
    let exits = daemon.barrier()["counts"]["exit_events"].as_u64().unwrap();
    let forks = ForkProber::start();
    let script = "genv activate --id mu; sleep 2 & (sleep 1; /bin/true) & sleep 1.5; wait";
    let run = Genv::get().bash(&node, script);
    assert!(run.success, "{}", run.stderr);
    // The daemon handled all that (the exits of sleep, sleep, true, sleep and the
    // subshell), and published its counts, within a bound: its event loop never waited
    // on the held process.
    let handled = |status: &serde_json::Value| {
        let now = status["counts"]["exit_events"].as_u64()?;
        (now >= exits + 5).then_some(())
    };
    daemon.wait_status_for("the exits handled", Duration::from_secs(15), handled);
    let slowest = forks.stop();
    eprintln!("the slowest fork on the node took {slowest:?}");
    assert!(
        slowest < Duration::from_secs(1),
        "a fork waited {slowest:?} on the node"
    );
}

/// A real `fork()` (which copies the address space, and so takes `dup_mmap_sem`; a
/// `posix_spawn` shares it and does not) whose child exits at once; the child's pid.
fn fork_and_exit() -> libc::pid_t {
    // SAFETY: the child calls only _exit(2), which is async-signal-safe.
    match unsafe { libc::fork() } {
        // SAFETY: as above.
        0 => unsafe { libc::_exit(0) },
        pid => {
            assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
            pid
        }
    }
}

/// Forks in a loop from a thread of its own, timing each `fork()`. One that never
/// returns (waiting on the kernel) is timed as far as it got.
struct ForkProber {
    stop: Arc<AtomicBool>,
    /// The slowest spawn so far, and when the one under way began.
    seen: Arc<Mutex<(Duration, Option<Instant>)>>,
}

impl ForkProber {
    fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new((Duration::ZERO, None)));
        let (stopped, timing) = (Arc::clone(&stop), Arc::clone(&seen));
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let started = Instant::now();
                timing.lock().unwrap().1 = Some(started);
                let child = fork_and_exit();
                let mut timing_now = timing.lock().unwrap();
                *timing_now = (timing_now.0.max(started.elapsed()), None);
                drop(timing_now);
                // SAFETY: waitpid(2) of the child just forked, into no status.
                unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self { stop, seen }
    }

    /// The slowest spawn seen, counting one still under way (a little after asking it to
    /// stop, so that a spawn that just began is not mistaken for a stuck one).
    fn stop(self) -> Duration {
        self.stop.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(1500));
        let (slowest, under_way) = *self.seen.lock().unwrap();
        slowest.max(under_way.map_or(Duration::ZERO, |since| since.elapsed()))
    }
}

/// A daemon with `--memory-at-alloc` started while a user holds a process that maps the
/// libcuda to probe: the registration (whose walk would wait for that process, holding
/// the lock every `fork()` takes) is put off and said, the node's forks go on, and the
/// probes are registered once the user lets go. (Before, the daemon's start waited in
/// the registration, and every fork on the node with it.)
#[test]
fn a_registration_is_put_off_while_a_process_mapping_the_library_holds_its_lock() {
    let _serial = serial();
    let (mut node, _gpu) = node_with_nobodys_e();
    let (lib, _cuda_env) = node.cuda();
    let holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    fuse.release_after(Duration::from_secs(40));
    holder = library_holder(&fuse, &lib);
    let forks = ForkProber::start();
    let args = ["--memory-at-alloc", "kill", "--cuda-lib", path(&lib)];
    let Some(daemon) = EventDaemon::start(&node, &args) else {
        return;
    };
    let line = daemon.expect("not probing");
    assert!(
        line.contains(&format!("{} (uid {NOBODY})", holder.0.id())),
        "{line}"
    );
    let slowest = forks.stop();
    assert!(
        slowest < Duration::from_secs(1),
        "a fork waited {slowest:?} on the node"
    );
    drop(fuse);
    daemon.expect("are held to their environment's gpu_memory");
}

/// genv's own polling cycle (`enforce` without `--event-driven`) never holds genv's lock
/// while a GPU process's block does not answer: every user's `genv activate`, `attach`
/// and `config` takes the lock meanwhile. (Before, the cycle read the blocks under it,
/// and waited there.)
#[test]
fn the_polling_cycle_never_holds_genvs_lock_across_a_held_process() {
    let _serial = serial();
    let (mut node, _gpu) = node_with_nobodys_e();
    let _holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    fuse.release_after(Duration::from_secs(60));
    _holder = gpu_holder(&mut node, &fuse, Some("E"));
    let run_dir = node.dir.join("run");
    let args = ["--interval", "1", "--run-dir", path(&run_dir)];
    let daemon = genv_enforcer_tests::Daemon::start(&node, &args);
    let lock = node.state.join("genv.lock");
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(700));
        let taken = std::process::Command::new("flock")
            .args(["-w", "3"])
            .arg(&lock)
            .arg("true")
            .status()
            .unwrap();
        assert!(taken.success(), "genv's lock was held for 3 s by the cycle");
    }
    drop(daemon);
}
