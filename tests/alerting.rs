//! The alerting rules shipped in `deploy/prometheus`: `promtool` checks them and runs
//! their unit tests; every alert has a unit test that fires it and one where it stays
//! quiet; and what they read is what a running daemon and a fleet's `remote enforce`
//! serve, scraped for real: promtool's lint passes on both scrapes, every metric the
//! rules name is there, and the rules evaluated on the scrapes fire where they should.
//! A machine without promtool fails here: `cargo xtask test` installs it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use genv_enforcer_tests::events::{self, EventDaemon, requested_tier};
use genv_enforcer_tests::metrics::{
    assert_promtool_passes, body, free_local_addr, promtool, scrape,
};
use genv_enforcer_tests::running::Running;
use genv_enforcer_tests::{Node, artefact, wait_for_or, workspace_root};

const RULES: &str = "genv-enforcer.rules.yml";
const UNIT_TESTS: &str = "genv-enforcer.rules.test.yml";

fn deploy() -> PathBuf {
    workspace_root().join("deploy/prometheus")
}

fn rules_text() -> String {
    std::fs::read_to_string(deploy().join(RULES)).unwrap()
}

#[test]
fn promtool_checks_the_rules_and_passes_their_unit_tests() {
    for args in [["check", "rules", RULES], ["test", "rules", UNIT_TESTS]] {
        let (passed, said) = promtool(&args, &deploy(), "");
        assert!(passed, "promtool {args:?}: {said}");
    }
}

/// The alerts the rules define, by name.
fn alerts() -> Vec<String> {
    let rules = rules_text();
    let names = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "));
    names.map(|name| name.trim().to_owned()).collect()
}

/// For each alert the unit tests evaluate: whether a test expects it firing, and
/// whether one expects it quiet (`exp_alerts: []`).
fn tested() -> BTreeMap<String, (bool, bool)> {
    let tests = std::fs::read_to_string(deploy().join(UNIT_TESTS)).unwrap();
    let mut tested = BTreeMap::<String, (bool, bool)>::new();
    let mut alert = None;
    for line in tests.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("alertname: ") {
            alert = Some(name.to_owned());
        }
        let seen = match line {
            "exp_alerts: []" => (false, true),
            "exp_alerts:" => (true, false),
            _ => continue,
        };
        let alert = alert.take().expect("exp_alerts follows its alertname");
        let entry = tested.entry(alert).or_default();
        *entry = (entry.0 || seen.0, entry.1 || seen.1);
    }
    tested
}

/// promtool passes a test of an alert that does not exist (nothing fires): each test
/// must name one, and each alert have both kinds.
#[test]
fn every_alert_has_a_unit_test_firing_it_and_one_where_it_is_quiet() {
    let alerts = alerts();
    assert!(alerts.len() >= 10, "{alerts:?}");
    let tested = tested();
    for alert in &alerts {
        assert_eq!(
            tested.get(alert),
            Some(&(true, true)),
            "{alert}: (fired, quiet) in {UNIT_TESTS}"
        );
    }
    let unknown: Vec<&String> = tested.keys().filter(|a| !alerts.contains(a)).collect();
    assert!(unknown.is_empty(), "tests of no alert: {unknown:?}");
}

/// The `genv_enforcer_` metrics the rules read, the fleet's (`remote`) or the node's.
fn metrics_read(remote: bool) -> Vec<String> {
    let rules = rules_text();
    let mut names: Vec<String> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("genv_enforcer_"))
        .filter(|word| word.starts_with("genv_enforcer_remote_") == remote)
        .map(str::to_owned)
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Whether `text` has a sample of `name`.
fn serves(text: &str, name: &str) -> bool {
    text.lines()
        .filter_map(|line| line.strip_prefix(name))
        .any(|rest| rest.starts_with(['{', ' ']))
}

/// A sample's value in `text`: the line starting with `series` then a space.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

