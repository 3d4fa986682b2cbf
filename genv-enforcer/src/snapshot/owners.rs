//! What the enforcer believes of genv's state, which any user can rewrite
//! (`$GENV_TMPDIR` is world-writable, its files 0666):
//! - an environment's owner is believed when the kernel confirms it: a live shell that
//!   activated it (its `pids`) runs as that uid. A confirmed owner is pinned for as long
//!   as one of those shells lives: a later `envs.json` that gives the environment another
//!   owner is reported and ignored, so nobody can turn another user's processes into
//!   outsiders (or claim their environment) by editing the file. An entry the kernel
//!   does not confirm (`pids` of someone else's processes) pins nothing;
//! - of several entries with one eid (genv keeps them; its lookups take the first), the
//!   first confirmed one counts, else the first;
//! - a file that does not parse does not switch enforcement off: the last good parse
//!   stands, and the warning says so.

use std::collections::{HashMap, HashSet};

use genv_ebpf_common::{MAX_ENV_ID, env_id_hash};

use super::Warning;
use crate::backends::procfs;
use crate::state::{Device, Env, StateError, drop_inactive};

/// Pins kept at most: one per environment the kernel confirmed; far more than a node
/// has, and a bound on what a flood of confirmed entries can cost.
const MAX_PINS: usize = 1 << 14;

#[derive(Debug, Default)]
pub(crate) struct StateGuard {
    /// eid → the owner first seen, and the shells that activated it then.
    pins: HashMap<String, Pin>,
    last_envs: Option<Vec<Env>>,
    last_devices: Option<Vec<Device>>,
}

#[derive(Debug)]
struct Pin {
    uid: u32,
    pids: Vec<i32>,
}

impl StateGuard {
    /// The environments to enforce from: those just read, with owners pinned and users
    /// named by uid; or, when the file did not parse, the last good ones still active.
    pub(crate) fn envs(
        &mut self,
        read: Result<Vec<Env>, StateError>,
        warnings: &mut Vec<Warning>,
    ) -> Option<Vec<Env>> {
        match read {
            Ok(envs) => {
                let mut envs = first_of_each(self.verify(envs), warnings);
                self.one_per_kernel_key(&mut envs, warnings);
                self.pin_owners(&mut envs, warnings);
                self.last_envs = Some(envs.clone());
                Some(envs)
            }
            Err(e) => {
                let Some(last) = self.last_envs.as_mut() else {
                    warnings.push(warning!(
                        "{e}; rules that need environments are skipped this cycle"
                    ));
                    return None;
                };
                drop_inactive(last);
                warnings.push(warning!(
                    "{e}; enforcing from its last good contents ({} active environments)",
                    last.len()
                ));
                Some(last.clone())
            }
        }
    }

    /// The devices to enforce from: those just read (`None` when the file does not
    /// exist yet), or the last good ones, with attachments of inactive environments
    /// dropped, when it did not parse.
    pub(crate) fn devices(
        &mut self,
        read: Result<Option<Vec<Device>>, StateError>,
        envs: &[Env],
        warnings: &mut Vec<Warning>,
    ) -> Result<Option<Vec<Device>>, ()> {
        match read {
            Ok(devices) => {
                self.last_devices.clone_from(&devices);
                Ok(devices)
            }
            Err(e) => {
                let Some(last) = self.last_devices.as_mut() else {
                    warnings.push(warning!(
                        "{e}; rules that need devices are skipped this cycle"
                    ));
                    return Err(());
                };
                for device in last.iter_mut() {
                    device
                        .attachments
                        .retain(|a| envs.iter().any(|env| env.eid == a.eid));
                }
                warnings.push(warning!("{e}; enforcing from its last good contents"));
                Ok(Some(last.clone()))
            }
        }
    }

    /// Marks the environments whose owner the kernel confirms: a live activating shell
    /// runs as the recorded uid. An owner pinned already was confirmed then, while one
    /// of its shells lives: no `/proc` read for it (snapshots run every few milliseconds
    /// after a GPU open).
    fn verify(&self, mut envs: Vec<Env>) -> Vec<Env> {
        for env in &mut envs {
            env.verified = self
                .pins
                .get(&env.eid)
                .is_some_and(|pin| pin.uid == env.uid)
                || env
                    .pids
                    .iter()
                    .filter_map(|pid| procfs::real_uid(u32::try_from(*pid).ok()?).ok())
                    .any(|uid| uid == env.uid);
        }
        envs
    }

