//! `cargo xtask vm-test`: the tier-dependent tests on the kernel tiers this machine's
//! kernel refuses ([`VM_TIERS`]: LSM, fmod_ret, fentry), on both of Debian bookworm's kernels
//! (6.1 and 6.12, [`KERNELS`]) under QEMU, against the binaries built here.
//!
//! Each kernel is booted once, and that boot runs every requested tier's suites in turn
//! (`GENV_TEST_BPF_TIER=<tier>`, `GENV_REQUIRE_BPF=1`: a tier the kernel refuses fails its
//! tests); then the next kernel. The console names the kernel and tier of each section,
//! and a failure names both. QEMU runs under TCG:
//! `/dev/kvm` here is nested and a stock kernel hangs at boot under it; TCG makes the
//! guest slow (an open costs ~50 µs instead of ~1 µs) but behaves like the real thing,
//! which is what these tests check. Overheads are measured on the host, never here.

mod initramfs;
mod kernel;
mod outcome;
mod patch_race;
mod qemu;
mod setup;
pub mod systemd;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// The test binaries whose scenarios depend on the tier. Every test in them says in its
/// name which group it is in (`tests/architecture.rs` fails on one that does not):
/// `tier_…` runs on every tier of every kernel; `any_tier_…` ([`ONCE_PER_KERNEL`])
/// proves the same whatever program sees the opens (the exec, fork and exit hooks,
/// userspace's state handling, the memory poll: identical on every tier) and runs
/// with the first tier of each kernel only.
const TIER_SUITES: [&str; 2] = ["event_driven", "prevention"];
/// The name prefix of the tier suites' tests that run once per kernel.
pub const ONCE_PER_KERNEL: &str = "any_tier_";
/// The test binaries whose scenarios depend on the kernel, not the tier (uprobes load
/// the same under every tier): run with the first tier, on one kernel, with the tests
/// CI runs there (every test of it, when `vm-test` is given test arguments). Each of
/// its tests starts a daemon and the real genv, about 90 s under TCG: the whole suite
/// on every kernel would take CI past its budget.
const KERNEL_SUITES: [&str; 1] = ["memory_at_alloc"];
const KERNEL_SUITE_KERNEL: &str = "6.1";
const KERNEL_SUITE_TESTS: [&str; 3] = [
    "the_allocation_that_crosses_the_cap",
    "racing_processes",
    "a_context_on_gpu_1",
];

/// The tiers the VM runs those suites on unless `--tiers` says otherwise, in order: the
/// ones this machine's kernel refuses (the host runs the tracepoint tier). A new tier
/// goes here and in [`KNOWN_TIERS`]; `cargo xtask test` then runs it on every kernel.
pub const VM_TIERS: &[&str] = &["lsm", "fmod_ret", "fentry"];

/// What `--tiers` accepts.
const KNOWN_TIERS: &[&str] = &["lsm", "fmod_ret", "fentry", "tracepoint"];

pub use kernel::{KERNELS, Series};
pub use outcome::{Outcome, Run};
use setup::{BUSYBOX, build_suites, ensure_packages};

/// Debian's own kernel would pick AppArmor first and no BPF LSM; this is the list the
/// LSM tier needs, with what a hardened distribution would also have.
pub const LSM_WITH_BPF: &str = "lockdown,capability,landlock,yama,bpf";

/// How long one VM run (one kernel's boot, every tier) may take before it is killed:
/// [`BOOT_ALLOWANCE`] plus [`PER_TIER`] for each tier it runs, 35 minutes for two tiers.
/// Measured on 2 cores, a tier's two suites take 4.5 minutes on 6.1 and 6 to 8 on 6.12
/// (the whole 6.12 run 14 minutes); with other VMs sharing those cores, 11 and 12 to 15
/// (26 minutes for the 6.12 run). CI has 90 minutes in all, for the host's suites and
/// every kernel: one hung guest still fails inside them, naming its kernel and tier.
fn deadline(tiers: usize) -> Duration {
    BOOT_ALLOWANCE + PER_TIER * tiers as u32
}
const BOOT_ALLOWANCE: Duration = Duration::from_secs(5 * 60);
const PER_TIER: Duration = Duration::from_secs(15 * 60);

