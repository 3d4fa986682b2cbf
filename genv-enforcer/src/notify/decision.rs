//! One decision about one process, as its user is told it: what was done, under which
//! rule, and the genv command that fixes it.
//!
//! Every text field is [`sanitize`](super::sanitize)d when the record is made, so the
//! record can go anywhere (a terminal, the journal, `why`'s answer) as it is.

use serde::{Deserialize, Serialize};

use super::sanitize::{NAME_CHARS, clean, clean_str};

/// What was done to the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// SIGTERM, from a rule.
    Terminated,
    /// SIGKILL: the kill after `--kill-after`, or the kernel's at the open (`--deny` on
    /// the fentry and tracepoint tiers).
    Killed,
    /// The kernel failed its GPU open with EPERM (`--deny` on the lsm and fmod_ret
    /// tiers); the process lives on.
    Refused,
    /// SIGKILL inside the allocation that would have crossed the cap
    /// (`--memory-at-alloc kill`).
    KilledAtAllocation,
    /// Its environment's GPU was detached (`--max-devices-per-user`), and the process
    /// stopped with it.
    Detached,
}

impl Action {
    pub fn word(self) -> &'static str {
        match self {
            Action::Terminated => "terminated",
            Action::Killed => "killed",
            Action::Refused => "refused",
            Action::KilledAtAllocation => "killed-at-allocation",
            Action::Detached => "detached",
        }
    }
}

/// Why: the rule, with what the user needs to see of its figures.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "rule", rename_all = "kebab-case")]
pub enum Rule {
    /// Outside any environment (`--non-env-processes`, and `--deny` at the open).
    NonEnvProcesses,
    /// On GPUs its environment was not given (`--env-devices`).
    EnvDevices,
    /// The environment used more than its `gpu_memory` on a GPU (`--env-memory`).
    EnvMemory { used_mb: u64, capacity: String },
    /// The user held more GPUs than allowed (`--max-devices-per-user`).
    MaxDevicesPerUser {
        user: String,
        devices: usize,
        maximum: usize,
    },
    /// An allocation would have taken the environment past its cap
    /// (`--memory-at-alloc kill`).
    MemoryAtAlloc { would_use_mb: u64, capacity: String },
}

impl Rule {
    /// The rule as its flag names it.
    pub fn name(&self) -> &'static str {
        match self {
            Rule::NonEnvProcesses => "non-env-processes",
            Rule::EnvDevices => "env-devices",
            Rule::EnvMemory { .. } => "env-memory",
            Rule::MaxDevicesPerUser { .. } => "max-devices-per-user",
            Rule::MemoryAtAlloc { .. } => "memory-at-alloc",
        }
    }

    /// The same rule with its user-given text cleaned.
    fn cleaned(self) -> Rule {
        match self {
            Rule::EnvMemory { used_mb, capacity } => Rule::EnvMemory {
                used_mb,
                capacity: clean_str(&capacity, NAME_CHARS),
            },
            Rule::MaxDevicesPerUser {
                user,
                devices,
                maximum,
            } => Rule::MaxDevicesPerUser {
                user: clean_str(&user, NAME_CHARS),
                devices,
                maximum,
            },
            Rule::MemoryAtAlloc {
                would_use_mb,
                capacity,
            } => Rule::MemoryAtAlloc {
                would_use_mb,
                capacity: clean_str(&capacity, NAME_CHARS),
            },
            other => other,
        }
    }
}

/// The facts of a decision as the daemon has them: names still raw.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    pub pid: u32,
    pub uid: u32,
    /// `comm` as the kernel or `/proc` gives it (any bytes).
    pub comm: &'a [u8],
    /// The environment's id and name (`config.name`), where it has one.
    pub env: Option<(&'a str, Option<&'a str>)>,
    pub gpus: Vec<u32>,
    pub rule: Rule,
    pub action: Action,
}

/// A decision, sanitised, with the line its user sees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Seconds since the epoch.
    pub time: u64,
    pub pid: u32,
    pub uid: u32,
    pub comm: String,
    pub env: Option<String>,
    pub env_name: Option<String>,
    pub gpus: Vec<u32>,
    #[serde(flatten)]
    pub rule: Rule,
    pub action: Action,
    /// What the process's terminal is told.
    pub line: String,
}

impl Decision {
    pub fn new(facts: Facts<'_>, time: u64) -> Self {
        let mut decision = Decision {
            time,
            pid: facts.pid,
            uid: facts.uid,
            comm: clean(facts.comm, NAME_CHARS),
            env: facts.env.map(|(id, _)| clean_str(id, NAME_CHARS)),
            env_name: facts
                .env
                .and_then(|(_, name)| name)
                .map(|n| clean_str(n, NAME_CHARS)),
            gpus: facts.gpus,
            rule: facts.rule.cleaned(),
            action: facts.action,
            line: String::new(),
        };
        decision.line = super::message::line(&decision);
        decision
    }

    /// The environment as the user knows it: its name, else its id.
    pub fn env_shown(&self) -> Option<&str> {
        self.env_name.as_deref().or(self.env.as_deref())
    }
}
