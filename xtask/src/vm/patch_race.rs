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
//! So such a death reboots the kernel once, running only the tiers that had not ended;
//! the run says so in its summary. Any other death, or a second one, fails the run.

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
            "[fentry tier] a_crashed_daemons_exemption_names_no_later_process\n\
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
    fn other_deaths_are_not_excused() {
        for text in [
            "[ 1.0] BUG: kernel NULL pointer dereference, address: 0000000000000008\n\
             [ 1.0] Oops: 0000 [#1] PREEMPT SMP NOPTI\n[ 1.0] RIP: 0010:bpf_prog_run+0x5",
            "[ 1.0] Oops: invalid opcode: 0000 [#1] SMP NOPTI\n[ 1.0] RIP: 0010:__text_poke+0x29c",
            "[ 1.0] Kernel panic - not syncing: Out of memory",
            "test opens_are_seen_whatever_the_way_in ... ok",
        ] {
            assert_eq!(int3_oops(&lines(text)), None, "{text}");
        }
    }
}
