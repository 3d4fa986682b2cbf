//! `--memory-at-alloc`: uprobes on libcuda hold an environment's `gpu_memory` at the
//! allocation call. Real uprobes on a real shared library (the fake libcuda of
//! `tests/fake-cuda`, a copy per node, which numbers devices through
//! `CUDA_VISIBLE_DEVICES` and reports its allocations to the fake NVML as a driver
//! would), real CUDA-calling processes (`cuda-user`), environments made by the real genv
//! 1.4.3 in the shell that then runs the program. A process killed at the call answers
//! nothing: the call never returned to it.
//!
//! Uprobes load on every tier's kernel; the tier the daemon runs on does not matter here.
//! One test at a time: each daemon's probes see every process mapping its library.

use std::path::Path;
use std::process::Command;

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::cuda::{
    CAP, CudaUser, ENUMERATION, NvmlGates, PROCESSES, capped, daemon, killed_at, ledger_total,
    ready, setup,
};
use genv_enforcer_tests::events::{EventDaemon, make_gpu_node};
use genv_enforcer_tests::{Genv, MIB, Node, artefact, serial};

/// 600 MiB fits under 1g; 600 MiB more does not: the process is killed in that call,
/// which never returns, and the driver never hands the memory out.
#[test]
fn the_allocation_that_crosses_the_cap_kills_its_process_in_the_call() {
    let _serial = serial();
    let Some((mut node, daemon, mut user)) = ready("kill", "alpha") else {
        return;
    };
    user.ok("alloc 600");
    let line = killed_at(&mut node, &daemon, &mut user, "alloc 600");
    assert!(
        line.starts_with(
            "Environment alpha would use 1258m on device 0 which is 258m over its capacity of 1g;"
        ),
        "{line}"
    );
    assert_eq!(ledger_total(&node, &[user.pid], 0), 600 * MIB);
    assert_eq!(
        daemon.wait_status("the kill counted", |s| s["counts"]["killed_at_alloc"]
            .as_u64()
            .filter(|n| *n > 0)),
        1
    );
}

/// Freed memory is given back: alloc, free, alloc stays under the cap, through every
/// allocation and free call the probes watch.
#[test]
fn freed_memory_is_given_back_and_the_process_survives() {
    let _serial = serial();
    let Some((mut node, daemon, mut user)) = ready("kill", "beta") else {
        return;
    };
    for _ in 0..3 {
        let pointer = user.ok("alloc 600");
        user.ok(&format!("free {pointer}"));
        let pointer = user.ok("async 600");
        user.ok(&format!("freeasync {pointer}"));
        let pointer = user.ok("pool 600");
        user.ok(&format!("free {pointer}"));
        let pointer = user.ok("alloc 600");
        user.ok(&format!("freeasync {pointer}"));
        let handle = user.ok("vmm 600 0");
        user.ok(&format!("release {handle}"));
        let pointer = user.ok("pitch 600");
        user.ok(&format!("free {pointer}"));
    }
    // Managed memory is not charged (it lives where it is touched).
    user.ok("managed 2000");
    user.ok("alloc 900");
    assert!(node.alive(user.pid));
    assert!(
        !daemon.lines().iter().any(|l| l.contains("would use")),
        "{:#?}",
        daemon.lines()
    );
}

