//! Property tests of the state files' parsers (how they run, and how to run them longer:
//! `arbitrary`). Whatever a file holds, reading it never panics; it succeeds exactly
//! where the document has genv's shape (`genv_shape`), and otherwise fails naming the
//! file and a place where the document departs from that shape; what genv writes reads
//! back as it was written. What genv's own Python reads and writes is compared in
//! `python_tests`.

use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

use super::model::{self, Device, Env};
use super::test_support::arbitrary::{self, Mutation, check};
use super::test_support::genv_shape::{self, DEVICES_JSON, ENVS_JSON};
use super::{StateDir, StateErrorKind, to_python_json};

fn parse_both(document: &Value) -> Result<(), TestCaseError> {
    genv_shape::agrees(&ENVS_JSON, document, &model::parse_envs(document))?;
    genv_shape::agrees(&DEVICES_JSON, document, &model::parse_devices(document))
}

/// A document genv could have written, in the current or the legacy shape.
pub(super) fn genv_document() -> impl Strategy<Value = Value> {
    prop_oneof![
        vec(arbitrary::env(), 0..5).prop_map(|envs| json!({ "envs": envs })),
        arbitrary::distinct_envs().prop_map(|envs| arbitrary::legacy_envs(&envs)),
        arbitrary::devices().prop_map(|devices| json!({ "devices": devices })),
        arbitrary::devices().prop_map(|devices| arbitrary::legacy_devices(&devices)),
    ]
}

/// A genv document with one to three mutations, and where they were made.
fn mutated_document() -> impl Strategy<Value = (Value, Vec<String>)> {
    let mutations = vec((any::<Index>(), arbitrary::mutation()), 1..4);
    (genv_document(), mutations).prop_map(|(mut document, mutations)| {
        let mut at = Vec::new();
        for (index, mutation) in &mutations {
            let (mutated, pointer) = arbitrary::mutate(document, *index, mutation);
            document = mutated;
            at.push(format!("{pointer} {mutation:?}"));
        }
        (document, at)
    })
}

#[test]
fn any_json_parses_exactly_where_it_has_genvs_shape() {
    let document = prop_oneof![
        arbitrary::json_value(),
        arbitrary::json_value().prop_map(|v| json!({ "envs": v })),
        arbitrary::json_value().prop_map(|v| json!({ "devices": v })),
        vec(arbitrary::json_value(), 0..4).prop_map(|v| json!({"envs": v, "devices": v})),
    ];
    check(document, |document| parse_both(&document));
}

#[test]
fn mutated_genv_documents_fail_where_they_depart_from_genvs_shape() {
    check(mutated_document(), |(document, at)| {
        parse_both(&document).map_err(|e| TestCaseError::fail(format!("{e}\nmutations: {at:?}")))
    });
}

#[test]
fn what_genv_writes_reads_back_as_written() {
    check(
        (vec(arbitrary::env(), 0..5), arbitrary::devices()),
        |(envs, devices)| {
            let text = to_python_json(&json!({ "envs": envs })).unwrap();
            let parsed = model::parse_envs(&serde_json::from_str(&text).unwrap());
            prop_assert_eq!(parsed.unwrap(), envs);
            let text = to_python_json(&json!({ "devices": devices })).unwrap();
            let parsed = model::parse_devices(&serde_json::from_str(&text).unwrap());
            prop_assert_eq!(parsed.unwrap(), devices);
            Ok(())
        },
    );
}

#[test]
fn legacy_files_read_as_genv_converts_them() {
    check(
        (arbitrary::distinct_envs(), arbitrary::devices()),
        |(envs, mut devices)| {
            let text = to_python_json(&arbitrary::legacy_envs(&envs)).unwrap();
            let parsed = model::parse_envs(&serde_json::from_str(&text).unwrap());
            prop_assert_eq!(parsed.unwrap(), envs);
            // Legacy attachments are keyed by eid: one per environment and device.
            for device in &mut devices {
                let mut seen = HashSet::new();
                device.attachments.retain(|a| seen.insert(a.eid.clone()));
            }
            let text = to_python_json(&arbitrary::legacy_devices(&devices)).unwrap();
            let parsed = model::parse_devices(&serde_json::from_str(&text).unwrap());
            prop_assert_eq!(parsed.unwrap(), devices);
            Ok(())
        },
    );
}

/// Python's `json` (genv's reader) keeps the last of a repeated key's values, in the
/// place of the first; so does serde_json with `preserve_order`.
#[test]
fn a_repeated_key_keeps_its_last_value_in_its_first_place() {
    let envs = vec(arbitrary::env(), 1..4);
    let junk = arbitrary::json_value();
    check(
        (envs, any::<Index>(), any::<Index>(), junk),
        |(envs, which, field, junk)| {
            // A field of one record given twice, junk first.
            let which = which.index(envs.len());
            let record = serde_json::to_value(&envs[which]).unwrap();
            let keys: Vec<&String> = record.as_object().unwrap().keys().collect();
            let key = keys[field.index(keys.len())];
            let records: Vec<String> = envs
                .iter()
                .map(|env| serde_json::to_string(env).unwrap())
                .collect();
            let mut repeated = records.clone();
            repeated[which] = format!("{{{}:{junk},{}", json!(key), &records[which][1..]);
            let text = format!("{{\"envs\":[{}]}}", repeated.join(","));
            let parsed = model::parse_envs(&serde_json::from_str(&text).unwrap());
            prop_assert_eq!(parsed.unwrap(), envs);
            Ok(())
        },
    );
}

