//! What the kernel decided, said the way genv says things: the guarantee the running
//! tier gives, and a genv-style line for each refusal or kill.

use crate::backends::users;
use crate::bpf::Tier;
use crate::bpf::policy_maps::DenyPolicy;
use crate::intake::{GpuOpen, Verdict};

/// What the kernel guarantees about GPU opens by processes outside any environment.
pub fn guarantee(tier: Option<Tier>, deny: DenyPolicy) -> String {
    let whose = match deny.root {
        true => "",
        false => "; root's processes are let through (--deny-root to include them)",
    };
    match (tier, deny.deny) {
        (Some(Tier::Lsm), true) => {
            format!("refused in the kernel: the open fails with EPERM (--deny, lsm tier){whose}")
        }
        (Some(tier), true) => format!(
            "killed in the syscall: SIGKILL from the {tier} program, before open() returns \
             (--deny; the kernel has no BPF LSM for refusing){whose}"
        ),
        (Some(_), false) => {
            "reacted to in userspace, milliseconds after the open (no --deny)".into()
        }
        (None, _) => "reacted to in userspace by the full cycle (no kernel programs)".into(),
    }
}

/// genv-style line for an in-kernel decision (stdout, like genv's own lines).
pub fn decision_line(open: &GpuOpen) -> Option<String> {
    let user = users::display_name(open.uid);
    let pid = open.pid;
    let index = open.index;
    match open.verdict {
        Verdict::Refused => Some(format!(
            "Refused process {pid} of user {user} access to GPU {index}: it is not running in a GPU environment"
        )),
        Verdict::Killed => Some(format!(
            "Killed process {pid} of user {user} when it opened GPU {index}: it is not running in a GPU environment"
        )),

        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_are_reported_with_pid_user_and_gpu() {
        let open = GpuOpen {
            pid: 42,
            tid: 43,
            major: 195,
            minor: 1,
            index: 1,
            tier: Tier::Lsm,
            uid: 0,
            verdict: Verdict::Refused,
            at_ns: 0,
        };
        assert_eq!(
            decision_line(&open).unwrap(),
            "Refused process 42 of user root access to GPU 1: it is not running in a GPU environment"
        );
        let killed = GpuOpen {
            verdict: Verdict::Killed,
            uid: 4_000_000,
            ..open
        };
        assert_eq!(
            decision_line(&killed).unwrap(),
            "Killed process 42 of user 4000000 when it opened GPU 1: it is not running in a GPU environment"
        );
        let seen = GpuOpen {
            verdict: Verdict::Outside,
            ..open
        };
        assert_eq!(decision_line(&seen), None);
    }

    #[test]
    fn the_guarantee_names_what_the_kernel_does() {
        let deny = DenyPolicy {
            deny: true,
            root: false,
        };
        let everyone = DenyPolicy { root: true, ..deny };
        assert!(guarantee(Some(Tier::Lsm), deny).starts_with("refused in the kernel"));
        assert!(guarantee(Some(Tier::Lsm), deny).contains("--deny-root"));
        assert!(!guarantee(Some(Tier::Lsm), everyone).contains("root"));
        assert!(guarantee(Some(Tier::Fentry), deny).starts_with("killed in the syscall"));
        assert!(guarantee(Some(Tier::Tracepoint), deny).contains("tracepoint program"));
        let off = DenyPolicy::default();
        assert!(guarantee(Some(Tier::Lsm), off).starts_with("reacted to in userspace"));
        assert!(guarantee(None, deny).contains("full cycle"));
    }
}