/// Two processes of one environment allocating as fast as they can, at once: the
/// environment never goes over its cap (the probes charge before they check, so two
/// racing calls can both be refused, never both let through). What the live processes
/// hold is sampled throughout, as the driver reports it; a killed process's memory is
/// the driver's again once it is gone, and the survivor may then have it.
#[test]
fn racing_processes_never_take_their_environment_over_its_cap() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let mut first = capped(&mut node, &cuda_env, &daemon, "gamma", &[0]);
    let mut second = CudaUser::start(&mut node, &cuda_env, "genv activate --id gamma");
    first.init(&daemon, "0");
    second.init(&daemon, "0");
    first.ok("ctx 0");
    second.ok("ctx 0");
    let pids = [first.pid, second.pid];
    let ledger = node.cuda_ledger_dir().unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut samples, mut most) = (0, 0);
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let held = live_total(&ledger, &pids);
                most = most.max(held);
                samples += 1;
            }
            (samples, most)
        })
    };
    let calls = ["alloc 100"; 12];
    first.send(&calls);
    second.send(&calls);
    let mut killed = 0;
    for user in [&mut first, &mut second] {
        let mut answers = 0;
        while let Some(answer) = user.answer() {
            assert!(answer.starts_with("ok "), "{answer}");
            answers += 1;
        }
        if answers < calls.len() {
            killed += 1;
            assert_eq!(node.wait_exit(user.pid, DEATH), Some(libc::SIGKILL));
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (samples, most) = sampler.join().unwrap();
    eprintln!("{samples} samples; at most {} MiB held at once", most / MIB);
    assert!(killed >= 1, "24 × 100 MiB went through a 1g cap");
    assert!(
        most <= CAP,
        "the environment held {most} bytes under a 1g cap"
    );
    assert!(live_total(&node.cuda_ledger_dir().unwrap(), &pids) <= CAP);
}

/// Bytes the live ones of `pids` hold on GPU 0, as the fake driver's ledger says; a
/// process is counted only if it is still alive after its file was read (a dead one's
/// memory is free).
fn live_total(ledger: &Path, pids: &[u32]) -> u64 {
    let mut total = 0;
    for pid in pids {
        let Ok(text) = std::fs::read_to_string(ledger.join(format!("{pid}-0"))) else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let alive = stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'));
        if alive {
            total += text.trim().parse::<u64>().unwrap_or(0);
        }
    }
    total
}

/// `cuMemCreate` (PyTorch's expandable segments) counts, on the device its properties
/// name.
#[test]
fn cu_mem_create_counts_against_the_cap() {
    let _serial = serial();
    let Some((mut node, daemon, mut user)) = ready("kill", "delta") else {
        return;
    };
    user.ok("vmm 600 0");
    killed_at(&mut node, &daemon, &mut user, "vmm 600 0");
}

/// Each GPU has its own account: 600 MiB on GPU 0 and 600 MiB on GPU 1 are both under
/// a 1g cap; the next 600 MiB on GPU 1 is not, and the line names device 1. The CUDA
/// device number goes through CUDA_VISIBLE_DEVICES (genv's `1,0` after attaching 1
/// first would renumber; here `0,1` and a second process on `1` alone).
#[test]
fn a_context_on_gpu_1_does_not_count_against_gpu_0() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let mut user = capped(&mut node, &cuda_env, &daemon, "eps", &[0, 1]);
    user.init(&daemon, "0,1");
    user.ok("ctx 0");
    user.ok("alloc 600");
    // A context of its own (`cuCtxCreate`), current once made.
    user.ok("create 1");
    user.ok("alloc 600");
    user.ok("push 0");
    user.ok("alloc 300");
    user.ok("pop");
    // Back on device 1, which holds 600 MiB.
    let line = killed_at(&mut node, &daemon, &mut user, "alloc 600");
    assert!(line.contains(" on device 1 "), "{line}");

    // Attached to GPU 1 alone: CUDA's device 0 is NVML's GPU 1.
    let mut other = capped(&mut node, &cuda_env, &daemon, "zeta", &[1]);
    other.init(&daemon, "1");
    other.ok("ctx 0");
    other.ok("alloc 600");
    assert_eq!(other.call("alloc 600"), None);
    let line = daemon.expect(&format!("killed process {} at the allocation", other.pid));
    assert!(
        line.starts_with("Environment zeta would use 1258m on device 1 "),
        "{line}"
    );
    assert_eq!(ledger_total(&node, &[other.pid], 1), 600 * MIB);
}

/// A context destroyed while current is popped, as the driver does: the thread is back
/// on the context below it, and charged there.
#[test]
fn a_destroyed_context_is_popped_off_its_threads_stack() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let mut user = capped(&mut node, &cuda_env, &daemon, "rho", &[0, 1]);
    user.init(&daemon, "0,1");
    user.ok("ctx 0");
    user.ok("alloc 600");
    let other = user.ok("create 1");
    user.ok(&format!("destroy {other}"));
    // Back on device 0, which holds 600 MiB.
    let line = killed_at(&mut node, &daemon, &mut user, "alloc 600");
    assert!(line.contains(" on device 0 "), "{line}");
}

