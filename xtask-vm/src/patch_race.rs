//! The one guest death the harness does not blame on the code under test: an `int3`
//! Oops in kernel text that is being patched.
//!
//! Attaching or detaching a BPF trampoline (every lsm, fmod_ret and fentry daemon start
//! and stop) rewrites the traced function's first instruction with `text_poke_bp`: an
//! `int3` goes in first, the kernel waits until every CPU has serialized, and only then
//! is the `int3` replaced, its handler still covering any CPU that hits it meanwhile. On
//! real CPUs a CPU cannot execute that `int3` after the handler has let go; under QEMU
//! 7.2's multi-threaded TCG (bookworm's QEMU, which the VM needs because `/dev/kvm` here
//! hangs a stock kernel) a vCPU occasionally runs a stale translation of the patched
//! bytes and does, and the guest dies with `Oops: int3` in `security_file_open` or
//! `bpf_lsm_file_open` (seen once in CI, 6.12's fentry tier, after every tier before it
//! had passed). No BPF program can cause it: the verifier leaves them no way to execute
//! a breakpoint in kernel text.
//!
//! The same race has a second face: the guest wedges instead of dying. The daemon that
//! attaches or detaches (in `text_poke_bp`, waiting for every CPU to serialize) and a
//! process running through the patched function both stay on their CPUs, and the
//! guest's watchdog reports them stuck, for ever (seen once, 6.1's LSM tier: a daemon
//! of a test that had just passed going away while the exec storm ran, `genv-enforcer`
//! and `sh` stuck on the two CPUs for ten minutes, until the deadline). The console
//! shows the watchdog's lines; once one names a `genv-enforcer` task stuck for
//! [`WEDGED_AFTER_S`], the guest is stopped instead of being left to its deadline.
//!
//! And a third: a double fault in kernel code no BPF program runs in, its registers
//! garbage (seen once in CI, 6.12's LSM tier, while a test unpinned its programs, with
//! a compile sharing the cores: a `kworker` of `rcu_gp` in `kmalloc`, `EFLAGS:
//! 01ef8a62`). A double fault is the CPU faulting while it delivers a fault: a stack
//! pointer gone wrong. A verified program cannot set a kernel thread's stack pointer;
//! a stale translation of freed or patched trampoline text can. One whose `RIP` is in a
//! program or a trampoline is not excused.
//!
//! So any of these deaths reboots the kernel once, running only the tiers that had not
//! ended; the run says so in its summary. Any other death, or a second one, fails the
//! run.

/// How long the guest's watchdog must have seen a daemon's CPU stuck before the guest
/// counts as wedged (its soft-lockup threshold is 20 s; a test never legitimately keeps
/// a CPU in the kernel for a minute).
pub const WEDGED_AFTER_S: u64 = 60;

/// What excuses the guest's death, if anything: the `int3` Oops, the wedge, or a double
/// fault outside the programs.
pub fn excused(console: &[String]) -> Option<String> {
    int3_oops(console)
        .map(|oops| format!("died of an int3 in kernel text being patched, {oops}"))
        .or_else(|| wedged(console).map(|line| format!("wedged: {line}")))
        .or_else(|| {
            double_fault(console)
                .map(|fault| format!("died of a double fault outside the programs, {fault}"))
        })
}

/// The console's double fault and the `RIP` line after it, unless that `RIP` is in a
/// BPF program or trampoline (then it may be ours).
pub fn double_fault(console: &[String]) -> Option<String> {
    let at = (console.iter()).position(|line| {
        line.contains("PANIC: double fault") || line.contains("Oops: double fault")
    })?;
    let rip = console[at..]
        .iter()
        .find(|line| line.contains("RIP: 0010:"))?
        .trim();
    let ours = rip.contains("bpf_prog") || rip.contains("bpf_trampoline");
    (!ours).then(|| format!("{} ({rip})", console[at].trim()))
}

/// The guest watchdog's first line naming a `genv-enforcer` task stuck on its CPU for
/// [`WEDGED_AFTER_S`] or more (`watchdog: BUG: soft lockup - CPU#1 stuck for 63s!
/// [genv-enforcer:578]`), trimmed.
pub fn wedged(console: &[String]) -> Option<String> {
    console.iter().find_map(|line| {
        let rest = line.split("watchdog: BUG: soft lockup - ").nth(1)?;
        let stuck: u64 = rest
            .split("stuck for ")
            .nth(1)?
            .split('s')
            .next()?
            .parse()
            .ok()?;
        (stuck >= WEDGED_AFTER_S && rest.contains("[genv-enforcer:"))
            .then(|| rest.trim().to_owned())
    })
}

