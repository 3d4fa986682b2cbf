//! `cargo xtask test`: the whole suite, what CI runs (`.ci/run`).
//!
//! In order: the tools installed, formatting, lints, then everything built: the
//! workspace, the host's test executables, and what the VM runs (the kernels, the
//! guest's suites, genv's venv). Nothing builds after that point. Then three lanes run
//! side by side, on this machine's two cores:
//!
//! 1. the 6.12 guest (every VM tier, and the `each_tier_` tests on each), then the 6.1
//!    guest and the harness's refusal check on 6.1's kernel;
//! 2. the host's suites (the tier-dependent ones on the tracepoint tier), then the unit
//!    under systemd on 6.12's kernel (the `.deb`, which the `dist` suite built);
//! 3. the newest kernel's guest (7, with the `memory_at_alloc` tests).
//!
//! A guest under TCG keeps about one core busy, and the host's suites mostly wait on
//! daemons and processes: the third lane takes what the host's leave. The guests are kernels of
//! their own (their daemons and processes never see the host's), and share with the
//! host only what was built before they started (read-only and cached in the guest,
//! `xtask-vm/src/initramfs.rs`) and the work tree. The guests' console lines are printed
//! with their kernel (`[vm 6.1] …`). Every job runs even where one before it failed;
//! the run then fails naming each that did.

use anyhow::{Result, bail};

use crate::timings::{self, Lane, job};
use crate::vm::{self, KERNELS, Options, Outcome};
use crate::{
    cargo, ensure_apt, ensure_openssh, ensure_promtool, ensure_python_venv, root, run, toolchain,
};

/// `cargo xtask test [-- CARGO TEST ARGS]`: with arguments, the host's tests only.
pub fn test(cargo_args: &[String]) -> Result<()> {
    // The end-to-end tests make device nodes (mknod), run processes as other users and
    // signal them: the enforcer's own privileges.
    if !rustix::process::geteuid().is_root() {
        bail!("the test suite needs root (mknod, other uids): run `sudo -E cargo xtask test`");
    }
    let result = phases(cargo_args);
    let table = timings::table();
    eprintln!("xtask: where the time went:{table}");
    if let Ok(dir) = crate::target_dir() {
        let _ = std::fs::write(dir.join("test-timings.md"), &table);
    }
    result
}

fn phases(cargo_args: &[String]) -> Result<()> {
    timings::phase("install tools", install_tools)?;
    timings::phase("fmt", || {
        run(&mut cargo(&["fmt", "--all", "--", "--check"]))
    })?;
    timings::phase("clippy", || {
        run(cargo(&["clippy", "--workspace", "--all-targets"]).args(["--", "-D", "warnings"]))
    })?;
    timings::phase("clippy (bpf)", clippy_bpf)?;
    timings::phase("build", || {
        run(&mut cargo(&["build", "--workspace"]))?;
        run(&mut host_tests_command(cargo_args, &["--no-run"]))
    })?;
    allow_an_untrusted_checkout();
    if !cargo_args.is_empty() {
        timings::phase("host tests", || {
            timings::cargo_test_by_suite("host tests", &mut host_tests_command(cargo_args, &[]))
        })?;
        eprintln!("xtask: test arguments given: the VM suites were not run (cargo xtask vm-test)");
        return Ok(());
    }
    let options = Options::default();
    let (kernels, guest) = timings::phase("vm build", || vm::prepare(&root(), &options))?;
    vm_and_host_lanes(&guest, &options, &kernels)
}

/// The three lanes, side by side, once everything is built; what failed, summed up.
fn vm_and_host_lanes(
    guest: &vm::Guest,
    options: &Options,
    kernels: &[(vm::Series, vm::Kernel)],
) -> Result<()> {
    let kernel = |version: &str| {
        (kernels.iter())
            .find(|(series, _)| series.version == version)
            .ok_or_else(|| anyhow::anyhow!("cargo xtask test boots kernel {version}, not prepared"))
    };
    let [first, middle, newest] = [kernel("6.1")?, kernel("6.12")?, kernel("7")?];
    let outcome = std::sync::Mutex::new(Outcome { runs: Vec::new() });
    let boot = |prepared| boot_job(guest, options, &outcome, prepared);
    // One boot at a time may write a kernel's files: 6.1's for its suites and the
    // refusal check, 6.12's for its suites and the systemd boot, each held while it runs.
    let (files_61, files_612) = (std::sync::Mutex::new(()), std::sync::Mutex::new(()));
    let systemd = vm::SYSTEMD_KERNEL;
    let systemd_kernel = kernel(systemd)?;
    let systemd_files = if systemd == "6.1" {
        &files_61
    } else {
        &files_612
    };
    // Three lanes on two cores: the host's suites mostly wait on processes, and a third
    // lane fills what they leave (`docs/dev/testing.md`, where the time goes). The
    // systemd boot comes after the host's suites, on 6.12's kernel, whose suites are long
    // done by then in lane 1: at the end of lane 1 (on 6.1's kernel) it ran alone on the
    // two cores, and made that lane the longest (1,233 s against 1,054 and 1,082).
    let systemd_boot = job(format!("vm systemd ({systemd})"), || {
        vm::systemd_check(guest, systemd_kernel)
    });
    let refusal = job("vm refusal check", || vm::refusal_check(guest, &first.1));
    let lanes: Vec<Lane> = vec![
        vec![
            holding(&files_612, boot(middle)),
            holding(&files_61, boot(first)),
            holding(&files_61, refusal),
        ],
        vec![
            job("host tests", host_tests),
            holding(systemd_files, systemd_boot),
        ],
        vec![boot(newest)],
    ];
    let failures = timings::lanes("host tests and vm (side by side)", lanes);
    let outcome = outcome.into_inner().unwrap();
    summary(&outcome, &failures)
}

