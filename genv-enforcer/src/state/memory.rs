//! genv's memory strings: `"2g"`, `"16384mi"`, `"1048576"`.

use std::fmt;

/// Units in the order genv tries them (`genv.utils.MEMORY_TO_BYTES_MULTIPLIERS_DICT`).
/// The order matters: a suffix is matched with `str.endswith`, first match wins.
const UNITS: [(&str, u64); 7] = [
    ("b", 1),
    ("k", 1000),
    ("m", 1000 * 1000),
    ("g", 1000 * 1000 * 1000),
    ("ki", 1024),
    ("mi", 1024 * 1024),
    ("gi", 1024 * 1024 * 1024),
];

/// Python's `int()` refuses a string of more digits than this (since 3.11, against
/// quadratic-time parsing), so genv fails on such an amount, whatever its value (a
/// thousand zeros are still 0): refused here too, rather than read as a cap of 0.
const PYTHON_INT_MAX_DIGITS: usize = 4300;

/// A memory amount as genv writes it: the original text is kept, because genv prints
/// capacities back verbatim (`... over its capacity of 2g`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemorySpec {
    text: String,
    bytes: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "not a memory amount: {text:?} (expected digits with an optional unit b, k, m, g, ki, mi or gi)"
)]
pub struct MemorySpecError {
    text: String,
}

impl MemorySpec {
    pub fn parse(text: &str) -> Result<Self, MemorySpecError> {
        let error = || MemorySpecError {
            text: text.to_owned(),
        };
        let (digits, multiplier) = UNITS
            .iter()
            .find_map(|(unit, multiplier)| text.strip_suffix(unit).map(|d| (d, *multiplier)))
            .unwrap_or((text, 1));
        if digits.is_empty()
            || digits.len() > PYTHON_INT_MAX_DIGITS
            || !digits.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(error());
        }
        let bytes = digits
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(multiplier))
            .ok_or_else(error)?;
        Ok(Self {
            text: text.to_owned(),
            bytes,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl fmt::Display for MemorySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Formats bytes as genv's output does: whole `m` (10^6) units, floored (`3145m`).
pub fn format_megabytes(bytes: u64) -> String {
    format!("{}m", bytes / 1_000_000)
}

/// Formats bytes as `nvidia-smi` reports them to genv: whole MiB, floored (`42mi`).
pub fn format_mebibytes(bytes: u64) -> String {
    format!("{}mi", bytes / (1024 * 1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_like_genv() {
        for (text, bytes) in [
            ("0", 0),
            ("1048576", 1 << 20),
            ("7b", 7),
            ("3k", 3000),
            ("2m", 2_000_000),
            ("2g", 2_000_000_000),
            ("3ki", 3072),
            ("16384mi", 16384 << 20),
            ("1gi", 1 << 30),
        ] {
            assert_eq!(MemorySpec::parse(text).unwrap().bytes(), bytes, "{text}");
        }
    }

    #[test]
    fn rejects_what_is_not_a_memory_amount() {
        for text in [
            "",
            "g",
            "2x",
            "-1g",
            "1.5g",
            " 2g",
            "2 g",
            "99999999999999999999g",
        ] {
            assert!(MemorySpec::parse(text).is_err(), "{text:?}");
        }
    }

    #[test]
    fn digits_past_pythons_int_limit_are_refused_as_genv_fails_on_them() {
        let zeros = |n: usize| "0".repeat(n);
        assert_eq!(
            MemorySpec::parse(&format!("{}g", zeros(4300)))
                .unwrap()
                .bytes(),
            0
        );
        assert!(MemorySpec::parse(&format!("{}g", zeros(4301))).is_err());
        assert!(MemorySpec::parse(&zeros(5000)).is_err());
    }

    #[test]
    fn keeps_the_text_for_messages() {
        assert_eq!(MemorySpec::parse("2g").unwrap().to_string(), "2g");
    }

    #[test]
    fn formats_like_genv() {
        assert_eq!(format_megabytes(3_145_728_000), "3145m");
        assert_eq!(format_megabytes(999_999), "0m");
        assert_eq!(format_mebibytes(42 << 20), "42mi");
    }
}
