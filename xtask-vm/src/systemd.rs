//! `cargo xtask vm-test --systemd`: the service as a node runs it, under a real systemd.
//!
//! This machine's init is not systemd, so the VM boots with systemd as PID 1: `/init`
//! builds the guest's root as for the tier suites, then `switch_root`s to
//! `/lib/systemd/systemd`, which starts [`TARGET`] (the system's basic target and
//! [`SERVICE`]) instead of the default target. [`SERVICE`] runs the `systemd_unit`
//! suite's test (ignored elsewhere: it installs into `/` and kills the machine's
//! service), prints the markers the host reads, and powers off. One kernel is enough:
//! the test installs the `.deb` (`cargo xtask dist`, built first) with `apt install`, as
//! a node does, and checks the unit, systemd and the package's scripts, not the kernel;
//! the first of [`KERNELS`] (6.1, what `linux-image-amd64` installs), on the LSM tier,
//! the one a node would run.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::guest::{quote, tier_marker};
use crate::initramfs::EXIT_MARKER;
use crate::qemu::Boot;
use crate::run::{boot_with, script_path};
use crate::{Guest, Kernel, LSM_WITH_BPF, Run, Series, deadline};

/// The suite whose test runs under systemd: the caller builds it into [`Guest::suites`].
pub const SUITE: &str = "systemd_unit";
const TEST: &str = "the_unit_restarts_a_killed_daemon_and_its_pinned_programs_guard_the_gap";
const TIER: &str = "lsm";
const TARGET: &str = "genv-vmtest.target";
const SERVICE: &str = "genv-vmtest.service";

/// Boots `series` (`kernel`, prepared) under systemd and runs the unit's test there,
/// which installs `deb` (`cargo xtask dist`'s, built first).
pub fn check(guest: &Guest, series: Series, kernel: &Kernel, deb: &Path) -> Result<Run> {
    crate::require_root("vm-test --systemd")?;
    ensure_systemd()?;
    let Some((_, suite)) = guest.suites.iter().find(|(name, _)| name == SUITE) else {
        bail!("vm-test --systemd: the {SUITE} suite was not built");
    };
    let section = format!("{TIER} under systemd");
    let script = script(guest, series, suite, &section, deb);
    let units = units(&script_path(kernel))?;
    eprintln!(
        "vm-test: kernel {}: booting {} under QEMU/TCG with systemd as init; {section}",
        series.version, kernel.package
    );
    let boot = Boot {
        series,
        kernel,
        lsm: LSM_WITH_BPF,
        label: format!("vm {} systemd", series.version),
        deadline: deadline(1),
    };
    let console = boot_with(guest, &boot, &script, Some(&units))?;
    let run = console.into_run(series, kernel, vec![section])?;
    eprintln!("vm-test: {}", run.summary());
    Ok(run)
}

/// The guest's systemd is the host's (its root is the host's, read-only).
fn ensure_systemd() -> Result<()> {
    if Path::new("/lib/systemd/systemd").exists() {
        return Ok(());
    }
    let install = Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends", "systemd"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()?;
    if !install.success() {
        bail!("apt-get install systemd failed: the guest boots the host's systemd");
    }
    Ok(())
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
fn script(guest: &Guest, series: Series, suite: &Path, section: &str, deb: &Path) -> String {
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
        tests = quote(&guest.root.join("tests").display().to_string()),
        suite = quote(&suite.display().to_string()),
        deb = quote(&deb.display().to_string()),
    )
}