/// Any user may rewrite `envs.json` (genv makes it 0666) and lower another user's
/// `gpu_memory`: the owner's program is still held, at the allocation, to the cap it was
/// started with (`GENV_GPU_MEMORY`, which genv's shell set from the owner's own
/// `genv config`), not killed at its next allocation. (The memory rule follows the
/// file at its polls, as genv's does: an hour apart here.)
#[test]
fn another_users_edit_of_gpu_memory_does_not_get_the_owners_allocation_killed() {
    const OTHER: u32 = 64_612;
    let _serial = serial();
    let mut node = Node::new(2);
    let (lib, cuda_env) = node.cuda();
    let Some(daemon) = daemon(&node, &lib, "kill", &["--memory-interval", "3600"]) else {
        return;
    };
    let mut user = capped(&mut node, &cuda_env, &daemon, "tau", &[0]);
    user.init(&daemon, "0");
    user.ok("ctx 0");
    // The other user's edit, in place, as genv writes.
    let edit = "import json, sys\n\
                d = json.load(open(sys.argv[1]))\n\
                for e in d['envs']: e['config']['gpu_memory'] = '100m'\n\
                open(sys.argv[1], 'w').write(json.dumps(d))";
    let mut python = Command::new("python3");
    python.args(["-c", edit]).arg(node.state.join("envs.json"));
    std::os::unix::process::CommandExt::uid(&mut python, OTHER);
    assert!(python.status().unwrap().success());
    daemon.expect("caps held at the allocation: tau 100m");
    user.ok("alloc 600");
    let line = killed_at(&mut node, &daemon, &mut user, "alloc 600");
    assert!(
        line.contains(&format!(
            "which is 258m over 1g, which process {} was started with (envs.json says 100m)",
            user.pid
        )),
        "{line}"
    );
}

/// A context switch the driver refuses (here a destroyed context, set or pushed)
/// leaves the thread's context as it was: the thread's allocations stay charged to
/// the GPU they land on, and the one that takes it past the cap there is killed.
#[test]
fn a_failed_context_switch_leaves_the_threads_context_as_it_was() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let mut user = capped(&mut node, &cuda_env, &daemon, "sigma", &[0, 1]);
    user.init(&daemon, "0,1");
    user.ok("ctx 0");
    user.ok("alloc 600");
    // A context on device 1, made (current), popped and destroyed.
    let other = user.ok("create 1");
    user.ok("pop");
    user.ok(&format!("destroy {other}"));
    assert_eq!(
        user.call(&format!("setctx {other}")).as_deref(),
        Some("err 201")
    );
    assert_eq!(
        user.call(&format!("pushctx {other}")).as_deref(),
        Some("err 201")
    );
    // Still on device 0, which holds 600 MiB.
    let line = killed_at(&mut node, &daemon, &mut user, "alloc 600");
    assert!(line.contains(" on device 0 "), "{line}");
}

/// `report`: the line, and the allocation goes on (here one from a memory pool, which
/// counts as any other).
#[test]
fn report_mode_says_so_and_lets_the_allocation_through() {
    let _serial = serial();
    let Some((_node, daemon, mut user)) = ready("report", "eta") else {
        return;
    };
    user.ok("alloc 600");
    user.ok("pool 600");
    let line = daemon.expect(&format!(
        "process {} allocated past it (--memory-at-alloc report)",
        user.pid
    ));
    assert!(
        line.starts_with("Environment eta would use 1258m on device 0 "),
        "{line}"
    );
}

