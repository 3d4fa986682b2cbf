//! `--memory-at-alloc` on libcuda copies the daemon was not told about (a user's, a
//! container's, renamed, under odd paths, on FUSE), found in the processes that open
//! GPU nodes and probed within a budget; and `cargo xtask gpu-check`'s own check, run
//! here on its `fake` workload. Host only, like the rest of the copies' logic: the
//! kernel side is the same uprobes `memory_at_alloc` proves on every kernel.

use std::path::Path;
use std::process::Command;

use genv_enforcer_tests::cuda::{
    CudaEnv, CudaUser, ENUMERATION, NvmlGates, capped, daemon, killed_at, setup,
};
use genv_enforcer_tests::events::make_gpu_node;
use genv_enforcer_tests::mounts::{self, SilentFuse};
use genv_enforcer_tests::{DEATH, Genv, Node, artefact, serial};

/// A copy of the node's libcuda at `path` (its directories made), which a program
/// started with `cuda_env` then loads, and whose `cuInit` opens GPU 0's node as CUDA's
/// does. The node.
fn use_copy(node: &Node, cuda_env: &mut CudaEnv, path: &Path) -> std::path::PathBuf {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::copy(artefact("libcuda_fake.so"), path).unwrap();
    let gpu = node.dir.join("nvidia0");
    if !gpu.exists() {
        make_gpu_node(&gpu);
    }
    cuda_env.retain(|(key, _)| key != "GENV_FAKE_CUDA_LIB" && key != "GENV_FAKE_CUDA_OPENS");
    cuda_env.push(("GENV_FAKE_CUDA_LIB".into(), path.to_str().unwrap().into()));
    cuda_env.push(("GENV_FAKE_CUDA_OPENS".into(), gpu.to_str().unwrap().into()));
    gpu
}

