//! The kernel tiers the open hook can run on, best first, and what each guarantees.

use std::fmt;

use genv_ebpf_common::hook;

use super::policy_maps::DenyPolicy;

/// Which program sees GPU opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// BPF LSM `file_open`: every open attempt (failed ones, io_uring, `openat2`),
    /// before the driver; can refuse the open.
    Lsm,
    /// fmod_ret on `security_file_open`: every attempt, before the driver; can refuse
    /// the open (its return value replaces the function's), without the BPF LSM.
    FmodRet,
    /// fentry on `security_file_open`: every attempt, before the driver; cannot refuse.
    Fentry,
    /// `sys_exit_open*` tracepoints: successful `open`/`openat`/`openat2` only, after
    /// the fact.
    Tracepoint,
}

impl Tier {
    pub const BEST_FIRST: [Tier; 4] = [Tier::Lsm, Tier::FmodRet, Tier::Fentry, Tier::Tracepoint];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Lsm => "lsm",
            Tier::FmodRet => "fmod_ret",
            Tier::Fentry => "fentry",
            Tier::Tracepoint => "tracepoint",
        }
    }

    /// Its rank from the bottom, as the metrics give it for alerts to compare: 4 for the
    /// LSM down to 1 for the tracepoints (0 stands for no programs).
    pub fn level(self) -> i64 {
        let best_first = Tier::BEST_FIRST.iter().position(|t| *t == self);
        (Tier::BEST_FIRST.len() - best_first.expect("every tier is listed")) as i64
    }

    /// The tier of an event's `hook` field.
    pub fn from_hook(value: u32) -> Option<Tier> {
        match value {
            hook::LSM => Some(Tier::Lsm),
            hook::FMOD_RET => Some(Tier::FmodRet),
            hook::FENTRY => Some(Tier::Fentry),
            hook::TRACEPOINT => Some(Tier::Tracepoint),
            _ => None,
        }
    }

    /// Whether the tier refuses an open (EPERM) under `--deny`; the others kill the
    /// opener in the syscall.
    pub fn refuses(self) -> bool {
        hook::refuses(self.hook())
    }

    /// The `hook` field of this tier's events.
    pub fn hook(self) -> u32 {
        match self {
            Tier::Lsm => hook::LSM,
            Tier::FmodRet => hook::FMOD_RET,
            Tier::Fentry => hook::FENTRY,
            Tier::Tracepoint => hook::TRACEPOINT,
        }
    }

    /// How an event line words what this tier saw: the LSM, fmod_ret and fentry hooks
    /// run before the driver's open, which may still fail; the tracepoints after a
    /// successful one.
    pub fn open_verb(self) -> &'static str {
        match self {
            Tier::Lsm | Tier::FmodRet | Tier::Fentry => "is opening",
            Tier::Tracepoint => "opened",
        }
    }

    /// What the tier sees, for the start-up line and the status output.
    pub fn sees(self) -> &'static str {
        match self {
            Tier::Lsm => "every open attempt of a GPU node (BPF LSM file_open)",
            Tier::FmodRet => "every open attempt of a GPU node (fmod_ret on security_file_open)",
            Tier::Fentry => "every open attempt of a GPU node (fentry on security_file_open)",
            Tier::Tracepoint => {
                "successful open/openat/openat2/creat/open_by_handle_at of a GPU node (syscall exit tracepoints; 32-bit ones with --deny)"
            }
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `--bpf-tier`: probe for the best, force one, or run without BPF.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TierChoice {
    Auto,
    Lsm,
    #[value(name = "fmod_ret")]
    FmodRet,
    Fentry,
    Tracepoint,
    None,
}

impl TierChoice {
    /// As written on the command line.
    pub fn name(self) -> &'static str {
        match self {
            TierChoice::Auto => "auto",
            TierChoice::Lsm => "lsm",
            TierChoice::FmodRet => "fmod_ret",
            TierChoice::Fentry => "fentry",
            TierChoice::Tracepoint => "tracepoint",
            TierChoice::None => "none",
        }
    }

    /// The least [`Tier::level`] this choice accepts: a forced tier's own, 1 for `auto`
    /// (any tier rather than none), 0 for `none`.
    pub fn least_level(self) -> i64 {
        match self {
            TierChoice::Auto => 1,
            choice => choice.candidates().first().map_or(0, |t| t.level()),
        }
    }

    /// The tiers to try, in order; empty for `none`.
    pub fn candidates(self) -> &'static [Tier] {
        match self {
            TierChoice::Auto => &Tier::BEST_FIRST,
            TierChoice::Lsm => &[Tier::Lsm],
            TierChoice::FmodRet => &[Tier::FmodRet],
            TierChoice::Fentry => &[Tier::Fentry],
            TierChoice::Tracepoint => &[Tier::Tracepoint],
            TierChoice::None => &[],
        }
    }
}