/// The guest console's Oops line for an `int3` in kernel text, and the `RIP` line after
/// it (where it was), if the console has one.
pub fn int3_oops(console: &[String]) -> Option<String> {
    let at = console
        .iter()
        .position(|line| line.contains("Oops: int3"))?;
    let rip = console[at..]
        .iter()
        .find(|line| line.contains("RIP: 0010:"))
        .map(|line| line.trim())
        .unwrap_or("RIP not printed");
    Some(format!("{} ({rip})", console[at].trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_owned).collect()
    }

    #[test]
    fn the_ci_consoles_oops_is_recognised_with_where_it_was() {
        let console = lines(
            "[fentry tier] each_tier_a_crashed_daemons_exemption_names_no_later_process\n\
             [  884.608901] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n\
             [  884.609992] CPU: 0 UID: 0 PID: 28606 Comm: a_crashed_daemo Not tainted\n\
             [  884.610165] RIP: 0010:security_file_open+0x5/0xe0\n\
             [  884.613941] Kernel panic - not syncing: Fatal exception in interrupt",
        );
        let found = int3_oops(&console).unwrap();
        assert!(found.contains("Oops: int3"), "{found}");
        assert!(found.contains("security_file_open+0x5"), "{found}");
    }

    #[test]
    fn a_daemons_cpu_stuck_for_a_minute_is_the_wedge() {
        let console = lines(
            "[  268.758070] watchdog: BUG: soft lockup - CPU#0 stuck for 23s! [sh:741]\n\
             [  268.845869] watchdog: BUG: soft lockup - CPU#1 stuck for 22s! [genv-enforcer:578]\n\
             [  296.757829] watchdog: BUG: soft lockup - CPU#0 stuck for 49s! [sh:741]\n\
             [  324.845842] watchdog: BUG: soft lockup - CPU#1 stuck for 74s! [genv-enforcer:578]",
        );
        assert_eq!(
            wedged(&console).as_deref(),
            Some("CPU#1 stuck for 74s! [genv-enforcer:578]")
        );
        assert!(excused(&console).unwrap().starts_with("wedged: "));
        // Shorter, or another task alone: not the wedge.
        assert_eq!(wedged(&console[..3]), None);
        let other = lines("[ 9.0] watchdog: BUG: soft lockup - CPU#0 stuck for 99s! [sh:741]");
        assert_eq!(excused(&other), None);
    }

    #[test]
    fn the_ci_consoles_double_fault_is_excused_and_one_in_a_program_is_not() {
        let console = lines(
            "[lsm tier] tier_pinned_programs_keep_deciding_while_the_daemon_is_down_until_unpinned\n\
             [  373.182570] traps: PANIC: double fault, error_code: 0x0\n\
             [  373.188773] Oops: double fault: 0000 [#1] PREEMPT SMP NOPTI\n\
             [  373.193213] CPU: 0 UID: 0 PID: 10 Comm: kworker/0:1 Not tainted 6.12.117+deb12-amd64 #1\n\
             [  373.195214] RIP: 0010:__kmalloc_node_track_caller_noprof+0x148/0x440\n\
             [  373.209301] Kernel panic - not syncing: Fatal exception in interrupt",
        );
        let why = excused(&console).unwrap();
        assert!(
            why.contains("double fault") && why.contains("__kmalloc_node"),
            "{why}"
        );
        let in_program = lines(
            "[ 1.0] traps: PANIC: double fault, error_code: 0x0\n\
             [ 1.0] RIP: 0010:bpf_prog_6deef7357e7b4530_open_lsm+0x40",
        );
        assert_eq!(excused(&in_program), None);
    }

    #[test]
    fn other_deaths_are_not_excused() {
        for text in [
            "[ 1.0] BUG: kernel NULL pointer dereference, address: 0000000000000008\n\
             [ 1.0] Oops: 0000 [#1] PREEMPT SMP NOPTI\n[ 1.0] RIP: 0010:bpf_prog_run+0x5",
            "[ 1.0] Oops: invalid opcode: 0000 [#1] SMP NOPTI\n[ 1.0] RIP: 0010:__text_poke+0x29c",
            "[ 1.0] Kernel panic - not syncing: Out of memory",
            "test tier_opens_are_seen_whatever_the_way_in ... ok",
        ] {
            assert_eq!(excused(&lines(text)), None, "{text}");
        }
    }
}
