//! The JSON of `genv usage snapshot`, read and written byte-compatibly, so that genv's
//! `remote enforce` can drive this binary and the other way round.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{GpuProcess, Snapshot, Usage};
use crate::state::memory::{MemorySpec, format_mebibytes};
use crate::state::model::{self, ShapeError};
use crate::state::{Device, Env};

#[derive(Serialize, Deserialize)]
pub(crate) struct ProcessJson {
    pub pid: u32,
    pub used_gpu_memory: Vec<UsageJson>,
    pub eid: Option<String>,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct UsageJson {
    pub index: u32,
    pub gpu_memory: MemorySpec,
}

#[derive(Serialize)]
struct Processes {
    processes: Vec<ProcessJson>,
}

#[derive(Serialize)]
struct Envs<'a> {
    envs: &'a [Env],
}

#[derive(Serialize)]
struct Devices<'a> {
    devices: &'a [Device],
}

impl From<&GpuProcess> for ProcessJson {
    fn from(p: &GpuProcess) -> Self {
        Self {
            pid: p.pid,
            // nvidia-smi reports whole MiB, and genv reads them as `Nmi`.
            used_gpu_memory: p
                .used_gpu_memory
                .iter()
                .map(|u| UsageJson {
                    index: u.index,
                    gpu_memory: MemorySpec::parse(&format_mebibytes(u.bytes.unwrap_or(0)))
                        .expect("formatted memory parses"),
                })
                .collect(),
            eid: p.eid.clone(),
        }
    }
}

/// A process as genv serializes it.
pub fn wire_process(process: &GpuProcess) -> Value {
    serde_json::to_value(ProcessJson::from(process)).expect("a process serializes")
}

/// Reads one process of a snapshot or report, naming the field that does not fit.
pub fn parse_wire_process(value: &Value, prefix: &str) -> Result<GpuProcess, ShapeError> {
    model::decode_record::<ProcessJson>(value, prefix, &[], &["used_gpu_memory"])
        .map(GpuProcess::from)
}

impl From<ProcessJson> for GpuProcess {
    fn from(p: ProcessJson) -> Self {
        Self {
            pid: p.pid,
            start_time: None,
            used_gpu_memory: p
                .used_gpu_memory
                .into_iter()
                .map(|u| Usage {
                    index: u.index,
                    bytes: Some(u.gpu_memory.bytes()),
                })
                .collect(),
            eid: p.eid,
        }
    }
}