pub struct Options {
    /// Kernels to boot, in order; each runs every tier.
    pub kernels: Vec<Series>,
    /// Tiers to run the suites on, in order.
    pub tiers: Vec<String>,
    /// The kernel's `lsm=` list.
    pub lsm: String,
    /// Passed to every test binary (a name filter, `--exact`, ...).
    pub test_args: Vec<String>,
}

impl Options {
    pub fn parse(args: &[String]) -> Result<Self> {
        let mut options = Options {
            kernels: KERNELS.to_vec(),
            tiers: VM_TIERS.iter().map(|&t| t.to_owned()).collect(),
            lsm: LSM_WITH_BPF.into(),
            test_args: Vec::new(),
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--kernel" => {
                    let which = args.next().context("--kernel needs 6.1, 6.12 or all")?;
                    options.kernels = kernels_named(which)?;
                }
                "--tiers" => {
                    let list = args
                        .next()
                        .context("--tiers needs a list, e.g. lsm,fentry")?;
                    options.tiers = list.split(',').map(str::to_owned).collect();
                    if let Some(bad) = options
                        .tiers
                        .iter()
                        .find(|t| !KNOWN_TIERS.contains(&t.as_str()))
                    {
                        bail!("--tiers: unknown tier {bad:?} ({})", KNOWN_TIERS.join(", "));
                    }
                }
                "--lsm" => {
                    options.lsm = args
                        .next()
                        .context("--lsm needs the kernel's lsm= list")?
                        .clone();
                }
                "--" => options.test_args.extend(args.by_ref().cloned()),
                other => bail!(
                    "vm-test: unknown argument {other:?} \
                     (usage: cargo xtask vm-test [--kernel 6.1|6.12|all] [--tiers lsm,fentry] \
                     [--lsm LIST] [-- TEST ARGS])"
                ),
            }
        }
        Ok(options)
    }
}

/// `--kernel`'s value: one of [`KERNELS`] by its version, or `all`.
fn kernels_named(which: &str) -> Result<Vec<Series>> {
    if which == "all" {
        return Ok(KERNELS.to_vec());
    }
    match KERNELS.iter().find(|k| k.version == which) {
        Some(&kernel) => Ok(vec![kernel]),
        None => {
            let versions: Vec<&str> = KERNELS.iter().map(|k| k.version).collect();
            bail!(
                "--kernel: unknown kernel {which:?} ({}, all)",
                versions.join(", ")
            )
        }
    }
}

/// The harness's own check, run by `cargo xtask test` after the suites: boot without
/// the BPF LSM, ask for the LSM tier, and require that the run fail, saying why. A
/// harness that quietly fell back to another tier would pass here and fail this check.
/// It checks the harness, not the kernel, so one kernel is enough: the first of
/// [`KERNELS`] (6.1, what `linux-image-amd64` installs).
pub fn refusal_check(root: &Path) -> Result<()> {
    let without_bpf = LSM_WITH_BPF.trim_end_matches(",bpf");
    let kernel = KERNELS[0];
    eprintln!(
        "vm-test: refusal check on kernel {}: booting with lsm={without_bpf}; the lsm tier \
         must fail loudly (the failure below is expected)",
        kernel.version
    );
    let outcome = test(
        root,
        &Options {
            kernels: vec![kernel],
            tiers: vec!["lsm".into()],
            lsm: without_bpf.into(),
            test_args: vec![
                "--exact".into(),
                "tier_one_instance_and_nothing_left_behind".into(),
            ],
        },
    )?;
    let said_why = outcome
        .console()
        .any(|line| line.contains("BPF LSM is not active"));
    if outcome.passed() || !said_why {
        bail!(
            "refusal check: a kernel without the BPF LSM {} (expected a failed run naming \
             the inactive BPF LSM)",
            if outcome.passed() {
                "passed the lsm tier's tests"
            } else {
                "failed without saying why"
            }
        );
    }
    eprintln!("vm-test: refusal check passed: the refused lsm tier failed the run, saying why");
    Ok(())
}

