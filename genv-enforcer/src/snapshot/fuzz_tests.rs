//! Property tests of `genv usage snapshot`'s wire format (how they run, and how to run
//! them longer: `state::test_support::arbitrary`). A snapshot reads back as it was printed; any text
//! is read without a panic, and a document reads exactly where it has genv's shape
//! (`state::test_support::genv_shape`), failing otherwise at a place where it departs from it.

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

use super::{GpuProcess, Snapshot, SnapshotJson, Usage, WireError, parse_wire_process};
use crate::state::model::{self, ShapeError};
use crate::state::test_support::arbitrary::{self, check};
use crate::state::test_support::genv_shape::{self, SNAPSHOT};

const MIB: u64 = 1024 * 1024;

/// A process as a snapshot carries it across the wire: memory in whole MiB (as
/// nvidia-smi reports it to genv), no start time.
pub(crate) fn wire_gpu_process() -> impl Strategy<Value = GpuProcess> {
    let mib = prop_oneof![0..100_000u64, 0..=u64::MAX / MIB];
    let usage = (prop_oneof![0..8u32, any::<u32>()], mib).prop_map(|(index, mib)| Usage {
        index,
        bytes: Some(mib * MIB),
    });
    let eid = option::of(arbitrary::eid());
    (any::<u32>(), vec(usage, 0..3), eid).prop_map(|(pid, used_gpu_memory, eid)| GpuProcess {
        pid,
        start_time: None,
        used_gpu_memory,
        eid,
    })
}

fn snapshot() -> impl Strategy<Value = Snapshot> {
    let processes = vec(wire_gpu_process(), 0..4);
    (processes, vec(arbitrary::env(), 0..4), arbitrary::devices()).prop_map(
        |(processes, envs, devices)| Snapshot {
            processes,
            envs: Some(envs),
            devices: Some(devices),
            memory_known: true,
            ..Snapshot::default()
        },
    )
}

/// How deep `value` nests: past serde_json's limit (128), its text does not parse.
pub(crate) fn depth(value: &Value) -> usize {
    match value {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(fields) => 1 + fields.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// `document` with `mutations` made, one after the other.
pub(crate) fn mutated(document: Value, mutations: &[(Index, arbitrary::Mutation)]) -> Value {
    mutations.iter().fold(document, |document, (at, mutation)| {
        arbitrary::mutate(document, *at, mutation).0
    })
}

/// One to three mutations, each at a node of the document.
pub(crate) fn mutations() -> impl Strategy<Value = Vec<(Index, arbitrary::Mutation)>> {
    vec((any::<Index>(), arbitrary::mutation()), 1..4)
}

/// The wire reader's error as a shape error; a syntax error only for text nested past
/// serde_json's limit.
pub(crate) fn shape_of<T>(
    document: &Value,
    parsed: Result<T, WireError>,
) -> Result<Result<T, ShapeError>, TestCaseError> {
    match parsed {
        Ok(parsed) => Ok(Ok(parsed)),
        Err(WireError::Shape(e)) => Ok(Err(e)),
        Err(e @ WireError::Syntax(_)) if depth(document) > 100 => Err(TestCaseError::reject(
            format!("nested too deep to print: {e}"),
        )),
        Err(e) => Err(TestCaseError::fail(format!("{e}: {document}"))),
    }
}

#[test]
fn a_snapshot_reads_back_as_it_was_printed() {
    check(snapshot(), |snapshot| {
        let text = snapshot.to_genv_json(None).unwrap();
        prop_assert_eq!(&Snapshot::from_genv_json(&text).unwrap(), &snapshot);
        let part = |part| -> Value {
            serde_json::from_str(&snapshot.to_genv_json(Some(part)).unwrap()).unwrap()
        };
        let envs = model::parse_envs(&part(SnapshotJson::Envs)).unwrap();
        prop_assert_eq!(Some(envs), snapshot.envs.clone());
        let devices = model::parse_devices(&part(SnapshotJson::Devices)).unwrap();
        prop_assert_eq!(Some(devices), snapshot.devices.clone());
        let processes = part(SnapshotJson::Processes);
        let processes: Vec<GpuProcess> = processes["processes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| parse_wire_process(p, "p").unwrap())
            .collect();
        prop_assert_eq!(processes, snapshot.processes);
        Ok(())
    });
}

/// A process's memory crosses the wire floored to whole MiB, as nvidia-smi reports it
/// to genv; a figure NVML did not have crosses as 0.
#[test]
fn memory_crosses_the_wire_in_whole_mebibytes() {
    let usage = (any::<u32>(), option::of(any::<u64>()));
    check((any::<u32>(), vec(usage, 0..3)), |(pid, usages)| {
        let used_gpu_memory: Vec<Usage> = usages
            .iter()
            .map(|&(index, bytes)| Usage { index, bytes })
            .collect();
        let process = GpuProcess {
            pid,
            start_time: Some(1),
            used_gpu_memory,
            eid: None,
        };
        let read = parse_wire_process(&super::wire_process(&process), "p").unwrap();
        prop_assert_eq!(read.pid, pid);
        prop_assert_eq!(read.start_time, None);
        for (read, &(index, bytes)) in read.used_gpu_memory.iter().zip(&usages) {
            prop_assert_eq!(read.index, index);
            prop_assert_eq!(read.bytes, Some(bytes.unwrap_or(0) / MIB * MIB));
        }
        Ok(())
    });
}

#[test]
fn mutated_snapshots_fail_where_they_depart_from_genvs_shape() {
    check((snapshot(), mutations()), |(snapshot, mutations)| {
        let text = snapshot.to_genv_json(None).unwrap();
        let document = mutated(serde_json::from_str(&text).unwrap(), &mutations);
        let parsed = shape_of(&document, Snapshot::from_genv_json(&document.to_string()))?;
        genv_shape::agrees(&SNAPSHOT, &document, &parsed)
    });
}

#[test]
fn any_json_reads_as_a_snapshot_exactly_where_it_has_genvs_shape() {
    let any = arbitrary::json_value;
    let process = prop_oneof![
        any(),
        wire_gpu_process().prop_map(|p| super::wire_process(&p))
    ];
    let env = prop_oneof![
        any(),
        arbitrary::env().prop_map(|env| serde_json::to_value(env).unwrap())
    ];
    let devices = prop_oneof![any(), arbitrary::devices().prop_map(|d| json!(d))];
    let structured = (process, env, devices).prop_map(|(process, env, devices)| {
        json!({
            "processes": {"processes": [process]},
            "envs": {"envs": [env]},
            "devices": {"devices": devices},
        })
    });
    check(prop_oneof![1 => any(), 4 => structured], |document| {
        let parsed = shape_of(&document, Snapshot::from_genv_json(&document.to_string()))?;
        genv_shape::agrees(&SNAPSHOT, &document, &parsed)
    });
}

#[test]
fn any_text_is_read_without_a_panic() {
    let text = prop_oneof![
        any::<String>(),
        (snapshot(), any::<Index>()).prop_map(|(snapshot, cut)| {
            let text = snapshot.to_genv_json(None).unwrap();
            let mut cut = cut.index(text.len() + 1);
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text[..cut].to_owned()
        }),
        (1..100_000usize).prop_map(|depth| "[".repeat(depth)),
    ];
    check(text, |text| {
        match Snapshot::from_genv_json(&text) {
            Ok(_) | Err(WireError::Syntax(_) | WireError::Shape(_)) => {}
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        }
        Ok(())
    });
}
