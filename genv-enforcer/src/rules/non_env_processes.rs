//! `--non-env-processes`: a GPU process outside any environment is terminated.

use super::{Action, Finding, FindingKind, Survey};

pub fn check(surveys: &[Survey<'_>]) -> Vec<Finding> {
    let mut findings = Vec::new();
    for (host, survey) in surveys.iter().enumerate() {
        for process in survey.snapshot.processes.iter().filter(|p| p.eid.is_none()) {
            findings.push(Finding {
                host: Some(host),
                kind: FindingKind::NonEnvProcess { pid: process.pid },
                actions: vec![Action::Terminate {
                    host,
                    pid: process.pid,
                }],
            });
        }
    }
    findings
}
