//! One kernel's run: its boot (booted again once after QEMU's patching race), and the
//! harness's own refusal check.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

use crate::qemu::Boot;
use crate::{Guest, KERNELS, Kernel, LSM_WITH_BPF, Options, Run, Series};
use crate::{deadline, guest, initramfs, patch_race, qemu, setup::BUSYBOX};

/// One kernel's boot: its initramfs, its guest script, every tier; booted once more for
/// the tiers that had not ended if the guest died of QEMU's text-patching race
/// ([`patch_race`]), never for anything else.
pub fn run_kernel(
    guest: &Guest,
    series: Series,
    kernel: &Kernel,
    options: &Options,
) -> Result<Run> {
    let version = series.version;
    let mut console = boot(guest, series, kernel, options, &options.tiers)?;
    let mut rebooted = None;
    if console.status.is_none()
        && let Some(why) = patch_race::excused(&console.lines)
    {
        let left: Vec<String> = (options.tiers.iter())
            .filter(|tier| !console.tiers.iter().any(|(ended, ..)| ended == *tier))
            .cloned()
            .collect();
        eprintln!(
            "vm-test: kernel {version}: the guest {why}: QEMU/TCG racing a trampoline's \
             patched or freed text (xtask-vm/src/patch_race.rs); booting it once more for the \
             tiers that had not ended: {}",
            left.join(", ")
        );
        let again = boot(guest, series, kernel, options, &left)?;
        console.follow_with(again);
        rebooted = Some(format!("rebooted once: the guest {why}"));
    }
    let run = console.into_run(series, kernel, options.tiers.clone())?;
    Ok(Run { rebooted, ..run })
}

/// One boot of `kernel` running `tiers`: the guest script, the initramfs, QEMU.
fn boot(
    guest: &Guest,
    series: Series,
    kernel: &Kernel,
    options: &Options,
    tiers: &[String],
) -> Result<qemu::Console> {
    let script = guest::script(guest, series, tiers, options);
    eprintln!(
        "vm-test: kernel {}: booting {} (lsm={}) under QEMU/TCG; tiers: {}",
        series.version,
        kernel.package,
        options.lsm,
        tiers.join(", ")
    );
    let boot = Boot {
        series,
        kernel,
        lsm: &options.lsm,
        label: format!("vm {}", series.version),
        deadline: deadline(tiers.len()),
    };
    boot_with(guest, &boot, &script, None)
}

/// Where a boot of `kernel` finds its script: beside the kernel, inside the work tree,
/// which the guest mounts at the same path.
pub(crate) fn script_path(kernel: &Kernel) -> PathBuf {
    kernel.vmlinux.with_file_name("guest.sh")
}

/// Boots `boot` with `script` as the guest's script: run by `/init` itself, or, with
/// `systemd`'s units (the first one started), by systemd as PID 1.
pub(crate) fn boot_with(
    guest: &Guest,
    boot: &Boot,
    script: &str,
    systemd: Option<&[(String, String)]>,
) -> Result<qemu::Console> {
    let script_path = script_path(boot.kernel);
    std::fs::write(&script_path, script)?;
    let initramfs = boot.kernel.vmlinux.with_file_name("initramfs.cpio");
    let then = match systemd {
        Some(units) => initramfs::Then::Systemd {
            unit: &units[0].0,
            units,
        },
        None => initramfs::Then::Script(&script_path),
    };
    let init = initramfs::Init {
        modules: (boot.kernel.modules.iter())
            .map(|m| m.file_name().unwrap().to_string_lossy().into_owned())
            .collect(),
        work_tree: &guest.root,
        then,
        target_dir: &guest.target_dir,
    };
    initramfs::write(&initramfs, Path::new(BUSYBOX), &boot.kernel.modules, &init)?;
    qemu::boot(guest, boot, &initramfs)
}

/// The harness's own check, run by `cargo xtask test` after the suites: boot without
/// the BPF LSM, ask for the LSM tier, and require that the run fail, saying why. A
/// harness that quietly fell back to another tier would pass here and fail this check.
/// It checks the harness, not the kernel, so one kernel is enough: the first of
/// [`KERNELS`] (6.1, what `linux-image-amd64` installs), which `kernel` must be. The
/// run it failed, for its times.
pub fn refusal_check(guest: &Guest, kernel: &Kernel) -> Result<Run> {
    let without_bpf = LSM_WITH_BPF.trim_end_matches(",bpf");
    let series = KERNELS[0];
    eprintln!(
        "vm-test: refusal check on kernel {}: booting with lsm={without_bpf}; the lsm tier \
         must fail loudly (the failure below is expected)",
        series.version
    );
    let options = Options {
        kernels: vec![series],
        tiers: vec!["lsm".into()],
        lsm: without_bpf.into(),
        test_args: vec![
            "--exact".into(),
            "tier_one_instance_and_nothing_left_behind".into(),
        ],
    };
    let run = run_kernel(guest, series, kernel, &options)?;
    let said_why = (run.console.iter()).any(|line| line.contains("BPF LSM is not active"));
    if run.status == 0 || !said_why {
        bail!(
            "refusal check: a kernel without the BPF LSM {} (expected a failed run naming \
             the inactive BPF LSM)",
            if run.status == 0 {
                "passed the lsm tier's tests"
            } else {
                "failed without saying why"
            }
        );
    }
    eprintln!("vm-test: refusal check passed: the refused lsm tier failed the run, saying why");
    Ok(run)
}
