//! Text from users made safe to put on a terminal: a process name (`comm`, which any
//! program sets with `prctl`), an environment name or id (anyone can write
//! `envs.json`), a user name (from a directory the enforcer does not own).
//!
//! The daemon writes these as root onto terminals: an escape sequence there could move
//! the cursor over earlier lines, retitle the window, set the clipboard (OSC 52), or on
//! old terminals answer back into the shell's input. So:
//! - escape sequences are dropped whole: `ESC [ … final` (CSI), `ESC ] … BEL|ST` (OSC),
//!   `ESC P|X|^|_ … ST` (DCS, SOS, PM, APC), `ESC` and one more character; their 8-bit
//!   forms (U+009B, U+009D, U+0090, U+0098, U+009E, U+009F) likewise;
//! - every other control character (C0, DEL, C1) goes: a tab or a line break becomes a
//!   space, the rest is removed;
//! - characters that reorder or hide text (bidirectional overrides and isolates,
//!   zero-width ones, the byte-order mark) are removed, so a name cannot make the line
//!   read as something else;
//! - bytes that are not UTF-8 become U+FFFD;
//! - the result is at most `max` characters, ending in `…` when cut.

/// The longest a process name, environment or user name is shown.
pub const NAME_CHARS: usize = 48;

/// `bytes` made safe for a terminal and at most `max` characters long.
pub fn clean(bytes: &[u8], max: usize) -> String {
    clean_str(&String::from_utf8_lossy(bytes), max)
}

/// [`clean`] for text already decoded.
pub fn clean_str(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max * 4));
    let mut count = 0;
    let mut state = State::Text;
    for c in text.chars() {
        let (next, keep) = state.step(c);
        state = next;
        let Some(c) = keep else { continue };
        if count == max {
            out.pop();
            out.push('…');
            return out;
        }
        out.push(c);
        count += 1;
    }
    out
}

/// Where the scanner is: in text, or inside a sequence being dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Text,
    /// After ESC: the next character says which sequence.
    Escape,
    /// In a CSI's parameters, up to its final character (0x40–0x7E).
    Csi,
    /// In a string (OSC, DCS, SOS, PM, APC), up to BEL or ST.
    Str,
    /// In a string, after an ESC: a `\` ends it (ST).
    StrEscape,
}

const ESC: char = '\u{1b}';
const BEL: char = '\u{7}';

impl State {
    /// The next state, and the character to keep, if any.
    fn step(self, c: char) -> (State, Option<char>) {
        match self {
            State::Text => match c {
                ESC => (State::Escape, None),
                '\u{9b}' => (State::Csi, None),
                '\u{90}' | '\u{98}' | '\u{9d}' | '\u{9e}' | '\u{9f}' => (State::Str, None),
                _ => (State::Text, shown(c)),
            },
            State::Escape => match c {
                '[' => (State::Csi, None),
                ']' | 'P' | 'X' | '^' | '_' => (State::Str, None),
                ESC => (State::Escape, None),
                _ => (State::Text, None),
            },
            State::Csi => match c {
                '\u{40}'..='\u{7e}' => (State::Text, None),
                ESC => (State::Escape, None),
                // Parameters and intermediates; anything else ends the sequence (a
                // terminal would too) and is judged as text.
                '\u{20}'..='\u{3f}' => (State::Csi, None),
                _ => (State::Text, shown(c)),
            },
            State::Str => match c {
                BEL | '\u{9c}' => (State::Text, None),
                ESC => (State::StrEscape, None),
                _ => (State::Str, None),
            },
            State::StrEscape => match c {
                '\\' => (State::Text, None),
                ESC => (State::StrEscape, None),
                _ => (State::Str, None),
            },
        }
    }
}

/// What a character outside a sequence becomes.
fn shown(c: char) -> Option<char> {
    match c {
        '\t' | '\n' | '\r' | '\u{b}' | '\u{c}' | '\u{85}' | '\u{2028}' | '\u{2029}' => Some(' '),
        _ if c.is_control() || hides_or_reorders(c) => None,
        _ => Some(c),
    }
}

