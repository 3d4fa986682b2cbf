//! `--max-devices-per-user N` (with `--max-devices-for-user user=N` overrides): a user
//! whose environments hold more devices than allowed has devices detached, one at a time
//! in device order, until within the limit; their processes there are terminated.

use super::{Action, DeviceLimit, Finding, FindingKind, Survey};
use crate::state::{Device, Env};

/// A user's devices on one host: (index, the user's environments attached to it), and
/// whether the user has environments there at all. Devices the user holds only through
/// environments whose owner the kernel did not confirm come first.
type HostHolding = (Vec<(u32, Vec<String>)>, bool);

/// Who a user is. On one host, the uid: the `username` field is anyone's to fill in, and
/// counting by it would let a user spread devices over made-up names (genv counts by
/// it). Across hosts, the name, as genv does, since a user's uid may differ from host
/// to host.
#[derive(Clone, Copy, PartialEq, Eq)]
enum User<'a> {
    Uid(u32),
    Name(&'a str),
}

impl User<'_> {
    fn owns(self, env: &Env) -> bool {
        match self {
            User::Uid(uid) => env.uid == uid,
            User::Name(name) => env.username.as_deref() == Some(name),
        }
    }
}

/// The users with environments, in order of first appearance (genv iterates a Python
/// set of usernames, whose order is randomised per run; this is the deterministic
/// choice), each with the name its lines print.
fn users<'a>(surveys: &[Survey<'a>]) -> Vec<(User<'a>, String)> {
    let local = matches!(surveys, [only] if only.hostname.is_none());
    let mut users: Vec<(User<'a>, String)> = Vec::new();
    for env in surveys
        .iter()
        .flat_map(|s| s.snapshot.envs.iter().flatten())
    {
        let name = env.username.as_deref().filter(|n| !n.is_empty());
        let user = match (local, name) {
            (true, _) => User::Uid(env.uid),
            (false, Some(name)) => User::Name(name),
            (false, None) => continue,
        };
        match users.iter_mut().find(|(known, _)| *known == user) {
            // A uid's name is the first its environments give.
            Some((_, shown)) if shown.is_empty() => *shown = name.unwrap_or("").to_owned(),
            Some(_) => {}
            None => users.push((user, name.unwrap_or("").to_owned())),
        }
    }
    for (user, shown) in &mut users {
        if let (User::Uid(uid), true) = (user, shown.is_empty()) {
            *shown = uid.to_string();
        }
    }
    users
}

pub fn check(surveys: &[Survey<'_>], limit: &DeviceLimit) -> Vec<Finding> {
    let mut findings = Vec::new();
    for (user, username) in users(surveys) {
        let username = username.as_str();
        // Per host: the devices with this user's attachments, and whether the user has
        // environments there.
        let per_host: Vec<HostHolding> = surveys
            .iter()
            .map(|survey| user_devices(survey, user))
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

fn user_devices(survey: &Survey<'_>, user: User<'_>) -> HostHolding {
    let snapshot = survey.snapshot;
    let (Some(envs), Some(devices)) = (&snapshot.envs, &snapshot.devices) else {
        return (Vec::new(), false);
    };
    let owned: Vec<&Env> = envs.iter().filter(|e| user.owns(e)).collect();
    let confirmed = |eid: &str| owned.iter().any(|e| e.eid == eid && e.verified);
    let mut held: Vec<(u32, Vec<String>)> = devices
        .iter()
        .filter_map(|device: &Device| {
            let mine: Vec<String> = device
                .attachments
                .iter()
                .filter(|a| owned.iter().any(|e| e.eid == a.eid))
                .map(|a| a.eid.clone())
                .collect();
            (!mine.is_empty()).then_some((device.index, mine))
        })
        .collect();
    // Anyone can write an entry with another user's uid (genv's files are 0666): such
    // an entry, which the kernel does not confirm, must not cost that user a device
    // they really use. So the devices held only through unconfirmed entries are
    // detached first; among the rest, genv's device order stands (a stable sort: with
    // every owner confirmed, as genv's own state always is, nothing moves).
    held.sort_by_key(|(_, eids)| eids.iter().any(|eid| confirmed(eid)));
    (held, !owned.is_empty())
}