/// `named`, run while it holds `files`.
fn holding<'a>(
    files: &'a std::sync::Mutex<()>,
    (name, run): (String, timings::Job<'a>),
) -> (String, timings::Job<'a>) {
    job(name, move || {
        let _files = files.lock().unwrap_or_else(|e| e.into_inner());
        run()
    })
}

/// One kernel's guest, every VM tier, as a lane's job; its run kept in `outcome`.
fn boot_job<'a>(
    guest: &'a vm::Guest,
    options: &'a Options,
    outcome: &'a std::sync::Mutex<Outcome>,
    (series, kernel): &'a (vm::Series, vm::Kernel),
) -> (String, timings::Job<'a>) {
    let series = *series;
    let run = move || {
        let run = vm::run(guest, series, kernel, options)?;
        outcome.lock().unwrap().runs.push(run);
        Ok(())
    };
    job(format!("vm {}", series.version), run)
}

/// The kernel programs' code is `cfg(target_arch = "bpf")`: the host's clippy sees none
/// of it, so it is linted for its own target too, with the nightly toolchain that builds
/// it (in a target directory of its own: its `core` is built for BPF).
fn clippy_bpf() -> Result<()> {
    let target = crate::target_dir()?.join("bpf-clippy");
    let mut clippy = std::process::Command::new("rustup");
    clippy
        .current_dir(root().join("genv-ebpf"))
        .args(["run", "nightly", "cargo", "clippy", "--release"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .args(["--", "-D", "warnings"])
        .env("CARGO_TARGET_DIR", target)
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("CARGO");
    run(&mut clippy)
}

/// What the suites need on this machine, installed where missing.
fn install_tools() -> Result<()> {
    ensure_python_venv()?;
    ensure_openssh()?;
    ensure_promtool(&crate::target_dir()?)?;
    // The dist suite checks the packages with these (apt lists updated first, as a fresh
    // machine needs).
    ensure_apt(&["lintian"], "lintian")?;
    ensure_apt(&["rpm"], "rpmbuild")?;
    toolchain::ensure_ebpf_toolchain()
}

/// `cargo test --workspace` with `extra` cargo flags and `cargo_args`; the tier-dependent
/// tests on the tracepoint tier (the one this machine's kernel loads), unless
/// `GENV_TEST_BPF_TIER` says otherwise.
fn host_tests_command(cargo_args: &[String], extra: &[&str]) -> std::process::Command {
    let mut test = cargo(&["test", "--workspace"]);
    test.args(extra).args(cargo_args);
    if std::env::var_os("GENV_TEST_BPF_TIER").is_none() {
        test.env("GENV_TEST_BPF_TIER", "tracepoint");
    }
    test
}

/// The suites run the binaries from the target directory as root, on the host, in the
/// guests (over 9p, owners kept) and on the remote tests' hosts (through sudo). A
/// checkout where another user could replace them is this machine's business, not the
/// suites': where the built binary refuses its own place, every process from here on
/// gets `GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY=1`, said. `tests/safety.rs` checks the
/// refusal itself, without it.
fn allow_an_untrusted_checkout() {
    if built_binary_refused_as_root() {
        eprintln!(
            "xtask test: genv-enforcer refuses to run as root from this target directory \
             (another user owns or can write a directory above it); the suites run with \
             GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY=1"
        );
        // SAFETY: no other thread of this process runs yet (the lanes start later).
        unsafe { std::env::set_var("GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY", "1") };
    }
}

/// Whether the built `genv-enforcer`, run as root, refuses to start from where it is.
fn built_binary_refused_as_root() -> bool {
    let Ok(binary) = crate::target_dir().map(|t| t.join("debug/genv-enforcer")) else {
        return false;
    };
    std::process::Command::new(binary)
        .args(["status", "--run-dir", "/nonexistent"])
        .env_remove("GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stderr).contains("not running as root from"))
}

/// Every host test, each suite timed; every suite runs even where one before it failed
/// (one failing unit test must not hide the end-to-end suites' results).
fn host_tests() -> Result<()> {
    timings::cargo_test_by_suite(
        "host tests",
        &mut host_tests_command(&[], &["--no-fail-fast"]),
    )
}

/// What the lanes showed: each kernel's line, then the failures named, or what passed.
fn summary(outcome: &Outcome, failures: &[String]) -> Result<()> {
    for run in &outcome.runs {
        eprintln!("xtask: {}", run.summary());
    }
    if !failures.is_empty() || !outcome.passed() {
        let mut failed = failures.to_vec();
        if !outcome.passed() {
            failed.push(format!(
                "the VM suites failed: {} (see their output above)",
                outcome.failures().join("; ")
            ));
        }
        bail!("failed:\n  {}", failed.join("\n  "));
    }
    let kernels: Vec<&str> = KERNELS.iter().map(|k| k.version).collect();
    eprintln!(
        "xtask: all passed: the tier suites on tracepoint (host), on {} in the VM on \
         kernels {}, the harness's refusal check, and the unit under systemd",
        vm::VM_TIERS.join(", "),
        kernels.join(", ")
    );
    Ok(())
}
