//! What one host must do after the rules ran: genv's `Report`.
//!
//! Built as genv's `Survey` builds it: terminations are listed in snapshot order (not
//! in the order rules asked for them), each process once; detaches are grouped by device
//! in the order first asked, and a detach also terminates the environment's processes on
//! that device.

pub mod reasons;
mod why;

use std::collections::BTreeMap;

use serde_json::Value;

use crate::rules::{Action, Finding, Survey};
use crate::snapshot::WireError;
use crate::snapshot::{GpuProcess, Snapshot};
use crate::state::Env;
use crate::state::model::{self, ShapeError};

pub use why::Why;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub terminate: Vec<GpuProcess>,
    pub detach: Vec<Detach>,
    /// Why each terminated process goes, by pid, for the line its user is told; not
    /// part of genv's wire format (a report read from `usage execute` has none).
    pub why: BTreeMap<u32, Why>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Detach {
    pub index: u32,
    pub envs: Vec<Env>,
}

impl Report {
    pub fn is_empty(&self) -> bool {
        self.terminate.is_empty() && self.detach.is_empty()
    }

    /// Whether `snapshot` shows this report carried out: none of its processes listed,
    /// none of its detached environments attached to the device. A snapshot that does is
    /// at least as new as the execute's effects (or shows them made some other way).
    pub fn done_in(&self, snapshot: &Snapshot) -> bool {
        let gone = |pid: u32| !snapshot.processes.iter().any(|p| p.pid == pid);
        let Some(devices) = &snapshot.devices else {
            return false;
        };
        let detached = |index: u32, eid: &str| {
            devices
                .iter()
                .filter(|d| d.index == index)
                .all(|d| d.attachments.iter().all(|a| a.eid != eid))
        };
        self.terminate.iter().all(|p| gone(p.pid))
            && (self.detach.iter()).all(|d| d.envs.iter().all(|e| detached(d.index, &e.eid)))
    }

