//! genv's lines as they reach a terminal: byte for byte genv's, except where a field a
//! user wrote (an environment id or name, a user name in `envs.json`, a host's line the
//! admin side reprints) carries something a terminal would act on or not show.
//!
//! genv prints such fields raw, so an environment id of `ESC ] 0 ; … BEL ESC [ 2 J`
//! retitles and clears the terminal of the root who runs `enforce`, or moves the cursor
//! over its own "Terminating" line. Here a line is cut at its spaces into words, and a
//! word holding such a character is written as the shell's ANSI-C quoting writes it
//! (`$'…'`, as GNU `ls` shows such file names): `\e`, `\a`, `\n`, `\t`, `\r`, `\xHH`
//! for other bytes below 0x80, `\uHHHH` / `\UHHHHHHHH` above, `\\` and `\'` for the
//! quoting's own characters. `printf '%s' $'…'` in bash gives the word's bytes back.
//! A line without such a character is genv's, unchanged.
//!
//! Escaped: every control character (C0, DEL, C1); characters that show nothing or
//! change how the rest reads (format characters, bidirectional controls, tags,
//! variation selectors, blank fillers, spaces other than U+0020); and characters whose
//! UTF-8 bytes include one in 0x80–0x9F, which a terminal not in UTF-8 mode (the Linux
//! console with UTF-8 off, xterm in a Latin-1 locale) takes as a C1 control: `Û` is
//! `c3 9b`, and 0x9B is CSI there.

use std::borrow::Cow;
use std::fmt::Write;

/// `line` as it may go to a terminal.
pub fn escaped(line: &str) -> Cow<'_, str> {
    if !line.chars().any(unsafe_on_a_terminal) {
        return Cow::Borrowed(line);
    }
    let words: Vec<Cow<'_, str>> = line.split(' ').map(word).collect();
    Cow::Owned(words.join(" "))
}

/// Prints `line` on stdout, escaped.
pub fn print(line: &str) {
    println!("{}", escaped(line));
}

/// Prints `line` on stderr, escaped.
pub fn eprint(line: &str) {
    eprintln!("{}", escaped(line));
}