/// Boots each kernel in turn, runs the suites on every tier in it, and reports.
pub fn test(root: &Path, options: &Options) -> Result<Outcome> {
    // SAFETY: geteuid(2) takes nothing and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("vm-test needs root (apt-get, and the tests inside make nodes and signal)");
    }
    let cache = root.join("target/vm");
    std::fs::create_dir_all(&cache)?;
    ensure_packages()?;
    // Prepared before the build, so that a kernel Debian no longer has fails at once.
    let mut kernels = Vec::new();
    for &series in &options.kernels {
        kernels.push((series, kernel::prepare(&cache, series)?));
    }
    let suites: Vec<&str> = TIER_SUITES.iter().chain(&KERNEL_SUITES).copied().collect();
    let suites = build_suites(&suites)?;
    let guest = Guest {
        root,
        suites: &suites,
        target_dir: shareable(root, outside(root, &crate::target_dir()?))?,
    };
    let mut outcome = Outcome { runs: Vec::new() };
    for (series, kernel) in &kernels {
        let run = test_on(&guest, *series, kernel, options)
            .with_context(|| format!("the VM on kernel {} ({})", series.version, kernel.package))?;
        eprintln!("vm-test: {}", run.summary());
        outcome.runs.push(run);
    }
    if outcome.runs.len() > 1 {
        eprintln!("vm-test: all kernels:");
        for run in &outcome.runs {
            eprintln!("vm-test:   {}", run.summary());
        }
    }
    Ok(outcome)
}

/// One kernel's boot: its initramfs, its guest script, every tier; booted once more for
/// the tiers that had not ended if the guest died of QEMU's text-patching race
/// ([`patch_race`]), never for anything else.
fn test_on(
    guest: &Guest,
    series: Series,
    kernel: &kernel::Kernel,
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
             text_poke (xtask/src/vm/patch_race.rs); booting it once more for the tiers that \
             had not ended: {}",
            left.join(", ")
        );
        let again = boot(guest, series, kernel, options, &left)?;
        let earlier_failed = console.tiers.iter().any(|(_, passed, _)| !passed);
        console.lines.extend(again.lines);
        console.suites.extend(again.suites);
        console.tiers.extend(again.tiers);
        console.total += again.total;
        console.status = again
            .status
            .map(|s| if earlier_failed { s.max(1) } else { s });
        rebooted = Some(format!("rebooted once: the guest {why}"));
    }
    let (Some(status), Some(booted)) = (console.status, console.booted) else {
        bail!(
            "the VM stopped after {:.0?} without reporting a result; its console is above",
            console.total
        );
    };
    crate::timings::record("vm boot", version, "-", "(boot)", booted);
    for (tier, suite, took) in &console.suites {
        crate::timings::record("vm", version, tier, suite, *took);
    }
    for (tier, _, took) in &console.tiers {
        crate::timings::record("vm", version, tier, "(tier)", *took);
    }
    crate::timings::record("vm", version, "-", "(boot to exit)", console.total);
    Ok(Run {
        kernel: series,
        package: kernel.package.clone(),
        status,
        tiers: console.tiers,
        asked: options.tiers.clone(),
        console: console.lines,
        booted,
        total: console.total,
        rebooted,
    })
}

/// What every boot shares: the work tree, the suites built, and cargo's target directory
/// where it is outside the work tree (the guest mounts it too).
struct Guest<'a> {
    root: &'a Path,
    suites: &'a [(String, PathBuf)],
    target_dir: Option<PathBuf>,
}

/// `target` if it is not inside the work tree `root` (both as the filesystem resolves
/// them: a target directory reached through a link into the tree is inside).
fn outside(root: &Path, target: &Path) -> Option<PathBuf> {
    let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
    let target = real(target);
    (!target.starts_with(real(root))).then_some(target)
}