    /// One report per survey, from every finding's actions.
    pub fn build(surveys: &[Survey<'_>], findings: &[Finding]) -> Vec<Report> {
        surveys
            .iter()
            .enumerate()
            .map(|(host, survey)| Self::build_one(host, survey, findings))
            .collect()
    }

    fn build_one(host: usize, survey: &Survey<'_>, findings: &[Finding]) -> Report {
        let snapshot = survey.snapshot;
        let mut pids: Vec<u32> = Vec::new();
        let mut detach: Vec<(u32, Vec<&str>)> = Vec::new();
        for action in findings.iter().flat_map(|f| &f.actions) {
            match action {
                Action::Terminate { host: h, pid } if *h == host => pids.push(*pid),
                Action::Detach {
                    host: h,
                    index,
                    eids,
                } if *h == host => {
                    let slot = match detach.iter().position(|(i, _)| i == index) {
                        Some(slot) => slot,
                        None => {
                            detach.push((*index, Vec::new()));
                            detach.len() - 1
                        }
                    };
                    for eid in eids {
                        detach[slot].1.push(eid);
                        pids.extend(
                            snapshot
                                .processes
                                .iter()
                                .filter(|p| {
                                    p.eid.as_deref() == Some(eid.as_str()) && p.is_on(*index)
                                })
                                .map(|p| p.pid),
                        );
                    }
                }
                _ => {}
            }
        }
        let envs = snapshot.envs.as_deref().unwrap_or_default();
        Report {
            terminate: snapshot
                .processes
                .iter()
                .filter(|p| pids.contains(&p.pid))
                .cloned()
                .collect(),
            detach: detach
                .into_iter()
                .map(|(index, eids)| Detach {
                    index,
                    envs: envs
                        .iter()
                        .filter(|e| eids.contains(&e.eid.as_str()))
                        .cloned()
                        .collect(),
                })
                .collect(),
            why: why::of_findings(host, snapshot, findings),
        }
    }

    /// The JSON `genv usage execute` reads on stdin.
    pub fn to_genv_json(&self) -> String {
        crate::state::to_python_json(&self.to_genv_value()).expect("a report serializes")
    }

    /// [`Self::to_genv_json`]'s document, for a caller that adds to it.
    pub fn to_genv_value(&self) -> Value {
        use crate::snapshot::wire_process;
        let detach: serde_json::Map<String, Value> = self
            .detach
            .iter()
            .map(|d| (d.index.to_string(), serde_json::json!({ "envs": d.envs })))
            .collect();
        serde_json::json!({
            "terminate": {"processes": self.terminate.iter().map(wire_process).collect::<Vec<_>>()},
            "detach": detach,
        })
    }

    /// Reads a report as genv's `remote enforce` sends it to `usage execute`.
    pub fn from_genv_json(text: &str) -> Result<Self, WireError> {
        let document: Value = serde_json::from_str(text)?;
        let shape = |path: &str, message: &str| ShapeError {
            path: path.to_owned(),
            message: message.to_owned(),
        };
        let terminate = model::member(&document, "", "terminate")?;
        let terminate = model::member(terminate, "terminate", "processes")?
            .as_array()
            .ok_or_else(|| shape("terminate.processes", "expected a list"))?;
        let terminate = terminate
            .iter()
            .enumerate()
            .map(|(i, p)| {
                crate::snapshot::parse_wire_process(p, &format!("terminate.processes[{i}]"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let detach = model::member(&document, "", "detach")?
            .as_object()
            .ok_or_else(|| shape("detach", "expected an object keyed by device index"))?;
        let detach = detach
            .iter()
            .map(|(index, envs)| {
                let path = format!("detach[{index:?}]");
                let index = index
                    .parse()
                    .map_err(|_| shape(&path, "not a device index"))?;
                Ok(Detach {
                    index,
                    envs: model::parse_envs_at(envs, &path)?,
                })
            })
            .collect::<Result<Vec<_>, ShapeError>>()?;
        Ok(Self {
            terminate,
            detach,
            why: BTreeMap::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn path(report: Value) -> String {
        match Report::from_genv_json(&report.to_string()) {
            Err(WireError::Shape(e)) => e.path,
            other => panic!("{other:?}"),
        }
    }

    /// Found by `fuzz_tests::mutated_reports_fail_where_they_depart_from_genvs_shape`: a
    /// missing or malformed `terminate` was named `terminate.processes`, and an error in
    /// a detached environment as if its entry were the whole document (`envs[0].uid`).
    #[test]
    fn report_errors_name_their_place_from_the_top() {
        let detach = json!({});
        assert_eq!(path(json!({"detach": detach})), "$");
        assert_eq!(
            path(json!({"terminate": null, "detach": detach})),
            "terminate"
        );
        let terminate = json!({"processes": []});
        assert_eq!(path(json!({"terminate": terminate})), "$");
        let detach = json!({"0": {"envs": [{"eid": "a", "uid": "root"}]}});
        let report = json!({"terminate": terminate, "detach": detach});
        assert_eq!(path(report), "detach[\"0\"].envs[0].uid");
        let report = json!({"terminate": terminate, "detach": {"0": []}});
        assert_eq!(path(report), "detach[\"0\"]");
        let report = json!({"terminate": terminate, "detach": {"x": {"envs": []}}});
        assert_eq!(path(report), "detach[\"x\"]");
    }

    /// A snapshot of the host `attached` to device 0 (or not) and running `pids`.
    fn host(attached: bool, pids: &[u32]) -> Snapshot {
        let env = json!({"eid": "a", "uid": 1000, "creation": "01/01/2026 00:00:00",
            "username": "u", "config": {"name": null, "gpu_memory": null, "gpus": null},
            "pids": [5], "kernel_ids": []});
        let attachments = match attached {
            true => json!([{"eid": "a", "gpu_memory": null, "time": "01/01/2026 00:00:00"}]),
            false => json!([]),
        };
        let processes: Vec<Value> = (pids.iter())
            .map(|p| json!({"pid": p, "used_gpu_memory": [{"index": 0, "gpu_memory": "1mi"}], "eid": "a"}))
            .collect();
        let text = json!({"processes": {"processes": processes}, "envs": {"envs": [env]},
            "devices": {"devices": [{"index": 0, "total_memory": "16g", "attachments": attachments}]}});
        Snapshot::from_genv_json(&text.to_string()).unwrap()
    }

    /// What ends the remote engine's wait after an execute without a check: the host's
    /// snapshot shows the detach made and the process gone; an earlier one does not.
    #[test]
    fn a_report_is_done_in_a_snapshot_that_shows_its_effects() {
        let wire = json!({
            "terminate": {"processes": [{"pid": 10, "used_gpu_memory": [{"index": 0, "gpu_memory": "1mi"}], "eid": "a"}]},
            "detach": {"0": {"envs": [{"eid": "a", "uid": 1000, "creation": "01/01/2026 00:00:00",
                "username": "u", "config": {"name": null, "gpu_memory": null, "gpus": null},
                "pids": [5], "kernel_ids": []}]}},
        });
        let report = Report::from_genv_json(&wire.to_string()).unwrap();
        assert!(report.done_in(&host(false, &[])));
        assert!(!report.done_in(&host(true, &[])), "still attached");
        assert!(!report.done_in(&host(false, &[10])), "still running");
        assert!(Report::default().done_in(&host(true, &[10])));
    }
}

#[cfg(test)]
mod fuzz_tests {
    //! Property tests of `genv usage execute`'s input, as `snapshot::fuzz_tests` tests
    //! the snapshot's: a report reads back as it was sent, and a document reads exactly
    //! where it has genv's shape, failing otherwise at a place where it departs from it.

    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::sample::Index;

    use super::*;
    use crate::snapshot::fuzz_tests::{mutated, mutations, shape_of, wire_gpu_process};
    use crate::state::test_support::arbitrary::{self, check};
    use crate::state::test_support::genv_shape::{self, REPORT};

    fn report() -> impl Strategy<Value = Report> {
        let detach = vec((any::<u32>(), vec(arbitrary::env(), 0..3)), 0..3);
        (vec(wire_gpu_process(), 0..4), detach).prop_map(|(terminate, mut detach)| {
            // One entry per device, in the order first asked (as `build_one` makes them).
            let mut seen = std::collections::HashSet::new();
            detach.retain(|(index, _)| seen.insert(*index));
            let detach = detach
                .into_iter()
                .map(|(index, envs)| Detach { index, envs })
                .collect();
            Report {
                terminate,
                detach,
                why: BTreeMap::new(),
            }
        })
    }

    #[test]
    fn a_report_reads_back_as_it_was_sent() {
        check(report(), |report| {
            prop_assert_eq!(
                Report::from_genv_json(&report.to_genv_json()).unwrap(),
                report
            );
            Ok(())
        });
    }

    #[test]
    fn mutated_reports_fail_where_they_depart_from_genvs_shape() {
        check((report(), mutations()), |(report, mutations)| {
            let document = serde_json::from_str(&report.to_genv_json()).unwrap();
            let document = mutated(document, &mutations);
            let parsed = shape_of(&document, Report::from_genv_json(&document.to_string()))?;
            genv_shape::agrees(&REPORT, &document, &parsed)
        });
    }

    #[test]
    fn any_text_is_read_without_a_panic() {
        let cut_short = (report(), any::<Index>()).prop_map(|(report, cut)| {
            let text = report.to_genv_json();
            text[..cut.index(text.len() + 1)].to_owned()
        });
        check(
            prop_oneof![any::<String>(), cut_short],
            |text| match Report::from_genv_json(&text) {
                Ok(_) | Err(WireError::Syntax(_) | WireError::Shape(_)) => Ok(()),
                Err(e) => Err(TestCaseError::fail(e.to_string())),
            },
        );
    }
}
