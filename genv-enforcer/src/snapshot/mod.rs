//! One consistent view of the node, in genv's shape: GPU processes (with the environment
//! each belongs to), active environments, and devices with their attachments.
//!
//! The rules read nothing else. Parts that could not be read this cycle are `None`, and
//! the rules that need them do nothing rather than act on a guess.

use std::fmt;

/// `Warning` from a format string.
macro_rules! warning {
    ($($arg:tt)*) => { $crate::snapshot::Warning(format!($($arg)*)) };
}

mod builder;
mod inspect;
pub mod order;
mod orphans;
mod owner_names;
mod owners;
mod process_table;
mod unreadable;
mod wire;

#[cfg(test)]
pub(crate) mod fuzz_tests;

pub use builder::SnapshotBuilder;
pub use inspect::{ProcessInspector, Procfs};
pub use orphans::{DroppedEnv, Orphan, OrphanPolicy};
pub use owner_names::name_confirmed_owners;
pub use process_table::EnvPolicy;
pub use wire::{SnapshotJson, WireError, parse_wire_process, wire_process};

use crate::state::{Device, Env};

/// Something the operator should know about this cycle; printed on stderr as
/// `[WARNING] ...`, as genv prints its warnings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning(pub String);

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[WARNING] {}", self.0)
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// In genv's order (see [`order`]).
    pub processes: Vec<GpuProcess>,
    /// `None`: `envs.json` could not be read this cycle.
    pub envs: Option<Vec<Env>>,
    /// `None`: `devices.json` could not be read this cycle.
    pub devices: Option<Vec<Device>>,
    /// `false` when processes came from a `/proc` scan, which knows no memory figures.
    pub memory_known: bool,
    /// Processes of environments genv dropped, left running (`--orphans leave`).
    pub orphans: Vec<Orphan>,
    /// The environments genv dropped that orphans may still run in (`--orphans leave`;
    /// empty with `terminate`): the kernel lets their processes open GPUs too.
    pub dropped_envs: Vec<DroppedEnv>,
}

/// A process using one or more GPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuProcess {
    pub pid: u32,
    /// Start time in clock ticks since boot, as read with the environment: with the pid
    /// it names exactly this process, so a reused pid is never signalled. `None` for
    /// processes described by another host's snapshot.
    pub start_time: Option<u64>,
    pub used_gpu_memory: Vec<Usage>,
    /// The environment the process counts as being in (after the identity checks of
    /// [`EnvPolicy`]); `None` means outside any environment.
    pub eid: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub index: u32,
    /// `None` where the figure is not available; counted as 0.
    pub bytes: Option<u64>,
}

impl GpuProcess {
    /// Device indices in the order NVML listed them.
    pub fn indices(&self) -> impl Iterator<Item = u32> + '_ {
        self.used_gpu_memory.iter().map(|u| u.index)
    }

    pub fn bytes_on(&self, index: u32) -> u64 {
        self.used_gpu_memory
            .iter()
            .filter(|u| u.index == index)
            .map(|u| u.bytes.unwrap_or(0))
            .sum()
    }

    pub fn is_on(&self, index: u32) -> bool {
        self.indices().any(|i| i == index)
    }
}

/// `0,1` as genv joins device indices.
pub fn join_indices(indices: impl IntoIterator<Item = u32>) -> String {
    indices
        .into_iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}
