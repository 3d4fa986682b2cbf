//! Project tasks: `cargo xtask test | demo | bench`.
//!
//! - `test`: the whole suite, on a fresh machine of this kind: checks formatting and
//!   lints, builds every artefact the end-to-end tests run (the enforcer, the fake NVML,
//!   the helper process), then runs every test on the host (the tier-dependent ones on
//!   the tracepoint tier), then the tier-dependent ones on every VM tier (LSM, fmod_ret, fentry)
//!   in a VM, on each of Debian bookworm's kernels (6.1, then 6.12), then the VM
//!   harness's refusal check (on 6.1). The real genv 1.4.3 is installed from PyPI
//!   into `target/genv-venv` on first use; openssh-server and sudo from apt, for the
//!   remote tests' hosts.
//! - `vm-test`: the tier-dependent suites in Debian's kernels under QEMU ([`vm`]).
//! - `demo`: the event-driven enforcer on a simulated GPU node with no GPU: the fake
//!   NVML, a genv environment, intruders opening a GPU node, and how fast they end.
//! - `build-ebpf`: the kernel programs' object alone (the enforcer's build script builds
//!   and embeds it too). `test`, `demo` and `build-ebpf` first install what building it
//!   needs ([`toolchain`]).
//! - `install` / `uninstall`: genv-enforcer on a node, with its `genv` front and its
//!   systemd unit ([`install`]).
//! - `dist`: the `.deb`, the RPM, the Python wheel and the tarball, built against glibc
//!   2.28, into `target/dist/` ([`dist`]); they and `install` lay down one list of files
//!   ([`layout`]).
//! - `bench`: one full enforcement cycle with 0, 100 and 1,000 GPU processes, the
//!   event-driven reaction to a GPU open, the kernel programs' cost per run, and remote
//!   enforcement over SSH ([`bench_remote`]); writes the tables to `docs/bench.md`.

mod bench_alloc;
mod bench_bpf_log;
mod bench_events;
mod bench_footprint;
mod bench_remote;
mod demo;
mod dist;
mod gpu_check;
mod install;
mod layout;
mod sim;
mod timings;
mod toolchain;
mod vm;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(&args[1..]),
        Some("demo") => demo::run(),
        Some("bench") => match args.get(1).map(String::as_str) {
            None => bench(),
            Some("footprint") => bench_footprint_only(),
            Some("bpf-log") => bench_section(bench_bpf_log::run),
            Some("memory-at-alloc") => bench_section(bench_alloc::run),
            Some("remote") => bench_section(bench_remote::run),
            Some(other) => {
                bail!(
                    "cargo xtask bench: unknown section {other:?} (footprint, bpf-log, memory-at-alloc, remote)"
                )
            }
        },
        Some("build-ebpf") => toolchain::build_ebpf(&root()),
        Some("vm-test") => vm_test(&args[1..]),
        Some("install") => install::install(&args[1..]),
        Some("dist") => dist::run(&args[1..]),
        Some("uninstall") => install::uninstall(&args[1..]),
        Some("gpu-check") => gpu_check::run_check(&args[1..]),
        _ => bail!(
            "usage: cargo xtask <test [-- cargo test args] | vm-test [--kernel 6.1|6.12|all] \
             [--tiers LIST] [--lsm LIST] [-- test args] | demo | bench [footprint|bpf-log|memory-at-alloc|remote] | build-ebpf | \
             install [--root DIR] [--binary PATH] | dist | uninstall [--root DIR] | gpu-check [-- ARGS]>"
        ),
    }
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_owned()
}

/// Cargo's target directory: `target/` in the work tree unless `CARGO_TARGET_DIR` or
/// cargo's configuration put it elsewhere (shared target directories are common), as
/// `cargo metadata` reports it.
pub fn target_dir() -> Result<PathBuf> {
    let output = cargo(&["metadata", "--no-deps", "--format-version", "1"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!("cargo metadata failed: {}", output.status);
    }
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("cargo metadata's output")?;
    match metadata["target_directory"].as_str() {
        Some(dir) => Ok(PathBuf::from(dir)),
        None => bail!("cargo metadata names no target_directory"),
    }
}

pub fn cargo(args: &[&str]) -> Command {
    let mut command = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    command.args(args).current_dir(root());
    command
}

pub fn run(command: &mut Command) -> Result<()> {
    eprintln!("xtask: {command:?}");
    let status = command
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}

fn test(extra: &[String]) -> Result<()> {
    // The end-to-end tests make device nodes (mknod), run processes as other users and
    // signal them: the enforcer's own privileges.
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the test suite needs root (mknod, other uids): run `sudo -E cargo xtask test`");
    }
    let result = test_phases(extra);
    let table = timings::table();
    eprintln!("xtask: where the time went:{table}");
    if let Ok(dir) = target_dir() {
        let _ = std::fs::write(dir.join("test-timings.md"), &table);
    }
    result
}

