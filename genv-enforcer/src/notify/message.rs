//! The line a user sees on the terminal, in genv's words where genv has them:
//!
//! `genv-enforcer: stopped process "python" (pid 1234) on GPU 1: not in a genv
//! environment; run 'genv activate --gpus 1' first`
//!
//! What happened, to which process, on which GPU; then why (the rule), then the genv
//! command that fixes it. Every name in it was sanitised when its
//! [`Decision`](super::Decision) was made, and each one another user could have written
//! (the process's name, the environment's name or id, a user name) is in double quotes
//! and labelled with what it is, so it cannot pass for the enforcer's own words. The
//! command the user is told to run holds none of them.

use super::rule::{Done, Rule};
use crate::snapshot::join_indices;

/// What a line says, its names already sanitised.
pub struct Said<'a> {
    pub comm: &'a str,
    pub pid: u32,
    pub gpus: &'a [u32],
    /// The environment's name (`config.name` in `envs.json`), where it has one.
    pub env_name: Option<&'a str>,
    /// The environment's id, shown where it has no name.
    pub env_id: Option<&'a str>,
    pub rule: &'a Rule,
    pub action: Done,
}

/// The whole line, without a line break.
pub fn line(d: &Said<'_>) -> String {
    format!("genv-enforcer: {}: {}", what(d), why(d))
}

fn gpus(d: &Said<'_>) -> String {
    match d.gpus.len() {
        0 => "a GPU".to_owned(),
        1 => format!("GPU {}", d.gpus[0]),
        _ => format!("GPUs {}", join_indices(d.gpus.iter().copied())),
    }
}

/// `stopped python (pid 1234) on GPU 1`.
fn what(d: &Said<'_>) -> String {
    let who = format!("process \"{}\" (pid {})", d.comm, d.pid);
    let on = gpus(d);
    match d.action {
        Done::Terminated => format!("stopped {who} on {on}"),
        Done::Killed => format!("killed {who} on {on}"),
        Done::Refused => format!("refused {on} to {who}"),
        Done::KilledAtAllocation => format!("killed {who} in a memory allocation on {on}"),
        Done::RefusedAtAllocation => {
            let size = match d.rule {
                Rule::MemoryAtAlloc {
                    size_mb: Some(mb), ..
                } => format!(" of {mb}m"),
                _ => String::new(),
            };
            format!("refused an allocation{size} by {who} on {on}")
        }
        Done::Detached => format!("detached {on} from {} and stopped {who}", env_phrase(d)),
    }
}

/// `environment named "train" in envs.json`, `environment with id "21364" in
/// envs.json`, or `its environment` where it has none to show.
fn env_phrase(d: &Said<'_>) -> String {
    match (d.env_name, d.env_id) {
        (Some(name), _) => format!("environment named \"{name}\" in envs.json"),
        (None, Some(id)) => format!("environment with id \"{id}\" in envs.json"),
        (None, None) => "its environment".to_owned(),
    }
}

