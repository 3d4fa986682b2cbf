//! What the kernel decided, told to the user it was done to ([`crate::notify`]): a GPU
//! open refused or killed under `--deny` (and the processes sharing a killed opener's
//! descriptors, killed by the sweep), an allocation past its environment's cap killed or
//! refused.
//! The process is often gone by now, so who it was and where its terminal is come from
//! what the program read at its decision.

use super::holders::Killed;
use crate::intake::{AllocOutcome, GpuOpen, KernelSubject, OverCap, Verdict};
use crate::notify::{Done, Facts, Notifier, Rule, Terminal};

/// A process the kernel refused a GPU, or killed in its open.
pub fn open(notifier: Option<&Notifier>, open: &GpuOpen) {
    let action = match open.verdict {
        Verdict::Refused => Done::Refused,
        Verdict::Killed => Done::Killed,
        _ => return,
    };
    let Some(notifier) = notifier else {
        return;
    };
    let subject = open.subject.unwrap_or_default();
    let facts = Facts {
        pid: open.pid,
        uid: open.uid,
        comm: subject.comm(),
        env: None,
        gpus: vec![open.index],
        rule: Rule::NonEnvProcesses,
        action,
    };
    notifier.decided(facts, terminal(&subject, open.uid));
}

/// A process that held a GPU opened by a process the kernel killed (sharing its file
/// table), killed by the sweep.
pub fn holder(notifier: Option<&Notifier>, killed: &Killed) {
    let (Some(notifier), Some(subject)) = (notifier, &killed.subject) else {
        return;
    };
    let facts = Facts {
        pid: killed.pid,
        uid: killed.uid,
        comm: &subject.comm,
        env: None,
        gpus: killed.gpus.clone(),
        rule: Rule::NonEnvProcesses,
        action: Done::Killed,
    };
    notifier.decided(facts, subject.terminal);
}

/// A process the kernel killed inside an allocation past its cap, or whose allocation
/// it refused; `held_to`: the environment and cap `alloc` says it was held to.
pub fn alloc(notifier: Option<&Notifier>, held_to: Option<(String, String)>, over: &OverCap) {
    let action = match over.outcome {
        AllocOutcome::Killed => Done::KilledAtAllocation,
        AllocOutcome::Refused => Done::RefusedAtAllocation,
        AllocOutcome::Reported | AllocOutcome::KillFailed => return,
    };
    let Some(notifier) = notifier else {
        return;
    };
    let (eid, capacity) =
        held_to.unwrap_or_else(|| (format!("{:016x}", over.env), "its gpu_memory".to_owned()));
    let facts = Facts {
        pid: over.pid,
        uid: over.uid,
        comm: over.subject.comm(),
        env: Some((&eid, None)),
        gpus: vec![over.index],
        rule: Rule::MemoryAtAlloc {
            would_use_mb: over.would_use / 1_000_000,
            capacity,
            size_mb: Some(over.size / 1_000_000),
        },
        action,
    };
    notifier.decided(facts, terminal(&over.subject, over.uid));
}

/// The terminal the program found, which must be `uid`'s to be written.
fn terminal(subject: &KernelSubject, uid: u32) -> Option<Terminal> {
    subject.tty.map(|(major, minor)| Terminal {
        rdev: rustix::fs::makedev(major, minor),
        uid,
    })
}
