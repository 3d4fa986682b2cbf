//! The VM runner behind `cargo xtask vm-test`: the tier-dependent tests on the kernel
//! tiers this machine's kernel refuses ([`VM_TIERS`]: LSM, fmod_ret, fentry), on three of
//! Debian's kernels (6.1, 6.12 and the newest, 7, [`KERNELS`]) under QEMU, against test
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
/// name which group it is in (`tests/architecture.rs` fails on one that does not), and
/// so where it runs in CI's whole run (`docs/dev/testing.md`, "Which test runs where"):
/// - `tier_…` (no other prefix): the kernel decides its outcome with the tier (whether
///   the tier's programs load and attach, which opens reach them, whether they refuse
///   or kill, its pins): every tier of every kernel;
/// - [`EACH_TIER`] (`each_tier_…`): the tier decides it, the kernel does not (the same
///   programs' verdicts, once loaded, and what the daemon makes of them): every tier of
///   [`EACH_TIER_KERNEL`];
/// - [`ONCE_PER_KERNEL`] (`kernel_…`): the kernel decides it, the tier does not (its BTF,
///   what its verifier accepts, which tiers it refuses): the first tier of every kernel;
/// - [`ONCE`] (`any_tier_…`): neither decides it (the exec, fork and exit hooks, which
///   every tier shares and every `tier_` test loads, the daemon's state handling, the
///   memory poll): the host's run only.
///
/// Every group runs on the host too. `vm-test` given test arguments runs what they
/// select on every tier of every kernel asked for, the `kernel_` and `any_tier_` tests
/// with the first tier.
pub const TIER_SUITES: [&str; 4] = ["event_driven", "prevention", "identities", "notify"];
/// The name prefix of the tier suites' tests that run once per kernel.
pub const ONCE_PER_KERNEL: &str = "kernel_";
/// The name prefix of the tier suites' tests that run on the host only in CI.
pub const ONCE: &str = "any_tier_";
/// The name prefix of the tier suites' tests that run on every tier of one kernel.
pub const EACH_TIER: &str = "each_tier_";
/// Every group's prefix. libtest's `--skip` matches anywhere in a name, so no test's
/// name may hold another group's prefix after its own (`tests/architecture.rs`).
pub const GROUPS: [&str; 4] = ["tier_", EACH_TIER, ONCE_PER_KERNEL, ONCE];
/// The kernel whose tiers run the `each_tier_` tests: Debian 13's series, the middle of
/// the three (the lanes' balance, `xtask/src/test.rs`).
const EACH_TIER_KERNEL: &str = "6.12";
/// The test binaries whose scenarios depend on the kernel, not the tier (uprobes load
/// the same under every tier): run with the first tier, on one kernel, with the tests
/// CI runs there (every test of it, when `vm-test` is given test arguments). Each of
/// its tests starts a daemon and the real genv (a dozen Python starts), one to two
/// minutes under TCG: the whole suite would take CI past its budget. These two prove
/// what the kernel does: it kills in the call, and it lets the refusing programs make
/// the call return out-of-memory (racing processes included); the rest (the breakpoints
/// placed system-wide, which every kernel's uprobes do alike, other GPUs, every
/// allocation call) is the same programs' arithmetic, run on the host.
pub const KERNEL_SUITES: [&str; 1] = ["memory_at_alloc"];
/// The kernel that runs the kernel suites: the newest, the first whose uprobe programs
/// may write the registers (a refusal at the allocation, `docs/memory-at-alloc.md`).
const KERNEL_SUITE_KERNEL: &str = "7";
const KERNEL_SUITE_TESTS: [&str; 2] = [
    "the_allocation_that_crosses_the_cap",
    "refuse_returns_out_of_memory",
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
