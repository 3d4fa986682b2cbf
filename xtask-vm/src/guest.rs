//! What every boot shares ([`Guest`]: the work tree, the suites built, cargo's target
//! directory) and the script a boot runs: every tier suite on every tier, with the
//! marker lines the host reads.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::{KERNEL_SUITE_TESTS, KERNEL_SUITES, ONCE, ONCE_PER_KERNEL, ONE_KERNEL};
use crate::{Options, Series, TIER_SUITES};

/// What every boot shares: the work tree (read-write, at its own path), the test
/// executables built, and cargo's target directory (read-only and cached, at its own
/// path, under a tmpfs for the guest's writes: see `initramfs`).
pub struct Guest {
    pub root: PathBuf,
    /// Each suite's name and executable.
    pub suites: Vec<(String, PathBuf)>,
    pub target_dir: PathBuf,
}

impl Guest {
    /// The guest for the work tree `root`, the `suites` built, and cargo's
    /// `target_dir`; an error where the guest could not mount that directory.
    pub fn new(root: &Path, suites: Vec<(String, PathBuf)>, target_dir: &Path) -> Result<Self> {
        let target_dir = std::fs::canonicalize(target_dir)
            .with_context(|| format!("cargo's target directory {}", target_dir.display()))?;
        Ok(Guest {
            root: root.to_owned(),
            suites,
            target_dir: shareable(root, target_dir)?,
        })
    }
}

/// A target directory the guest can mount at its own path: not an ancestor of the work
/// tree (its mount would hide the tree's), and a path the init script and QEMU's
/// `-fsdev` option can carry as it is.
fn shareable(root: &Path, target: PathBuf) -> Result<PathBuf> {
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
    Ok(target)
}

