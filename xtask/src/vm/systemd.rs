//! `cargo xtask vm-test --systemd`: the service as a node runs it, under a real systemd.
//!
//! This machine's init is not systemd, so the VM boots with systemd as PID 1: `/init`
//! builds the guest's root as for the tier suites, then `switch_root`s to
//! `/lib/systemd/systemd`, which starts [`TARGET`] (the system's basic target and
//! [`SERVICE`]) instead of the default target. [`SERVICE`] runs the `systemd_unit`
//! suite's test (ignored elsewhere: it installs into `/` and kills the machine's
//! service), prints the markers the host reads, and powers off. One kernel is enough:
//! the test installs the `.deb` (`cargo xtask dist`, built first) with `dpkg -i` and
//! checks the unit, systemd and the package's scripts, not the kernel; the first of [`KERNELS`] (6.1,
//! what `linux-image-amd64` installs), on the LSM tier, the one a node would run.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use super::{
    Guest, KERNELS, LSM_WITH_BPF, Run, boot_with, build_suites, deadline, ensure_packages, kernel,
    outside, script_path, shareable, tier_marker,
};
use crate::vm::initramfs::EXIT_MARKER;

const SUITE: &str = "systemd_unit";
const TEST: &str = "the_unit_restarts_a_killed_daemon_and_its_pinned_programs_guard_the_gap";
const TIER: &str = "lsm";
const TARGET: &str = "genv-vmtest.target";
const SERVICE: &str = "genv-vmtest.service";

/// Boots the VM under systemd and runs the unit's test there.
pub fn check(root: &Path) -> Result<Run> {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("vm-test --systemd needs root (apt-get, and the test inside makes nodes)");
    }
    let cache = root.join("target/vm");
    std::fs::create_dir_all(&cache)?;
    ensure_packages()?;
    // The guest's systemd is the host's (its root is the host's, read-only).
    if !Path::new("/lib/systemd/systemd").exists() {
        let install = Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", "systemd"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()?;
        if !install.success() {
            bail!("apt-get install systemd failed: the guest boots the host's systemd");
        }
    }
    // The guest installs the .deb as a node does (`dpkg -i`).
    let [.., deb, _] = crate::dist::build_all()?;
    let series = KERNELS[0];
    let kernel = kernel::prepare(&cache, series)?;
    let suites = build_suites(&[SUITE])?;
    let guest = Guest {
        root,
        suites: &suites,
        target_dir: shareable(root, outside(root, &crate::target_dir()?))?,
    };
    let section = format!("{TIER} under systemd");
    let script = script(root, series, &suites[0].1, &section, &deb);
    let units = units(&script_path(&kernel))?;
    eprintln!(
        "vm-test: kernel {}: booting {} under QEMU/TCG with systemd as init; {section}",
        series.version, kernel.package
    );
    let console = boot_with(
        &guest,
        series,
        &kernel,
        LSM_WITH_BPF,
        &script,
        Some(&units),
        deadline(1),
    )?;
    let (Some(status), Some(booted)) = (console.status, console.booted) else {
        bail!(
            "the VM under systemd stopped after {:.0?} without reporting a result; its \
             console is above",
            console.total
        );
    };
    let run = Run {
        kernel: series,
        package: kernel.package.clone(),
        status,
        tiers: console.tiers,
        asked: vec![section],
        console: console.lines,
        booted,
        total: console.total,
        rebooted: None,
    };
    eprintln!("vm-test: {}", run.summary());
    Ok(run)
}

/// [`TARGET`] first (systemd's `--unit`), then [`SERVICE`], which runs `script`.
fn units(script: &Path) -> Result<Vec<(String, String)>> {
    // systemd's command lines: quoted, `%` doubled (a specifier otherwise).
    let script = script.display().to_string();
    if script.contains(['"', '\\', '\n']) {
        bail!("the guest script's path {script:?} cannot go on a unit's command line");
    }
    let script = script.replace('%', "%%");
    let target = format!(
        "[Unit]\n\
         Description=genv-enforcer's tests under systemd (cargo xtask vm-test --systemd)\n\
         Requires=basic.target {SERVICE}\n\
         After=basic.target {SERVICE}\n\
         AllowIsolate=yes\n"
    );
    let service = format!(
        "[Unit]\n\
         Description=genv-enforcer's systemd_unit suite\n\
         After=basic.target\n\
         [Service]\n\
         Type=oneshot\n\
         ExecStart=/bin/sh \"{script}\"\n\
         StandardInput=null\n\
         StandardOutput=tty\n\
         StandardError=inherit\n\
         TTYPath=/dev/console\n"
    );
    Ok(vec![(TARGET.into(), target), (SERVICE.into(), service)])
}

/// The script [`SERVICE`] runs: the test, between the markers the host reads (booted,
/// the section's start and end, the exit status), then a power-off.
fn script(root: &Path, series: super::Series, suite: &Path, section: &str, deb: &Path) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let marker = format!("{}{section}", tier_marker(series));
    format!(
        "# Written by `cargo xtask vm-test --systemd`; systemd runs it ({SERVICE}).\n\
         export PATH={path} HOME=/root GENV_REQUIRE_BPF=1 GENV_TEST_BPF_TIER={TIER} \
         GENV_TEST_DEB={deb}\n\
         cd {tests}\n\
         echo \"genv-vm: booted $(uname -r) under $(systemctl --version | head -n 1), \
         PID 1 is $(cat /proc/1/comm), active LSMs: $(cat /sys/kernel/security/lsm)\"\n\
         echo '{marker}: start'\n\
         status=passed\n\
         {suite} --color=never --ignored --exact --nocapture {TEST} > /tmp/suite.log 2>&1 \
         || status=FAILED\n\
         cat /tmp/suite.log\n\
         grep -q '^test result: ok. 1 passed' /tmp/suite.log \
         || {{ status=FAILED; echo 'genv-vm: the test did not run and pass'; }}\n\
         echo \"{marker}: $status\"\n\
         [ $status = passed ]\n\
         echo \"{EXIT_MARKER}$?\"\n\
         sync\n\
         systemctl poweroff --force --force\n",
        path = quote(&std::env::var("PATH").unwrap_or_default()),
        tests = quote(&root.join("tests").display().to_string()),
        suite = quote(&suite.display().to_string()),
        deb = quote(&deb.display().to_string()),
    )
}
