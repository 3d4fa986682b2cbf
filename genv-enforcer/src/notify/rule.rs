//! What was done to a process, and under which rule: the words `why`, the log and the
//! line share.

use serde::{Deserialize, Serialize};

/// What was done to the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Done {
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
    /// The allocation that would have crossed the cap returned out-of-memory without
    /// running (`--memory-at-alloc refuse`); the process lives on.
    RefusedAtAllocation,
    /// Its environment's GPU was detached (`--max-devices-per-user`), and the process
    /// stopped with it.
    Detached,
}

impl Done {
    pub fn word(self) -> &'static str {
        match self {
            Done::Terminated => "terminated",
            Done::Killed => "killed",
            Done::Refused => "refused",
            Done::KilledAtAllocation => "killed-at-allocation",
            Done::RefusedAtAllocation => "refused-at-allocation",
            Done::Detached => "detached",
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
    /// The user held more GPUs than allowed (`--max-devices-per-user`); `hosts`: how
    /// many hosts those GPUs were on, where remote enforcement counted across a fleet
    /// (absent for one node, and in records of earlier versions).
    MaxDevicesPerUser {
        user: String,
        devices: usize,
        maximum: usize,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hosts: Option<usize>,
    },
    /// An allocation would have taken the environment past its cap
    /// (`--memory-at-alloc kill` or `refuse`); `size_mb`: the allocation's (absent in
    /// records of earlier versions).
    MemoryAtAlloc {
        would_use_mb: u64,
        capacity: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        size_mb: Option<u64>,
    },
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
}