/// A target directory the guest can mount at its own path: not an ancestor of the work
/// tree (its mount would hide the tree's), and a path the init script and QEMU's
/// `-fsdev` option can carry as it is.
fn shareable(root: &Path, target: Option<PathBuf>) -> Result<Option<PathBuf>> {
    let Some(target) = target else {
        return Ok(None);
    };
    let text = target.to_string_lossy();
    if text.contains(['"', '$', '`', '\\', ',', '\n'])
        || text != target.as_os_str().to_str().unwrap_or("")
    {
        bail!(
            "cargo's target directory {} (CARGO_TARGET_DIR?) has characters the VM cannot share it under; use a plain path",
            target.display()
        );
    }
    if std::fs::canonicalize(root).is_ok_and(|root| root.starts_with(&target)) {
        bail!(
            "cargo's target directory {} contains the work tree {}: the VM cannot share it",
            target.display(),
            root.display()
        );
    }
    Ok(Some(target))
}

/// One boot of `kernel` running `tiers`: the guest script, the initramfs, QEMU.
fn boot(
    guest: &Guest,
    series: Series,
    kernel: &kernel::Kernel,
    options: &Options,
    tiers: &[String],
) -> Result<qemu::Console> {
    let script = guest_script(guest.root, series, guest.suites, tiers, options);
    eprintln!(
        "vm-test: kernel {}: booting {} (lsm={}) under QEMU/TCG; tiers: {}",
        series.version,
        kernel.package,
        options.lsm,
        tiers.join(", ")
    );
    boot_with(
        guest,
        series,
        kernel,
        &options.lsm,
        &script,
        None,
        deadline(tiers.len()),
    )
}

/// Where a boot of `kernel` finds its script: beside the kernel, inside the work tree,
/// which the guest mounts at the same path.
fn script_path(kernel: &kernel::Kernel) -> PathBuf {
    kernel.vmlinux.with_file_name("guest.sh")
}

/// Boots `kernel` with `script` as the guest's script: run by `/init` itself, or, with
/// `systemd`'s units (the first one started), by systemd as PID 1.
fn boot_with(
    guest: &Guest,
    series: Series,
    kernel: &kernel::Kernel,
    lsm: &str,
    script: &str,
    systemd: Option<&[(String, String)]>,
    deadline: Duration,
) -> Result<qemu::Console> {
    let root = guest.root;
    let script_path = script_path(kernel);
    std::fs::write(&script_path, script)?;
    let initramfs = kernel.vmlinux.with_file_name("initramfs.cpio");
    let then = match systemd {
        Some(units) => initramfs::Then::Systemd {
            unit: &units[0].0,
            units,
        },
        None => initramfs::Then::Script(&script_path),
    };
    let init = initramfs::Init {
        modules: kernel
            .modules
            .iter()
            .map(|m| m.file_name().unwrap().to_string_lossy().into_owned())
            .collect(),
        work_tree: root,
        then,
        target_dir: guest.target_dir.as_deref(),
    };
    initramfs::write(&initramfs, Path::new(BUSYBOX), &kernel.modules, &init)?;
    qemu::boot(
        root,
        guest.target_dir.as_deref(),
        kernel,
        &initramfs,
        lsm,
        series,
        deadline,
    )
}

