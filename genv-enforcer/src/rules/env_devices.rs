//! `--env-devices`: a process of environment E on a device not attached to E is
//! terminated.

use super::{Action, Finding, FindingKind, Survey};

pub fn check(surveys: &[Survey<'_>]) -> Vec<Finding> {
    let mut findings = Vec::new();
    for (host, survey) in surveys.iter().enumerate() {
        let snapshot = survey.snapshot;
        let (Some(envs), Some(devices)) = (&snapshot.envs, &snapshot.devices) else {
            continue;
        };
        for env in envs {
            let allowed: Vec<u32> = devices
                .iter()
                .filter(|d| d.is_attached_to(&env.eid))
                .map(|d| d.index)
                .collect();
            for process in snapshot
                .processes
                .iter()
                .filter(|p| p.eid.as_deref() == Some(env.eid.as_str()))
            {
                let unallowed: Vec<u32> =
                    process.indices().filter(|i| !allowed.contains(i)).collect();
                if unallowed.is_empty() {
                    continue;
                }
                findings.push(Finding {
                    host: Some(host),
                    kind: FindingKind::NonAttachedDevices {
                        pid: process.pid,
                        eid: env.eid.clone(),
                        indices: unallowed,
                    },
                    actions: vec![Action::Terminate {
                        host,
                        pid: process.pid,
                    }],
                });
            }
        }
    }
    findings
}
