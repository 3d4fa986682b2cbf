//! Inputs for the parsers' property tests: genv's documents as genv 1.4.3 writes them,
//! arbitrary JSON, and structure-aware mutations of the one towards the other.
//!
//! Each property runs `PROPTEST_CASES` cases (proptest's 256 unless set) from a fresh
//! random seed (`PROPTEST_RNG_SEED` fixes it); a failure panics with the smallest input
//! proptest could shrink it to.

use std::fmt::Debug;

use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestError, TestRunner};
use serde_json::{Number, Value, json};

use crate::state::memory::MemorySpec;
use crate::state::model::{Attachment, Device, Env, EnvConfig};

/// Runs `test` on values of `strategy` (see the module's comment).
pub(crate) fn check<S>(strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>)
where
    S: Strategy,
    S::Value: Debug,
{
    let config = Config {
        failure_persistence: None,
        ..Config::default()
    };
    match TestRunner::new(config).run(&strategy, test) {
        Ok(()) => {}
        Err(TestError::Fail(reason, input)) => panic!("{reason}\nminimal input: {input:#?}"),
        Err(TestError::Abort(reason)) => panic!("aborted: {reason}"),
    }
}

/// `count` values of `strategy` (more in proportion where `PROPTEST_CASES` is over
/// 256), for checks that run once over a batch (against python3).
pub(crate) fn sample<S: Strategy>(strategy: S, count: usize) -> Vec<S::Value> {
    let config = Config::default();
    let count = count * (config.cases as usize).max(256) / 256;
    let mut runner = TestRunner::new(config);
    (0..count)
        .map(|_| strategy.new_tree(&mut runner).unwrap().current())
        .collect()
}

/// Any text: identifiers, any characters (controls, non-BMP), now and then very long.
pub(crate) fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z0-9_.-]{0,12}",
        3 => vec(any::<char>(), 0..24).prop_map(String::from_iter),
        1 => (any::<char>(), 1000..5000usize).prop_map(|(c, n)| c.to_string().repeat(n)),
    ]
}

/// Strings that look like numbers to someone: what a hand-edited file might hold.
pub(crate) fn number_like() -> impl Strategy<Value = String> {
    select(
        &[
            "NaN",
            "nan",
            "Infinity",
            "-Infinity",
            "1e3",
            "0x10",
            "",
            " 1",
            "1 ",
            "+1",
            "-0",
            "1_000",
            "\u{0661}",
            "\u{ff11}",
            "4294967296",
            "99999999999999999999999",
        ][..],
    )
    .prop_map(str::to_owned)
}

/// JSON numbers at and past the edges of the parsers' integer types.
fn edge_number() -> impl Strategy<Value = Value> {
    select(vec![
        json!(0),
        json!(-1),
        json!(u32::MAX),
        json!(u64::from(u32::MAX) + 1),
        json!(i32::MIN),
        json!(i64::from(i32::MAX) + 1),
        json!(i64::from(i32::MIN) - 1),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(1.0),
        json!(-0.0),
        json!(0.5),
        json!(1e300),
    ])
}

/// Any JSON value, nested a few levels.
pub(crate) fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("not finite", |f| Number::from_f64(f).map(Value::Number)),
        edge_number(),
        text().prop_map(Value::String),
        number_like().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            vec((text(), inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

const UNITS: [&str; 8] = ["", "b", "k", "m", "g", "ki", "mi", "gi"];

/// A memory amount genv reads: digits (leading zeros now and then) and a unit.
pub(crate) fn memory() -> impl Strategy<Value = MemorySpec> {
    let number = prop_oneof![0u64..100_000, any::<u64>()];
    (0..3usize, number, select(&UNITS[..])).prop_filter_map("past u64", |(zeros, n, unit)| {
        MemorySpec::parse(&format!("{}{n}{unit}", "0".repeat(zeros))).ok()
    })
}

/// `%d/%m/%Y %H:%M:%S`, as genv stamps environments and attachments.
fn time() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[0-3][0-9]/[01][0-9]/20[0-9]{2} [0-2][0-9]:[0-5][0-9]:[0-5][0-9]",
        1 => text(),
    ]
}

