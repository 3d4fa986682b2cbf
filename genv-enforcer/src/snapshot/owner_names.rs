//! Who owns each environment, as this host tells other hosts (`usage snapshot`, `usage
//! watch`).
//!
//! Across hosts, `--max-devices-per-user` can only match users by name (a user's uid
//! may differ from host to host), and genv's wire format names an environment's user
//! in its `username` field, which anyone can write in `envs.json`. Believed as written,
//! a user on one host could write entries naming bob, attach devices to them, and have
//! the cross-host rule detach bob's real devices on another host. So a snapshot leaving
//! this host names an environment's user as this host's user database names the owner
//! the kernel confirms (a live shell that activated the environment runs as its uid,
//! see `owners`), and no user (`null`, as genv writes an unknown one) where the kernel
//! confirms none. genv's own rule skips environments with no user, as ours does, so
//! genv 1.4.3's `remote enforce` driving this host counts the same. The field keeps
//! its place and type: genv reads these snapshots by their exact set of keys, and an
//! extra one would make it fail.

use super::{Snapshot, Warning};

/// Gives each environment of `snapshot` the name of the owner the kernel confirms, from
/// `name_of` (the host's user database), or none; what was changed from `envs.json` is
/// said.
pub fn name_confirmed_owners(
    snapshot: &mut Snapshot,
    name_of: impl Fn(u32) -> Option<String>,
) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for env in snapshot.envs.iter_mut().flatten() {
        let written = env.username.take().filter(|n| !n.is_empty());
        let confirmed = env.verified.then(|| name_of(env.uid)).flatten();
        match (&written, &confirmed) {
            (Some(written), None) if env.verified => warnings.push(warning!(
                "environment {} (user {written:?} in envs.json) belongs to uid {}, which has no name here: other hosts are given no user for it, and do not count it against anyone",
                env.eid,
                env.uid
            )),
            (Some(written), None) => warnings.push(warning!(
                "environment {} names user {written:?} in envs.json, but no shell that activated it runs as its uid {}: other hosts are given no user for it, and do not count it against anyone",
                env.eid,
                env.uid
            )),
            (Some(written), Some(name)) if written != name => warnings.push(warning!(
                "environment {} names user {written:?} in envs.json, but belongs to uid {} ({name}): other hosts are told {name}",
                env.eid,
                env.uid
            )),
            _ => {}
        }
        env.username = confirmed;
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Env;

    fn env(eid: &str, uid: u32, username: Option<&str>, verified: bool) -> Env {
        let mut env: Env = serde_json::from_value(serde_json::json!({
            "eid": eid, "uid": uid, "username": username, "pids": [1]
        }))
        .unwrap();
        env.verified = verified;
        env
    }

    fn names(uid: u32) -> Option<String> {
        match uid {
            1000 => Some("bob".into()),
            1001 => Some("mallory".into()),
            _ => None,
        }
    }

    #[test]
    fn other_hosts_are_told_the_confirmed_owner_and_nothing_else() {
        let mut snapshot = Snapshot {
            envs: Some(vec![
                env("real", 1000, Some("bob"), true),
                // mallory's own environment, named for bob.
                env("renamed", 1001, Some("bob"), true),
                // bob's uid, with a shell that is not bob's.
                env("forged", 1000, Some("bob"), false),
                env("nameless", 4242, Some("carol"), true),
                env("unnamed", 1001, None, false),
            ]),
            ..Snapshot::default()
        };
        let warnings = name_confirmed_owners(&mut snapshot, names);
        let told: Vec<Option<&str>> = snapshot
            .envs
            .iter()
            .flatten()
            .map(|e| e.username.as_deref())
            .collect();
        assert_eq!(told, [Some("bob"), Some("mallory"), None, None, None]);
        let said: Vec<&str> = warnings.iter().map(|w| w.0.as_str()).collect();
        assert_eq!(said.len(), 3, "{said:#?}");
        assert!(said[0].starts_with("environment renamed names user \"bob\""));
        assert!(said[0].ends_with("other hosts are told mallory"));
        assert!(
            said[1].contains("environment forged names user \"bob\" in envs.json, but no shell")
        );
        assert!(said[2].contains("uid 4242, which has no name here"));
    }
}
