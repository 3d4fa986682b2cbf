//! `--max-devices-per-user N` (with `--max-devices-for-user user=N` overrides): a user
//! whose environments hold more devices than allowed has devices detached, one at a time
//! in device order, until within the limit; their processes there are terminated.

use super::{Action, DeviceLimit, Finding, FindingKind, Survey};
use crate::state::Device;

/// A user's devices on one host: (index, the user's environments attached to it), and
/// whether the user has environments there at all.
type HostHolding = (Vec<(u32, Vec<String>)>, bool);

pub fn check(surveys: &[Survey<'_>], limit: &DeviceLimit) -> Vec<Finding> {
    // genv iterates a Python set of usernames, whose order is randomised per run; the
    // order of first appearance is the deterministic choice.
    let mut usernames: Vec<&str> = Vec::new();
    for survey in surveys {
        for env in survey.snapshot.envs.iter().flatten() {
            if let Some(name) = env.username.as_deref().filter(|n| !n.is_empty()) {
                if !usernames.contains(&name) {
                    usernames.push(name);
                }
            }
        }
    }

    let mut findings = Vec::new();
    for username in usernames {
        // Per host: the devices with this user's attachments, and whether the user has
        // environments there.
        let per_host: Vec<HostHolding> = surveys
            .iter()
            .map(|survey| user_devices(survey, username))
            .collect();
        let attached: usize = per_host.iter().map(|(devices, _)| devices.len()).sum();
        let over = attached.saturating_sub(limit.for_user(username) as usize);
        if over == 0 {
            continue;
        }
        let hosts = surveys
            .iter()
            .all(|s| s.hostname.is_some())
            .then(|| per_host.iter().filter(|(_, has_envs)| *has_envs).count());
        let actions = per_host
            .into_iter()
            .enumerate()
            .flat_map(|(host, (devices, _))| {
                devices
                    .into_iter()
                    .map(move |(index, eids)| Action::Detach { host, index, eids })
            })
            .take(over)
            .collect();
        findings.push(Finding {
            host: None,
            kind: FindingKind::UserOverDevices {
                username: username.to_owned(),
                devices: attached,
                over,
                hosts,
            },
            actions,
        });
    }
    findings
}

fn user_devices(survey: &Survey<'_>, username: &str) -> HostHolding {
    let snapshot = survey.snapshot;
    let (Some(envs), Some(devices)) = (&snapshot.envs, &snapshot.devices) else {
        return (Vec::new(), false);
    };
    let eids: Vec<&str> = envs
        .iter()
        .filter(|e| e.username.as_deref() == Some(username))
        .map(|e| e.eid.as_str())
        .collect();
    let held = devices
        .iter()
        .filter_map(|device: &Device| {
            let mine: Vec<String> = device
                .attachments
                .iter()
                .filter(|a| eids.contains(&a.eid.as_str()))
                .map(|a| a.eid.clone())
                .collect();
            (!mine.is_empty()).then_some((device.index, mine))
        })
        .collect();
    (held, !eids.is_empty())
}