/// A legacy file's entries in order, one of them (`first`) also given, junk, at the front.
fn legacy_with_repeated_entry(envs: &[Env], first: usize, junk: &Value) -> String {
    let entries: Vec<String> = envs
        .iter()
        .map(|env| format!("{}:{}", json!(env.eid), json!(env)))
        .collect();
    let front = format!("{}:{junk}", json!(envs[first].eid));
    format!("{{\"envs\":{{{front},{}}}}}", entries.join(","))
}

#[test]
fn a_repeated_legacy_entry_counts_in_its_first_place() {
    let envs = arbitrary::distinct_envs().prop_filter("empty", |envs| !envs.is_empty());
    check(
        (envs, any::<Index>(), arbitrary::json_value()),
        |(envs, first, junk)| {
            let first = first.index(envs.len());
            let text = legacy_with_repeated_entry(&envs, first, &junk);
            let mut expected = envs.clone();
            let moved = expected.remove(first);
            expected.insert(0, moved);
            let parsed = model::parse_envs(&serde_json::from_str(&text).unwrap());
            prop_assert_eq!(parsed.unwrap(), expected);
            Ok(())
        },
    );
}

#[test]
fn python_orders_a_repeated_legacy_entry_as_we_do() {
    let cases = arbitrary::sample(
        (
            arbitrary::distinct_envs(),
            any::<Index>(),
            arbitrary::json_value(),
        ),
        64,
    );
    let mut texts = Vec::new();
    let mut ours = Vec::new();
    for (envs, first, junk) in cases.into_iter().filter(|(envs, ..)| !envs.is_empty()) {
        let text = legacy_with_repeated_entry(&envs, first.index(envs.len()), &junk);
        let parsed = model::parse_envs(&serde_json::from_str(&text).unwrap()).unwrap();
        ours.push(json!(parsed.iter().map(|e| &e.eid).collect::<Vec<_>>()).to_string());
        texts.push(json!(text).to_string());
    }
    let script = "import json, sys\nfor line in sys.stdin.buffer.read().decode().split('\\n'):\n    envs = json.loads(json.loads(line))['envs']\n    print(json.dumps([e['eid'] for e in envs.values()], separators=(',', ':')))\n";
    let theirs = arbitrary::python(script, &texts.join("\n"));
    let theirs: Vec<Value> = theirs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ours: Vec<Value> = ours
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(ours, theirs);
}

#[test]
fn check_unique_refuses_exactly_repeated_keys() {
    check(vec("[a-c]{0,2}", 0..8), |keys| {
        let distinct = keys.iter().collect::<HashSet<_>>().len() == keys.len();
        match model::check_unique(keys.iter().cloned(), "devices") {
            Ok(()) => prop_assert!(distinct),
            Err(e) => {
                prop_assert!(!distinct);
                prop_assert_eq!(&e.path, "devices");
                let named = keys
                    .iter()
                    .filter(|k| e.message == format!("duplicate entry {k}"));
                prop_assert!(named.count() >= 2, "{}", e);
            }
        }
        Ok(())
    });
}

/// A state directory of its own for one case, removed after it.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("genv-fuzz-{}-{n}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn state(&self, envs: &[u8], devices: &[u8]) -> StateDir {
        fs::write(self.0.join("envs.json"), envs).unwrap();
        fs::write(self.0.join("devices.json"), devices).unwrap();
        StateDir::new(&self.0)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// What a half-written or hand-edited file might hold: a genv document cut short, with
/// bytes changed, added or removed; nesting past any limit; any bytes at all.
fn damaged_file() -> impl Strategy<Value = Vec<u8>> {
    let edit = (any::<Index>(), any::<u8>(), 0..3u8);
    let edited = (
        prop_oneof![genv_document(), mutated_document().prop_map(|(d, _)| d)],
        vec(edit, 0..4),
        proptest::option::of(any::<Index>()),
    )
        .prop_map(|(document, edits, cut)| {
            let mut bytes = to_python_json(&document).unwrap().into_bytes();
            for (at, byte, how) in edits {
                let at = at.index(bytes.len() + 1);
                match how {
                    0 if at < bytes.len() => bytes[at] = byte,
                    1 => bytes.insert(at, byte),
                    _ if at < bytes.len() => {
                        bytes.remove(at);
                    }
                    _ => {}
                }
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len() + 1));
            }
            bytes
        });
    let deep = (1..100_000usize, "[\\[{]").prop_map(|(depth, open)| {
        let inner = if open == "[" { "[" } else { "{\"envs\":" };
        format!("{{\"envs\":{}", inner.repeat(depth)).into_bytes()
    });
    prop_oneof![
        4 => edited,
        1 => deep,
        1 => vec(any::<u8>(), 0..200),
        1 => "[ \t\r\n]{0,4}".prop_map(String::into_bytes),
    ]
}