/// What the kernel guarantees about GPU opens by processes outside any environment,
/// on `tier` (`None`: no programs) with `deny`.
pub fn guarantee(tier: Option<Tier>, deny: DenyPolicy) -> String {
    let whose = match deny.root {
        true => "",
        false => "; root's processes are let through (--deny-root to include them)",
    };
    // Every program but the LSM's carries the kernel's recursion guard: where the kernel
    // preempts inside programs it may skip one (`crate::kernel::skipped_runs`).
    let skips = match tier {
        Some(Tier::Lsm) | None => "",
        Some(_) => {
            "; an open whose run the kernel skips (a kernel that preempts inside programs) \
             is swept within 250 ms"
        }
    };
    match (tier, deny.deny) {
        (Some(tier), true) if tier.refuses() => format!(
            "refused in the kernel: the open fails with EPERM (--deny, {tier} tier){whose}{skips}"
        ),
        (Some(tier), true) => format!(
            "killed in the syscall: SIGKILL from the {tier} program, before open() returns \
             (--deny; no refusing tier, BPF LSM or fmod_ret, is loaded){whose}{skips}"
        ),
        (Some(_), false) => {
            "reacted to in userspace, milliseconds after the open (no --deny)".into()
        }
        (None, _) => "reacted to in userspace by the full cycle (no kernel programs)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn tiers_round_trip_through_their_hooks_and_names() {
        for tier in Tier::BEST_FIRST {
            assert_eq!(Tier::from_hook(tier.hook()), Some(tier));
            let choice = TierChoice::from_str(tier.name(), false).unwrap();
            assert_eq!(choice.name(), tier.name());
            assert_eq!(choice.candidates(), &[tier]);
        }
        assert_eq!(Tier::from_hook(hook::NONE), None);
        let levels: Vec<i64> = Tier::BEST_FIRST.iter().map(|t| t.level()).collect();
        assert_eq!(levels, [4, 3, 2, 1]);
        assert_eq!(TierChoice::FmodRet.least_level(), 3);
        assert_eq!(TierChoice::Auto.least_level(), 1);
        assert_eq!(TierChoice::None.least_level(), 0);
    }

    #[test]
    fn the_refusing_tiers_come_first() {
        let refusing: Vec<&str> = Tier::BEST_FIRST
            .iter()
            .filter(|t| t.refuses())
            .map(|t| t.name())
            .collect();
        assert_eq!(refusing, ["lsm", "fmod_ret"]);
        assert!(Tier::BEST_FIRST[..2].iter().all(|t| t.refuses()));
    }

    #[test]
    fn the_guarantee_names_what_the_kernel_does() {
        let deny = DenyPolicy {
            deny: true,
            root: false,
        };
        let everyone = DenyPolicy { root: true, ..deny };
        assert!(guarantee(Some(Tier::Lsm), deny).starts_with("refused in the kernel"));
        let fmod_ret = guarantee(Some(Tier::FmodRet), deny);
        assert!(
            fmod_ret.starts_with("refused in the kernel: the open fails with EPERM")
                && fmod_ret.contains("fmod_ret tier"),
            "{fmod_ret}"
        );
        assert!(guarantee(Some(Tier::Lsm), deny).contains("--deny-root"));
        // Only the LSM's program has no recursion guard for the kernel to skip it by.
        assert!(!guarantee(Some(Tier::Lsm), deny).contains("skips"));
        for tier in [Tier::FmodRet, Tier::Fentry, Tier::Tracepoint] {
            assert!(guarantee(Some(tier), deny).contains("swept within 250 ms"));
        }
        assert!(!guarantee(Some(Tier::Lsm), everyone).contains("root"));
        assert!(guarantee(Some(Tier::Fentry), deny).starts_with("killed in the syscall"));
        assert!(guarantee(Some(Tier::Tracepoint), deny).contains("tracepoint program"));
        let off = DenyPolicy::default();
        assert!(guarantee(Some(Tier::Lsm), off).starts_with("reacted to in userspace"));
        assert!(guarantee(None, deny).contains("full cycle"));
    }
}
