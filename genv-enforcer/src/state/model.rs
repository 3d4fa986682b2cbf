//! The contents of genv's state files, in both the current and the legacy shapes.
//!
//! Field order in the records is genv's dataclass order: `usage snapshot` and
//! `devices.json` are written in it, byte for byte as genv writes them.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use super::memory::MemorySpec;

/// An environment from `envs.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Env {
    pub eid: String,
    pub uid: u32,
    /// `%d/%m/%Y %H:%M:%S`; unused by the rules, kept to write it back unchanged.
    #[serde(default)]
    pub creation: Option<String>,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub config: EnvConfig,
    /// The activating shells, not every member process.
    #[serde(default)]
    pub pids: Vec<i32>,
    #[serde(default)]
    pub kernel_ids: Vec<String>,
    /// The kernel confirms the owner: a live shell that activated it runs as `uid`.
    /// Never read from or written to the file (`snapshot::owners` decides it).
    #[serde(skip)]
    pub verified: bool,
    /// Another active environment's id has the same kernel key (its FNV-1a hash, which
    /// a user can collide on purpose) and keeps it: the kernel cannot tell this one's
    /// processes from that one's, so nothing of it goes into the kernel's maps and its
    /// processes' kernel identity names the other. Never in the file
    /// (`snapshot::owners` decides it).
    #[serde(skip)]
    pub key_lost: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvConfig {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub gpu_memory: Option<MemorySpec>,
    #[serde(default)]
    pub gpus: Option<u32>,
}

/// A device from `devices.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// The NVML index (PCI bus order), not the `/dev/nvidiaN` minor number.
    pub index: u32,
    pub total_memory: String,
    #[serde(default)]
    pub attachments: Vec<Attachment>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attachment {
    pub eid: String,
    #[serde(default)]
    pub gpu_memory: Option<String>,
    pub time: String,
}

impl Device {
    pub fn is_attached_to(&self, eid: &str) -> bool {
        self.attachments.iter().any(|a| a.eid == eid)
    }
}

impl Serialize for MemorySpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for MemorySpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        MemorySpec::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Where in a state file a value did not fit, and why.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{path}: {message}")]
pub struct ShapeError {
    /// A JSON path such as `envs[2].config.gpu_memory`.
    pub path: String,
    pub message: String,
}

fn shape_error(path: impl Into<String>, message: impl Into<String>) -> ShapeError {
    ShapeError {
        path: path.into(),
        message: message.into(),
    }
}

/// `path` as an error names it: `$` for the document itself.
fn here(path: &str) -> &str {
    if path.is_empty() { "$" } else { path }
}

/// The member `name` of what `path` names (`""`: the document).
fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

/// Deserializes `value`, reporting the exact field that failed under `prefix`.
fn decode<T: serde::de::DeserializeOwned>(value: &Value, prefix: &str) -> Result<T, ShapeError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let path = if inner == "." {
            prefix.to_owned()
        } else {
            format!("{prefix}.{inner}")
        };
        shape_error(path, e.inner().to_string())
    })
}

/// Deserializes the record (an object) at `path`. serde would also read a record, and
/// the records within it (the fields named in `records`, the elements of the lists
/// named in `lists`), from a JSON list, fields by position: genv never writes that, and
/// its reader fails on it, so it is refused here.
pub(crate) fn decode_record<T: serde::de::DeserializeOwned>(
    value: &Value,
    path: &str,
    records: &[&str],
    lists: &[&str],
) -> Result<T, ShapeError> {
    let refuse = |path: String| Err(shape_error(path, "expected an object, found a list"));
    if value.is_array() {
        return refuse(path.to_owned());
    }
    for name in records {
        if value.get(name).is_some_and(Value::is_array) {
            return refuse(join(path, name));
        }
    }
    for name in lists {
        if let Some(Value::Array(items)) = value.get(name) {
            if let Some(i) = items.iter().position(Value::is_array) {
                return refuse(format!("{}[{i}]", join(path, name)));
            }
        }
    }
    decode(value, path)
}

