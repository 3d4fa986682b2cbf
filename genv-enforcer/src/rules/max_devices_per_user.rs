//! `--max-devices-per-user N` (with `--max-devices-for-user user=N` overrides): a user
//! whose environments hold more devices than allowed has devices detached, one at a time
//! in device order, until within the limit; their processes there are terminated.

use super::{Action, DeviceLimit, Finding, FindingKind, Survey};
use crate::state::{Device, Env};

/// A user's devices on one host, and whether the user has environments there at all.
type HostHolding = (Vec<Held>, bool);

/// A device a user holds: its index, the user's environments attached to it, and what
/// says the user really uses it.
struct Held {
    index: u32,
    eids: Vec<String>,
    /// One of those environments has a GPU process (on any device). A process counts in
    /// an environment only if its uid is the owner's, so a user cannot put bob's
    /// processes in an entry they wrote, while bob's real environment runs his jobs.
    in_use: bool,
    /// One of those environments' owners is confirmed by the kernel (a live shell in
    /// its `pids` runs as its uid; weaker: a user can list any live process of bob's).
    confirmed: bool,
}

impl Held {
    /// Detached in this order: devices of environments with no GPU process and no
    /// confirmed owner first, so that entries anyone can write with bob's uid or name
    /// (genv's files are 0666) cost their own attachments before a device of an
    /// environment bob's jobs run in. Within one environment, and among equals, genv's
    /// order (host, then device) stands: a stable sort, so genv's reference run, and
    /// any user whose environments all run jobs, are detached exactly as genv does.
    fn keep_rank(&self) -> (bool, bool) {
        (self.in_use, self.confirmed)
    }
}

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
        let mut held: Vec<(usize, Held)> = per_host
            .into_iter()
            .enumerate()
            .flat_map(|(host, (devices, _))| devices.into_iter().map(move |d| (host, d)))
            .collect();
        held.sort_by_key(|(_, d)| d.keep_rank());
        let actions = held
            .into_iter()
            .take(over)
            .map(|(host, d)| Action::Detach {
                host,
                index: d.index,
                eids: d.eids,
            })
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
    let in_use = |eid: &str| (snapshot.processes.iter()).any(|p| p.eid.as_deref() == Some(eid));
    let held = devices
        .iter()
        .filter_map(|device: &Device| {
            let eids: Vec<String> = device
                .attachments
                .iter()
                .filter(|a| owned.iter().any(|e| e.eid == a.eid))
                .map(|a| a.eid.clone())
                .collect();
            (!eids.is_empty()).then(|| Held {
                index: device.index,
                in_use: eids.iter().any(|eid| in_use(eid)),
                confirmed: eids.iter().any(|eid| confirmed(eid)),
                eids,
            })
        })
        .collect();
    (held, !owned.is_empty())
}
