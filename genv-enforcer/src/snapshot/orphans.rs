//! Environments genv dropped while processes of theirs still run. genv drops an
//! environment when its activating shells have all exited; a `nohup` job started in it
//! keeps its `GENV_ENVIRONMENT_ID`, and genv then leaves it alone (no rule looks at an
//! environment that is not active). The enforcer does the same by default, on the GPUs
//! the environment had attached when genv dropped it, and says so; `--orphans
//! terminate` counts such processes as outside any environment instead.

use std::collections::HashMap;

use crate::state::{Device, Env};

/// What to do with processes of an environment genv dropped (`--orphans`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OrphanPolicy {
    /// Leave them running on the GPUs their environment had, and report them.
    #[default]
    Leave,
    /// Count them as outside any environment (the non-env rule, `--deny`).
    Terminate,
}

/// At most this many dropped environments are remembered; the oldest go first.
const CAPACITY: usize = 4096;

/// An environment genv dropped, as it was when last active.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DroppedEnv {
    pub eid: String,
    /// Its owner: only that uid's (or root's) processes are its orphans.
    pub uid: u32,
    /// The GPUs attached to it when it was last active, by index.
    pub attached: Vec<u32>,
}

/// A running process of an environment genv dropped, left running.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Orphan {
    pub pid: u32,
    pub uid: u32,
    pub eid: String,
}

/// Every environment seen active, remembered after genv drops it.
#[derive(Default)]
pub(crate) struct DroppedEnvs {
    known: HashMap<String, Remembered>,
    /// Counts updates, to tell the oldest dropped environments.
    generation: u64,
}

struct Remembered {
    env: DroppedEnv,
    active: bool,
    /// The update it was last seen active in.
    last_active: u64,
}

impl DroppedEnvs {
    /// Takes in the environments active now (and the devices, for their attachments).
    pub(crate) fn update(&mut self, active: &[Env], devices: Option<&[Device]>) {
        self.generation += 1;
        for remembered in self.known.values_mut() {
            remembered.active = false;
        }
        for env in active {
            let attached = match devices {
                Some(devices) => devices
                    .iter()
                    .filter(|d| d.is_attached_to(&env.eid))
                    .map(|d| d.index)
                    .collect(),
                // Unknown this cycle: keep what was known.
                None => self
                    .known
                    .get(&env.eid)
                    .map(|r| r.env.attached.clone())
                    .unwrap_or_default(),
            };
            self.known.insert(
                env.eid.clone(),
                Remembered {
                    env: DroppedEnv {
                        eid: env.eid.clone(),
                        uid: env.uid,
                        attached,
                    },
                    active: true,
                    last_active: self.generation,
                },
            );
        }
        while self.known.len() > CAPACITY {
            let oldest = self
                .known
                .iter()
                .filter(|(_, r)| !r.active)
                .min_by_key(|(_, r)| r.last_active)
                .map(|(eid, _)| eid.clone());
            match oldest {
                Some(eid) => self.known.remove(&eid),
                None => break, // all active: nothing to forget
            };
        }
    }

    /// The environment `eid` as genv last had it, if genv dropped it since.
    pub(crate) fn dropped(&self, eid: &str) -> Option<&DroppedEnv> {
        self.known.get(eid).filter(|r| !r.active).map(|r| &r.env)
    }

    /// Every environment genv dropped that is remembered.
    pub(crate) fn all_dropped(&self) -> Vec<DroppedEnv> {
        let mut dropped: Vec<DroppedEnv> = self
            .known
            .values()
            .filter(|r| !r.active)
            .map(|r| r.env.clone())
            .collect();
        dropped.sort_by(|a, b| a.eid.cmp(&b.eid));
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(eid: &str, uid: u32) -> Env {
        serde_json::from_value(serde_json::json!({"eid": eid, "uid": uid, "pids": [1]})).unwrap()
    }

    fn device(index: u32, eids: &[&str]) -> Device {
        Device {
            index,
            total_memory: "16384m".into(),
            attachments: eids
                .iter()
                .map(|eid| crate::state::model::Attachment {
                    eid: (*eid).to_owned(),
                    gpu_memory: None,
                    time: String::new(),
                })
                .collect(),
        }
    }

    #[test]
    fn an_environment_is_dropped_once_it_is_no_longer_active_with_its_last_attachments() {
        let mut dropped = DroppedEnvs::default();
        let devices = [device(0, &[]), device(1, &["E"])];
        dropped.update(&[env("E", 1000), env("F", 1001)], Some(&devices));
        assert_eq!(dropped.dropped("E"), None, "active");
        // genv's cleanup dropped E (and its attachment).
        dropped.update(&[env("F", 1001)], Some(&[device(0, &[]), device(1, &[])]));
        let e = dropped.dropped("E").expect("dropped");
        assert_eq!((e.uid, e.attached.clone()), (1000, vec![1]));
        assert_eq!(dropped.dropped("never-seen"), None);
        // Active again (a shell with the same pid activated it): not dropped.
        dropped.update(&[env("E", 1000)], Some(&devices));
        assert_eq!(dropped.dropped("E"), None);
        assert_eq!(dropped.all_dropped().len(), 1, "F now");
    }

    #[test]
    fn the_oldest_dropped_environments_are_forgotten_first() {
        let mut dropped = DroppedEnvs::default();
        for i in 0..CAPACITY + 10 {
            dropped.update(&[env(&i.to_string(), 1000)], None);
        }
        dropped.update(&[], None);
        assert_eq!(dropped.all_dropped().len(), CAPACITY);
        assert!(dropped.dropped("0").is_none(), "the oldest went");
        assert!(dropped.dropped(&(CAPACITY + 9).to_string()).is_some());
    }
}