/// The probes are registered once, system-wide: every process that maps libcuda has
/// their breakpoints, placed by the kernel at its own `mmap`. Only a process of an
/// environment with a cap is held: one outside any environment, or in one without a
/// cap, starts nothing in the daemon and is charged nothing (its calls return from the
/// programs at once), and is judged at its GPU open, as `cuInit` makes one. An
/// environment given a cap later has its running processes held from then on (to the
/// larger of it and the cap each was started with), and one whose cap goes, no longer.
#[test]
fn only_processes_in_capped_environments_are_held_though_every_one_has_the_breakpoints() {
    let _serial = serial();
    let mut node = Node::new(2);
    let (lib, mut cuda_env) = node.cuda();
    let Some(daemon) = daemon(&node, &lib, "kill", &["--non-env-processes"]) else {
        return;
    };
    let mut insider = capped(&mut node, &cuda_env, &daemon, "theta", &[0]);
    insider.init(&daemon, "0");
    let breakpoint = "0xcc";
    assert_eq!(insider.ok("peek cuMemAlloc_v2"), breakpoint);

    // An environment without a cap: breakpoints, and nothing started or charged.
    let mut uncapped = CudaUser::start(
        &mut node,
        &cuda_env,
        "genv activate --id iota; genv attach --index 1",
    );
    uncapped.ok("init");
    assert_eq!(uncapped.ok("peek cuMemAlloc_v2"), breakpoint);
    uncapped.ok("ctx 0");
    uncapped.ok("alloc 100");

    // Outside any environment, on a libcuda whose `cuInit` opens a GPU node.
    let gpu = node.dir.join("nvidia0");
    make_gpu_node(&gpu);
    cuda_env.push(("GENV_FAKE_CUDA_OPENS".into(), gpu.to_str().unwrap().into()));
    let mut command = Command::new(artefact("cuda-user"));
    command.env_remove("GENV_ENVIRONMENT_ID");
    let mut outsider = CudaUser::spawn(&mut node, &cuda_env, command);
    assert_eq!(outsider.ok("peek cuInit"), breakpoint);
    // Its open is watched; once NVML lists it on the GPU, it is terminated (answered or
    // not: the signal may land first).
    outsider.send(&["init", "ctx 0", "alloc 100"]);
    assert_eq!(node.wait_exit(outsider.pid, DEATH), Some(libc::SIGTERM));
    daemon.expect(&format!(
        "Process {} is not running in a GPU environment",
        outsider.pid
    ));
    // The insider's start alone was seen.
    assert_eq!(daemon.status()["counts"]["cuda_starts"], 1);

    // The cap comes: the running process is held from then on; it goes: no longer.
    let capped = Genv::get().bash(&node, "genv activate --id iota; genv config gpu-memory 1g");
    assert!(capped.success, "{}", capped.stderr);
    daemon.expect("caps held at the allocation: iota 1g");
    daemon.expect(&format!(
        "Process {} is held at its allocations",
        uncapped.pid
    ));
    // Started from genv's shell while iota had no cap, it is held to none (see
    // `another_users_edit_of_gpu_memory_...`): its calls are charged from now on.
    uncapped.ok("alloc 600");
    uncapped.ok("alloc 600");
    let cleared = Genv::get().bash(
        &node,
        "genv activate --id iota; genv config --clear gpu-memory",
    );
    assert!(cleared.success, "{}", cleared.stderr);
    daemon.expect_count("caps held at the allocation: theta 1g", 2);
    insider.ok("ctx 0");
    insider.ok("alloc 100");
}

/// A user forking without end in a capped environment costs the daemon no descriptor:
/// nothing is opened per process (the probes' perf events are the libraries', one per
/// probed call), so no pool one user could exhaust for others is there.
#[test]
fn processes_in_a_capped_environment_cost_the_daemon_no_descriptor() {
    let _serial = serial();
    let mut node = Node::new(2);
    let (lib, cuda_env) = node.cuda();
    let Some(daemon) = daemon(&node, &lib, "kill", &[]) else {
        return;
    };
    let mut first = capped(&mut node, &cuda_env, &daemon, "lambda", &[0]);
    let perf_events = || perf_events_of(daemon.daemon.pid());
    let before = perf_events();
    assert!(before > 0, "the library's probes hold perf events");
    let mut more = Vec::new();
    for _ in 0..5 {
        let mut command = Command::new(artefact("cuda-user"));
        command.env("GENV_ENVIRONMENT_ID", "lambda");
        let user = CudaUser::spawn(&mut node, &cuda_env, command);
        daemon.expect(&format!("Process {} is held at its allocations", user.pid));
        more.push(user);
    }
    assert_eq!(perf_events(), before, "perf events opened per process");
    // All of them are held at the allocation.
    first.init(&daemon, "0");
    first.ok("ctx 0");
    first.ok("alloc 600");
    killed_at(&mut node, &daemon, &mut first, "alloc 600");
}

/// How many perf events process `pid` holds open.
fn perf_events_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy() == "anon_inode:[perf_event]")
        .count()
}