/// The guest's script: every tier suite on every tier, and the kernel suites with the
/// first tier, with a marker line around each tier, naming the kernel, so the host can
/// time them and tell which kernel and tier failed.
pub(crate) fn script(guest: &Guest, series: Series, tiers: &[String], options: &Options) -> String {
    let test_args: Vec<String> = options.test_args.iter().map(|a| quote(a)).collect();
    let mut script = format!(
        "# Written by `cargo xtask vm-test`; runs inside the guest.\n\
         export PATH={path} HOME=/root GENV_REQUIRE_BPF=1\n\
         cd {tests}\n\
         echo \"genv-vm: booted $(uname -r), active LSMs: $(cat /sys/kernel/security/lsm 2>/dev/null || echo unknown)\"\n\
         failed=0\n",
        path = quote(&std::env::var("PATH").unwrap_or_default()),
        tests = quote(&guest.root.join("tests").display().to_string()),
    );
    for (nth, tier) in tiers.iter().enumerate() {
        let marker = format!("{}{tier}", tier_marker(series));
        script.push_str(&format!("echo '{marker}: start'\nstatus=passed\n"));
        for (name, suite) in &guest.suites {
            let Some(args) = suite_args(name, nth, series, &test_args) else {
                continue;
            };
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

/// The arguments suite `name` runs with on the `nth` tier of a boot, or none where it
/// does not run there.
fn suite_args(name: &str, nth: usize, series: Series, test_args: &[String]) -> Option<String> {
    if !TIER_SUITES.contains(&name) && !KERNEL_SUITES.contains(&name) {
        return None;
    }
    let mut args = test_args.join(" ");
    // What proves the same on any open tier runs with the first tier of a boot only:
    // the `kernel_` tests on every kernel, the `any_tier_` ones on one kernel in CI's
    // run (see [`ONCE_PER_KERNEL`] and [`ONCE`]).
    let one_kernel = test_args.is_empty() && series.version != ONE_KERNEL;
    if TIER_SUITES.contains(&name) {
        if nth > 0 {
            args.push_str(&format!(" --skip {ONCE_PER_KERNEL} --skip {ONCE}"));
        } else if one_kernel {
            args.push_str(&format!(" --skip {ONCE}"));
        }
    }
    if KERNEL_SUITES.contains(&name) {
        if nth > 0 || one_kernel {
            return None;
        }
        if test_args.is_empty() {
            args = KERNEL_SUITE_TESTS.join(" ");
        }
    }
    Some(args)
}

/// `s` quoted for the guest's shell.
pub(crate) fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// How the guest script's tier lines begin: `genv-vm: kernel 6.12, tier ` and the tier.
pub(crate) fn tier_marker(series: Series) -> String {
    format!("genv-vm: kernel {}, tier ", series.version)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KERNELS;

    /// The commands of `suite` on `tier` in `script` (what runs before `||`).
    fn runs(script: &str, tier: &str, suite: &str) -> Vec<String> {
        script
            .lines()
            .filter(|l| l.starts_with(&format!("GENV_TEST_BPF_TIER={tier} '/t/{suite}'")))
            .map(|l| l.split(" || ").next().unwrap_or(l).trim_end().to_owned())
            .collect()
    }

    #[test]
    fn once_per_kernel_tests_run_with_the_first_tier_and_once_tests_on_one_kernel() {
        let guest = Guest {
            root: PathBuf::from("/w"),
            // Every tier suite there is (a new one is checked as the others are), and
            // two that are not.
            suites: TIER_SUITES
                .iter()
                .chain(&["memory_at_alloc", "systemd_unit"])
                .map(|s| (s.to_string(), PathBuf::from(format!("/t/{s}"))))
                .collect(),
            target_dir: PathBuf::from("/t"),
        };
        let tiers = ["lsm".to_owned(), "fentry".to_owned()];
        let [one, other] = KERNELS;
        assert_eq!(one.version, ONE_KERNEL);
        let (script_one, script_other) = (
            script(&guest, one, &tiers, &Options::default()),
            script(&guest, other, &tiers, &Options::default()),
        );
        let both = format!(" --skip {ONCE_PER_KERNEL} --skip {ONCE}");
        for suite in TIER_SUITES {
            let first = runs(&script_one, "lsm", suite);
            let later = runs(&script_one, "fentry", suite);
            assert_eq!((first.len(), later.len()), (1, 1), "{script_one}");
            assert!(!first[0].contains("--skip"), "{}", first[0]);
            assert!(later[0].ends_with(&both), "{}", later[0]);
            // The other kernel: its first tier runs the `kernel_` tests, not `any_tier_`.
            let first = runs(&script_other, "lsm", suite);
            let later = runs(&script_other, "fentry", suite);
            assert!(
                first[0].ends_with(&format!(" --skip {ONCE}")),
                "{}",
                first[0]
            );
            assert!(!first[0].contains(ONCE_PER_KERNEL), "{}", first[0]);
            assert!(later[0].ends_with(&both), "{}", later[0]);
        }
        assert_eq!(runs(&script_one, "lsm", "memory_at_alloc").len(), 1);
        assert_eq!(runs(&script_one, "fentry", "memory_at_alloc").len(), 0);
        assert_eq!(runs(&script_other, "lsm", "memory_at_alloc").len(), 0);
        assert!(!script_one.contains("systemd_unit"), "{script_one}");
    }

    /// Asked for tests by name, every kernel runs them (with its first tier).
    #[test]
    fn tests_asked_for_run_on_every_kernel_asked_for() {
        let guest = Guest {
            root: PathBuf::from("/w"),
            suites: vec![("prevention".into(), PathBuf::from("/t/prevention"))],
            target_dir: PathBuf::from("/t"),
        };
        let options = Options {
            test_args: vec!["any_tier_x".into()],
            ..Options::default()
        };
        let script = script(&guest, KERNELS[1], &["lsm".to_owned()], &options);
        let first = runs(&script, "lsm", "prevention");
        assert!(first[0].ends_with("'any_tier_x'"), "{}", first[0]);
    }

    #[test]
    fn a_target_directory_the_guest_cannot_mount_as_it_is_is_an_error_naming_it() {
        let root = std::env::temp_dir();
        for bad in ["/tmp/a\"b", "/tmp/a$b", "/tmp/a,b", "/"] {
            let error = shareable(&root, PathBuf::from(bad)).unwrap_err();
            assert!(
                error.to_string().contains("target directory"),
                "{bad}: {error}"
            );
        }
        let fine = PathBuf::from("/srv/cargo-target");
        assert_eq!(shareable(&root, fine.clone()).unwrap(), fine);
    }
}