    /// Of environments whose ids share a kernel key ([`env_id_hash`], FNV-1a: not
    /// collision-resistant, so a user can make an id that collides with another user's
    /// on purpose), one keeps the key: one whose owner is pinned already (it held the
    /// key first), else a confirmed one, else the first in the file. The others are
    /// marked [`Env::key_lost`] and named: the kernel cannot tell their processes apart,
    /// and a newcomer must never take over the maps' entry (attached GPUs, memory cap)
    /// of an environment already there.
    fn one_per_kernel_key(&self, envs: &mut [Env], warnings: &mut Vec<Warning>) {
        let mut holders: HashMap<u64, usize> = HashMap::new();
        let rank = |env: &Env| {
            let pinned = self.pins.get(&env.eid).is_some_and(|p| p.uid == env.uid);
            (pinned, env.verified)
        };
        for i in 0..envs.len() {
            envs[i].key_lost = false;
            if envs[i].eid.len() > MAX_ENV_ID {
                continue; // never in the kernel's maps: nothing to share
            }
            let key = env_id_hash(envs[i].eid.as_bytes());
            let Some(&holder) = holders.get(&key) else {
                holders.insert(key, i);
                continue;
            };
            let loser = if rank(&envs[i]) > rank(&envs[holder]) {
                holders.insert(key, i);
                holder
            } else {
                i
            };
            let winner = holders[&key];
            envs[loser].key_lost = true;
            warnings.push(warning!(
                "environments {} and {} have ids with the same kernel key (FNV-1a): {} keeps \
                 it ({}); {} is left out of the kernel's maps, and its processes count as \
                 outside any environment",
                envs[winner].eid,
                envs[loser].eid,
                envs[winner].eid,
                match rank(&envs[winner]) {
                    (true, _) => "it was there first",
                    (false, true) => "its owner is confirmed",
                    (false, false) => "it comes first in envs.json",
                },
                envs[loser].eid
            ));
        }
    }

    fn pin_owners(&mut self, envs: &mut [Env], warnings: &mut Vec<Warning>) {
        // A pin lasts while a shell that activated the environment lives: after that,
        // genv itself would drop the environment, and its id may be reused.
        self.pins.retain(|eid, pin| {
            envs.iter().any(|env| env.eid == *eid)
                || pin.pids.iter().any(|pid| procfs::pid_exists(*pid))
        });
        for env in envs.iter_mut() {
            match self.pins.get(&env.eid) {
                Some(pin) if pin.uid != env.uid => {
                    env.verified = false;
                    warnings.push(warning!(
                        "envs.json now says environment {} belongs to uid {}, but it was \
                         created by uid {}: ignoring the change",
                        env.eid,
                        env.uid,
                        pin.uid
                    ));
                    env.uid = pin.uid;
                }
                Some(_) => {}
                // An environment that lost its kernel key is not pinned: the pin is
                // what keeps a key with the environment that held it first.
                None if !env.verified || env.key_lost || self.pins.len() >= MAX_PINS => {}
                None => {
                    let pin = Pin {
                        uid: env.uid,
                        pids: env.pids.clone(),
                    };
                    self.pins.insert(env.eid.clone(), pin);
                }
            }
        }
    }
}