/// A size no driver can give (2^63 + 1 bytes) is charged as the largest allocation
/// there is and, failing, given back whole: it cannot leave the account in credit.
/// (Given back as its raw size, it once wrapped the environment's count negative, and
/// every later allocation passed under any cap.)
#[test]
fn an_impossible_size_leaves_no_credit_behind() {
    let _serial = serial();
    let Some((_node, daemon, mut user)) = ready("report", "kappa") else {
        return;
    };
    user.ok("alloc 600");
    assert_eq!(
        user.call("bytes 9223372036854775809").as_deref(),
        Some("err 2"),
        "the fake driver is out of memory"
    );
    user.ok("alloc 600");
    let line = daemon.expect("would use 1258m on device 0");
    assert!(
        line.contains(&format!("process {} allocated past it", user.pid)),
        "{line}"
    );
}

/// `cuMemAllocPitch_v2` hands out pitch × height bytes, the pitch rounded up from the
/// width: rows of 1 byte take 512 each. Two allocations of a million such rows are
/// 1,024 MB under a 1g cap: the second is killed.
#[test]
fn a_pitched_allocation_counts_its_pitch_not_its_width() {
    let _serial = serial();
    let Some((mut node, daemon, mut user)) = ready("kill", "lambda") else {
        return;
    };
    user.ok("pitchw 1 1000000");
    let line = killed_at(&mut node, &daemon, &mut user, "pitchw 1 1000000");
    assert!(line.contains("would use 1024m on device 0"), "{line}");
}

/// CUDA reads `CUDA_VISIBLE_DEVICES` with `getenv`: with two assignments the first
/// wins, and the daemon reads it so (taking the last, as genv reads its own variable,
/// it once charged GPU 1's allocations to GPU 0).
#[test]
fn a_duplicated_visible_devices_is_read_as_cuda_reads_it() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    // genv sets CUDA_VISIBLE_DEVICES=1; one more assignment goes at the end.
    let exec = "genv activate --id mu; genv config gpu-memory 1g; genv attach --index 1; \
         exec python3 -c 'import ctypes, os, sys\n\
         env = [f\"{k}={v}\".encode() for k, v in os.environ.items()] + [b\"CUDA_VISIBLE_DEVICES=0\"]\n\
         envp = (ctypes.c_char_p * (len(env) + 1))(*env, None)\n\
         argv = (ctypes.c_char_p * 2)(sys.argv[1].encode(), None)\n\
         ctypes.CDLL(None).execve(argv[0], argv, envp)' \"$CUDA_USER\"";
    let mut user = CudaUser::start(&mut node, &cuda_env, exec);
    daemon.expect("caps held at the allocation: mu 1g");
    daemon.expect(&format!("Process {} is held at its allocations", user.pid));
    user.init(&daemon, "1");
    user.ok("ctx 0");
    user.ok("alloc 600");
    assert_eq!(user.call("alloc 600"), None);
    let line = daemon.expect(&format!("killed process {} at the allocation", user.pid));
    assert!(line.contains(" on device 1 "), "{line}");
}

/// CUDA also takes GPUs by UUID (`GPU-…`, or a prefix only one GPU has): a program that
/// names its GPU so is charged on that GPU. (Read as device numbers only, such a list
/// named no GPU at all, and the program allocated past its cap uncharged.)
#[test]
fn a_gpu_named_by_uuid_in_visible_devices_is_charged() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    // genv sets CUDA_VISIBLE_DEVICES=1; the program names the same GPU by its UUID.
    let mut user = CudaUser::start(
        &mut node,
        &cuda_env,
        "genv activate --id nu; genv config gpu-memory 1g; genv attach --index 1; \
         export CUDA_VISIBLE_DEVICES=GPU-fake-1",
    );
    daemon.expect("caps held at the allocation: nu 1g");
    daemon.expect(&format!("Process {} is held at its allocations", user.pid));
    user.init(&daemon, "GPU-fake-1");
    user.ok("ctx 0");
    user.ok("alloc 600");
    let line = killed_at(&mut node, &daemon, &mut user, "alloc 600");
    assert!(
        line.starts_with("Environment nu would use 1258m on device 1 "),
        "{line}"
    );
    assert_eq!(ledger_total(&node, &[user.pid], 1), 600 * MIB);
}

