//! One line of the doctor's report: an item, what was found, and the fix.

use serde::Serialize;

/// How an item stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ItemStatus {
    /// Found, and as the configuration needs it.
    Ok,
    /// Not there, and nothing needs it (no pins, no systemd).
    Absent,
    /// Missing or refused, but the configuration still runs (a better tier refused,
    /// no NVML yet).
    Warn,
    /// The configuration cannot run as asked because of it.
    Fail,
}

impl ItemStatus {
    /// Its mark at the head of a text line, as wide as the widest.
    fn mark(self) -> &'static str {
        match self {
            ItemStatus::Ok => "ok  ",
            ItemStatus::Absent => "-   ",
            ItemStatus::Warn => "warn",
            ItemStatus::Fail => "FAIL",
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CheckedItem {
    /// What was looked at (`btf`, `tier lsm`, `nvml`, ...).
    pub item: String,
    pub status: ItemStatus,
    /// What was found, or why it is missing or refused: the kernel's own words where
    /// it answered.
    pub detail: String,
    /// What to do about it, where something can be done.
    pub fix: Option<String>,
}

impl CheckedItem {
    pub fn new(item: impl Into<String>, status: ItemStatus, detail: impl Into<String>) -> Self {
        Self {
            item: item.into(),
            status,
            detail: detail.into(),
            fix: None,
        }
    }

    pub fn ok(item: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(item, ItemStatus::Ok, detail)
    }

    pub fn with_fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }

    /// Whether it is [`ItemStatus::Ok`].
    pub fn found(&self) -> bool {
        self.status == ItemStatus::Ok
    }

    /// Its one line of text: control characters (a verifier's newlines, a path a user
    /// chose) shown escaped, so that an item stays one line.
    pub fn line(&self) -> String {
        let fix = match &self.fix {
            Some(fix) if self.status != ItemStatus::Ok => format!(" (fix: {fix})"),
            _ => String::new(),
        };
        let text = format!(
            "{} {:<16} {}{fix}",
            self.status.mark(),
            self.item,
            self.detail
        );
        text.chars()
            .map(|c| match c.is_control() {
                true => c.escape_debug().collect(),
                false => c.to_string(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_one_line_and_shows_the_fix_only_when_needed() {
        let refused =
            CheckedItem::new("tier lsm", ItemStatus::Warn, "refused:\nEPERM").with_fix("boot");
        assert_eq!(
            refused.line(),
            "warn tier lsm         refused:\\nEPERM (fix: boot)"
        );
        let fine = CheckedItem::ok("btf", "present").with_fix("unused");
        assert_eq!(fine.line(), "ok   btf              present");
        assert!(fine.found() && !refused.found());
    }
}