/// A program on a copy of libcuda at `path` (under the node's directory), in the
/// environment `eid` capped at 1g: it starts CUDA, the daemon probes the copy, and the
/// allocation that crosses the cap is killed in its call.
fn copy_is_held_to_the_cap(path: &str, eid: &str) {
    let _serial = serial();
    let Some((mut node, mut cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let path = node.dir.join(path);
    use_copy(&node, &mut cuda_env, &path);
    let mut user = capped(&mut node, &cuda_env, &daemon, eid, &[0]);
    user.ok("init");
    daemon.expect(&format!(
        "process {} maps a libcuda not probed yet",
        user.pid
    ));
    user.ok("ctx 0");
    user.ok("alloc 600");
    killed_at(&mut node, &daemon, &mut user, "alloc 600");
}

/// A libcuda the daemon was not told about (a user's copy, a container's own) is
/// probed once a process that maps it opens a GPU node, which CUDA does in `cuInit`,
/// before any allocation: the copy does not get past the cap.
#[test]
fn a_copy_of_libcuda_is_probed_when_its_process_opens_a_gpu() {
    copy_is_held_to_the_cap("mine/libcuda.so.1", "nu");
}

/// A copy is known by what it exports, not by its name.
#[test]
fn a_renamed_copy_is_probed_and_killed_at_the_crossing_allocation() {
    copy_is_held_to_the_cap("mine/libmine.so", "renamed");
}

/// The path of a mapping is everything after its fifth field, spaces and all.
#[test]
fn a_copy_under_a_path_with_a_space_is_probed() {
    copy_is_held_to_the_cap("my libs/libcuda.so.1", "spaced");
}

/// NVML's init opens every GPU node (eight on an eight-GPU node), and a program may
/// make it before it loads its own libcuda: those opens do not use up the looks, and
/// CUDA's own open, once the library is loaded, has the copy probed.
#[test]
fn a_copy_loaded_after_eight_gpu_opens_is_probed_at_cudas_own_open() {
    let _serial = serial();
    let Some((mut node, mut cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let path = node.dir.join("late/libcuda.so.1");
    let gpu = use_copy(&node, &mut cuda_env, &path);
    cuda_env.push(("GENV_CUDA_USER_LAZY".into(), "1".into()));
    let mut user = capped(&mut node, &cuda_env, &daemon, "late", &[0]);
    for _ in 0..8 {
        user.ok(&format!("open {}", gpu.display()));
    }
    // The daemon has handled all eight before the library is loaded.
    daemon.expect_count(&format!("Process {} (thread", user.pid), 8);
    user.ok("load");
    user.ok("init");
    daemon.expect(&format!(
        "process {} maps a libcuda not probed yet",
        user.pid
    ));
    user.ok("ctx 0");
    user.ok("alloc 600");
    killed_at(&mut node, &daemon, &mut user, "alloc 600");
}

/// The daemon hears of events after the fact. A shell opened GPU 0 five times, then
/// exec'd a program on a libcuda copy: handled after the exec, its opens' looks read
/// the program's mappings and probed the copy, and then the exec, taken as the end of
/// what had been read, took the copy's probes off again (`no live process maps the
/// libcuda copy`), so that the program's first allocations went unheld until the look
/// at its next open (found on a quiet machine: 3 s late, two allocations past the
/// cap). The daemon is held in a memory poll (the fake NVML's gate) while the shell
/// opens and execs, so that it catches up on them after the exec, every time.
#[test]
fn a_program_whose_shell_opened_gpus_before_its_exec_keeps_its_copy_probed() {
    let _serial = serial();
    let Some((mut node, mut cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let path = node.dir.join("execd/libcuda.so.1");
    let gpu = use_copy(&node, &mut cuda_env, &path);
    // The environment and its cap first (memory polls run once an environment has a
    // cap), in a shell that stays.
    let keeper = Genv::get()
        .shell_command(
            &node,
            "genv activate --id execd; genv config gpu-memory 1g; exec sleep 600",
        )
        .spawn()
        .unwrap();
    node.adopt(keeper, &[]);
    daemon.expect("caps held at the allocation: execd 1g");
    let gates = NvmlGates::install(&node);
    gates.hold(ENUMERATION);
    let setup = format!(
        "genv activate --id execd; genv attach --index 0; for i in 1 2 3 4 5; do : < {gpu}; done",
        gpu = gpu.display()
    );
    let mut user = CudaUser::start(&mut node, &cuda_env, &setup);
    gates.release(ENUMERATION);
    daemon.expect_count(&format!("Process {} (thread", user.pid), 5);
    daemon.expect(&format!("Process {} is held at its allocations", user.pid));
    daemon.expect(&format!(
        "process {} maps a libcuda not probed yet",
        user.pid
    ));
    user.ok("init");
    user.ok("ctx 0");
    user.ok("alloc 600");
    // Its probes were never taken off while it lived (they come off at its exit).
    let unprobed: Vec<String> = (daemon.lines().into_iter())
        .filter(|l| l.contains("no live process maps the libcuda copy"))
        .collect();
    assert!(unprobed.is_empty(), "{unprobed:#?}");
    killed_at(&mut node, &daemon, &mut user, "alloc 600");
}

/// A uid has a few copies probed at once; its next is refused while they are, and
/// probed once one of their processes exits (its probes come off then). So copies
/// that come and go with their processes (containers) never use the budget up.
#[test]
fn a_place_in_the_copy_budget_comes_back_when_its_processes_exit() {
    const USER: u32 = 64_611;
    let _serial = serial();
    let Some((mut node, cuda_env, daemon)) = setup("kill") else {
        return;
    };
    let start = |node: &mut Node, at: usize| {
        let mut env = cuda_env.clone();
        let gpu = use_copy(
            node,
            &mut env,
            &node.dir.join(format!("c{at}/libcuda.so.1")),
        );
        // In an environment (of no one): the daemon looks only at processes in one.
        env.push(("GENV_ENVIRONMENT_ID".into(), "budget".into()));
        let mut command = Command::new(artefact("cuda-user"));
        std::os::unix::process::CommandExt::uid(&mut command, USER);
        let mut user = CudaUser::spawn(node, &env, command);
        user.ok("init");
        (user, gpu)
    };
    let probed = |pid: u32| format!("process {pid} maps a libcuda not probed yet");
    let mut first = Vec::new();
    for at in 0..4 {
        let (user, _) = start(&mut node, at);
        daemon.expect(&probed(user.pid));
        first.push(user);
    }
    // The fifth's open is handled (its look made before the line), and its copy left.
    let (mut fifth, gpu) = start(&mut node, 4);
    daemon.expect(&format!("Process {} (thread", fifth.pid));
    let lines = daemon.lines();
    assert!(
        !lines.iter().any(|l| l.contains(&probed(fifth.pid))),
        "{lines:#?}"
    );
    let gone = first.remove(0);
    drop(gone.stdin); // cuda-user exits at the end of its input
    assert_eq!(node.wait_exit(gone.pid, DEATH), Some(0));
    fifth.ok(&format!("open {}", gpu.display()));
    daemon.expect(&probed(fifth.pid));
    daemon.expect("no live process maps the libcuda copy");
}

/// A library on a FUSE mount (any user's server, which may never answer) is refused
/// unopened: the daemon says so and goes on, instead of waiting in `open` or `stat` for
/// ever. A server that never answers stands for it, mounted over the library in the
/// daemon's own mount namespace; the library beside it is probed as usual.
#[test]
fn a_libcuda_on_a_fuse_mount_is_refused_unopened() {
    let _serial = serial();
    let mut node = Node::new(2);
    let (lib, _) = node.cuda();
    let silent = node.dir.join("silent.so");
    std::fs::write(&silent, b"not read").unwrap();
    // Declared after the node, so dropped first: closing the server frees anything
    // stuck on the mount.
    let fuse = SilentFuse::new();
    node.before_exec = Some(mounts::private_namespace(Some((&fuse, &silent))));
    let Some(daemon) = daemon(
        &node,
        &lib,
        "kill",
        &["--cuda-lib", silent.to_str().unwrap()],
    ) else {
        return;
    };
    daemon.expect(&format!(
        "not probing {}: on a FUSE file system: not read",
        silent.display()
    ));
}

/// `cargo xtask gpu-check` (`tests/gpu-check.py`), the real-GPU check, run here on its
/// `fake` workload (cuda-user on this node's libcuda and NVML): with `kill` it passes,
/// having seen the allocation that crosses the cap killed in its call; with `report`
/// (nothing stops the process) it fails, saying why; with `refuse` on a kernel that
/// cannot refuse (this host's), it fails too. What it checks on a GPU node with PyTorch
/// and CuPy is the same code.
#[test]
fn the_gpu_check_passes_when_the_cap_holds_and_fails_when_it_does_not() {
    let _serial = serial();
    let mut node = Node::new(2);
    let (lib, cuda_env) = node.cuda();
    let [gpu0, gpu1] = genv_enforcer_tests::events::test_node_flags();
    let tier = genv_enforcer_tests::events::requested_tier();
    // In `report` mode the memory rule's cycle is put off past the check: it would
    // otherwise SIGTERM the workload once NVML shows it over the cap, racing the
    // check's own NVML samples (on a loaded CI machine it won, and NVML was never seen
    // over the cap). What `report` shows is that nothing stops the allocation itself.
    let check = |mode: &str| {
        let memory_interval = if mode == "kill" { "0.5" } else { "3600" };
        let report = node.dir.join(format!("gpu-check-{mode}.md"));
        let output = Command::new("python3")
            .arg(genv_enforcer_tests::workspace_root().join("tests/gpu-check.py"))
            .args(["--enforcer", artefact("genv-enforcer").to_str().unwrap()])
            .args(["--workloads", "fake", "--cap", "1g", "--step", "256"])
            .args(["--fine-step", "256", "--settle", "1", "--timeout", "60"])
            .args(["--mode", mode])
            .arg("--state-dir")
            .arg(&node.state)
            .arg("--report")
            .arg(&report)
            .args(["--", "--cuda-lib", lib.to_str().unwrap()])
            .args(["--memory-interval", memory_interval, "--bpf-tier", &tier])
            .args(["--gpu-node", &gpu0, "--gpu-node", &gpu1])
            .env("PATH", Genv::get().path())
            .env("GENV_FAKE_NVML_CONFIG", node.config_path())
            .env("GENV_ENFORCER_NVML_LIB", artefact("libnvidia_ml_fake.so"))
            .env("CUDA_USER", artefact("cuda-user"))
            .envs(cuda_env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        let said = std::fs::read_to_string(&report).unwrap_or_default();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        (output.status.code(), said, stderr)
    };
    let (code, said, stderr) = check("kill");
    if code != Some(0)
        && !genv_enforcer_tests::events::bpf_required()
        && stderr.contains("did not say \"are held")
    {
        eprintln!("skipped (GENV_REQUIRE_BPF is not set): the daemon loaded no probes: {stderr}");
        return;
    }
    assert_eq!(code, Some(0), "{said}\n{stderr}");
    eprintln!("{said}");
    assert!(said.contains("- verdict: PASS"), "{said}");
    // 3 × 256 MiB returned, each seen by NVML; the 4th crosses 10^9 bytes and is
    // killed in its call.
    let row = said.lines().find(|l| l.starts_with("| fake |")).unwrap();
    assert!(
        row.contains("| 768 MiB | 1024 MiB | 768 MiB | 768 MiB (")
            && row.contains("| SIGKILL | pass |"),
        "{row}"
    );
    assert!(said.contains("at the allocation"), "{said}");

    let (code, said, stderr) = check("report");
    assert_eq!(code, Some(1), "{said}\n{stderr}");
    assert!(said.contains("- verdict: FAIL"), "{said}");
    let row = said.lines().find(|l| l.starts_with("| fake |")).unwrap();
    assert!(
        row.contains("not SIGKILL") && row.contains("over the cap"),
        "{row}"
    );

    // `refuse` on this host, whose kernel cannot refuse: the daemon kills instead, and
    // the check fails saying the program was not refused and did not live.
    let (code, said, stderr) = check("refuse");
    assert_eq!(code, Some(1), "{said}\n{stderr}");
    let row = said.lines().find(|l| l.starts_with("| fake |")).unwrap();
    assert!(
        row.contains("no allocation was refused") && row.contains("it should have lived"),
        "{row}"
    );
}