/// One entry per eid: the first confirmed one, else the first; duplicates are named.
fn first_of_each(envs: Vec<Env>, warnings: &mut Vec<Warning>) -> Vec<Env> {
    let confirmed: HashSet<String> = envs
        .iter()
        .filter(|e| e.verified)
        .map(|e| e.eid.clone())
        .collect();
    let mut seen = HashSet::new();
    let mut kept = Vec::with_capacity(envs.len());
    for env in envs {
        let wanted = env.verified || !confirmed.contains(&env.eid);
        if wanted && seen.insert(env.eid.clone()) {
            kept.push(env);
        } else {
            warnings.push(warning!(
                "envs.json holds environment {} more than once: the first {}entry counts",
                env.eid,
                if confirmed.contains(&env.eid) {
                    "confirmed "
                } else {
                    ""
                }
            ));
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::state::StateErrorKind;

    fn env(eid: &str, uid: u32, pid: i32) -> Env {
        serde_json::from_value(serde_json::json!({
            "eid": eid, "uid": uid, "username": "whoever", "pids": [pid]
        }))
        .unwrap()
    }

    /// A live process of `uid` (the test runs as root; a child is given the uid).
    fn shell_of(uid: u32) -> std::process::Child {
        let mut command = std::process::Command::new("sleep");
        std::os::unix::process::CommandExt::uid(&mut command, uid);
        command.arg("60").spawn().unwrap()
    }

    fn malformed() -> StateError {
        StateError {
            path: Path::new("/var/tmp/genv/envs.json").to_owned(),
            kind: StateErrorKind::Empty,
        }
    }

    /// A pid that lives as long as the test: the test's own.
    fn alive() -> i32 {
        std::process::id() as i32
    }

    #[test]
    fn a_confirmed_owner_is_pinned_and_a_later_change_is_reported_and_ignored() {
        let mut shell = shell_of(64_501);
        let pid = shell.id() as i32;
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        let first = guard.envs(Ok(vec![env("e", 64_501, pid)]), &mut warnings);
        assert!(first.as_ref().unwrap()[0].verified);
        assert!(warnings.is_empty(), "{warnings:?}");
        let forged = guard.envs(Ok(vec![env("e", 0, pid)]), &mut warnings);
        assert_eq!(forged.unwrap()[0].uid, 64_501, "the pinned owner stands");
        assert!(
            warnings[0].0.contains("created by uid 64501"),
            "{warnings:?}"
        );
        // Taken out of the file and put back: the pin holds while its shell lives.
        guard.envs(Ok(vec![]), &mut warnings);
        let back = guard.envs(Ok(vec![env("e", 0, pid)]), &mut warnings);
        assert_eq!(back.unwrap()[0].uid, 64_501);
        shell.kill().unwrap();
        shell.wait().unwrap();
    }

    #[test]
    fn an_entry_the_kernel_does_not_confirm_pins_nothing() {
        // A user writes an entry for a predictable eid, with someone else's pid (here
        // the test's own, which runs as root) and their own uid.
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        let forged = guard.envs(Ok(vec![env("4242", 64_502, alive())]), &mut warnings);
        assert!(!forged.unwrap()[0].verified);
        // The real environment with that id appears: its owner counts.
        let mut shell = shell_of(64_503);
        let real = env("4242", 64_503, shell.id() as i32);
        let envs = guard.envs(Ok(vec![real]), &mut warnings).unwrap();
        assert_eq!((envs[0].uid, envs[0].verified), (64_503, true));
        assert!(warnings.is_empty(), "{warnings:?}");
        shell.kill().unwrap();
        shell.wait().unwrap();
    }

    #[test]
    fn of_duplicate_entries_the_first_confirmed_one_counts() {
        let mut shell = shell_of(64_504);
        let pid = shell.id() as i32;
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        // A forged copy first, the real one after: the real one counts, the file is
        // not refused (genv accepts it), and the duplicate is named.
        let envs = guard
            .envs(
                Ok(vec![env("e", 64_505, alive()), env("e", 64_504, pid)]),
                &mut warnings,
            )
            .unwrap();
        assert_eq!(envs.len(), 1);
        assert_eq!(envs[0].uid, 64_504);
        assert!(warnings[0].0.contains("more than once"), "{warnings:?}");
        // Neither confirmed: the first, as genv's lookups take.
        let envs = guard
            .envs(
                Ok(vec![env("f", 64_506, alive()), env("f", 64_507, alive())]),
                &mut Vec::new(),
            )
            .unwrap();
        assert_eq!(envs.iter().filter(|e| e.eid == "f").count(), 1);
        assert_eq!(envs.iter().find(|e| e.eid == "f").unwrap().uid, 64_506);
        shell.kill().unwrap();
        shell.wait().unwrap();
    }

    #[test]
    fn a_pin_ends_with_the_environment_and_its_shells() {
        let mut shell = shell_of(64_508);
        let pid = shell.id() as i32;
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        guard.envs(Ok(vec![env("e", 64_508, pid)]), &mut warnings);
        shell.kill().unwrap();
        shell.wait().unwrap();
        guard.envs(Ok(vec![]), &mut warnings);
        let mut next = shell_of(64_509);
        let reused = env("e", 64_509, next.id() as i32);
        let envs = guard.envs(Ok(vec![reused]), &mut warnings).unwrap();
        assert_eq!(envs[0].uid, 64_509, "a new environment with that id");
        assert!(warnings.is_empty(), "{warnings:?}");
        next.kill().unwrap();
        next.wait().unwrap();
    }

    #[test]
    fn a_malformed_file_leaves_the_last_good_parse_in_force() {
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        assert!(guard.envs(Err(malformed()), &mut warnings).is_none());
        assert!(warnings[0].0.contains("skipped"), "{warnings:?}");
        guard.envs(
            Ok(vec![env("live", 1000, alive()), env("gone", 1000, 1 << 23)]),
            &mut warnings,
        );
        warnings.clear();
        let kept = guard.envs(Err(malformed()), &mut warnings).unwrap();
        assert_eq!(kept.len(), 1, "an environment whose shells are gone ended");
        assert_eq!(kept[0].eid, "live");
        assert!(warnings[0].0.contains("last good contents"), "{warnings:?}");
    }

    /// Two ids with one FNV-1a hash (found by a cycle search over 16-hex-digit ids).
    const COLLIDING: (&str, &str) = ("c5bde799c2362419", "a1a9a9bf38687075");

    /// The kernel's entry for an id's key, as the mirror would write it.
    fn kernel_owner(envs: &[Env], eid: &str) -> Option<u32> {
        let mirror = crate::sync::environments::env_entries(envs, &[], &[]);
        mirror
            .entries
            .get(&env_id_hash(eid.as_bytes()))
            .map(|e| e.uid)
    }

    #[test]
    fn an_id_made_to_collide_never_takes_the_kernel_key_of_one_already_there() {
        let (victims, forged) = COLLIDING;
        assert_ne!(victims, forged);
        assert_eq!(
            env_id_hash(victims.as_bytes()),
            env_id_hash(forged.as_bytes())
        );
        let victim = shell_of(64_510);
        let attacker = shell_of(64_511);
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        let first = guard
            .envs(
                Ok(vec![env(victims, 64_510, victim.id() as i32)]),
                &mut warnings,
            )
            .unwrap();
        assert_eq!(kernel_owner(&first, victims), Some(64_510));
        // The attacker activates an environment with the colliding id, confirmed (their
        // own shell), before and after the victim's in the file.
        for order in [[0, 1], [1, 0]] {
            let mut capped = env(forged, 64_511, attacker.id() as i32);
            capped.config.gpu_memory =
                Some(serde_json::from_value(serde_json::json!("1m")).unwrap());
            let entries = [env(victims, 64_510, victim.id() as i32), capped];
            let envs = guard
                .envs(
                    Ok(order.map(|i| entries[i].clone()).to_vec()),
                    &mut warnings,
                )
                .unwrap();
            assert_eq!(
                kernel_owner(&envs, victims),
                Some(64_510),
                "the kernel's entry for the victim's key stays the victim's ({order:?})"
            );
            // Nor does the forged environment's memory cap reach the key (ENV_MEMORY):
            // the victim's allocations would be killed at it.
            let caps = crate::alloc::caps::Caps::of(&envs);
            assert!(
                !caps
                    .by_identity
                    .contains_key(&env_id_hash(victims.as_bytes())),
                "{caps:?}"
            );
            let said = warnings.iter().map(|w| w.0.as_str()).collect::<Vec<_>>();
            assert!(
                said.iter().any(|w| w.contains("same kernel key")
                    && w.contains(&format!("{victims} keeps it (it was there first)"))),
                "{said:?}"
            );
            warnings.clear();
        }
        // Neither confirmed nor pinned: the first in the file keeps it, and says so.
        let mut fresh = StateGuard::default();
        let envs = fresh
            .envs(
                Ok(vec![
                    env(forged, 64_512, alive()),
                    env(victims, 64_513, alive()),
                ]),
                &mut warnings,
            )
            .unwrap();
        assert_eq!(kernel_owner(&envs, forged), Some(64_512));
        assert!(
            warnings[0].0.contains("comes first in envs.json"),
            "{warnings:?}"
        );
        for mut shell in [victim, attacker] {
            shell.kill().unwrap();
            shell.wait().unwrap();
        }
    }
}