fn test_phases(extra: &[String]) -> Result<()> {
    timings::phase("install tools", || {
        ensure_python_venv()?;
        ensure_openssh()?;
        // The dist suite checks the packages with these (apt lists updated first, as a
        // fresh machine needs).
        ensure_apt(&["lintian"], "lintian")?;
        ensure_apt(&["rpm"], "rpmbuild")?;
        toolchain::ensure_ebpf_toolchain()
    })?;
    timings::phase("fmt", || {
        run(&mut cargo(&["fmt", "--all", "--", "--check"]))
    })?;
    timings::phase("clippy", || {
        run(&mut cargo(&[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    timings::phase("build", || run(&mut cargo(&["build", "--workspace"])))?;
    // The host runs the tier-dependent suites on the tracepoint tier (the one this
    // machine's kernel loads); the VM runs them on the others, on every kernel.
    let mut test = cargo(&["test", "--workspace"]);
    test.args(extra.iter().skip_while(|a| *a == "--"));
    if std::env::var_os("GENV_TEST_BPF_TIER").is_none() {
        test.env("GENV_TEST_BPF_TIER", "tracepoint");
    }
    timings::cargo_test_by_suite("host tests", &mut test)?;
    if !extra.is_empty() {
        eprintln!("xtask: test arguments given: the VM suites were not run (cargo xtask vm-test)");
        return Ok(());
    }
    // Every kernel, every VM tier.
    let outcome = timings::phase("vm suites", || vm::test(&root(), &vm::Options::parse(&[])?))?;
    if !outcome.passed() {
        bail!(
            "the VM suites failed: {} (see their output above)",
            outcome.failures().join("; ")
        );
    }
    timings::phase("vm refusal check", || vm::refusal_check(&root()))?;
    timings::phase("vm systemd", systemd_check)?;
    let kernels: Vec<&str> = vm::KERNELS.iter().map(|k| k.version).collect();
    eprintln!(
        "xtask: all passed: the tier suites on tracepoint (host), on {} in the VM on \
         kernels {} each, the harness's refusal check, and the unit under systemd",
        vm::VM_TIERS.join(", "),
        kernels.join(" and ")
    );
    Ok(())
}

/// The systemd unit under systemd as PID 1, in the VM (`vm::systemd`).
fn systemd_check() -> Result<()> {
    let run = vm::systemd::check(&root())?;
    let outcome = vm::Outcome { runs: vec![run] };
    if !outcome.passed() {
        bail!(
            "vm-test --systemd: failed: {} (see the test's output above)",
            outcome.failures().join("; ")
        );
    }
    Ok(())
}

fn vm_test(args: &[String]) -> Result<()> {
    toolchain::ensure_ebpf_toolchain()?;
    if args.iter().any(|a| a == "--systemd") {
        if args.len() > 1 {
            bail!("vm-test --systemd takes no other arguments");
        }
        return systemd_check();
    }
    let outcome = vm::test(&root(), &vm::Options::parse(args)?)?;
    if !outcome.passed() {
        bail!(
            "vm-test: failed: {} (see the tests' output above)",
            outcome.failures().join("; ")
        );
    }
    Ok(())
}

/// The real genv 1.4.3 is installed from PyPI into a venv under target/: that needs
/// python3 with `venv` and `ensurepip` (Debian splits them into python3-venv).
pub fn ensure_python_venv() -> Result<()> {
    which("python3").context("the end-to-end tests run the real genv, which needs python3")?;
    let has_venv = Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .status()?
        .success();
    if !has_venv {
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get").args(["install", "-y", "python3-venv"]))?;
    }
    Ok(())
}

/// genv 1.4.3 in a venv: the one the test suite installs (`target/debug/genv-venv`,
/// where the tests' `Genv::get` looks), or a new one.
pub fn genv_venv(target: &Path) -> Result<PathBuf> {
    let venv = target.join("debug/genv-venv");
    // The tests' lock: a suite installing it at the same time waits, and so does this.
    std::fs::create_dir_all(target.join("debug"))?;
    let lock = std::fs::File::create(target.join("debug/genv-venv.lock"))?;
    // SAFETY: flock on a descriptor this function owns; released when it is dropped.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("locking genv-venv.lock");
    }
    if !venv.join("bin/genv").exists() {
        ensure_python_venv()?;
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/pip")).args(["install", "-q", "genv==1.4.3"]))?;
    }
    Ok(venv)
}

/// The remote-enforcement tests run Debian's real sshd (one per simulated host, in
/// network namespaces) and sudo on the hosts' side. Installed without starting the
/// system's own ssh service: a `policy-rc.d` that refuses service starts is put in
/// place for the install where none exists, and removed after.
pub fn ensure_openssh() -> Result<()> {
    let tools = [
        "/usr/sbin/sshd",
        "/usr/bin/ssh",
        "/usr/bin/ssh-keygen",
        "/usr/bin/sudo",
    ];
    if tools.iter().all(|t| Path::new(t).exists()) {
        return Ok(());
    }
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        std::fs::write(
            policy,
            "#!/bin/sh\n# genv-enforcer's xtask: no service starts while installing\nexit 101\n",
        )?;
        std::fs::set_permissions(
            policy,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
        )?;
    }
    let installed = run(Command::new("apt-get").arg("update")).and_then(|()| {
        run(Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(["openssh-server", "openssh-client", "sudo"])
            .env("DEBIAN_FRONTEND", "noninteractive"))
    });
    if ours {
        let _ = std::fs::remove_file(policy);
    }
    installed.context("installing openssh-server, openssh-client and sudo for the remote tests")
}

/// Debian `packages`, installed from apt unless `tool` (a command) is already there.
pub fn ensure_apt(packages: &[&str], tool: &str) -> Result<()> {
    if which(tool).is_ok() {
        return Ok(());
    }
    run(Command::new("apt-get").arg("update"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .with_context(|| format!("installing {packages:?} for {tool}"))
}

/// What a simulated node runs: the enforcer, the fake NVML, the gpu-process helper.
pub fn build_node_artefacts(extra: &[&str]) -> Result<()> {
    let mut build = cargo(&["build", "-p", "genv-enforcer", "-p", "fake-nvml"]);
    build.args([
        "-p",
        "fake-cuda",
        "-p",
        "genv-enforcer-tests",
        "--bin",
        "genv-enforcer",
    ]);
    build
        .args(["--bin", "gpu-process", "--bin", "cuda-user", "--lib"])
        .args(extra);
    run(&mut build)
}

fn which(program: &str) -> Result<()> {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()?
        .status
        .success();
    if !found {
        bail!("{program} is not installed");
    }
    Ok(())
}

/// `cargo xtask bench bpf-log`: one section alone, printed.
fn bench_section(section: fn(&Path) -> Result<String>) -> Result<()> {
    toolchain::ensure_ebpf_toolchain()?;
    build_node_artefacts(&["--release"])?;
    print!("{}", section(&target_dir()?.join("release"))?);
    Ok(())
}

/// `cargo xtask bench footprint`: that table alone, printed (docs/bench.md is left as
/// the whole bench wrote it).
fn bench_footprint_only() -> Result<()> {
    toolchain::ensure_ebpf_toolchain()?;
    build_node_artefacts(&["--release"])?;
    let venv = genv_venv(&target_dir()?)?;
    print!(
        "{}",
        bench_footprint::run(&target_dir()?.join("release"), &venv)?
    );
    Ok(())
}

fn bench() -> Result<()> {
    toolchain::ensure_ebpf_toolchain()?;
    build_node_artefacts(&["--release"])?;
    let release = target_dir()?.join("release");
    let lib = release.join("libnvidia_ml_fake.so");
    let output = cargo(&[
        "bench",
        "-p",
        "genv-enforcer",
        "--bench",
        "cycle",
        "--quiet",
    ])
    .env("GENV_ENFORCER_NVML_LIB", &lib)
    .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "the benchmark failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let venv = genv_venv(&target_dir()?)?;
    let table = format!(
        "{stdout}{}{}{}{}{}",
        bench_events::run(&release)?,
        bench_bpf_log::run(&release)?,
        bench_alloc::run(&release)?,
        bench_footprint::run(&release, &venv)?,
        bench_remote::run(&release)?
    );
    print!("{table}");
    let docs = root().join("docs");
    std::fs::create_dir_all(&docs)?;
    std::fs::write(docs.join("bench.md"), table.as_bytes())?;
    eprintln!("xtask: wrote docs/bench.md");
    Ok(())
}
