//! One decision about one process, as its user is told it: what was done, under which
//! rule, and the genv command that fixes it.
//!
//! Every text field is [`sanitize`](super::sanitize)d when the record is made, so the
//! record can go anywhere (a terminal, the journal, `why`'s answer) as it is.

use serde::{Deserialize, Serialize};

use super::message::{self, Said};
use super::rule::{Done, Rule};
use super::sanitize::{NAME_CHARS, clean, clean_str};

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
    pub action: Done,
}

/// A decision, sanitised, with the line its user sees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    /// Seconds since the epoch.
    pub time: u64,
    pub pid: u32,
    pub uid: u32,
    /// The user whose bounds it counts against (the uid's owner,
    /// [`crate::backends::uid_owners`]); the uid itself until the notifier says.
    #[serde(skip)]
    pub owner: u32,
    pub comm: String,
    pub env: Option<String>,
    pub env_name: Option<String>,
    pub gpus: Vec<u32>,
    #[serde(flatten)]
    pub rule: Rule,
    pub action: Done,
    /// What the process's terminal is told.
    pub line: String,
}

impl Decision {
    pub fn new(facts: Facts<'_>, time: u64) -> Self {
        let mut decision = Decision {
            time,
            pid: facts.pid,
            uid: facts.uid,
            owner: facts.uid,
            comm: clean(facts.comm, NAME_CHARS),
            env: facts.env.map(|(id, _)| clean_str(id, NAME_CHARS)),
            env_name: facts
                .env
                .and_then(|(_, name)| name)
                .map(|n| clean_str(n, NAME_CHARS)),
            gpus: facts.gpus,
            rule: cleaned(facts.rule),
            action: facts.action,
            line: String::new(),
        };
        decision.line = message::line(&Said {
            comm: &decision.comm,
            pid: decision.pid,
            gpus: &decision.gpus,
            env_name: decision.env_name.as_deref(),
            env_id: decision.env.as_deref(),
            rule: &decision.rule,
            action: decision.action,
        });
        decision
    }
}

/// `rule` with its user-given text cleaned.
fn cleaned(rule: Rule) -> Rule {
    match rule {
        Rule::EnvMemory { used_mb, capacity } => Rule::EnvMemory {
            used_mb,
            capacity: clean_str(&capacity, NAME_CHARS),
        },
        Rule::MaxDevicesPerUser {
            user,
            devices,
            maximum,
            hosts,
        } => Rule::MaxDevicesPerUser {
            user: clean_str(&user, NAME_CHARS),
            devices,
            maximum,
            hosts,
        },
        Rule::MemoryAtAlloc {
            would_use_mb,
            capacity,
            size_mb,
        } => Rule::MemoryAtAlloc {
            would_use_mb,
            capacity: clean_str(&capacity, NAME_CHARS),
            size_mb,
        },
        other => other,
    }
}