/// A UUID names a GPU only through NVML's device list: a program that starts CUDA
/// while NVML lists none (here, it fails to count them) is read again once NVML lists
/// them, at the next full cycle, and is charged from then on.
#[test]
fn a_uuid_read_before_nvml_listed_any_gpu_is_resolved_once_it_does() {
    let _serial = serial();
    let mut node = Node::new(2);
    let (lib, cuda_env) = node.cuda();
    let listed = serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(node.config_path()).unwrap(),
    )
    .unwrap();
    let mut failing = listed.clone();
    failing["fail"] = serde_json::json!({"nvmlDeviceGetCount_v2": 999});
    node.write_nvml(failing);
    let Some(daemon) = daemon(&node, &lib, "kill", &[]) else {
        return;
    };
    let mut user = CudaUser::start(
        &mut node,
        &cuda_env,
        "genv activate --id xi; genv config gpu-memory 1g; genv attach --index 1; \
         export CUDA_VISIBLE_DEVICES=GPU-fake-1",
    );
    daemon.expect("caps held at the allocation: xi 1g");
    daemon.expect(&format!("Process {} is held at its allocations", user.pid));
    user.init(&daemon, "GPU-fake-1");
    user.ok("ctx 0");
    user.ok("alloc 600");
    // NVML lists the GPUs again; genv's next write makes a full cycle, which reads the
    // program's list again.
    node.write_nvml(listed);
    Genv::get().bash(&node, "genv activate --id omicron");
    daemon.expect_count(
        &format!(
            "Process {} started CUDA with CUDA_VISIBLE_DEVICES=GPU-fake-1",
            user.pid
        ),
        2,
    );
    // A memory poll since: NVML's 600 MiB on GPU 1 is the baseline.
    two_memory_polls(&daemon);
    let line = killed_at(&mut node, &daemon, &mut user, "alloc 600");
    assert!(
        line.starts_with("Environment xi would use 1258m on device 1 "),
        "{line}"
    );
}

/// Returns once the daemon has made two memory polls more (the status it publishes,
/// at most a second old, shows one at least: two make sure one began after the call).
fn two_memory_polls(daemon: &EventDaemon) {
    let polls = |s: &serde_json::Value| s["counts"]["memory_checks"].as_u64();
    let now = daemon.wait_status("a memory poll", polls);
    daemon.wait_status("two more", |s| polls(s).filter(|n| *n >= now + 2));
}

/// An allocation made while a memory poll is asking NVML may or may not be in NVML's
/// answer: that account keeps its last baseline until a poll with nothing in flight, so
/// the allocation is counted once. (Taking NVML's figure with the delta read before the
/// question counted it twice until the next poll, and killed a process with room left
/// under its cap.)
#[test]
fn an_allocation_while_nvml_is_asked_is_counted_once() {
    let _serial = serial();
    let Some((mut node, daemon, mut user)) = ready("kill", "pi") else {
        return;
    };
    user.ok("alloc 600");
    let gates = NvmlGates::install(&node);
    gates.hold(ENUMERATION);
    // In flight for the poll that is asking: charged, and in the answer NVML will give.
    user.ok("alloc 300");
    // Let that poll answer, and hold the next one: the first has rebased by then.
    gates.release(ENUMERATION);
    gates.hold(ENUMERATION);
    // 950 MiB in all: under 1g (953 MiB).
    user.ok("alloc 50");
    gates.release(ENUMERATION);
    past_the_cap_after_a_quiet_poll(&mut node, &daemon, &mut user, "pi 1101m");
}

/// The same with an allocation and its free, both in flight for one poll, NVML's
/// answer made between them: the account's bytes are as they were, but it moved, and
/// keeps its baseline. (Told by its bytes, the poll looked quiet, and the freed 300 MiB
/// stayed counted.)
#[test]
fn an_allocation_and_its_free_while_nvml_is_asked_are_not_counted() {
    let _serial = serial();
    let Some((mut node, daemon, mut user)) = ready("kill", "rho") else {
        return;
    };
    user.ok("alloc 600");
    let gates = NvmlGates::install(&node);
    gates.hold(ENUMERATION);
    let pointer = user.ok("alloc 300");
    // NVML reads what is held (900 MiB), then is held again before it answers.
    gates.close(PROCESSES);
    gates.release(ENUMERATION);
    gates.waiting(PROCESSES, true);
    user.ok(&format!("free {pointer}"));
    gates.release(PROCESSES);
    // The poll has answered once the next one is held.
    gates.hold(ENUMERATION);
    // 900 MiB in all: under 1g.
    user.ok("alloc 300");
    gates.release(ENUMERATION);
    past_the_cap_after_a_quiet_poll(&mut node, &daemon, &mut user, "rho 1101m");
}