/// The rules evaluated on `scrape` (its samples, labelled `job` and `instance`, held
/// for 15 minutes), where `expected` says what each alert named does at 10 minutes
/// (`[]`, or the YAML of its alerts).
fn evaluate(scrape: &str, job: &str, expected: &[(&str, &str)]) {
    let labels = format!("job=\"{job}\", instance=\"{job}:9469\"");
    let mut series = String::new();
    for line in scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let (sample, value) = line.rsplit_once(' ').expect("a sample and its value");
        let sample = match sample.split_once('{') {
            Some((name, rest)) => format!("{name}{{{labels}, {rest}"),
            None => format!("{sample}{{{labels}}}"),
        };
        let sample = sample.replace('\'', "''");
        series.push_str(&format!(
            "      - series: '{sample}'\n        values: '{value}x15'\n"
        ));
    }
    let mut tests = String::new();
    for (alert, alerts) in expected {
        tests.push_str(&format!(
            "      - eval_time: 10m\n        alertname: {alert}\n        exp_alerts: {alerts}\n"
        ));
    }
    let rules = deploy().join(RULES);
    let file = format!(
        "rule_files:\n  - {}\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    \
         input_series:\n{series}    alert_rule_test:\n{tests}",
        rules.display()
    );
    let dir = std::env::temp_dir().join(format!("genv-alerting-{}-{job}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("scrape.test.yml"), &file).unwrap();
    let (passed, said) = promtool(&["test", "rules", "scrape.test.yml"], &dir, "");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(passed, "the rules on the scrape: {said}\n{file}");
}

/// One alert of the rules, as `exp_alerts` lists it.
fn fired(labels: &[(&str, &str)], summary: &str, description: &str) -> String {
    let labels: String = labels
        .iter()
        .map(|(k, v)| format!("              {k}: '{v}'\n"))
        .collect();
    format!(
        "\n          - exp_labels:\n{labels}            exp_annotations:\n              \
         summary: '{summary}'\n              description: '{description}'\n"
    )
}

/// The level `tier_level` gives `tier` (0: none).
fn level(tier: &str) -> f64 {
    let best_first = ["lsm", "fmod_ret", "fentry", "tracepoint"];
    best_first
        .iter()
        .position(|t| *t == tier)
        .map_or(0.0, |at| (best_first.len() - at) as f64)
}

/// A daemon with `--deny`, after an outsider's open was decided in the kernel: its
/// scrape passes promtool's lint, serves every metric the node's rules read, says what
/// is in force beside what was asked for, and the rules on it are quiet; with
/// `deny_in_force` turned to 0 in it, `GenvEnforcerDenyNotInForce` fires.
#[test]
fn a_daemons_scrape_passes_promtool_and_the_rules_read_it() {
    let mut node = Node::new(1);
    let addr = free_local_addr();
    let args = ["--non-env-processes", "--deny", "--metrics-addr", &addr];
    let Some(daemon) = EventDaemon::start(&node, &args) else {
        return;
    };
    daemon.expect("GPU opens outside any environment are");
    let gpu = events::make_gpu_node(&node.dir.join("gpu0"));
    node.spawn_with(None, &[(0, 100)], &["--open", gpu.to_str().unwrap()], None);
    let decided = "genv_enforcer_decisions_total{rule=\"non-env-processes\",action=\"";
    let last = std::cell::RefCell::new(String::new());
    let answer = wait_for_or(
        "a scrape with --deny in force and the kernel's decision",
        Duration::from_secs(30),
        || {
            let answer = scrape(&addr);
            *last.borrow_mut() = answer.clone();
            let text = body(&answer);
            let armed = value(text, "genv_enforcer_deny_in_force") == Some(1.0);
            (armed && text.contains(decided)).then_some(answer)
        },
        || last.take(),
    );
    assert_promtool_passes(&answer);
    let text = body(&answer);
    for name in metrics_read(false) {
        assert!(serves(text, &name), "{name} is not served: {text}");
    }
    let asked = requested_tier();
    let info = format!(
        "genv_enforcer_tier_info{{tier=\"{}\",configured=\"{asked}\"}}",
        daemon.tier
    );
    let configured = if asked == "auto" { 1.0 } else { level(&asked) };
    for (series, wanted) in [
        (info.as_str(), 1.0),
        ("genv_enforcer_tier_level", level(&daemon.tier)),
        ("genv_enforcer_tier_configured_level", configured),
        ("genv_enforcer_deny_configured", 1.0),
        ("genv_enforcer_full_cycle_interval_seconds", 3600.0),
    ] {
        assert_eq!(value(text, series), Some(wanted), "{series} in {text}");
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    for stamp in [
        "genv_enforcer_heartbeat_timestamp_seconds",
        "genv_enforcer_last_full_cycle_timestamp_seconds",
    ] {
        let at = value(text, stamp).unwrap_or_else(|| panic!("no {stamp}: {text}"));
        assert!((now - at).abs() < 60.0, "{stamp} {at}, now {now}");
    }
    evaluate_the_node_rules_on(text);
}

/// The node's rules that read no clock on a healthy daemon's scrape, then on it with
/// `--deny` disarmed.
fn evaluate_the_node_rules_on(text: &str) {
    let quiet = [
        ("GenvEnforcerDenyNotInForce", "[]"),
        ("GenvEnforcerTierBelowConfigured", "[]"),
        ("GenvEnforcerDecisionsSpike", "[]"),
    ];
    evaluate(text, "genv-enforcer", &quiet);
    let disarmed = text.replace(
        "genv_enforcer_deny_in_force 1",
        "genv_enforcer_deny_in_force 0",
    );
    let labels = [
        ("severity", "critical"),
        ("job", "genv-enforcer"),
        ("instance", "genv-enforcer:9469"),
    ];
    let alert = fired(
        &labels,
        "--deny is not in force on genv-enforcer:9469",
        "genv-enforcer was started with --deny, but the kernel does not refuse GPU opens \
         outside environments there: see `genv-enforcer status` and its log.",
    );
    evaluate(
        &disarmed,
        "genv-enforcer",
        &[("GenvEnforcerDenyNotInForce", &alert)],
    );
}

/// `remote enforce --metrics-addr` with two hosts that cannot be reached (no daemon
/// anywhere): its scrape passes promtool's lint, shows each host down with its
/// failure, and the rules on it find both unenforced. `genv_enforcer_remote_last_heard_seconds`,
/// served once a host was heard, is scraped from a fleet of real hosts in
/// `tests/remote/faults.rs`.
#[test]
fn a_fleets_scrape_passes_promtool_and_the_rules_find_its_hosts_unenforced() {
    let addr = free_local_addr();
    let hosts = ["gpu-a.invalid", "gpu-b.invalid"];
    let mut command = Command::new(artefact("genv-enforcer"));
    command.args([
        "remote",
        "--ssh-config",
        "/dev/null",
        "-H",
        &hosts.join(","),
    ]);
    command.args(["--host-timeout", "5", "--metrics-addr", &addr]);
    command.args(["enforce", "--interval", "600", "--non-env-processes"]);
    let mut fleet = Running::start(command);
    let failed =
        |host: &str| format!("genv_enforcer_remote_host_failures_total{{host=\"{host}\"}}");
    let mut answer = String::new();
    fleet.wait_until("each host's failure in a scrape", || {
        answer = scrape(&addr);
        hosts
            .iter()
            .all(|h| value(body(&answer), &failed(h)) >= Some(1.0))
    });
    fleet.stop();
    assert_promtool_passes(&answer);
    let text = body(&answer);
    for host in hosts {
        let up = format!("genv_enforcer_remote_host_up{{host=\"{host}\"}}");
        assert_eq!(value(text, &up), Some(0.0), "{text}");
    }
    let heard_only = ["genv_enforcer_remote_last_heard_seconds"];
    for name in metrics_read(true) {
        assert!(
            serves(text, &name) || heard_only.contains(&name.as_str()),
            "{name}: {text}"
        );
    }
    let alerts: String = hosts
        .iter()
        .map(|host| {
            let labels = [
                ("severity", "critical"),
                ("job", "genv-enforcer-remote"),
                ("instance", "genv-enforcer-remote:9469"),
                ("host", host),
            ];
            let summary = format!("Host {host} is not enforced by genv-enforcer-remote:9469");
            let description =
                "Its last snapshot failed, was refused or went silent 5 minutes ago or more.";
            fired(&labels, &summary, description)
        })
        .collect();
    evaluate(
        text,
        "genv-enforcer-remote",
        &[("GenvEnforcerRemoteHostUnenforced", &alerts)],
    );
}