/// The guest's script: every tier suite on every tier, and the kernel suites with the
/// first tier, with a marker line around each tier, naming the kernel, so the host can
/// time them and tell which kernel and tier failed.
fn guest_script(
    root: &Path,
    series: Series,
    suites: &[(String, PathBuf)],
    tiers: &[String],
    options: &Options,
) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let test_args: Vec<String> = options.test_args.iter().map(|a| quote(a)).collect();
    let mut script = format!(
        "# Written by `cargo xtask vm-test`; runs inside the guest.\n\
         export PATH={path} HOME=/root GENV_REQUIRE_BPF=1\n\
         cd {tests}\n\
         echo \"genv-vm: booted $(uname -r), active LSMs: $(cat /sys/kernel/security/lsm 2>/dev/null || echo unknown)\"\n\
         failed=0\n",
        path = quote(&std::env::var("PATH").unwrap_or_default()),
        tests = quote(&root.join("tests").display().to_string()),
    );
    for (nth, tier) in tiers.iter().enumerate() {
        let marker = format!("{}{tier}", tier_marker(series));
        script.push_str(&format!("echo '{marker}: start'\nstatus=passed\n"));
        for (name, suite) in suites {
            let mut args = test_args.join(" ");
            // Tests that prove the same on any open tier (`any_tier_`, see
            // [`ONCE_PER_KERNEL`]) run with the first tier of each boot only.
            if nth > 0 && TIER_SUITES.contains(&name.as_str()) {
                args.push_str(&format!(" --skip {ONCE_PER_KERNEL}"));
            }
            if KERNEL_SUITES.contains(&name.as_str()) {
                if nth > 0 || (test_args.is_empty() && series.version != KERNEL_SUITE_KERNEL) {
                    continue;
                }
                if test_args.is_empty() {
                    args = KERNEL_SUITE_TESTS.join(" ");
                }
            }
            script.push_str(&format!(
                "echo '{marker}: suite {name} start'\n\
                 GENV_TEST_BPF_TIER={tier} {} --color=never {args} \
                 || {{ status=FAILED; echo '{marker}: suite {name} failed'; }}\n\
                 echo '{marker}: suite {name} end'\n",
                quote(&suite.display().to_string()),
            ));
        }
        script.push_str(&format!(
            "echo \"{marker}: $status\"\n[ $status = passed ] || failed=1\n"
        ));
    }
    script.push_str("exit $failed\n");
    script
}

/// How the guest script's tier lines begin: `genv-vm: kernel 6.12, tier ` and the tier.
fn tier_marker(series: Series) -> String {
    format!("genv-vm: kernel {}, tier ", series.version)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_kernel_tests_run_with_the_first_tier_only() {
        let suites: Vec<(String, PathBuf)> = ["event_driven", "prevention", "memory_at_alloc"]
            .iter()
            .map(|s| (s.to_string(), PathBuf::from(format!("/t/{s}"))))
            .collect();
        let tiers = ["lsm".to_owned(), "fentry".to_owned()];
        let options = Options::parse(&[]).unwrap();
        let script = guest_script(Path::new("/w"), KERNELS[0], &suites, &tiers, &options);
        let runs = |tier: &str, suite: &str| -> Vec<String> {
            script
                .lines()
                .filter(|l| l.starts_with(&format!("GENV_TEST_BPF_TIER={tier} '/t/{suite}'")))
                .map(str::to_owned)
                .collect()
        };
        for suite in TIER_SUITES {
            let (first, later) = (runs("lsm", suite), runs("fentry", suite));
            assert_eq!((first.len(), later.len()), (1, 1), "{script}");
            assert!(!first[0].contains("--skip"), "{}", first[0]);
            assert!(
                later[0].contains(&format!("--skip {ONCE_PER_KERNEL}")),
                "{}",
                later[0]
            );
        }
    }

    #[test]
    fn only_a_target_directory_outside_the_work_tree_is_shared_apart() {
        let scratch = std::env::temp_dir().join(format!("xtask-outside-{}", std::process::id()));
        let (tree, elsewhere) = (scratch.join("tree"), scratch.join("elsewhere"));
        std::fs::create_dir_all(tree.join("target")).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::os::unix::fs::symlink(tree.join("target"), scratch.join("link-in")).unwrap();
        assert_eq!(outside(&tree, &tree.join("target")), None);
        assert_eq!(outside(&tree, &scratch.join("link-in")), None);
        assert_eq!(
            outside(&tree, &elsewhere),
            Some(std::fs::canonicalize(&elsewhere).unwrap())
        );
        std::fs::remove_dir_all(&scratch).unwrap();
    }

    #[test]
    fn a_target_directory_the_guest_cannot_mount_as_it_is_is_an_error_naming_it() {
        let root = std::env::temp_dir();
        for bad in ["/tmp/a\"b", "/tmp/a$b", "/tmp/a,b", "/"] {
            let error = shareable(&root, Some(PathBuf::from(bad))).unwrap_err();
            assert!(
                error.to_string().contains("target directory"),
                "{bad}: {error}"
            );
        }
        let fine = Some(PathBuf::from("/srv/cargo-target"));
        assert_eq!(shareable(&root, fine.clone()).unwrap(), fine);
        assert_eq!(shareable(&root, None).unwrap(), None);
    }
}
