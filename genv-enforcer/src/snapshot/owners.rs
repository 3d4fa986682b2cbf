//! What the enforcer believes of genv's state, which any user can rewrite
//! (`$GENV_TMPDIR` is world-writable, its files 0666):
//! - an environment's owner uid is pinned the first time it is seen, for as long as
//!   one of the shells that activated it lives: a later `envs.json` that gives it
//!   another owner is reported and ignored, so nobody can turn another user's
//!   processes into outsiders (or claim their environment) by editing the file;
//! - a file that does not parse does not switch enforcement off: the last good parse
//!   stands, and the warning says so.

use std::collections::HashMap;

use super::Warning;
use crate::backends::procfs;
use crate::state::{Device, Env, StateError};

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
            Ok(mut envs) => {
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

/// genv's cleanup, applied again to a kept list: environments whose activating shells
/// are all gone (and that have no Jupyter kernels) are no longer active.
fn drop_inactive(envs: &mut Vec<Env>) {
    for env in envs.iter_mut() {
        env.pids.retain(|pid| procfs::pid_exists(*pid));
    }
    envs.retain(|env| !env.pids.is_empty() || !env.kernel_ids.is_empty());
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
    fn an_owner_is_pinned_and_a_later_change_is_reported_and_ignored() {
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        let first = guard.envs(Ok(vec![env("e", 1000, alive())]), &mut warnings);
        assert_eq!(first.unwrap()[0].uid, 1000);
        assert!(warnings.is_empty());
        let forged = guard.envs(Ok(vec![env("e", 0, alive())]), &mut warnings);
        assert_eq!(forged.unwrap()[0].uid, 1000, "the pinned owner stands");
        assert!(
            warnings[0].0.contains("created by uid 1000"),
            "{warnings:?}"
        );
        // Taken out of the file and put back: the pin holds while its shell lives.
        guard.envs(Ok(vec![]), &mut warnings);
        let back = guard.envs(Ok(vec![env("e", 0, alive())]), &mut warnings);
        assert_eq!(back.unwrap()[0].uid, 1000);
    }

    #[test]
    fn a_pin_ends_with_the_environment_and_its_shells() {
        let mut guard = StateGuard::default();
        let mut warnings = Vec::new();
        // pid_max is at most 2^22: this pid lives nowhere.
        guard.envs(Ok(vec![env("e", 1000, 1 << 23)]), &mut warnings);
        guard.envs(Ok(vec![]), &mut warnings);
        let reused = guard.envs(Ok(vec![env("e", 1001, alive())]), &mut warnings);
        assert_eq!(
            reused.unwrap()[0].uid,
            1001,
            "a new environment with that id"
        );
        assert!(warnings.is_empty(), "{warnings:?}");
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
}
