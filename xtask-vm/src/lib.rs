//! The VM runner behind `cargo xtask vm-test`: the tier-dependent tests on the kernel
//! tiers this machine's kernel refuses ([`VM_TIERS`]: LSM, fmod_ret, fentry), on both of
//! Debian bookworm's kernels (6.1 and 6.12, [`KERNELS`]) under QEMU, against test
//! executables the caller built (xtask builds them; this crate never runs cargo).
//!
//! Each kernel is booted once, and that boot runs every requested tier's suites in turn
//! (`GENV_TEST_BPF_TIER=<tier>`, `GENV_REQUIRE_BPF=1`: a tier the kernel refuses fails its
//! tests); then the next kernel. The console names the kernel and tier of each section,
//! and a failure names both. QEMU runs under TCG:
//! `/dev/kvm` here is nested and a stock kernel hangs at boot under it; TCG makes the
//! guest slow (an open costs ~50 µs instead of ~1 µs) but behaves like the real thing,
//! which is what these tests check. Overheads are measured on the host, never here.

mod archive;
mod args;
mod command;
mod guest;
mod initramfs;
mod kernel;
mod outcome;
mod patch_race;
mod qemu;
mod run;
mod setup;
pub mod systemd;

use std::time::Duration;

pub use archive::Archive;
pub use args::{Args, Options, kernels_named};
pub use command::run_as;
pub use guest::Guest;
pub use kernel::{KERNELS, Kernel, Series};
pub use outcome::{Outcome, Run};
pub use run::{refusal_check, run_kernel};
pub use setup::{ensure_packages, prepare};

/// The test binaries whose scenarios depend on the tier. Every test in them says in its
/// name which group it is in (`tests/architecture.rs` fails on one that does not):
/// `tier_…` runs on every tier of every kernel; `kernel_…` ([`ONCE_PER_KERNEL`]) proves
/// the same whatever program sees the opens but depends on the kernel (its BTF, what
/// its verifier accepts, which tiers it refuses) and runs with the first tier of each
/// kernel; `any_tier_…` ([`ONCE`]) proves what neither changes (the exec, fork and exit
/// hooks' behaviour, userspace's state handling, the memory poll) and runs with the
/// first tier of [`ONE_KERNEL`] only, in CI's whole run (every kernel it is asked for,
/// when `vm-test` is given test arguments). Every group runs on the host too.
pub const TIER_SUITES: [&str; 4] = ["event_driven", "prevention", "identities", "notify"];
/// The name prefix of the tier suites' tests that run once per kernel.
pub const ONCE_PER_KERNEL: &str = "kernel_";
/// The name prefix of the tier suites' tests that run on one kernel.
pub const ONCE: &str = "any_tier_";
/// The test binaries whose scenarios depend on the kernel, not the tier (uprobes load
/// the same under every tier): run with the first tier, on one kernel, with the tests
/// CI runs there (every test of it, when `vm-test` is given test arguments). Each of
/// its tests starts a daemon and the real genv (a dozen Python starts), one to two
/// minutes under TCG: the whole suite would take CI past its budget. These two prove
/// what the kernel does: it kills in the call, and places the breakpoints only in the
/// processes that carry the probes; the rest (racing processes, other GPUs, every
/// allocation call) is the same programs' arithmetic, run on the host.
pub const KERNEL_SUITES: [&str; 1] = ["memory_at_alloc"];
/// The kernel that runs what one kernel runs: the kernel suites and the `any_tier_`
/// tests: the older one, Debian 12's own.
const ONE_KERNEL: &str = "6.1";
const KERNEL_SUITE_TESTS: [&str; 2] = [
    "the_allocation_that_crosses_the_cap",
    "only_processes_in_capped_environments",
];

/// Every suite a boot of [`run_kernel`] may run: what the caller builds.
pub fn suites() -> Vec<&'static str> {
    TIER_SUITES.iter().chain(&KERNEL_SUITES).copied().collect()
}

/// The tiers the VM runs those suites on unless `--tiers` says otherwise, in order: the
/// ones this machine's kernel refuses (the host runs the tracepoint tier). A new tier
/// goes here and in [`KNOWN_TIERS`]; `cargo xtask test` then runs it on every kernel.
pub const VM_TIERS: &[&str] = &["lsm", "fmod_ret", "fentry"];

/// What `--tiers` accepts.
pub const KNOWN_TIERS: &[&str] = &["lsm", "fmod_ret", "fentry", "tracepoint"];

/// Debian's own kernel would pick AppArmor first and no BPF LSM; this is the list the
/// LSM tier needs, with what a hardened distribution would also have.
pub const LSM_WITH_BPF: &str = "lockdown,capability,landlock,yama,bpf";

/// How long one VM run (one kernel's boot, every tier) may take before it is killed:
/// [`BOOT_ALLOWANCE`] plus [`PER_TIER`] for each tier it runs, 50 minutes for three tiers.
/// Measured on 2 cores, a tier's two suites take 4.5 minutes on 6.1 and 6 to 8 on 6.12
/// (the whole 6.12 run 14 minutes); with other VMs sharing those cores, 11 and 12 to 15
/// (26 minutes for the 6.12 run). CI has 90 minutes in all, for the host's suites and
/// every kernel: one hung guest still fails inside them, naming its kernel and tier.
fn deadline(tiers: usize) -> Duration {
    BOOT_ALLOWANCE + PER_TIER * tiers as u32
}
const BOOT_ALLOWANCE: Duration = Duration::from_secs(5 * 60);
const PER_TIER: Duration = Duration::from_secs(15 * 60);

/// The work needs root: apt-get, and the tests inside make nodes and signal.
fn require_root(what: &str) -> anyhow::Result<()> {
    if !rustix::process::geteuid().is_root() {
        anyhow::bail!("{what} needs root (apt-get, and the tests inside make nodes and signal)");
    }
    Ok(())
}