/// Format characters that change how the rest of a line reads.
fn hides_or_reorders(c: char) -> bool {
    matches!(c,
        '\u{200b}'..='\u{200f}' // zero-width space, joiners, LRM, RLM
        | '\u{202a}'..='\u{202e}' // bidirectional embeddings and overrides
        | '\u{2060}'..='\u{2064}' // word joiner, invisible operators
        | '\u{2066}'..='\u{2069}' // bidirectional isolates
        | '\u{061c}' // Arabic letter mark
        | '\u{feff}' // byte-order mark
        | '\u{fff9}'..='\u{fffb}' // interlinear annotations
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing a terminal acts on is left: no C0 or C1 control, no DEL.
    fn inert(text: &str) -> bool {
        !text.chars().any(|c| c.is_control())
    }

    #[test]
    fn plain_names_pass_unchanged() {
        for name in ["python", "train.py", "my-env_2", "Łukasz", "名前"] {
            assert_eq!(clean_str(name, NAME_CHARS), name);
        }
    }

    #[test]
    fn escape_sequences_are_dropped_whole() {
        let cases: [(&[u8], &str); 9] = [
            (b"\x1b[2J\x1b[Hevil", "evil"),            // clear the screen
            (b"a\x1b[1;31mred\x1b[0m", "ared"),        // colours
            (b"\x1b]0;owned\x07title", "title"),       // window title, BEL
            (b"\x1b]52;c;ZXZpbA==\x1b\\clip", "clip"), // OSC 52 clipboard, ST
            (b"\x1bP+q544e\x1b\\dcs", "dcs"),          // DCS request
            (b"\x1b_apc\x1b\\x", "x"),                 // APC
            (b"\xc2\x9b2Jc1", "c1"),                   // 8-bit CSI
            (b"\xc2\x9d0;t\xc2\x9cosc", "osc"),        // 8-bit OSC, 8-bit ST
            (b"\x1bcreset", "reset"),                  // ESC c (RIS)
        ];
        for (hostile, expected) in cases {
            let shown = clean(hostile, NAME_CHARS);
            assert_eq!(shown, expected, "{hostile:?}");
            assert!(inert(&shown));
        }
    }

    #[test]
    fn line_breaks_and_tabs_become_spaces_and_other_controls_go() {
        assert_eq!(
            clean(b"x\ngenv-enforcer: all fine\r\tok", 80),
            "x genv-enforcer: all fine  ok"
        );
        assert_eq!(clean(b"a\x00b\x07c\x08d\x7fe", 80), "abcde");
        assert_eq!(clean("a\u{85}b\u{2028}c".as_bytes(), 80), "a b c");
    }

    #[test]
    fn text_that_reorders_or_hides_is_removed() {
        // "evil\u{202e}txt.exe" reads as "evilexe.txt" on a terminal that honours it.
        assert_eq!(clean_str("evil\u{202e}txt.exe", 80), "eviltxt.exe");
        assert_eq!(clean_str("a\u{200b}b\u{2066}c\u{feff}", 80), "abc");
    }

    #[test]
    fn invalid_utf8_is_replaced_and_length_is_bounded() {
        assert_eq!(clean(b"a\xffb", 80), "a\u{fffd}b");
        let long = "x".repeat(1000);
        let shown = clean_str(&long, 10);
        assert_eq!(shown.chars().count(), 10);
        assert!(shown.ends_with('…'));
        assert_eq!(clean_str("exactly10!", 10), "exactly10!");
    }

    /// An unterminated sequence swallows the rest rather than letting it through.
    #[test]
    fn an_unterminated_sequence_hides_the_rest() {
        assert_eq!(clean(b"ok\x1b]0;never ends", 80), "ok");
        assert_eq!(clean(b"ok\x1b[", 80), "ok");
    }

    #[test]
    fn any_bytes_come_out_inert_and_bounded() {
        // Every pair of bytes after every interesting prefix.
        let prefixes: [&[u8]; 5] = [b"", b"\x1b", b"\x1b[", b"\x1b]", b"\xc2"];
        for prefix in prefixes {
            for a in 0..=255u8 {
                for b in [0u8, 7, 0x1b, b'[', b'\\', 0x9b, 0xc2, b'a'] {
                    let bytes = [prefix, &[a, b, b'z']].concat();
                    let shown = clean(&bytes, 4);
                    assert!(inert(&shown), "{bytes:?} → {shown:?}");
                    assert!(shown.chars().count() <= 4);
                }
            }
        }
    }
}
