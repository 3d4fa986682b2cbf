//! genv's enforcement rules, as pure functions from snapshots to findings.
//!
//! Each rule takes every host's survey at once (one for local enforcement, several for
//! remote), exactly as genv's rules do, and returns what it found: the line genv prints
//! and the actions genv would queue. Nothing here reads the system or acts on it.

mod env_devices;
mod env_memory;
mod finding;
mod max_devices_per_user;
mod non_env_processes;

use std::collections::HashMap;

pub use finding::{Action, Finding, FindingKind};

use crate::snapshot::Snapshot;

/// One host's snapshot; `hostname` is set for remote enforcement and prefixes its lines.
#[derive(Clone, Copy, Debug)]
pub struct Survey<'a> {
    pub hostname: Option<&'a str>,
    pub snapshot: &'a Snapshot,
}

/// Which rules run, as genv's `enforce` flags choose them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rules {
    pub non_env_processes: bool,
    pub env_devices: bool,
    pub env_memory: bool,
    pub max_devices_per_user: Option<DeviceLimit>,
}

impl Default for Rules {
    /// genv's defaults.
    fn default() -> Self {
        Self {
            non_env_processes: false,
            env_devices: true,
            env_memory: true,
            max_devices_per_user: None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceLimit {
    pub default: u32,
    pub per_user: HashMap<String, u32>,
}

impl DeviceLimit {
    fn for_user(&self, username: &str) -> u32 {
        self.per_user.get(username).copied().unwrap_or(self.default)
    }
}

/// Runs the enabled rules in genv's order over all surveys.
pub fn check(surveys: &[Survey<'_>], rules: &Rules) -> Vec<Finding> {
    let mut findings = Vec::new();
    if rules.non_env_processes {
        findings.extend(non_env_processes::check(surveys));
    }
    if rules.env_devices {
        findings.extend(env_devices::check(surveys));
    }
    if rules.env_memory {
        findings.extend(env_memory::check(surveys));
    }
    if let Some(limit) = &rules.max_devices_per_user {
        findings.extend(max_devices_per_user::check(surveys, limit));
    }
    findings
}

#[cfg(test)]
mod tests;
