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
    serde_path_to_error::deserialize::<_, ProcessJson>(value)
        .map(GpuProcess::from)
        .map_err(|e| ShapeError {
            path: format!("{prefix}.{}", e.path()),
            message: e.inner().to_string(),
        })
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
        Ok(crate::state::to_python_json(&value)?)
    }

    /// Reads a whole snapshot printed by `genv usage snapshot` (genv's or ours).
    pub fn from_genv_json(text: &str) -> Result<Self, WireError> {
        let document: Value = serde_json::from_str(text)?;
        let field = |key: &str| {
            document.get(key).ok_or_else(|| ShapeError {
                path: "$".into(),
                message: format!("missing key {key:?}"),
            })
        };
        let processes = field("processes")?
            .get("processes")
            .cloned()
            .ok_or_else(|| ShapeError {
                path: "processes".into(),
                message: "missing key \"processes\"".into(),
            })?;
        let processes = processes
            .as_array()
            .ok_or_else(|| ShapeError {
                path: "processes.processes".into(),
                message: "expected a list".into(),
            })?
            .iter()
            .enumerate()
            .map(|(i, p)| parse_wire_process(p, &format!("processes.processes[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            processes,
            envs: Some(model::parse_envs(field("envs")?)?),
            devices: Some(model::parse_devices(field("devices")?)?),
            memory_known: true,
        })
    }
}