/// How loading `bytes` must fail, if it must: the kinds in the order the loader checks.
fn expected_failure(bytes: &[u8], shape: &genv_shape::Shape) -> Option<&'static str> {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return Some("read");
    };
    if text.trim().is_empty() {
        return Some("empty");
    }
    let Ok(document) = serde_json::from_str::<Value>(text) else {
        return Some("syntax");
    };
    (!genv_shape::departures(shape, &document).is_empty()).then_some("shape")
}

fn kind(error: &StateErrorKind) -> &'static str {
    match error {
        StateErrorKind::Read(_) => "read",
        StateErrorKind::Empty => "empty",
        StateErrorKind::Syntax(_) => "syntax",
        StateErrorKind::Shape(_) => "shape",
        _ => "other",
    }
}

#[test]
fn damaged_state_files_are_refused_naming_the_file() {
    check((damaged_file(), damaged_file()), |(envs, devices)| {
        let scratch = Scratch::new();
        let dir = scratch.state(&envs, &devices);
        let loaded = dir.load_envs();
        match (&loaded, expected_failure(&envs, &ENVS_JSON)) {
            (Ok(_), None) => {}
            (Err(e), Some(expected)) => {
                prop_assert_eq!(&e.path, &dir.root().join("envs.json"));
                let named = format!("{}: ", e.path.display());
                prop_assert!(e.to_string().starts_with(&named), "{}", e);
                prop_assert_eq!(kind(&e.kind), expected, "{}", e);
            }
            (loaded, expected) => {
                let message = format!("{loaded:?}, expected {expected:?}");
                return Err(TestCaseError::fail(message));
            }
        }
        let envs = loaded.unwrap_or_default();
        match (
            dir.load_devices(&envs),
            expected_failure(&devices, &DEVICES_JSON),
        ) {
            (Ok(_), None) => {}
            (Err(e), expected) => {
                prop_assert_eq!(&e.path, &dir.root().join("devices.json"));
                let named = format!("{}: ", e.path.display());
                prop_assert!(e.to_string().starts_with(&named), "{}", e);
                // A file of genv's shape is still refused if two devices share an index.
                let duplicate = expected.is_none() && e.to_string().contains("duplicate entry");
                prop_assert!(duplicate || Some(kind(&e.kind)) == expected, "{}", e);
            }
            (loaded, expected) => {
                let message = format!("{loaded:?}, expected {expected:?}");
                return Err(TestCaseError::fail(message));
            }
        }
        Ok(())
    });
}

#[test]
fn genv_state_files_load_as_written() {
    check(
        (vec(arbitrary::env(), 0..5), arbitrary::devices()),
        |(mut envs, devices)| {
            // Alive: this process activated them all (genv drops the others on load).
            for env in &mut envs {
                env.pids = vec![std::process::id() as i32];
            }
            let scratch = Scratch::new();
            let envs_text = to_python_json(&json!({ "envs": envs })).unwrap();
            let devices_text = to_python_json(&json!({ "devices": devices })).unwrap();
            let dir = scratch.state(envs_text.as_bytes(), devices_text.as_bytes());
            let loaded = dir.load_envs().unwrap();
            prop_assert_eq!(&loaded, &envs);
            // Attachments of environments that are not active are dropped.
            let expected: Vec<Device> = devices
                .into_iter()
                .map(|mut device| {
                    device
                        .attachments
                        .retain(|a| envs.iter().any(|e| e.eid == a.eid));
                    device
                })
                .collect();
            prop_assert_eq!(dir.load_devices(&loaded).unwrap(), Some(expected));
            Ok(())
        },
    );
}

#[test]
fn the_mutator_changes_what_it_says() {
    let document = json!({"envs": [{"eid": "a", "uid": 0, "pids": [1]}]});
    let at = |pointer, mutation| arbitrary::apply(document.clone(), pointer, &mutation);
    assert_eq!(
        at("/envs/0/uid", Mutation::Remove),
        json!({"envs": [{"eid": "a", "pids": [1]}]})
    );
    assert_eq!(
        at("/envs/0", Mutation::Retype),
        json!({"envs": [["a", 0, [1]]]})
    );
    assert_eq!(
        at("/envs/0/pids/0", Mutation::Duplicate),
        json!({"envs": [{"eid": "a", "uid": 0, "pids": [1, 1]}]})
    );
    assert_eq!(
        at("/envs/0/eid", Mutation::Nest(2)),
        json!({"envs": [{"eid": [["a"]], "uid": 0, "pids": [1]}]})
    );
    assert_eq!(
        at("/envs", Mutation::Retype),
        json!({"envs": {"0": {"eid": "a", "uid": 0, "pids": [1]}}})
    );
}
