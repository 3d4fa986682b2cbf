//! What a rule found: a line to print, and the actions genv would queue for it.

use std::fmt;

use crate::snapshot::join_indices;
use crate::state::MemorySpec;
use crate::state::memory::format_megabytes;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// Index of the survey (host) the finding is about; for a user over the device limit
    /// across hosts, the actions name their own hosts.
    pub host: Option<usize>,
    pub kind: FindingKind,
    pub actions: Vec<Action>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FindingKind {
    NonEnvProcess {
        pid: u32,
    },
    NonAttachedDevices {
        pid: u32,
        eid: String,
        indices: Vec<u32>,
    },
    EnvOverMemory {
        eid: String,
        used: u64,
        index: u32,
        over: u64,
        capacity: MemorySpec,
    },
    UserOverDevices {
        username: String,
        devices: usize,
        over: usize,
        /// Set when every survey names a host: the count of hosts with the user's
        /// environments.
        hosts: Option<usize>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    Terminate {
        host: usize,
        pid: u32,
    },
    /// Detach the environments from the device; their processes on it are terminated.
    Detach {
        host: usize,
        index: u32,
        eids: Vec<String>,
    },
}

impl FindingKind {
    /// The rule that found it, as its flag names it.
    pub fn rule(&self) -> &'static str {
        match self {
            FindingKind::NonEnvProcess { .. } => "non-env-processes",
            FindingKind::NonAttachedDevices { .. } => "env-devices",
            FindingKind::EnvOverMemory { .. } => "env-memory",
            FindingKind::UserOverDevices { .. } => "max-devices-per-user",
        }
    }
}

impl Action {
    /// What it does, in a word.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Terminate { .. } => "terminate",
            Action::Detach { .. } => "detach",
        }
    }

    /// The survey (host) it acts on.
    pub fn host(&self) -> usize {
        match self {
            Action::Terminate { host, .. } | Action::Detach { host, .. } => *host,
        }
    }
}

impl fmt::Display for FindingKind {
    /// genv's exact words.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NonEnvProcess { pid } => {
                write!(f, "Process {pid} is not running in a GPU environment")
            }
            Self::NonAttachedDevices { pid, eid, indices } => write!(
                f,
                "Process {pid} from environment {eid} is using non-attached GPU(s) {}",
                join_indices(indices.iter().copied())
            ),
            Self::EnvOverMemory {
                eid,
                used,
                index,
                over,
                capacity,
            } => write!(
                f,
                "Environment {eid} is using {} on device {index} which is {} over its capacity of {capacity}",
                format_megabytes(*used),
                format_megabytes(*over)
            ),
            Self::UserOverDevices {
                username,
                devices,
                over,
                hosts: None,
            } => write!(
                f,
                "User {username} is using {devices} devices which is {over} more than the maximum allowed"
            ),
            Self::UserOverDevices {
                username,
                devices,
                over,
                hosts: Some(hosts),
            } => write!(
                f,
                "User {username} is using {devices} devices on {hosts} hosts which is {over} more than the maximum allowed"
            ),
        }
    }
}

impl Finding {
    /// The printed line, with genv's `[host] ` prefix for per-host findings.
    pub fn line(&self, hostnames: &[Option<&str>]) -> String {
        match self.host.and_then(|h| hostnames.get(h).copied().flatten()) {
            Some(host) => format!("[{host}] {}", self.kind),
            None => self.kind.to_string(),
        }
    }
}
