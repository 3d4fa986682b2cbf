//! What every boot shares ([`Guest`]: the work tree, the suites built, cargo's target
//! directory) and the script a boot runs: every tier suite on every tier, with the
//! marker lines the host reads.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::{EACH_TIER, EACH_TIER_KERNEL, ONCE, ONCE_PER_KERNEL, TIER_SUITES};
use crate::{KERNEL_SUITE_KERNEL, KERNEL_SUITE_TESTS, KERNEL_SUITES, Options, Series};

/// The attempt loop's size in CI's guests of kernels that never preempt a task inside a
/// kernel program (`prevention`'s
/// `tier_thousands_of_attempts_from_outside_get_the_gpu_only_through_skipped_runs`;
/// 10,000 elsewhere, where 10,000 took a minute of TCG on each tier). What it can meet
/// there is a decision that is wrong every time, which a thousand attempts show as well
/// as ten thousand; on a kernel that preempts inside programs, the kernel skipping a
/// run is a matter of odds (2 to 11 in 10,000 on 7.3's fentry tier, 1 on fmod_ret, none
/// seen on lsm), and its fentry tier makes 10,000; its other tiers make as many as the
/// other kernels' (10,000 on each took 7's lane past the two cores' share of CI's
/// budget).
const WHOLE_RUN_ATTEMPTS: u32 = 1_000;
/// The tier of a preempting kernel whose attempt loop makes 10,000.
const ODDS_TIER: &str = "fentry";

/// `GENV_TEST_ATTEMPTS` for `tier` of `series` in a whole run; `None`: the loop's own
/// 10,000.
fn attempts(series: Series, tier: &str) -> Option<u32> {
    (!series.preempts_programs || tier != ODDS_TIER).then_some(WHOLE_RUN_ATTEMPTS)
}

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
         export PATH={path} HOME=/root GENV_REQUIRE_BPF=1{allow}\n\
         cd {tests}\n\
         echo \"genv-vm: booted $(uname -r), active LSMs: $(cat /sys/kernel/security/lsm 2>/dev/null || echo unknown)\"\n\
         failed=0\n",
        path = quote(&std::env::var("PATH").unwrap_or_default()),
        // The host's checkout, seen over 9p with its owners: where `cargo xtask test`
        // lets root run binaries from it (and says so), so does the guest.
        allow = match std::env::var("GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY") {
            Ok(v) => format!(" GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY={}", quote(&v)),
            Err(_) => String::new(),
        },
        tests = quote(&guest.root.join("tests").display().to_string()),
    );
    script.push_str(&format!(
        "export GENV_TEST_KERNEL_REFUSES={}\n",
        u8::from(series.refuses_at_alloc)
    ));
    for (nth, tier) in tiers.iter().enumerate() {
        let marker = format!("{}{tier}", tier_marker(series));
        script.push_str(&format!("echo '{marker}: start'\nstatus=passed\n"));
        if options.test_args.is_empty() {
            script.push_str(&match attempts(series, tier) {
                Some(n) => format!("export GENV_TEST_ATTEMPTS={n}\n"),
                None => "unset GENV_TEST_ATTEMPTS\n".to_owned(),
            });
        }
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
/// does not run there (the groups: [`TIER_SUITES`]).
fn suite_args(name: &str, nth: usize, series: Series, test_args: &[String]) -> Option<String> {
    // Tests asked for by name run wherever they are asked for.
    let whole_run = test_args.is_empty();
    let mut args = test_args.join(" ");
    if TIER_SUITES.contains(&name) {
        let mut skip = Vec::new();
        if nth > 0 || whole_run {
            skip.push(ONCE);
        }
        if nth > 0 {
            skip.push(ONCE_PER_KERNEL);
        }
        if whole_run && series.version != EACH_TIER_KERNEL {
            skip.push(EACH_TIER);
        }
        for group in skip {
            args.push_str(&format!(" --skip {group}"));
        }
        return Some(args);
    }
    if KERNEL_SUITES.contains(&name) {
        if nth > 0 || (whole_run && series.version != KERNEL_SUITE_KERNEL) {
            return None;
        }
        if whole_run {
            args = KERNEL_SUITE_TESTS.join(" ");
        }
        return Some(args);
    }
    None
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
    fn each_group_runs_where_its_outcome_can_change_and_once_where_it_cannot() {
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
        let tiers = ["lsm".to_owned(), "fmod_ret".to_owned(), "fentry".to_owned()];
        let skips = |line: &str| -> Vec<String> {
            let words: Vec<&str> = line.split_whitespace().collect();
            (words.windows(2))
                .filter(|w| w[0] == "--skip")
                .map(|w| w[1].to_owned())
                .collect()
        };
        let names =
            |groups: &[&str]| -> Vec<String> { groups.iter().map(|g| g.to_string()).collect() };
        for series in KERNELS {
            let script = script(&guest, series, &tiers, &Options::default());
            let each_tier = series.version == EACH_TIER_KERNEL;
            for suite in TIER_SUITES {
                for (nth, tier) in tiers.iter().enumerate() {
                    let run = runs(&script, tier, suite);
                    assert_eq!(run.len(), 1, "{script}");
                    // `tier_` runs everywhere; `any_tier_` nowhere in the VM (the host's);
                    // `kernel_` with each kernel's first tier; `each_tier_` on every
                    // tier of one kernel.
                    let mut skipped = names(&[ONCE]);
                    if nth > 0 {
                        skipped.push(ONCE_PER_KERNEL.into());
                    }
                    if !each_tier {
                        skipped.push(EACH_TIER.into());
                    }
                    assert_eq!(skips(&run[0]), skipped, "{}: {}", series.version, run[0]);
                }
            }
            let alloc = (tiers.iter())
                .map(|tier| runs(&script, tier, "memory_at_alloc").len())
                .collect::<Vec<_>>();
            let newest = series.version == KERNEL_SUITE_KERNEL;
            assert_eq!(alloc, [usize::from(newest), 0, 0], "{}", series.version);
            assert!(!script.contains("systemd_unit"), "{script}");
            // 1,000 attempts on every tier but a preempting kernel's fentry tier.
            let set: Vec<&str> = (script.lines())
                .filter(|l| l.contains("GENV_TEST_ATTEMPTS") && !l.contains("GENV_TEST_BPF_TIER"))
                .collect();
            let expected: Vec<&str> = (tiers.iter())
                .map(|tier| match series.preempts_programs && tier == ODDS_TIER {
                    true => "unset GENV_TEST_ATTEMPTS",
                    false => "export GENV_TEST_ATTEMPTS=1000",
                })
                .collect();
            assert_eq!(set, expected, "{}", series.version);
        }
        assert!(KERNELS.iter().any(|k| k.version == EACH_TIER_KERNEL));
        assert!(KERNELS.iter().any(|k| k.version == KERNEL_SUITE_KERNEL));
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
        for series in KERNELS {
            let script = script(&guest, series, &["lsm".to_owned()], &options);
            let first = runs(&script, "lsm", "prevention");
            assert!(first[0].ends_with("'any_tier_x'"), "{}", first[0]);
            // The attempt loop at its full size, as the benchmark asks for it.
            assert!(!script.contains("GENV_TEST_ATTEMPTS"), "{script}");
        }
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
