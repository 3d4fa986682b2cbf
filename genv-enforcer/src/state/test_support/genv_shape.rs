//! The property tests' oracle: genv's documents written down as data, independently of
//! the parsers, and a check that lists every place a document departs from them, in the
//! parsers' path notation (`envs[0].config.gpu_memory`, `devices["1"].eids["7"]`).
//!
//! A field the parsers default (everything genv always writes except the identities)
//! may be absent; an unknown field is ignored; an `Option` takes `null`. A record must
//! be an object: genv's reader never builds one from a list.

use proptest::prelude::*;
use serde_json::Value;

use crate::state::memory::MemorySpec;
use crate::state::model::ShapeError;

#[derive(Clone, Copy, Debug)]
pub(crate) enum Shape {
    Text,
    U32,
    I32,
    /// A string genv's `memory_to_bytes` reads, within `u64`.
    Memory,
    /// The shape, or `null`.
    Nullable(&'static Shape),
    List(&'static Shape),
    Record(&'static [Field]),
    /// A state file's document: `{key: [current]}`, or `{key: legacy}`.
    Document {
        key: &'static str,
        current: &'static Shape,
        legacy: &'static Shape,
    },
    /// An object whose values all have the shape, keyed by anything or by a device index.
    Keyed {
        item: &'static Shape,
        by_index: bool,
    },
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Field {
    name: &'static str,
    required: bool,
    shape: Shape,
}

pub(crate) const fn required(name: &'static str, shape: Shape) -> Field {
    Field {
        name,
        required: true,
        shape,
    }
}

pub(crate) const fn optional(name: &'static str, shape: Shape) -> Field {
    Field {
        name,
        required: false,
        shape,
    }
}

const OPTIONAL_TEXT: Shape = Shape::Nullable(&Shape::Text);

pub(crate) const ENV: Shape = Shape::Record(&[
    required("eid", Shape::Text),
    required("uid", Shape::U32),
    optional("creation", OPTIONAL_TEXT),
    optional("username", OPTIONAL_TEXT),
    optional(
        "config",
        Shape::Record(&[
            optional("name", OPTIONAL_TEXT),
            optional("gpu_memory", Shape::Nullable(&Shape::Memory)),
            optional("gpus", Shape::Nullable(&Shape::U32)),
        ]),
    ),
    optional("pids", Shape::List(&Shape::I32)),
    optional("kernel_ids", Shape::List(&Shape::Text)),
]);

pub(crate) const ENVS_JSON: Shape = Shape::Document {
    key: "envs",
    current: &ENV,
    legacy: &Shape::Keyed {
        item: &ENV,
        by_index: false,
    },
};

const ATTACHMENT: Shape = Shape::Record(&[
    required("eid", Shape::Text),
    optional("gpu_memory", OPTIONAL_TEXT),
    required("time", Shape::Text),
]);

pub(crate) const DEVICES_JSON: Shape = Shape::Document {
    key: "devices",
    current: &Shape::Record(&[
        required("index", Shape::U32),
        required("total_memory", Shape::Text),
        optional("attachments", Shape::List(&ATTACHMENT)),
    ]),
    legacy: &Shape::Keyed {
        item: &Shape::Record(&[
            required("total_memory", Shape::Text),
            optional(
                "eids",
                Shape::Keyed {
                    item: &Shape::Record(&[
                        required("eid", Shape::Text),
                        optional("gpu_memory", OPTIONAL_TEXT),
                        required("attached", Shape::Text),
                    ]),
                    by_index: false,
                },
            ),
        ]),
        by_index: true,
    },
};

/// A process of `genv usage snapshot` and of a report.
pub(crate) const PROCESS: Shape = Shape::Record(&[
    required("pid", Shape::U32),
    required(
        "used_gpu_memory",
        Shape::List(&Shape::Record(&[
            required("index", Shape::U32),
            required("gpu_memory", Shape::Memory),
        ])),
    ),
    optional("eid", OPTIONAL_TEXT),
]);

/// `genv usage snapshot`'s whole output.
pub(crate) const SNAPSHOT: Shape = Shape::Record(&[
    required(
        "processes",
        Shape::Record(&[required("processes", Shape::List(&PROCESS))]),
    ),
    required("envs", ENVS_JSON),
    required("devices", DEVICES_JSON),
]);

/// What `genv usage execute` reads: the processes to terminate, and by device index
/// the environments to detach (an `envs.json`-shaped document each).
pub(crate) const REPORT: Shape = Shape::Record(&[
    required(
        "terminate",
        Shape::Record(&[required("processes", Shape::List(&PROCESS))]),
    ),
    required(
        "detach",
        Shape::Keyed {
            item: &ENVS_JSON,
            by_index: true,
        },
    ),
]);

/// Where `value` departs from `shape`: each place in the parsers' notation, `$` for
/// the document itself.
pub(crate) fn departures(shape: &Shape, value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    walk(shape, value, "", &mut out);
    out
}

fn at(path: &str) -> String {
    if path.is_empty() { "$" } else { path }.to_owned()
}

fn join(path: &str, name: &str) -> String {
    if path.is_empty() {
        name.to_owned()
    } else {
        format!("{path}.{name}")
    }
}

fn walk(shape: &Shape, value: &Value, path: &str, out: &mut Vec<String>) {
    let fits = match (shape, value) {
        (Shape::Text, Value::String(_)) => true,
        (Shape::U32, value) => value.as_u64().is_some_and(|n| u32::try_from(n).is_ok()),
        (Shape::I32, value) => value.as_i64().is_some_and(|n| i32::try_from(n).is_ok()),
        (Shape::Memory, Value::String(text)) => MemorySpec::parse(text).is_ok(),
        (Shape::Nullable(_), Value::Null) => true,
        (Shape::Nullable(inner), value) => return walk(inner, value, path, out),
        (Shape::List(item), Value::Array(items)) => {
            for (i, value) in items.iter().enumerate() {
                walk(item, value, &format!("{path}[{i}]"), out);
            }
            true
        }
        (Shape::Record(fields), Value::Object(_)) => {
            for field in *fields {
                match value.get(field.name) {
                    Some(v) => walk(&field.shape, v, &join(path, field.name), out),
                    None if field.required => out.push(at(path)),
                    None => {}
                }
            }
            true
        }
        (Shape::Keyed { item, by_index }, Value::Object(entries)) => {
            for (key, value) in entries {
                let entry = format!("{path}[{key:?}]");
                if *by_index && key.parse::<u32>().is_err() {
                    out.push(entry);
                } else {
                    walk(item, value, &entry, out);
                }
            }
            true
        }
        (Shape::Document { .. }, value) => return document(shape, value, path, out),
        _ => false,
    };
    if !fits {
        out.push(at(path));
    }
}

fn document(shape: &Shape, value: &Value, path: &str, out: &mut Vec<String>) {
    let Shape::Document {
        key,
        current,
        legacy,
    } = shape
    else {
        unreachable!("only documents")
    };
    let inner = join(path, key);
    match value.get(key) {
        _ if !value.is_object() => out.push(at(path)),
        None => out.push(at(path)),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                walk(current, item, &format!("{inner}[{i}]"), out);
            }
        }
        Some(entries @ Value::Object(_)) => walk(legacy, entries, &inner, out),
        Some(_) => out.push(inner),
    }
}

/// The parser agrees with the oracle: `parsed` is Ok exactly where `document` has
/// `shape`, and otherwise an error at one of the places where it departs from it.
pub(crate) fn agrees<T>(
    shape: &Shape,
    document: &Value,
    parsed: &Result<T, ShapeError>,
) -> Result<(), TestCaseError> {
    let departures = departures(shape, document);
    match parsed {
        Ok(_) => prop_assert!(
            departures.is_empty(),
            "accepted, but genv's shape differs at {departures:?}: {document}"
        ),
        Err(e) => {
            prop_assert!(
                !departures.is_empty(),
                "refused a document of genv's shape ({e}): {document}"
            );
            prop_assert!(
                departures.contains(&e.path),
                "error at {:?}, but the document departs at {departures:?} ({e}): {document}",
                e.path
            );
        }
    }
    Ok(())
}
