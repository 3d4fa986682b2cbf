//! `cargo xtask vm-test`: what xtask adds to the VM runner (the `xtask-vm` crate, which
//! boots the kernels and runs the suites): building what the guest runs, and recording
//! each boot's times in the timing table.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Result, bail};

pub use xtask_vm::{Guest, KERNELS, Kernel, Options, Outcome, Run, Series, VM_TIERS};

use crate::{cargo, timings};

/// `cargo xtask vm-test`: the suites as `options` say, or (`systemd`) the unit under
/// systemd.
/// The kernel the unit is run under systemd on: 6.12, Debian 12's backports and
/// Debian 13's kernel series, the one most nodes boot. In `cargo xtask test` its boot
/// comes after 6.12's suites in another lane than theirs, where its guest fills a core
/// the host's suites leave (`xtask/src/test.rs`).
pub const SYSTEMD_KERNEL: &str = "6.12";

pub fn command(systemd: bool, options: Options) -> Result<()> {
    crate::toolchain::ensure_ebpf_toolchain()?;
    if systemd {
        let series = KERNELS.iter().find(|k| k.version == SYSTEMD_KERNEL);
        let first = Options {
            kernels: vec![*series.expect("SYSTEMD_KERNEL is one of KERNELS")],
            ..options
        };
        let (kernels, guest) = prepare(&crate::root(), &first)?;
        return systemd_check(&guest, &kernels[0]);
    }
    let outcome = test(&crate::root(), &options)?;
    if !outcome.passed() {
        bail!(
            "vm-test: failed: {} (see the tests' output above)",
            outcome.failures().join("; ")
        );
    }
    Ok(())
}

/// The kernels `options` asks for, prepared, and the guest with every suite built (the
/// systemd check's too): what [`run`] boots. Everything the guest runs is built here,
/// before any boot, except the `.deb` of [`systemd_check`].
pub fn prepare(root: &Path, options: &Options) -> Result<(Vec<(Series, Kernel)>, Guest)> {
    let kernels = xtask_vm::prepare(root, &options.kernels)?;
    let mut suites = xtask_vm::suites();
    suites.push(xtask_vm::systemd::SUITE);
    let suites = build_suites(&suites)?;
    let guest = Guest::new(root, suites, &crate::target_dir()?)?;
    Ok((kernels, guest))
}

/// Boots each kernel in turn, runs the suites on every tier in it, and reports.
pub fn test(root: &Path, options: &Options) -> Result<Outcome> {
    let (kernels, guest) = prepare(root, options)?;
    let mut outcome = Outcome { runs: Vec::new() };
    for (series, kernel) in &kernels {
        outcome.runs.push(run(&guest, *series, kernel, options)?);
    }
    if outcome.runs.len() > 1 {
        eprintln!("vm-test: all kernels:");
        for run in &outcome.runs {
            eprintln!("vm-test:   {}", run.summary());
        }
    }
    Ok(outcome)
}

/// One kernel's boot, every tier, its times recorded.
pub fn run(guest: &Guest, series: Series, kernel: &Kernel, options: &Options) -> Result<Run> {
    let run = xtask_vm::run_kernel(guest, series, kernel, options).map_err(|e| {
        e.context(format!(
            "the VM on kernel {} ({})",
            series.version, kernel.package
        ))
    })?;
    eprintln!("vm-test: {}", run.summary());
    for (tier, suite, took) in &run.suites {
        eprintln!(
            "vm-test:   kernel {}, tier {tier}, suite {suite}: {took:.1?}",
            series.version
        );
    }
    record(&run);
    Ok(run)
}

/// The harness's refusal check (`xtask_vm::refusal_check`) on the first kernel,
/// `kernel`.
pub fn refusal_check(guest: &Guest, kernel: &Kernel) -> Result<()> {
    record(&xtask_vm::refusal_check(guest, kernel)?);
    Ok(())
}

/// The systemd unit under systemd as PID 1, in the VM (`xtask_vm::systemd`) on the first
/// kernel, `kernel`, with the `.deb` `cargo xtask dist` builds (copied for the guest:
/// the dist suite may build it again meanwhile).
pub fn systemd_check(guest: &Guest, (series, kernel): &(Series, Kernel)) -> Result<()> {
    let [.., deb, _] = crate::dist::build_all()?;
    let copy = kernel
        .vmlinux
        .with_file_name(deb.file_name().unwrap_or_default());
    std::fs::copy(&deb, &copy)?;
    let run = xtask_vm::systemd::check(guest, *series, kernel, &copy)?;
    record(&run);
    let outcome = Outcome { runs: vec![run] };
    if !outcome.passed() {
        bail!(
            "vm-test --systemd: failed: {} (see the test's output above)",
            outcome.failures().join("; ")
        );
    }
    Ok(())
}

/// A boot's rows in the timing table.
fn record(run: &Run) {
    let version = run.kernel.version;
    timings::record("vm boot", version, "-", "(boot)", run.booted);
    for (tier, suite, took) in &run.suites {
        timings::record("vm", version, tier, suite, *took);
    }
    for (tier, _, took) in &run.tiers {
        timings::record("vm", version, tier, "(tier)", *took);
    }
    timings::record("vm", version, "-", "(boot to exit)", run.total);
}

/// Builds the binaries the tests run and the test executables of `suites`; their names
/// and paths.
fn build_suites(suites: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    crate::build_node_artefacts(&[])?;
    // The suites run the real genv from the venv the host's run installs; the guest has
    // no network to install it from, so it is made here when no host run has yet.
    crate::genv_venv(&crate::target_dir()?)?;
    let mut build = cargo(&[
        "test",
        "--no-run",
        "--message-format=json",
        "-p",
        "genv-enforcer-tests",
    ]);
    for suite in suites {
        build.args(["--test", suite]);
    }
    let output = build.stderr(Stdio::inherit()).output()?;
    if !output.status.success() {
        bail!("building the test suites {suites:?} failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = message["target"]["name"].as_str().unwrap_or_default();
        if let Some(exe) = message["executable"].as_str()
            && suites.contains(&name)
        {
            found.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    if found.len() != suites.len() {
        bail!("cargo built {found:?}, expected the suites {suites:?}");
    }
    Ok(found)
}
