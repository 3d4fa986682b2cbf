//! Text from users made safe to put on any terminal: a process name (`comm`, which any
//! program sets with `prctl`), an environment name or id (anyone can write
//! `envs.json`), a user name (from a directory the enforcer does not own).
//!
//! The daemon writes these as root onto terminals: an escape sequence there could move
//! the cursor over earlier lines, retitle the window, set the clipboard (OSC 52), or on
//! old terminals answer back into the shell's input. Stripping controls as characters
//! is not enough: `Û` is `c3 9b` in UTF-8, and 0x9B is CSI to a terminal not in UTF-8
//! mode (the Linux console with UTF-8 off, xterm in a Latin-1 locale); and invisible or
//! look-alike characters make a line read as something else. So what is kept is
//! printable ASCII only (but `"` and `\`, since a name is shown between double quotes),
//! and everything else is written as `\u{…}` (its code point in hex; a byte that is not
//! UTF-8 as `\x{…}`): `python\u{1b}[2J`, `caf\u{e9}`, `\u{22}`.
//! The result is at most `max` characters, ending in `...` when cut, and never cut
//! inside an escape.

use std::fmt::Write;

/// The longest a process name, environment or user name is shown.
pub const NAME_CHARS: usize = 48;

/// `bytes` made safe for any terminal and at most `max` characters long.
pub fn clean(bytes: &[u8], max: usize) -> String {
    cleaned(bytes, max, false)
}

/// A whole line the daemon wrote (its names already [`clean`]ed), made safe again where
/// it is shown (`why`'s client): printable ASCII, quotes and backslashes kept.
pub fn clean_line(text: &str, max: usize) -> String {
    cleaned(text.as_bytes(), max, true)
}

fn cleaned(bytes: &[u8], max: usize, keep_quotes: bool) -> String {
    let mut out = Bounded::new(max, keep_quotes);
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if !out.push_char(c) {
                return out.cut();
            }
        }
        for b in chunk.invalid() {
            if !out.push(&format!("\\x{{{b:02x}}}")) {
                return out.cut();
            }
        }
    }
    out.text
}

/// [`clean`] for text already decoded.
pub fn clean_str(text: &str, max: usize) -> String {
    clean(text.as_bytes(), max)
}

/// The text so far, and the longest prefix of it that leaves room for `...`.
struct Bounded {
    text: String,
    max: usize,
    /// A line's own quotes are kept; a name's are escaped.
    keep_quotes: bool,
    /// Where the text is cut if it overflows: a boundary between pieces.
    fits_with_dots: usize,
}

impl Bounded {
    fn new(max: usize, keep_quotes: bool) -> Self {
        Bounded {
            text: String::new(),
            max,
            keep_quotes,
            fits_with_dots: 0,
        }
    }

    fn push_char(&mut self, c: char) -> bool {
        // `"` and `\` too are escaped: a name sits between double quotes in the line,
        // and must not close them, nor pass for one of its own escapes.
        let quote = c == '"' || c == '\\';
        if c == ' ' || (c.is_ascii_graphic() && (!quote || self.keep_quotes)) {
            let mut buf = [0; 4];
            self.push(c.encode_utf8(&mut buf))
        } else {
            let mut piece = String::new();
            let _ = write!(piece, "\\u{{{:x}}}", c as u32);
            self.push(&piece)
        }
    }

    /// Adds a piece whole; false once the text would pass `max`.
    fn push(&mut self, piece: &str) -> bool {
        if self.text.len() + piece.len() > self.max {
            return false;
        }
        self.text.push_str(piece);
        if self.text.len() + 3 <= self.max {
            self.fits_with_dots = self.text.len();
        }
        true
    }

    /// The text cut where `...` fits after it.
    fn cut(mut self) -> String {
        self.text.truncate(self.fits_with_dots);
        self.text.push_str(&"..."[..3.min(self.max)]);
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What any terminal shows as written: printable ASCII, nothing else.
    fn inert(text: &str) -> bool {
        text.bytes().all(|b| (0x20..0x7f).contains(&b))
    }

    #[test]
    fn plain_names_pass_unchanged() {
        for name in ["python", "train.py", "my-env_2", "a b", "it's (x)"] {
            assert_eq!(clean_str(name, NAME_CHARS), name);
        }
        // Not the quotes a name is shown in, nor what its escapes are made of.
        assert_eq!(
            clean_str("x\" is fine. Run 'y' \\u{1b}", NAME_CHARS),
            "x\\u{22} is fine. Run 'y' \\u{5c}u{1b}"
        );
    }

    #[test]
    fn everything_else_is_escaped_by_code_point() {
        let cases: [(&[u8], &str); 8] = [
            (b"\x1b[2J\x1b[Hevil", "\\u{1b}[2J\\u{1b}[Hevil"),
            (b"\x1b]0;owned\x07t", "\\u{1b}]0;owned\\u{7}t"),
            (b"\xc2\x9b2J", "\\u{9b}2J"),
            ("\u{db}".as_bytes(), "\\u{db}"), // c3 9b: CSI to an 8-bit terminal
            ("caf\u{e9}".as_bytes(), "caf\\u{e9}"),
            (
                "a\u{ad}b\u{2800}c\u{e0041}".as_bytes(),
                "a\\u{ad}b\\u{2800}c\\u{e0041}",
            ),
            ("evil\u{202e}txt".as_bytes(), "evil\\u{202e}txt"),
            (b"a\xffb\n", "a\\x{ff}b\\u{a}"),
        ];
        for (hostile, expected) in cases {
            let shown = clean(hostile, 80);
            assert_eq!(shown, expected, "{hostile:?}");
            assert!(inert(&shown));
        }
    }

    #[test]
    fn length_is_bounded_and_never_cuts_an_escape() {
        let long = "x".repeat(1000);
        let shown = clean_str(&long, 10);
        assert_eq!(shown, "xxxxxxx...");
        assert_eq!(clean_str("exactly10!", 10), "exactly10!");
        let shown = clean_str("ab\u{1b}\u{1b}\u{1b}", 12);
        assert_eq!(shown, "ab\\u{1b}...");
    }

    #[test]
    fn any_bytes_come_out_inert_and_bounded() {
        let prefixes: [&[u8]; 4] = [b"", b"\x1b", b"\xc2", b"\xe2\x80"];
        for prefix in prefixes {
            for a in 0..=255u8 {
                for b in [0u8, 7, 0x1b, b'[', b'\\', 0x9b, 0xc2, b'a'] {
                    let bytes = [prefix, &[a, b, b'z']].concat();
                    for max in [4, 12, 48] {
                        let shown = clean(&bytes, max);
                        assert!(inert(&shown), "{bytes:?} -> {shown:?}");
                        assert!(shown.len() <= max, "{bytes:?} -> {shown:?}");
                    }
                }
            }
        }
    }
}
