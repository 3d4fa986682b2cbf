//! The Prometheus text format (0.0.4), for clients that do not ask for OpenMetrics:
//! `curl`, `promtool check metrics`, older scrapers. `prometheus-client` writes only
//! OpenMetrics, whose families are named without their samples' suffix (a counter
//! `x` whose sample is `x_total`); the text format names a family as its samples are
//! named, or its HELP is found on no sample (promtool: "no help text"). Prometheus
//! itself asks for OpenMetrics and gets it unchanged.

use std::collections::HashMap;

/// `openmetrics` (as `prometheus-client` writes it) in the text format: counters and
/// infos named by their samples, infos as gauges, no `_created` samples, units or
/// `# EOF`.
pub(super) fn from_openmetrics(openmetrics: &str) -> String {
    let types: HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .collect();
    let renamed = |name: &str| match types.get(name) {
        Some(&"counter") => format!("{name}_total"),
        Some(&"info") => format!("{name}_info"),
        _ => name.to_owned(),
    };
    let mut text = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        let converted = if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            // The text format escapes only backslashes and line breaks in HELP.
            format!("# HELP {} {}", renamed(name), help.replace("\\\"", "\""))
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            format!("# TYPE {} {}", renamed(name), text_type(kind))
        } else if line.starts_with('#') {
            // `# UNIT` and `# EOF`: the text format has neither.
            continue;
        } else if is_created(line, &types) {
            continue;
        } else {
            line.to_owned()
        };
        text.push_str(&converted);
        text.push('\n');
    }
    text
}

/// The text format's name for an OpenMetrics type.
fn text_type(kind: &str) -> &str {
    match kind {
        "counter" | "gauge" | "histogram" | "summary" => kind,
        "info" | "stateset" => "gauge",
        "gaugehistogram" => "histogram",
        _ => "untyped",
    }
}

/// A counter's `_created` sample, which the text format does not have.
fn is_created(sample: &str, types: &HashMap<&str, &str>) -> bool {
    let name = sample.split(['{', ' ']).next().unwrap_or_default();
    name.strip_suffix("_created")
        .is_some_and(|family| types.get(family) == Some(&"counter"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_named_by_their_samples() {
        let openmetrics = "# HELP x_events Events \\\"seen\\\".\n# TYPE x_events counter\n\
                           x_events_total{kind=\"open\"} 5\nx_events_created 1.5\n\
                           # HELP x_build Build.\n# TYPE x_build info\n\
                           x_build_info{version=\"1\"} 1\n\
                           # HELP x_age_seconds Age.\n# TYPE x_age_seconds gauge\n\
                           # UNIT x_age_seconds seconds\nx_age_seconds 2.5\n# EOF\n";
        assert_eq!(
            from_openmetrics(openmetrics),
            "# HELP x_events_total Events \"seen\".\n# TYPE x_events_total counter\n\
             x_events_total{kind=\"open\"} 5\n\
             # HELP x_build_info Build.\n# TYPE x_build_info gauge\n\
             x_build_info{version=\"1\"} 1\n\
             # HELP x_age_seconds Age.\n# TYPE x_age_seconds gauge\nx_age_seconds 2.5\n"
        );
    }
}