/// A process gone from NVML's list while its environment's account keeps its baseline
/// (another process's allocation in flight) has its charges taken off that account, as
/// at its exit: the kept baseline still holds them. (Dropped unaccounted, its 600 MiB
/// stayed counted, and the other process was killed with room left under the cap.)
#[test]
fn a_process_gone_while_its_account_keeps_its_baseline_is_taken_off() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let mut first = capped(&mut node, &cuda_env, &daemon, "sigma", &[0]);
    let mut second = CudaUser::start(&mut node, &cuda_env, "genv activate --id sigma");
    first.init(&daemon, "0");
    second.init(&daemon, "0");
    first.ok("ctx 0");
    second.ok("ctx 0");
    first.ok("alloc 600");
    two_memory_polls(&daemon);
    let gates = NvmlGates::install(&node);
    gates.hold(ENUMERATION);
    // Gone before NVML lists (its exit is read after the poll), and an allocation in
    // flight for the same account.
    // SAFETY: kill(2) takes no pointer; the process is one this test started.
    unsafe { libc::kill(first.pid as i32, libc::SIGKILL) };
    assert_eq!(node.wait_exit(first.pid, DEATH), Some(libc::SIGKILL));
    second.ok("alloc 300");
    gates.release(ENUMERATION);
    gates.hold(ENUMERATION);
    // The second holds 300 MiB; 600 more is 900, under 1g.
    second.ok("alloc 600");
    gates.release(ENUMERATION);
    past_the_cap_after_a_quiet_poll(&mut node, &daemon, &mut second, "sigma 1101m");
}

/// An account with something in flight at every poll keeps its baseline three polls in
/// a row at most: the fourth takes NVML's figure anyway, so memory only NVML sees (here
/// another process of the environment, which never calls libcuda) is not left out for
/// as long as the environment keeps allocating. (Like every test of the gates, it
/// counts on the daemon asking NVML only for its memory polls: no GPU node is opened
/// meanwhile, which would make it ask for an open check too.)
#[test]
fn an_account_always_in_flight_takes_nvmls_figure_at_the_fourth_poll() {
    let _serial = serial();
    let Some((mut node, daemon, mut user)) = ready("kill", "tau") else {
        return;
    };
    user.ok("alloc 300");
    let other = node.spawn(Some("tau"), &[]);
    two_memory_polls(&daemon);
    let gates = NvmlGates::install(&node);
    // 500 MiB that NVML lists and the probes never see.
    let ledger = node.cuda_ledger_dir().unwrap();
    std::fs::write(ledger.join(format!("{other}-0")), (500 * MIB).to_string()).unwrap();
    for _ in 0..4 {
        gates.hold(ENUMERATION);
        user.ok("alloc 1");
        gates.release(ENUMERATION);
    }
    // The fourth has rebased once the next is held: 304 + 500 MiB, and 200 more is
    // past 1g (953 MiB).
    gates.hold(ENUMERATION);
    assert_eq!(user.call("alloc 200"), None, "the 500 MiB were left out");
    gates.release(ENUMERATION);
    assert_eq!(node.wait_exit(user.pid, DEATH), Some(libc::SIGKILL));
    daemon.expect(&format!("killed process {} at the allocation", user.pid));
}

/// Once a poll with nothing in flight has taken NVML's figure (held: 900 or 950 MiB),
/// an allocation that takes the environment to 1050 MiB is killed, and the line says
/// `env would_use`.
fn past_the_cap_after_a_quiet_poll(
    node: &mut Node,
    daemon: &EventDaemon,
    user: &mut CudaUser,
    would_use: &str,
) {
    two_memory_polls(daemon);
    let held: u64 = node.cuda_ledger().get(&(user.pid, 0)).copied().unwrap();
    let line = killed_at(node, daemon, user, &format!("alloc {}", 1050 - held / MIB));
    let (env, mb) = would_use.split_once(' ').unwrap();
    assert!(
        line.starts_with(&format!("Environment {env} would use {mb} on device 0 ")),
        "{line}"
    );
}