/// The member `key` of the object at `path`.
pub(crate) fn member<'a>(value: &'a Value, path: &str, key: &str) -> Result<&'a Value, ShapeError> {
    let Value::Object(fields) = value else {
        return Err(shape_error(
            here(path),
            format!("expected an object with key {key:?}"),
        ));
    };
    fields
        .get(key)
        .ok_or_else(|| shape_error(here(path), format!("missing key {key:?}")))
}

/// The top-level collection of a state file: a list (current) or an object keyed by id
/// (legacy: `envs.json` of genv <= 0.9.0, `devices.json` of genv <= 0.8.0).
fn collection<'a>(document: &'a Value, at: &str, key: &str) -> Result<Collection<'a>, ShapeError> {
    match member(document, at, key)? {
        Value::Array(items) => Ok(Collection::Current(items)),
        Value::Object(items) => Ok(Collection::Legacy(items)),
        _ => Err(shape_error(
            join(at, key),
            "expected a list (or, legacy, an object)",
        )),
    }
}

enum Collection<'a> {
    Current(&'a Vec<Value>),
    Legacy(&'a serde_json::Map<String, Value>),
}

pub fn parse_envs(document: &Value) -> Result<Vec<Env>, ShapeError> {
    parse_envs_at(document, "")
}

/// [`parse_envs`] of a document found at `at` in a larger one (a snapshot, a report),
/// naming fields from the top of that one.
pub fn parse_envs_at(document: &Value, at: &str) -> Result<Vec<Env>, ShapeError> {
    let envs = join(at, "envs");
    let env = |item, path: String| decode_record(item, &path, &["config"], &[]);
    match collection(document, at, "envs")? {
        Collection::Current(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| env(item, format!("{envs}[{i}]")))
            .collect(),
        // Legacy entries have the same fields as current ones.
        Collection::Legacy(items) => items
            .iter()
            .map(|(eid, item)| env(item, format!("{envs}[{eid:?}]")))
            .collect(),
    }
}

/// A legacy `devices.json` entry: `{"total_memory", "eids": {eid: {"eid", "gpu_memory"?, "attached"}}}`.
#[derive(Deserialize)]
struct LegacyDevice {
    total_memory: String,
    #[serde(default)]
    eids: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
struct LegacyAttachment {
    eid: String,
    #[serde(default)]
    gpu_memory: Option<String>,
    attached: String,
}

pub fn parse_devices(document: &Value) -> Result<Vec<Device>, ShapeError> {
    parse_devices_at(document, "")
}

/// [`parse_devices`] of a document found at `at` in a larger one (a snapshot).
pub fn parse_devices_at(document: &Value, at: &str) -> Result<Vec<Device>, ShapeError> {
    let devices = join(at, "devices");
    match collection(document, at, "devices")? {
        Collection::Current(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| decode_record(item, &format!("{devices}[{i}]"), &[], &["attachments"]))
            .collect(),
        Collection::Legacy(items) => items
            .iter()
            .map(|(key, item)| legacy_device(key, item, &format!("{devices}[{key:?}]")))
            .collect(),
    }
}

fn legacy_device(key: &str, item: &Value, path: &str) -> Result<Device, ShapeError> {
    let index = key
        .parse::<u32>()
        .map_err(|_| shape_error(path, "legacy device key is not an index"))?;
    let legacy: LegacyDevice = decode_record(item, path, &[], &[])?;
    let attachments = legacy
        .eids
        .iter()
        .map(|(eid, value)| {
            let a: LegacyAttachment =
                decode_record(value, &format!("{path}.eids[{eid:?}]"), &[], &[])?;
            Ok(Attachment {
                eid: a.eid,
                gpu_memory: a.gpu_memory,
                time: a.attached,
            })
        })
        .collect::<Result<_, ShapeError>>()?;
    Ok(Device {
        index,
        total_memory: legacy.total_memory,
        attachments,
    })
}

/// Both files must agree on identity: two records with one key would make every rule
/// ambiguous, so they are refused rather than guessed at.
pub fn check_unique(keys: impl Iterator<Item = String>, what: &str) -> Result<(), ShapeError> {
    let mut seen = std::collections::HashSet::new();
    for key in keys {
        if !seen.insert(key.clone()) {
            return Err(shape_error(what, format!("duplicate entry {key}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn reads_current_envs() {
        let envs = parse_envs(&json!({"envs": [{"eid": "21210", "uid": 0,
            "creation": "22/11/2026 02:28:47", "username": "root",
            "config": {"name": "mem-env", "gpu_memory": "2g", "gpus": 1},
            "pids": [21210], "kernel_ids": []}]}))
        .unwrap();
        assert_eq!(envs[0].eid, "21210");
        assert_eq!(
            envs[0].config.gpu_memory.as_ref().unwrap().bytes(),
            2_000_000_000
        );
        assert_eq!(envs[0].pids, vec![21210]);
    }

    #[test]
    fn reads_legacy_envs() {
        let envs = parse_envs(&json!({"envs": {"7": {"eid": "7", "uid": 1000,
            "creation": "01/01/2022 00:00:00", "username": null,
            "config": {"name": null, "gpu_memory": null, "gpus": null},
            "pids": [7], "kernel_ids": []}}}))
        .unwrap();
        assert_eq!(envs[0].eid, "7");
        assert_eq!(envs[0].username, None);
    }

    #[test]
    fn reads_legacy_devices() {
        let devices = parse_devices(&json!({"devices": {"1": {"total_memory": "16384mi",
            "eids": {"7": {"eid": "7", "gpu_memory": "1g", "attached": "01/01/2022 00:00:00"}}}}}))
        .unwrap();
        assert_eq!(devices[0].index, 1);
        assert_eq!(devices[0].attachments[0].eid, "7");
        assert_eq!(devices[0].attachments[0].time, "01/01/2022 00:00:00");
    }

    #[test]
    fn names_the_field_that_has_the_wrong_type() {
        let err = parse_envs(&json!({"envs": [{"eid": 5, "uid": 0}]})).unwrap_err();
        assert_eq!(err.path, "envs[0].eid");
        let err = parse_envs(&json!({"envs": [{"eid": "a", "uid": 0,
            "config": {"gpu_memory": "lots"}}]}))
        .unwrap_err();
        assert_eq!(err.path, "envs[0].config.gpu_memory");
        let err =
            parse_devices(&json!({"devices": [{"index": "0", "total_memory": "1g"}]})).unwrap_err();
        assert_eq!(err.path, "devices[0].index");
        assert_eq!(
            parse_devices(&json!({"devices": 3})).unwrap_err().path,
            "devices"
        );
        assert_eq!(parse_envs(&json!([])).unwrap_err().path, "$");
    }

    /// Found by `fuzz_tests::any_json_parses_exactly_where_it_has_genvs_shape`: serde
    /// read a record from a JSON list, fields by position (`{"envs": [["21210", 0]]}`
    /// was an environment), which genv neither writes nor reads.
    #[test]
    fn records_given_as_lists_are_refused() {
        let refused = |result: Result<Vec<Env>, ShapeError>| result.unwrap_err();
        let err = refused(parse_envs(&json!({"envs": [["21210", 0]]})));
        assert_eq!(err.path, "envs[0]");
        assert_eq!(err.message, "expected an object, found a list");
        let env = json!({"eid": "a", "uid": 0, "config": ["n", "2g", 1]});
        assert_eq!(
            refused(parse_envs(&json!({"envs": [env]}))).path,
            "envs[0].config"
        );
        assert_eq!(
            refused(parse_envs(&json!({"envs": {"a": ["a", 0]}}))).path,
            "envs[\"a\"]"
        );
        let err = |document| parse_devices(&document).unwrap_err().path;
        assert_eq!(err(json!({"devices": [[0, "16384mi", []]]})), "devices[0]");
        let device = json!({"index": 0, "total_memory": "1g", "attachments": [["e", null, "t"]]});
        assert_eq!(
            err(json!({"devices": [device]})),
            "devices[0].attachments[0]"
        );
        assert_eq!(
            err(json!({"devices": {"1": ["16384mi", {}]}})),
            "devices[\"1\"]"
        );
        let eids = json!({"7": ["7", "1g", "01/01/2022 00:00:00"]});
        assert_eq!(
            err(json!({"devices": {"1": {"total_memory": "1g", "eids": eids}}})),
            "devices[\"1\"].eids[\"7\"]"
        );
    }
}