/// The rule, then the fix.
fn why(d: &Said<'_>) -> String {
    let env = env_phrase(d);
    let first_gpu = d.gpus.first().copied().unwrap_or(0);
    match d.rule {
        Rule::NonEnvProcesses => format!(
            "not in a genv environment; run 'genv activate --gpus {}' first",
            d.gpus.len().max(1)
        ),
        Rule::EnvDevices => format!(
            "{env} is not attached to {}; run 'genv attach --index {first_gpu}' first, or use only its own GPUs",
            gpus(d)
        ),
        Rule::EnvMemory { used_mb, capacity } => format!(
            "{env} used {used_mb}m on {}, over its gpu_memory of {capacity}; use less GPU memory, or set a larger cap with 'genv config gpu-memory SIZE'",
            gpus(d)
        ),
        Rule::MaxDevicesPerUser {
            user,
            devices,
            maximum,
            hosts,
        } => {
            // A fleet's count is the surprise: the GPUs over the limit may all be on
            // other machines than the one whose process stopped.
            let across = match hosts {
                Some(hosts) if *hosts > 1 => format!(" across {hosts} hosts"),
                _ => String::new(),
            };
            format!(
                "user \"{user}\" had {devices} GPUs attached{across}, {maximum} allowed; run 'genv detach' in the environments you do not need"
            )
        }
        Rule::MemoryAtAlloc {
            would_use_mb,
            capacity,
            ..
        } if d.action == Done::RefusedAtAllocation => format!(
            "{env} would use {would_use_mb}m of its gpu_memory {capacity}; free memory, or set a larger cap with 'genv config gpu-memory SIZE'"
        ),
        Rule::MemoryAtAlloc {
            would_use_mb,
            capacity,
            ..
        } => format!(
            "the allocation would take {env} to {would_use_mb}m, over its gpu_memory of {capacity}; allocate less, or set a larger cap with 'genv config gpu-memory SIZE'"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::decision::{Decision, Facts};

    fn decision(rule: Rule, action: Done, gpus: Vec<u32>) -> Decision {
        Decision::new(
            Facts {
                pid: 1234,
                uid: 1000,
                comm: b"python",
                env: Some(("21364", Some("train"))),
                gpus,
                rule,
                action,
            },
            0,
        )
    }

    #[test]
    fn the_issues_example_reads_as_written() {
        let d = decision(Rule::NonEnvProcesses, Done::Terminated, vec![1]);
        let said = Said {
            env_name: None,
            env_id: None,
            comm: &d.comm,
            pid: d.pid,
            gpus: &d.gpus,
            rule: &d.rule,
            action: d.action,
        };
        assert_eq!(
            line(&said),
            "genv-enforcer: stopped process \"python\" (pid 1234) on GPU 1: not in a genv environment; run 'genv activate --gpus 1' first"
        );
    }

    #[test]
    fn each_rule_names_its_fix() {
        let cases = [
            (
                decision(Rule::EnvDevices, Done::Terminated, vec![2, 3]),
                "stopped process \"python\" (pid 1234) on GPUs 2,3: environment named \"train\" in envs.json is not attached to GPUs 2,3; run 'genv attach --index 2' first",
            ),
            (
                decision(
                    Rule::EnvMemory {
                        used_mb: 2097,
                        capacity: "1g".into(),
                    },
                    Done::Terminated,
                    vec![0],
                ),
                "environment named \"train\" in envs.json used 2097m on GPU 0, over its gpu_memory of 1g; use less GPU memory, or set a larger cap with 'genv config gpu-memory SIZE'",
            ),
            (
                decision(
                    Rule::MaxDevicesPerUser {
                        user: "alice".into(),
                        devices: 3,
                        maximum: 2,
                        hosts: None,
                    },
                    Done::Detached,
                    vec![1],
                ),
                "detached GPU 1 from environment named \"train\" in envs.json and stopped process \"python\" (pid 1234): user \"alice\" had 3 GPUs attached, 2 allowed; run 'genv detach'",
            ),
            (
                decision(
                    Rule::MemoryAtAlloc {
                        would_use_mb: 3000,
                        capacity: "2g".into(),
                        size_mb: Some(629),
                    },
                    Done::KilledAtAllocation,
                    vec![0],
                ),
                "killed process \"python\" (pid 1234) in a memory allocation on GPU 0: the allocation would take environment named \"train\" in envs.json to 3000m, over its gpu_memory of 2g",
            ),
            (
                decision(
                    Rule::MemoryAtAlloc {
                        would_use_mb: 1258,
                        capacity: "1g".into(),
                        size_mb: Some(629),
                    },
                    Done::RefusedAtAllocation,
                    vec![0],
                ),
                "refused an allocation of 629m by process \"python\" (pid 1234) on GPU 0: environment named \"train\" in envs.json would use 1258m of its gpu_memory 1g; free memory, or set a larger cap with 'genv config gpu-memory SIZE'",
            ),
            (
                decision(Rule::NonEnvProcesses, Done::Refused, vec![0]),
                "refused GPU 0 to process \"python\" (pid 1234): not in a genv environment; run 'genv activate --gpus 1' first",
            ),
        ];
        for (d, expected) in cases {
            assert!(d.line.contains(expected), "{}\nlacks\n{expected}", d.line);
        }
    }

    #[test]
    fn hostile_names_reach_the_line_escaped_quoted_and_labelled() {
        let d = Decision::new(
            Facts {
                pid: 7,
                uid: 1000,
                comm: "\x1b]0;pwned\x07py\nthon\u{db}".as_bytes(),
                env: Some(("e", Some("\x1b[2J\x1b[1;1Hroot's env\r\n$ "))),
                gpus: vec![0],
                rule: Rule::EnvDevices,
                action: Done::Terminated,
            },
            0,
        );
        assert!(
            d.line.bytes().all(|b| (0x20..0x7f).contains(&b)),
            "{:?}",
            d.line
        );
        assert!(
            d.line
                .contains("stopped process \"\\u{1b}]0;pwned\\u{7}py\\u{a}thon\\u{db}\" (pid 7)"),
            "{}",
            d.line
        );
        assert!(
            d.line.contains(
                "environment named \"\\u{1b}[2J\\u{1b}[1;1Hroot's env\\u{d}\\u{a}$ \" in envs.json"
            ),
            "{}",
            d.line
        );
        // The command the user is told to run is the enforcer's words only.
        assert!(
            d.line
                .ends_with("run 'genv attach --index 0' first, or use only its own GPUs")
        );
    }
}