/// `refuse` where the kernel lets a uprobe program set registers (`GENV_TEST_KERNEL_REFUSES=1`,
/// which the VM sets on its newest kernel): the call that would cross the cap returns
/// `CUDA_ERROR_OUT_OF_MEMORY` (2) without running, and the program lives. Elsewhere
/// (this host's 6.18, Debian's 6.1 and 6.12) the daemon says at start, and in status,
/// that it kills instead, and does. Either way the other is a failure, never a skip.
#[test]
fn refuse_returns_out_of_memory_where_the_kernel_lets_it_and_kills_elsewhere() {
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("refuse") else {
        return;
    };
    let expected = std::env::var("GENV_TEST_KERNEL_REFUSES").as_deref() == Ok("1");
    let mode = daemon.wait_status("memory_at_alloc in status", |s| {
        s["memory_at_alloc"].as_str().map(str::to_owned)
    });
    let mut first = capped(&mut node, &cuda_env, &daemon, "rho", &[0]);
    first.init(&daemon, "0");
    first.ok("ctx 0");
    let pointer = first.ok("alloc 600");
    if !expected {
        assert!(
            mode.starts_with("kill (refuse asked for; the kernel refused the refusing programs: "),
            "{mode}: this kernel loaded the refusing programs (set GENV_TEST_KERNEL_REFUSES=1 where it should)"
        );
        daemon.expect(
            "--memory-at-alloc refuse: this kernel does not let a uprobe program set registers (",
        );
        killed_at(&mut node, &daemon, &mut first, "alloc 600");
        return;
    }
    assert_eq!(
        mode, "refuse",
        "the kernel should have loaded the refusing programs"
    );
    // Past the cap: out-of-memory, the out-pointer untouched (still 0), the driver
    // never called, the program alive.
    assert_eq!(first.call("alloc 600").as_deref(), Some("err 2"));
    assert_eq!(ledger_total(&node, &[first.pid], 0), 600 * MIB);
    assert!(node.alive(first.pid));
    let line = daemon.expect(&format!(
        "refused an allocation of 629m by process {}",
        first.pid
    ));
    assert!(
        line.starts_with(
            "Environment rho would use 1258m on device 0 which is 258m over its capacity of 1g;"
        ),
        "{line}"
    );
    // Nothing of the refused call stayed charged: the cap, to the byte, fits.
    first.ok(&format!("bytes {}", CAP - 600 * MIB));
    assert_eq!(first.call("bytes 1").as_deref(), Some("err 2"));
    // A free, then an allocation that fits.
    first.ok(&format!("free {pointer}"));
    first.ok("alloc 300");
    refused_racing(&mut node, &cuda_env, &daemon, first);
}

/// Two processes of the environment racing over its cap: both are refused, never both
/// let through; both live; the lines are held back to one per process at a time.
fn refused_racing(
    node: &mut Node,
    cuda_env: &[(String, String)],
    daemon: &EventDaemon,
    mut first: CudaUser,
) {
    let mut second = CudaUser::start(node, cuda_env, "genv activate --id rho");
    second.init(daemon, "0");
    second.ok("ctx 0");
    let held = ledger_total(node, &[first.pid, second.pid], 0);
    let room = (CAP - held) / (100 * MIB);
    let calls = ["alloc 100"; 12];
    first.send(&calls);
    second.send(&calls);
    let (mut granted, mut refused) = (0, Vec::new());
    for user in [&mut first, &mut second] {
        let mut own = 0;
        for _ in 0..calls.len() {
            match user.answer().as_deref() {
                Some(a) if a.starts_with("ok ") => granted += 1,
                Some("err 2") => own += 1,
                other => panic!("process {}: {other:?}", user.pid),
            }
        }
        refused.push(own);
        assert!(node.alive(user.pid));
    }
    assert!(
        granted <= room,
        "{granted} × 100 MiB granted with room for {room}"
    );
    assert!(refused.iter().all(|n| *n > 0), "refused {refused:?}");
    assert!(ledger_total(node, &[first.pid, second.pid], 0) <= CAP);
    let counted = |s: &serde_json::Value| {
        s["counts"]["refused_at_alloc"]
            .as_u64()
            .filter(|n| *n >= 2 + refused.iter().sum::<u64>())
    };
    daemon.wait_status("every refusal counted", counted);
    let said = daemon
        .lines()
        .iter()
        .filter(|l| {
            l.contains(&format!(
                "refused an allocation of 104m by process {}",
                second.pid
            ))
        })
        .count() as u64;
    assert!(
        said < refused[1],
        "{said} lines for {} refusals",
        refused[1]
    );
}
