//! JSON text exactly as Python's `json.dump(o, f, indent=2)` writes it, which is how genv
//! writes its state files and its `usage snapshot` output.
//!
//! serde_json's pretty printer already matches Python's layout (`"key": value`, `[]` and
//! `{}` for empty containers, no trailing newline); the one difference is that Python
//! escapes every character outside printable ASCII (`ensure_ascii=True`: non-ASCII, and
//! DEL, U+007F), which this formatter adds.

use std::io::{self, Write};

use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter};

struct PythonFormatter<'a>(PrettyFormatter<'a>);

macro_rules! delegate {
    ($($name:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {
        $(fn $name<W: ?Sized + Write>(&mut self, writer: &mut W $(, $arg: $ty)*) -> io::Result<()> {
            self.0.$name(writer $(, $arg)*)
        })*
    };
}

impl Formatter for PythonFormatter<'_> {
    delegate!(
        begin_array(),
        end_array(),
        begin_array_value(first: bool),
        end_array_value(),
        begin_object(),
        end_object(),
        begin_object_key(first: bool),
        begin_object_value(),
        end_object_value(),
    );

    fn write_string_fragment<W: ?Sized + Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        for c in fragment.chars() {
            // serde_json escapes the control characters below the space itself.
            if c.is_ascii() && c != '\x7f' {
                writer.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(writer, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

/// Serializes `value` as genv would write it.
pub fn to_python_json<T: Serialize>(value: &T) -> serde_json::Result<String> {
    let mut out = Vec::new();
    let mut serializer = serde_json::Serializer::with_formatter(
        &mut out,
        PythonFormatter(PrettyFormatter::with_indent(b"  ")),
    );
    value.serialize(&mut serializer)?;
    Ok(String::from_utf8(out).expect("the formatter writes ASCII only"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn matches_python_json_dump_indent_2() {
        let value = json!({"devices": [{"index": 0, "total_memory": "16384mi", "attachments": []},
            {"index": 1, "x": {}, "u": "J\u{fc}rgen \u{1f600}", "n": null, "b": true}]});
        // python3 -c 'import json,sys; json.dump(v, sys.stdout, indent=2)' on the same value
        let expected = "{\n  \"devices\": [\n    {\n      \"index\": 0,\n      \"total_memory\": \"16384mi\",\n      \"attachments\": []\n    },\n    {\n      \"index\": 1,\n      \"x\": {},\n      \"u\": \"J\\u00fcrgen \\ud83d\\ude00\",\n      \"n\": null,\n      \"b\": true\n    }\n  ]\n}";
        assert_eq!(to_python_json(&value).unwrap(), expected);
    }

    /// Found by `fuzz_tests::json_text_is_pythons_json_dump_with_indent_2`: DEL is
    /// ASCII, but Python's `ensure_ascii` escapes it (its raw range is `' '..='~'`).
    #[test]
    fn escapes_delete_as_python_does() {
        // python3 -c 'import json; print(json.dumps({"a": "x\x7fy"}, indent=2))'
        let text = to_python_json(&json!({"a": "x\u{7f}y~"})).unwrap();
        assert_eq!(text, "{\n  \"a\": \"x\\u007fy~\"\n}");
    }
}
