//! `--env-memory`: an environment over its `gpu_memory` on a device has its processes
//! there terminated one by one, in snapshot order, until the freed memory covers the
//! excess (genv's greedy choice: not all of them).

use super::{Action, Finding, FindingKind, Survey};

pub fn check(surveys: &[Survey<'_>]) -> Vec<Finding> {
    let mut findings = Vec::new();
    for (host, survey) in surveys.iter().enumerate() {
        let snapshot = survey.snapshot;
        let (Some(envs), Some(devices), true) =
            (&snapshot.envs, &snapshot.devices, snapshot.memory_known)
        else {
            continue;
        };
        for env in envs {
            let Some(capacity) = &env.config.gpu_memory else {
                continue;
            };
            for device in devices.iter().filter(|d| d.is_attached_to(&env.eid)) {
                let processes: Vec<_> = snapshot
                    .processes
                    .iter()
                    .filter(|p| p.eid.as_deref() == Some(env.eid.as_str()) && p.is_on(device.index))
                    .collect();
                let used: u64 = processes.iter().map(|p| p.bytes_on(device.index)).sum();
                let Some(over) = used.checked_sub(capacity.bytes()).filter(|over| *over > 0) else {
                    continue;
                };
                let mut actions = Vec::new();
                let mut freed = 0;
                for process in processes {
                    actions.push(Action::Terminate {
                        host,
                        pid: process.pid,
                    });
                    freed += process.bytes_on(device.index);
                    if freed >= over {
                        break;
                    }
                }
                findings.push(Finding {
                    host: Some(host),
                    kind: FindingKind::EnvOverMemory {
                        eid: env.eid.clone(),
                        used,
                        index: device.index,
                        over,
                        capacity: capacity.clone(),
                    },
                    actions,
                });
            }
        }
    }
    findings
}
