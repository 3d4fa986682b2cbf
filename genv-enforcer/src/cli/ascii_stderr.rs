//! stderr for `--log-format json`: every character past printable ASCII written as JSON's
//! `\uXXXX`, as Python's `json.dumps` does by default (`ensure_ascii`).
//!
//! The JSON formatter escapes C0 controls only, so a name a user wrote (an environment id
//! in a message) would reach a terminal reading the log with DEL, C1 controls or bytes an
//! 8-bit terminal takes as C1 (`Û` is `c3 9b`; 0x9B is CSI there). Outside JSON strings
//! the text is ASCII already, so escaping every other character keeps the document as it
//! was, to any JSON reader.

use std::fmt::Write as _;
use std::io::{self, Write};

/// Writes each event's text to stderr, ASCII only.
pub struct AsciiStderr;

impl Write for AsciiStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        io::stderr().lock().write_all(ascii(buf).as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

/// `buf` with every character past `~` as `\uXXXX` (UTF-16 units, as JSON spells them).
pub fn ascii(buf: &[u8]) -> String {
    let text = String::from_utf8_lossy(buf);
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if (c as u32) < 0x7f {
            out.push(c);
            continue;
        }
        let mut units = [0u16; 2];
        for unit in c.encode_utf16(&mut units) {
            let _ = write!(out, "\\u{unit:04x}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_ascii_is_escaped_as_json_spells_it_and_reads_back() {
        let message = "environment \u{1b}x\u{7f}\u{9b}\u{db}\u{1f600} gone";
        let line = serde_json::json!({"fields": {"message": message}}).to_string();
        let shown = ascii(line.as_bytes());
        assert!(shown.bytes().all(|b| b < 0x7f), "{shown}");
        assert!(
            shown.contains("\\u007f\\u009b\\u00db\\ud83d\\ude00"),
            "{shown}"
        );
        let back: serde_json::Value = serde_json::from_str(&shown).unwrap();
        assert_eq!(back["fields"]["message"], message);
    }
}