/// An environment id: the activating shell's pid, or any name given with `--id`.
pub(crate) fn eid() -> impl Strategy<Value = String> {
    prop_oneof![(1..4_194_304u32).prop_map(|pid| pid.to_string()), text()]
}

fn config() -> impl Strategy<Value = EnvConfig> {
    (
        option::of(text()),
        option::of(memory()),
        option::of(any::<u32>()),
    )
        .prop_map(|(name, gpu_memory, gpus)| EnvConfig {
            name,
            gpu_memory,
            gpus,
        })
}

pub(crate) fn env() -> impl Strategy<Value = Env> {
    let ids = (eid(), any::<u32>(), option::of(time()), option::of(text()));
    let rest = (config(), vec(any::<i32>(), 0..4), vec(text(), 0..3));
    (ids, rest).prop_map(
        |((eid, uid, creation, username), (config, pids, kernel_ids))| Env {
            eid,
            uid,
            creation,
            username,
            config,
            pids,
            kernel_ids,
            verified: false,
            key_lost: false,
        },
    )
}

fn attachment() -> impl Strategy<Value = Attachment> {
    (eid(), option::of(text()), time()).prop_map(|(eid, gpu_memory, time)| Attachment {
        eid,
        gpu_memory,
        time,
    })
}

/// Devices with distinct indices, as genv numbers them (0, 1, ...) or any.
pub(crate) fn devices() -> impl Strategy<Value = Vec<Device>> {
    let total = prop_oneof![
        3 => (0..200_000u32).prop_map(|mib| format!("{mib}mi")),
        1 => text(),
    ];
    let device = (
        prop_oneof![0..16u32, any::<u32>()],
        total,
        vec(attachment(), 0..3),
    );
    vec(device, 0..5).prop_map(|mut devices| {
        let mut seen = std::collections::HashSet::new();
        devices.retain(|(index, _, _)| seen.insert(*index));
        devices
            .into_iter()
            .map(|(index, total_memory, attachments)| Device {
                index,
                total_memory,
                attachments,
            })
            .collect()
    })
}

/// Environments with distinct ids: a legacy file is keyed by them.
pub(crate) fn distinct_envs() -> impl Strategy<Value = Vec<Env>> {
    vec(env(), 0..5).prop_map(|mut envs| {
        let mut seen = std::collections::HashSet::new();
        envs.retain(|env| seen.insert(env.eid.clone()));
        envs
    })
}

/// `envs.json` of genv <= 0.9.0: the environments keyed by eid.
pub(crate) fn legacy_envs(envs: &[Env]) -> Value {
    let keyed: serde_json::Map<String, Value> = envs
        .iter()
        .map(|env| (env.eid.clone(), serde_json::to_value(env).unwrap()))
        .collect();
    json!({ "envs": keyed })
}

/// `devices.json` of genv <= 0.8.0: keyed by index, attachments keyed by eid (an
/// attachment's `gpu_memory` left out when it has none).
pub(crate) fn legacy_devices(devices: &[Device]) -> Value {
    let keyed: serde_json::Map<String, Value> = devices
        .iter()
        .map(|device| {
            let eids: serde_json::Map<String, Value> = device
                .attachments
                .iter()
                .map(|a| {
                    let mut entry = json!({"eid": a.eid, "attached": a.time});
                    if let Some(memory) = &a.gpu_memory {
                        entry["gpu_memory"] = json!(memory);
                    }
                    (a.eid.clone(), entry)
                })
                .collect();
            let entry = json!({"total_memory": device.total_memory, "eids": eids});
            (device.index.to_string(), entry)
        })
        .collect();
    json!({ "devices": keyed })
}