/// Which part of the snapshot `usage snapshot --type` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SnapshotJson {
    Devices,
    Envs,
    Processes,
}

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("{0} is not available: see the error above")]
    Missing(&'static str),
    #[error("not valid JSON: {0}")]
    Syntax(#[from] serde_json::Error),
    #[error("{0}")]
    Shape(#[from] ShapeError),
}

fn processes_json(snapshot: &Snapshot) -> Processes {
    Processes {
        processes: snapshot.processes.iter().map(ProcessJson::from).collect(),
    }
}

impl Snapshot {
    /// `genv usage snapshot [--type T]`, in genv's exact text.
    pub fn to_genv_json(&self, part: Option<SnapshotJson>) -> Result<String, WireError> {
        Ok(crate::state::to_python_json(&self.to_genv_value(part)?)?)
    }

    /// The same document, as a value (`usage watch` prints it on one line).
    pub fn to_genv_value(&self, part: Option<SnapshotJson>) -> Result<Value, WireError> {
        let envs = || self.envs.as_deref().ok_or(WireError::Missing("envs.json"));
        let devices = || {
            self.devices
                .as_deref()
                .ok_or(WireError::Missing("devices.json"))
        };
        let value = match part {
            Some(SnapshotJson::Processes) => serde_json::to_value(processes_json(self))?,
            Some(SnapshotJson::Envs) => serde_json::to_value(Envs { envs: envs()? })?,
            Some(SnapshotJson::Devices) => serde_json::to_value(Devices {
                devices: devices()?,
            })?,
            None => serde_json::json!({
                "processes": processes_json(self),
                "envs": Envs { envs: envs()? },
                "devices": Devices { devices: devices()? },
            }),
        };
        Ok(value)
    }

    /// Reads a whole snapshot printed by `genv usage snapshot` (genv's or ours).
    pub fn from_genv_json(text: &str) -> Result<Self, WireError> {
        let document: Value = serde_json::from_str(text)?;
        let processes = model::member(&document, "", "processes")?;
        let processes = model::member(processes, "processes", "processes")?
            .as_array()
            .ok_or_else(|| ShapeError {
                path: "processes.processes".into(),
                message: "expected a list".into(),
            })?;
        let processes = processes
            .iter()
            .enumerate()
            .map(|(i, p)| parse_wire_process(p, &format!("processes.processes[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        let envs = model::member(&document, "", "envs")?;
        let devices = model::member(&document, "", "devices")?;
        Ok(Self {
            processes,
            envs: Some(model::parse_envs_at(envs, "envs")?),
            devices: Some(model::parse_devices_at(devices, "devices")?),
            memory_known: true,
            // genv's wire format carries neither; a remote host's own enforcer judges them.
            orphans: Vec::new(),
            dropped_envs: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn shape_error(text: &str) -> ShapeError {
        match Snapshot::from_genv_json(text) {
            Err(WireError::Shape(e)) => e,
            other => panic!("{other:?}"),
        }
    }

    fn snapshot(processes: Value, envs: Value, devices: Value) -> String {
        json!({"processes": processes, "envs": envs, "devices": devices}).to_string()
    }

    /// Found by `fuzz_tests::any_json_reads_as_a_snapshot_exactly_where_it_has_genvs_shape`:
    /// a process that is not an object was named `processes.processes[0]..`.
    #[test]
    fn a_process_that_is_not_an_object_is_named_by_its_path() {
        let err = parse_wire_process(&json!(5), "processes.processes[0]").unwrap_err();
        assert_eq!(err.path, "processes.processes[0]");
        let err = parse_wire_process(&json!({"pid": "x"}), "p").unwrap_err();
        assert_eq!(err.path, "p.pid");
    }

    /// Found with `records_given_as_lists_are_refused` (`state::model`): a process, or a
    /// usage within one, was read from a JSON list, fields by position.
    #[test]
    fn a_process_given_as_a_list_is_refused() {
        let err = parse_wire_process(&json!([5, [], null]), "p").unwrap_err();
        assert_eq!(
            (err.path.as_str(), err.message.as_str()),
            ("p", "expected an object, found a list")
        );
        let process = json!({"pid": 5, "used_gpu_memory": [[0, "1mi"]], "eid": null});
        assert_eq!(
            parse_wire_process(&process, "p").unwrap_err().path,
            "p.used_gpu_memory[0]"
        );
    }

    /// Found by `fuzz_tests::mutated_snapshots_fail_where_they_depart_from_genvs_shape`:
    /// errors in the `envs` and `devices` parts were named as if each were the whole
    /// document (`$: missing key "envs"` for `{"envs": {}}`, `devices[0].index`).
    #[test]
    fn snapshot_parts_name_their_fields_from_the_top() {
        let processes = json!({"processes": []});
        let devices = json!({"devices": []});
        let err = shape_error(&snapshot(processes.clone(), json!({}), devices.clone()));
        assert_eq!(
            (err.path.as_str(), err.message.as_str()),
            ("envs", "missing key \"envs\"")
        );
        let err = shape_error(&snapshot(processes.clone(), json!(null), devices.clone()));
        assert_eq!(err.path, "envs");
        let envs = json!({"envs": [{"eid": "a", "uid": -1}]});
        let err = shape_error(&snapshot(processes.clone(), envs, devices));
        assert_eq!(err.path, "envs.envs[0].uid");
        let envs = json!({"envs": []});
        let devices = json!({"devices": [{"index": null, "total_memory": "1g"}]});
        let err = shape_error(&snapshot(processes.clone(), envs.clone(), devices));
        assert_eq!(err.path, "devices.devices[0].index");
        let err = shape_error(&snapshot(processes, envs, json!({"devices": 3})));
        assert_eq!(err.path, "devices.devices");
        let err = shape_error(&json!({"processes": []}).to_string());
        assert_eq!(
            (err.path.as_str(), err.message.as_str()),
            ("processes", "expected an object with key \"processes\"")
        );
    }
}
