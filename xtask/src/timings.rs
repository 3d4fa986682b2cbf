//! Where `cargo xtask test`'s time went: one row per phase (and kernel, tier, suite where
//! there is one), printed as a table when the run ends, passed or not. CI's budget is
//! spent here; the table is what a change to the suite is measured by.
//!
//! Phases that run at the same time ([`lanes`]) are rows of their own, marked with their
//! lane; the total counts the lanes' wall-clock once, not each phase in them.

use std::cell::Cell;
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
    /// The lane it ran in, counting from 1, where it ran beside others ([`lanes`]).
    pub lane: Option<usize>,
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());

thread_local! {
    /// The lane this thread runs, if any.
    static LANE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Records a row; `-` stands for a column that does not apply.
pub fn record(phase: &str, kernel: &str, tier: &str, suite: &str, took: Duration) {
    ROWS.lock().unwrap().push(Row {
        phase: phase.into(),
        kernel: kernel.into(),
        tier: tier.into(),
        suite: suite.into(),
        took,
        lane: LANE.get(),
    });
}

/// Runs `f` and records how long it took as `phase`.
pub fn phase<T>(phase: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let start = Instant::now();
    let result = f();
    record(phase, "-", "-", "-", start.elapsed());
    result
}

/// What runs in one lane of [`lanes`], in order: each job's name (its phase in the
/// table) and the job.
pub type Lane<'a> = Vec<(String, Job<'a>)>;
pub type Job<'a> = Box<dyn FnOnce() -> Result<()> + Send + 'a>;

/// A job of a [`Lane`], named.
pub fn job<'a>(
    name: impl Into<String>,
    job: impl FnOnce() -> Result<()> + Send + 'a,
) -> (String, Job<'a>) {
    (name.into(), Box::new(job))
}

/// Runs `lanes` side by side, each lane's jobs in order (a job runs even where one
/// before it failed); records each job as a phase of its lane, each lane's wall-clock,
/// and the whole as `phase`. Every failure, named by its job.
pub fn lanes(phase: &str, lanes: Vec<Lane<'_>>) -> Vec<String> {
    let start = Instant::now();
    let failures = std::thread::scope(|scope| {
        let running: Vec<_> = (lanes.into_iter().enumerate())
            .map(|(nth, jobs)| scope.spawn(move || run_lane(nth + 1, jobs)))
            .collect();
        let lanes = running.into_iter().map(|lane| lane.join());
        lanes
            .flat_map(|failures| failures.unwrap_or_else(|_| vec!["a lane panicked".into()]))
            .collect()
    });
    record(phase, "-", "-", "-", start.elapsed());
    failures
}

/// One lane of [`lanes`], on this thread: its jobs in order, then its wall-clock.
fn run_lane(lane: usize, jobs: Lane<'_>) -> Vec<String> {
    LANE.set(Some(lane));
    let start = Instant::now();
    let names: Vec<String> = jobs.iter().map(|(name, _)| name.clone()).collect();
    let mut failures = Vec::new();
    for (name, job) in jobs {
        if let Err(error) = self::phase(&name, job) {
            eprintln!("xtask: {name} failed: {error:#}");
            failures.push(format!("{name}: {error:#}"));
        }
    }
    record("lane", "-", "-", &names.join(", "), start.elapsed());
    failures
}

/// The table of every row so far, with the total of the top-level rows (suites inside
/// a measured phase, and phases inside lanes, are not added twice).
pub fn table() -> String {
    let rows = ROWS.lock().unwrap().clone();
    let mut out =
        String::from("\n| phase | kernel | tier | suite | seconds |\n|---|---|---|---|---:|\n");
    for row in &rows {
        let phase = match (row.phase.as_str(), row.lane) {
            ("lane", Some(n)) => format!("lane {n}"),
            (phase, Some(n)) => format!("{phase} (lane {n})"),
            (phase, None) => phase.to_owned(),
        };
        out.push_str(&format!(
            "| {phase} | {} | {} | {} | {:.1} |\n",
            row.kernel,
            row.tier,
            row.suite,
            row.took.as_secs_f64()
        ));
    }
    let total: Duration = (rows.iter())
        .filter(|r| r.suite == "-" && r.tier == "-" && r.lane.is_none())
        .map(|r| r.took)
        .sum();
    out.push_str(&format!("| total | | | | {:.1} |\n", total.as_secs_f64()));
    out
}

/// Runs `cargo test …` with its stderr read line by line (and passed on), so that each
/// test binary's time is recorded under `phase` by the `Running …` line cargo prints
/// before it (the whole is the caller's [`phase`]). Fails as the command does.
pub fn cargo_test_by_suite(phase: &str, command: &mut Command) -> Result<()> {
    eprintln!("xtask: {command:?}");
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
    // In a lane, everything was built before: a build now could replace what a guest
    // beside it is running.
    let mut built = None;
    for line in BufReader::new(stderr).lines() {
        let line = line.context("reading cargo test's stderr")?;
        eprintln!("{line}");
        if let Some(suite) = suite_of(&line) {
            close(&mut current);
            current = Some((suite, Instant::now()));
        } else if current.is_none() && line.trim_start().starts_with("Compiling ") {
            built.get_or_insert(line.trim().to_owned());
        }
    }
    let status = child.wait()?;
    close(&mut current);
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    if let Some(line) = built.filter(|_| LANE.get().is_some()) {
        bail!(
            "{command:?} built something beside the VM ({line:?}): everything the host's \
             tests run must be built before the lanes start (xtask/src/test.rs)"
        );
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

    #[test]
    fn lanes_run_side_by_side_and_count_once_in_the_total() {
        let barrier = std::sync::Barrier::new(2);
        let wait = || {
            barrier.wait();
            Ok(())
        };
        let failing = || -> Result<()> { bail!("broke") };
        // Each lane's first job waits for the other's: they finish only side by side.
        let failures = lanes(
            "both",
            vec![
                vec![job("a", wait)],
                vec![job("b", wait), job("c", failing)],
            ],
        );
        assert_eq!(failures, ["c: broke"]);
        let rows = ROWS.lock().unwrap().clone();
        let lane_of = |phase: &str| rows.iter().find(|r| r.phase == phase).map(|r| r.lane);
        assert_eq!(lane_of("a"), Some(Some(1)));
        assert_eq!((lane_of("b"), lane_of("c")), (Some(Some(2)), Some(Some(2))));
        assert_eq!(lane_of("both"), Some(None));
        let table = table();
        assert!(table.contains("| a (lane 1) | - | - | - |"), "{table}");
        assert!(table.contains("| lane 2 | - | - | b, c |"), "{table}");
    }
}
