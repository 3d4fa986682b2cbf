//! Where `cargo xtask test`'s time went: one row per phase (and kernel, tier, suite where
//! there is one), printed as a table when the run ends, passed or not. CI's budget is
//! spent here; the table is what a change to the suite is measured by.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// One measured stretch of the run.
#[derive(Clone, Debug)]
pub struct Row {
    pub phase: String,
    pub kernel: String,
    pub tier: String,
    pub suite: String,
    pub took: Duration,
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());

/// Records a row; `-` stands for a column that does not apply.
pub fn record(phase: &str, kernel: &str, tier: &str, suite: &str, took: Duration) {
    ROWS.lock().unwrap().push(Row {
        phase: phase.into(),
        kernel: kernel.into(),
        tier: tier.into(),
        suite: suite.into(),
        took,
    });
}

/// Runs `f` and records how long it took as `phase`.
pub fn phase<T>(phase: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let start = Instant::now();
    let result = f();
    record(phase, "-", "-", "-", start.elapsed());
    result
}

/// The table of every row so far, with the total of the top-level rows (suites inside
/// a measured phase are not added twice).
pub fn table() -> String {
    let rows = ROWS.lock().unwrap().clone();
    let mut out =
        String::from("\n| phase | kernel | tier | suite | seconds |\n|---|---|---|---|---:|\n");
    for row in &rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} |\n",
            row.phase,
            row.kernel,
            row.tier,
            row.suite,
            row.took.as_secs_f64()
        ));
    }
    let total: Duration = rows
        .iter()
        .filter(|r| r.suite == "-" && r.tier == "-")
        .map(|r| r.took)
        .sum();
    out.push_str(&format!("| total | | | | {:.1} |\n", total.as_secs_f64()));
    out
}

/// Runs `cargo test …` with its stderr read line by line (and passed on), so that each
/// test binary's time is recorded under `phase` by the `Running …` line cargo prints
/// before it. Fails as the command does.
pub fn cargo_test_by_suite(phase: &str, command: &mut Command) -> Result<()> {
    eprintln!("xtask: {command:?}");
    let start = Instant::now();
    let mut child = command
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {command:?}"))?;
    let stderr = child.stderr.take().expect("piped");
    let mut current: Option<(String, Instant)> = None;
    let close = |current: &mut Option<(String, Instant)>| {
        if let Some((suite, since)) = current.take() {
            record(phase, "host", "tracepoint", &suite, since.elapsed());
        }
    };
    for line in BufReader::new(stderr).lines() {
        let line = line.context("reading cargo test's stderr")?;
        eprintln!("{line}");
        if let Some(suite) = suite_of(&line) {
            close(&mut current);
            current = Some((suite, Instant::now()));
        }
    }
    let status = child.wait()?;
    close(&mut current);
    record(phase, "-", "-", "-", start.elapsed());
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}

/// The suite a cargo line announces: `Running tests/remote.rs (target/…)` is `remote`,
/// `Running unittests src/lib.rs (target/debug/deps/genv_enforcer-…)` is
/// `genv_enforcer (unit)`, `Doc-tests genv_enforcer` is `genv_enforcer (doc)`.
fn suite_of(line: &str) -> Option<String> {
    let line = line.trim_start();
    if let Some(crate_name) = line.strip_prefix("Doc-tests ") {
        return Some(format!("{} (doc)", crate_name.trim()));
    }
    let rest = line.strip_prefix("Running ")?;
    if let Some(unit) = rest.strip_prefix("unittests ") {
        let binary = unit.split('(').nth(1)?.trim_end_matches(')');
        let name = binary.rsplit('/').next()?;
        let name = name.rsplit_once('-').map_or(name, |(n, _)| n);
        return Some(format!("{name} (unit)"));
    }
    let file = rest.split_whitespace().next()?;
    let name = file.rsplit('/').next()?.trim_end_matches(".rs");
    Some(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cargos_lines_name_their_suites() {
        assert_eq!(
            suite_of("     Running tests/remote.rs (target/debug/deps/remote-0a1b)").as_deref(),
            Some("remote")
        );
        assert_eq!(
            suite_of("     Running unittests src/lib.rs (target/debug/deps/genv_enforcer-d98d)")
                .as_deref(),
            Some("genv_enforcer (unit)")
        );
        assert_eq!(
            suite_of("   Doc-tests genv_enforcer").as_deref(),
            Some("genv_enforcer (doc)")
        );
        assert_eq!(suite_of("test a ... ok"), None);
    }
}
