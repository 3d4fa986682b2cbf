//! The whole report: every finding, the tier the configuration would get and why the
//! others were refused, and the verdict; as text for an admin, or as JSON.

use serde::Serialize;

use super::checked_item::{CheckedItem, ItemStatus};
use super::kernel_checks::TierOutcome;

#[derive(Debug, Serialize)]
pub struct Checkup {
    /// Whether the configuration can run here as asked: no finding is a failure.
    pub ready: bool,
    /// The tier it would run on (`None`: no kernel programs, asked or not).
    pub tier: Option<String>,
    /// Each tier the kernel refused, and its words.
    pub refused: Vec<RefusedTier>,
    /// The verdict, in one sentence.
    pub verdict: String,
    pub items: Vec<CheckedItem>,
}

#[derive(Debug, Serialize)]
pub struct RefusedTier {
    pub tier: String,
    pub why: String,
}

impl Checkup {
    /// `event_driven`: whether the configuration loads kernel programs.
    pub fn new(items: Vec<CheckedItem>, outcome: TierOutcome, event_driven: bool) -> Self {
        // Each failing item with what it found: the verdict alone says what to fix.
        let failed: Vec<String> = items
            .iter()
            .filter(|f| f.status == ItemStatus::Fail)
            .map(|f| format!("{}: {}", f.item, f.detail))
            .collect();
        let ready = failed.is_empty();
        let tier = outcome
            .chosen
            .filter(|_| event_driven)
            .map(|t| t.to_string());
        let refused_names: Vec<String> =
            outcome.refused.iter().map(|(t, _)| t.to_string()).collect();
        let refused_text = match refused_names.is_empty() {
            true => String::new(),
            false => format!("; refused by this kernel: {}", refused_names.join(", ")),
        };
        let runs_on = match &tier {
            Some(tier) => format!("event-driven on the {tier} tier{refused_text}"),
            None if event_driven => "event-driven without kernel programs".to_owned(),
            None => "the full cycle alone (no --event-driven)".to_owned(),
        };
        let verdict = match ready {
            true => format!("ready: this configuration runs here: {runs_on}"),
            false => format!("not ready: {}", failed.join("; ")),
        };
        let refused = outcome
            .refused
            .into_iter()
            .map(|(tier, why)| RefusedTier {
                tier: tier.to_string(),
                why,
            })
            .collect();
        Self {
            ready,
            tier,
            refused,
            verdict,
            items,
        }
    }

    /// One line per item, then the verdict.
    pub fn text(&self) -> String {
        let mut text = String::new();
        for item in &self.items {
            text.push_str(&item.line());
            text.push('\n');
        }
        text.push_str(&format!("verdict: {}\n", self.verdict));
        text
    }

    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::Tier;

    #[test]
    fn one_failure_makes_it_not_ready_and_the_verdict_names_it() {
        let outcome = TierOutcome {
            chosen: Some(Tier::Tracepoint),
            refused: vec![(Tier::Lsm, "EPERM".into())],
        };
        let items = vec![
            CheckedItem::ok("btf", "present"),
            CheckedItem::new("root", ItemStatus::Fail, "uid 1000"),
        ];
        let checkup = Checkup::new(items, outcome, true);
        assert!(!checkup.ready);
        assert_eq!(checkup.tier.as_deref(), Some("tracepoint"));
        assert_eq!(checkup.verdict, "not ready: root: uid 1000");
        let json: serde_json::Value = serde_json::from_str(&checkup.json()).unwrap();
        assert_eq!(json["refused"][0]["tier"], "lsm");
        assert_eq!(json["items"][1]["status"], "fail");
        assert!(
            checkup
                .text()
                .ends_with(&format!("verdict: {}\n", checkup.verdict))
        );
    }

    #[test]
    fn without_event_driven_no_tier_is_claimed() {
        let outcome = TierOutcome {
            chosen: Some(Tier::Lsm),
            refused: Vec::new(),
        };
        let checkup = Checkup::new(vec![CheckedItem::ok("btf", "present")], outcome, false);
        assert!(checkup.ready && checkup.tier.is_none());
        assert!(
            checkup.verdict.contains("full cycle alone"),
            "{}",
            checkup.verdict
        );
    }
}