/// One word: itself, or its `$'…'` form.
fn word(w: &str) -> Cow<'_, str> {
    if !w.chars().any(unsafe_on_a_terminal) {
        return Cow::Borrowed(w);
    }
    let mut out = String::with_capacity(w.len() * 2 + 3);
    out.push_str("$'");
    for c in w.chars() {
        match c {
            '\u{1b}' => out.push_str("\\e"),
            '\u{7}' => out.push_str("\\a"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            c if (c as u32) < 0x80 && unsafe_on_a_terminal(c) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if unsafe_on_a_terminal(c) && (c as u32) <= 0xffff => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if unsafe_on_a_terminal(c) => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('\'');
    Cow::Owned(out)
}

/// A character a terminal would act on, not show, or (not in UTF-8 mode) read as a
/// C1 control.
pub fn unsafe_on_a_terminal(c: char) -> bool {
    c.is_control() || invisible(c) || (c.is_whitespace() && c != ' ') || has_c1_byte(c)
}

/// Its UTF-8 form holds a byte in 0x80–0x9F (a continuation byte whose low six bits
/// are below 0x20).
fn has_c1_byte(c: char) -> bool {
    let mut buf = [0; 4];
    c.encode_utf8(&mut buf)
        .bytes()
        .any(|b| (0x80..=0x9f).contains(&b))
}

/// Characters that show nothing, or change how what follows reads.
fn invisible(c: char) -> bool {
    matches!(c,
        '\u{ad}' // soft hyphen
        | '\u{34f}' // combining grapheme joiner
        | '\u{61c}' // Arabic letter mark
        | '\u{115f}' | '\u{1160}' | '\u{3164}' | '\u{ffa0}' // Hangul fillers
        | '\u{17b4}' | '\u{17b5}' // Khmer inherent vowels
        | '\u{180b}'..='\u{180f}' // Mongolian variation selectors, vowel separator
        | '\u{200b}'..='\u{200f}' // zero-width space, joiners, LRM, RLM
        | '\u{2028}'..='\u{202e}' // separators, bidirectional embeddings, overrides
        | '\u{2060}'..='\u{206f}' // word joiner, invisible operators, isolates
        | '\u{2800}' // braille blank
        | '\u{fe00}'..='\u{fe0f}' // variation selectors
        | '\u{feff}' // byte-order mark
        | '\u{fff0}'..='\u{fffb}' // specials, interlinear annotations
        | '\u{1d173}'..='\u{1d17a}' // musical formatting
        | '\u{e0000}'..='\u{e0fff}' // tags, variation selectors supplement
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What bash's `$'…'` gives back for one escaped word.
    fn unescape(word: &str) -> String {
        let Some(body) = word.strip_prefix("$'").and_then(|w| w.strip_suffix('\'')) else {
            return word.to_owned();
        };
        let mut out = String::new();
        let mut chars = body.chars();
        while let Some(c) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            let hex = |chars: &mut std::str::Chars<'_>, n| {
                let digits: String = chars.take(n).collect();
                char::from_u32(u32::from_str_radix(&digits, 16).unwrap()).unwrap()
            };
            match chars.next().unwrap() {
                'e' => out.push('\u{1b}'),
                'a' => out.push('\u{7}'),
                'n' => out.push('\n'),
                't' => out.push('\t'),
                'r' => out.push('\r'),
                'x' => out.push(hex(&mut chars, 2)),
                'u' => out.push(hex(&mut chars, 4)),
                'U' => out.push(hex(&mut chars, 8)),
                other => out.push(other),
            }
        }
        out
    }

    fn reversed(line: &str) -> String {
        line.split(' ').map(unescape).collect::<Vec<_>>().join(" ")
    }

    #[test]
    fn genvs_lines_pass_byte_for_byte() {
        for line in [
            "Terminating process 42 from environment 1234 that is running on GPU(s) 0,1",
            "Detaching environment my-env_2 of user alice from device 3",
            "[host-a] Process 7 from environment it's\\odd é that is using non-attached GPU(s) 1",
        ] {
            assert!(matches!(escaped(line), Cow::Borrowed(l) if l == line));
        }
    }

    #[test]
    fn controls_are_escaped_and_the_line_reverses() {
        let id = "\u{1b}]0;pwned\u{7}\u{1b}[2J\u{1b}[H x\u{1b}]52;c;ZXZpbA==\u{1b}\\ y\u{1b}[1A";
        let line = format!("Terminating process 42 from environment {id} that is running");
        let shown = escaped(&line);
        assert!(
            shown.is_ascii() && !shown.chars().any(|c| c.is_control()),
            "{shown}"
        );
        assert_eq!(
            shown,
            "Terminating process 42 from environment $'\\e]0;pwned\\a\\e[2J\\e[H' $'x\\e]52;c;ZXZpbA==\\e\\\\' $'y\\e[1A' that is running"
        );
        assert_eq!(reversed(&shown), line);
    }

    #[test]
    fn invisible_and_8_bit_unsafe_characters_are_escaped() {
        for c in [
            '\u{ad}',
            '\u{2800}',
            '\u{e0041}',
            '\u{202e}',
            '\u{a0}',
            'Û',
            'Ł',
            '\u{9b}',
        ] {
            let line = format!("environment a{c}b of user bob");
            let shown = escaped(&line);
            assert!(shown.is_ascii(), "{c:?}: {shown}");
            assert!(!shown.bytes().any(|b| (0x80..=0x9f).contains(&b)));
            assert_eq!(reversed(&shown), line, "{c:?}");
        }
        assert_eq!(escaped("a Û"), "a $'\\u00db'");
        assert_eq!(escaped("tag\u{e0041}"), "$'tag\\U000e0041'");
    }

    #[test]
    fn escaping_twice_changes_nothing() {
        let once = escaped("x \u{1b}[2J'\\ y").into_owned();
        assert_eq!(escaped(&once), once);
    }
}
