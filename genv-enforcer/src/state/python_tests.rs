//! genv's own Python against ours, over many generated inputs (how they run: `arbitrary`):
//! memory amounts read as genv reads them, and the JSON text written as genv writes it.

use proptest::prelude::*;
use serde_json::{Value, json};

use super::fuzz_tests::genv_document;
use super::test_support::arbitrary;
use super::to_python_json;

/// genv 1.4.3's `genv.utils.memory_to_bytes`, verbatim, over JSON strings one a line.
const GENV_MEMORY_TO_BYTES: &str = r#"import json, sys
MEMORY_TO_BYTES_MULTIPLIERS_DICT = {"b": 1, "k": 1000, "m": 1000 * 1000, "g": 1000 * 1000 * 1000, "ki": 1024, "mi": 1024 * 1024, "gi": 1024 * 1024 * 1024}
def memory_to_bytes(cap):
    for unit, multiplier in MEMORY_TO_BYTES_MULTIPLIERS_DICT.items():
        if cap.endswith(unit):
            return int(cap.replace(unit, "")) * multiplier
    return int(cap)
for line in sys.stdin.buffer.read().decode().split('\n'):
    try:
        print(memory_to_bytes(json.loads(line)))
    except ValueError:
        print("error")
"#;

/// Digits and a unit as genv documents them: what any genv must read.
fn is_canonical_memory(text: &str) -> bool {
    let digits = ["ki", "mi", "gi", "b", "k", "m", "g"]
        .iter()
        .find_map(|unit| text.strip_suffix(unit))
        .unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// Where both read an amount they agree on it; ours refuses only what genv reads by
/// accident of Python's `int` (signs, spaces, `_`, non-ASCII digits, units repeated
/// inside: `" 2g"`, `"-1g"`, `"1g1g"`), or past `u64`.
#[test]
fn memory_amounts_read_as_genv_reads_them() {
    let amount = prop_oneof![
        arbitrary::memory().prop_map(|m| m.as_str().to_owned()),
        "[0-9bkmgi +_.-]{0,8}",
        "[0-9\u{0661}\u{ff11}]{1,3}[bkmgi]{0,3}",
        arbitrary::number_like(),
        arbitrary::text(),
    ];
    let amounts = arbitrary::sample(amount, 2000);
    let lines: Vec<String> = amounts.iter().map(|a| json!(a).to_string()).collect();
    let genv = arbitrary::python(GENV_MEMORY_TO_BYTES, &lines.join("\n"));
    let genv: Vec<Option<i128>> = genv.lines().map(|l| l.parse().ok()).collect();
    assert_eq!(genv.len(), amounts.len());
    for (amount, genv) in amounts.iter().zip(genv) {
        let ours = super::MemorySpec::parse(amount).map(|m| i128::from(m.bytes()));
        match (ours, genv) {
            (Ok(ours), genv) => assert_eq!(Some(ours), genv, "{amount:?}"),
            (Err(_), Some(bytes)) if u64::try_from(bytes).is_ok() => {
                assert!(!is_canonical_memory(amount), "genv reads {amount:?}")
            }
            (Err(_), _) => {}
        }
    }
}

/// Floats replaced: genv writes none, and Python prints them its own way (`1e+300`).
fn without_floats(value: Value) -> Value {
    match value {
        Value::Number(n) if n.is_f64() => Value::Null,
        Value::Array(items) => items.into_iter().map(without_floats).collect(),
        Value::Object(fields) => Value::Object(
            fields
                .into_iter()
                .map(|(k, v)| (k, without_floats(v)))
                .collect(),
        ),
        value => value,
    }
}

#[test]
fn json_text_is_pythons_json_dump_with_indent_2() {
    let values: Vec<Value> =
        arbitrary::sample(prop_oneof![arbitrary::json_value(), genv_document()], 300)
            .into_iter()
            .map(without_floats)
            .collect();
    let lines: Vec<String> = values.iter().map(Value::to_string).collect();
    let script = "import json, sys\nfor line in sys.stdin.buffer.read().decode().split('\\n'):\n    print(json.dumps(json.dumps(json.loads(line), indent=2)))\n";
    let python = arbitrary::python(script, &lines.join("\n"));
    let python: Vec<String> = python
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(python.len(), values.len());
    for (value, python) in values.iter().zip(python) {
        assert_eq!(to_python_json(value).unwrap(), python, "{value}");
    }
}
