//! The kernel tiers the open hook can run on, best first, and what each guarantees.

use std::fmt;

use genv_ebpf_common::hook;

/// Which program sees GPU opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// BPF LSM `file_open`: every open attempt (failed ones, io_uring, `openat2`),
    /// before the driver; can refuse the open.
    Lsm,
    /// fentry on `security_file_open`: every attempt, before the driver; cannot refuse.
    Fentry,
    /// `sys_exit_open*` tracepoints: successful `open`/`openat`/`openat2` only, after
    /// the fact.
    Tracepoint,
}

impl Tier {
    pub const BEST_FIRST: [Tier; 3] = [Tier::Lsm, Tier::Fentry, Tier::Tracepoint];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Lsm => "lsm",
            Tier::Fentry => "fentry",
            Tier::Tracepoint => "tracepoint",
        }
    }

    /// The tier of an event's `hook` field.
    pub fn from_hook(value: u32) -> Option<Tier> {
        match value {
            hook::LSM => Some(Tier::Lsm),
            hook::FENTRY => Some(Tier::Fentry),
            hook::TRACEPOINT => Some(Tier::Tracepoint),
            _ => None,
        }
    }

    /// How an event line words what this tier saw: the LSM and fentry hooks run before
    /// the driver's open, which may still fail; the tracepoints after a successful one.
    pub fn open_verb(self) -> &'static str {
        match self {
            Tier::Lsm | Tier::Fentry => "is opening",
            Tier::Tracepoint => "opened",
        }
    }

    /// What the tier sees, for the start-up line and the status output.
    pub fn sees(self) -> &'static str {
        match self {
            Tier::Lsm => "every open attempt of a GPU node (BPF LSM file_open)",
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
            TierChoice::Fentry => "fentry",
            TierChoice::Tracepoint => "tracepoint",
            TierChoice::None => "none",
        }
    }

    /// The tiers to try, in order; empty for `none`.
    pub fn candidates(self) -> &'static [Tier] {
        match self {
            TierChoice::Auto => &Tier::BEST_FIRST,
            TierChoice::Lsm => &[Tier::Lsm],
            TierChoice::Fentry => &[Tier::Fentry],
            TierChoice::Tracepoint => &[Tier::Tracepoint],
            TierChoice::None => &[],
        }
    }
}
