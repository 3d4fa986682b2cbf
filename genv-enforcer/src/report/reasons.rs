//! Why each process of a report goes, carried to the host that executes it, so that the
//! host can tell the process's user as a local stop would (issue 38).
//!
//! genv's own `usage execute` reads the report with a decoder that matches classes by
//! their exact members: a report with one member more is not a report to it. So the
//! reasons travel only to a host that asked for them by name: the admin side runs
//! `usage execute --with-reasons` and sends genv's report with a `reasons` member
//! (`{"<pid>": {"rule": …, "gpus": […], …}}`); a host that does not know the flag
//! refuses it before it reads anything, and is then sent genv's report alone
//! ([`crate::remote::fleet`]).
//!
//! On the host, a reason is a courtesy to a user, never a condition of the report: one
//! that cannot be read is left out with a warning, and the report is carried out all
//! the same.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{Report, Why};

/// The most reasons read from one report: a report terminates a host's GPU processes,
/// which are far fewer.
pub const MAX_REASONS: usize = 4096;

/// GPUs named in one reason at most: a node has a handful (the bound keeps a kept
/// decision small).
const MAX_GPUS: usize = 64;

/// The member of the report's JSON object that holds them.
const MEMBER: &str = "reasons";

/// genv's report for `usage execute`, with the reasons beside it.
pub fn to_json(report: &Report) -> String {
    let mut document = report.to_genv_value();
    let reasons: serde_json::Map<String, Value> = (report.why.iter())
        .map(|(pid, why)| {
            let why = serde_json::to_value(why).expect("a reason serializes");
            (pid.to_string(), why)
        })
        .collect();
    document[MEMBER] = Value::Object(reasons);
    crate::state::to_python_json(&document).expect("a report serializes")
}

/// The reasons in `text`, a report read with `--with-reasons`, and a warning for each
/// that could not be read (none is fatal).
pub fn from_json(text: &str) -> (BTreeMap<u32, Why>, Vec<String>) {
    let mut reasons = BTreeMap::new();
    let mut warnings = Vec::new();
    let document: Value = match serde_json::from_str(text) {
        Ok(document) => document,
        // The report's own reading names what is wrong with it.
        Err(_) => return (reasons, warnings),
    };
    let Some(member) = document.get(MEMBER) else {
        warnings.push(format!(
            "the report has no {MEMBER:?}: its users are not told why"
        ));
        return (reasons, warnings);
    };
    let Some(member) = member.as_object() else {
        warnings.push(format!("{MEMBER}: expected an object keyed by pid"));
        return (reasons, warnings);
    };
    for (key, value) in member.iter().take(MAX_REASONS) {
        let pid = key.parse::<u32>().ok().filter(|pid| *pid > 0);
        let why = serde_json::from_value::<Why>(value.clone());
        match (pid, why) {
            (Some(pid), Ok(mut why)) => {
                why.gpus.truncate(MAX_GPUS);
                reasons.insert(pid, why);
            }
            (None, _) => warnings.push(format!("{MEMBER}[{key:?}]: not a pid")),
            (_, Err(e)) => warnings.push(format!("{MEMBER}[{key:?}]: {e}")),
        }
    }
    if member.len() > MAX_REASONS {
        warnings.push(format!(
            "{MEMBER}: {} reasons, the first {MAX_REASONS} read",
            member.len()
        ));
    }
    (reasons, warnings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::notify::Rule;

    fn reported() -> Report {
        let mut report = Report::from_genv_json(
            r#"{"terminate": {"processes": [{"pid": 42, "used_gpu_memory": [{"index": 0, "gpu_memory": "100mi"}], "eid": "a1"}]}, "detach": {}}"#,
        )
        .unwrap();
        report.why.insert(
            42,
            Why {
                rule: Rule::MaxDevicesPerUser {
                    user: "alice".into(),
                    devices: 3,
                    maximum: 2,
                    hosts: Some(2),
                },
                gpus: vec![0],
                detached: true,
                env_name: Some("train".into()),
            },
        );
        report
    }

    #[test]
    fn the_reasons_travel_beside_genvs_report_and_read_back() {
        let report = reported();
        let text = to_json(&report);
        let back = Report::from_genv_json(&text).unwrap();
        assert_eq!(back.terminate, report.terminate, "genv's part unchanged");
        let (reasons, warnings) = from_json(&text);
        assert_eq!(reasons, report.why);
        assert!(warnings.is_empty(), "{warnings:?}");
    }

    #[test]
    fn a_reason_that_cannot_be_read_is_left_out_with_a_warning() {
        let text = to_json(&reported()).replace(
            "\"reasons\": {",
            "\"reasons\": {\"x\": 1, \"7\": {\"rule\": \"made-up\"}, ",
        );
        let (reasons, warnings) = from_json(&text);
        assert_eq!(reasons.keys().collect::<Vec<_>>(), [&42]);
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].contains("\"7\"") || warnings[1].contains("\"7\""));
        let (none, warnings) = from_json(&reported().to_genv_json());
        assert!(none.is_empty() && warnings.len() == 1, "{warnings:?}");
    }
}