/// One change to a document, at one of its nodes.
#[derive(Clone, Debug)]
pub(crate) enum Mutation {
    /// Another value, of any type: retyped, huge, negative, number-like, unicode.
    Replace(Value),
    /// Dropped: a field, or an element of a list.
    Remove,
    /// A field genv does not write, added to an object.
    AddKey(String, Value),
    /// An element of a list twice (duplicate environments, devices).
    Duplicate,
    /// Wrapped in that many lists.
    Nest(usize),
    /// An object made a list of its values, a list an object keyed "0", "1", ...
    Retype,
}

pub(crate) fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => json_value().prop_map(Mutation::Replace),
        1 => edge_number().prop_map(Mutation::Replace),
        3 => Just(Mutation::Remove),
        1 => (text(), json_value()).prop_map(|(k, v)| Mutation::AddKey(k, v)),
        2 => Just(Mutation::Duplicate),
        1 => (1..200usize).prop_map(Mutation::Nest),
        2 => Just(Mutation::Retype),
    ]
}

/// `document` with `mutation` applied at its `at`-th node (in preorder, the root left
/// out), and that node's JSON pointer, for failure messages.
pub(crate) fn mutate(document: Value, at: Index, mutation: &Mutation) -> (Value, String) {
    let mut nodes = Vec::new();
    pointers(&document, String::new(), &mut nodes);
    if nodes.is_empty() {
        return (document, String::new());
    }
    let pointer = nodes.swap_remove(at.index(nodes.len()));
    (apply(document, &pointer, mutation), pointer)
}

/// `document` with `mutation` applied at the node `pointer` names (not the root).
pub(crate) fn apply(mut document: Value, pointer: &str, mutation: &Mutation) -> Value {
    let (parent, last) = pointer.rsplit_once('/').unwrap();
    let last = last.replace("~1", "/").replace("~0", "~");
    let parent = document.pointer_mut(parent).unwrap();
    match (mutation, parent) {
        (Mutation::Remove, Value::Array(items)) => {
            items.remove(last.parse().unwrap());
        }
        (Mutation::Remove, Value::Object(fields)) => {
            fields.shift_remove(&last);
        }
        (Mutation::Duplicate, Value::Array(items)) => {
            let i: usize = last.parse().unwrap();
            items.insert(i, items[i].clone());
        }
        (mutation, parent) => {
            let node = match parent {
                Value::Array(items) => &mut items[last.parse::<usize>().unwrap()],
                parent => &mut parent[last.as_str()],
            };
            change(node, mutation);
        }
    }
    document
}

fn change(node: &mut Value, mutation: &Mutation) {
    match (mutation, &mut *node) {
        (Mutation::Replace(value), _) => *node = value.clone(),
        (Mutation::AddKey(key, value), Value::Object(fields)) => {
            fields.insert(key.clone(), value.clone());
        }
        (Mutation::Nest(depth), _) => {
            for _ in 0..*depth {
                *node = Value::Array(vec![node.take()]);
            }
        }
        (Mutation::Retype, Value::Object(fields)) => {
            *node = Value::Array(std::mem::take(fields).into_iter().map(|(_, v)| v).collect());
        }
        (Mutation::Retype, Value::Array(items)) => {
            let keyed = std::mem::take(items).into_iter().enumerate();
            *node = Value::Object(keyed.map(|(i, v)| (i.to_string(), v)).collect());
        }
        _ => {}
    }
}

/// The JSON pointers of `value`'s nodes below `here`.
fn pointers(value: &Value, here: String, out: &mut Vec<String>) {
    let children: Vec<(String, &Value)> = match value {
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect(),
        Value::Object(fields) => fields
            .iter()
            .map(|(k, v)| (k.replace('~', "~0").replace('/', "~1"), v))
            .collect(),
        _ => Vec::new(),
    };
    for (step, child) in children {
        let pointer = format!("{here}/{step}");
        out.push(pointer.clone());
        pointers(child, pointer, out);
    }
}

/// `script`'s output on `stdin` under python3, which the unit tests already need (see
/// `snapshot::order`).
pub(crate) fn python(script: &str, stdin: &str) -> String {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 is needed to compare with Python's json");
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python3 failed");
    String::from_utf8(out.stdout).unwrap()
}
