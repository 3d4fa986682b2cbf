//! `cargo xtask bench --compare REV [SECTION]`: the regression guard. REV is built in a
//! worktree of its own (`target/compare/<commit>`, its own target directory), this tree
//! as it is; then the chosen sections (`events`, `remote`; both by default) run against
//! each build in turn, interleaved (before, after, after, before, …: a machine that
//! drifts drifts for both), `--runs` times each, with this tree's harness for both, so
//! that the same scenario measures two builds of the product. Each figure of the
//! sections' tables is printed as `before → after`, medians over the runs, with each
//! side's spread (min–max) after it.
//!
//! No timing is asserted anywhere: the table is for a reader, and for `docs/bench.md`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{BenchSection, bench_events, bench_remote, root, run, target_dir};

/// Builds both, measures, prints the table.
pub fn compare(rev: &str, sections: &[BenchSection], runs: usize) -> Result<()> {
    let commit = resolve(rev)?;
    let before = build_worktree(&commit)?;
    crate::toolchain::ensure_ebpf_toolchain()?;
    run(&mut crate::cargo(&["build", "--release", "--workspace"]))?;
    let after = target_dir()?.join("release");
    // The events section's VM rows are counts, the same on both: not run here.
    // SAFETY: set before any thread of this process is started.
    unsafe { std::env::set_var("GENV_BENCH_NO_VM", "1") };
    let short = &commit[..12];
    println!("# `cargo xtask bench --compare {rev}`: {short} → this tree, {runs} runs each\n");
    for &section in sections {
        let mut outputs: [Vec<String>; 2] = [Vec::new(), Vec::new()];
        for round in 0..runs {
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for side in order {
                let dir = [&before, &after][side];
                eprintln!(
                    "bench --compare: {section:?}, run {}, {}",
                    round + 1,
                    ["before", "after"][side]
                );
                outputs[side].push(measure(section, dir)?);
            }
        }
        print!("{}", merged(&outputs[0], &outputs[1]));
    }
    Ok(())
}

/// The commit REV names.
fn resolve(rev: &str) -> Result<String> {
    let output = Command::new("git")
        .current_dir(root())
        .args(["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
        .output()?;
    if !output.status.success() {
        bail!("--compare {rev}: not a commit of this repository");
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// REV's release build, in a worktree and target directory of its own (kept for the
/// next comparison with the same commit).
fn build_worktree(commit: &str) -> Result<PathBuf> {
    let base = target_dir()?.join("compare");
    let tree = base.join(commit);
    if !tree.join("Cargo.toml").exists() {
        std::fs::create_dir_all(&base)?;
        run(Command::new("git")
            .current_dir(root())
            .args(["worktree", "add", "--detach", "--force"])
            .arg(&tree)
            .arg(commit))?;
    }
    let target = base.join(format!("{commit}-target"));
    run(Command::new("cargo")
        .current_dir(&tree)
        .args(["build", "--release", "--workspace"])
        .env("CARGO_TARGET_DIR", &target))
    .with_context(|| format!("building {commit} in {}", tree.display()))?;
    Ok(target.join("release"))
}

/// One run of a section against the build in `release`.
fn measure(section: BenchSection, release: &Path) -> Result<String> {
    match section {
        BenchSection::Events => bench_events::run(release),
        BenchSection::Remote => bench_remote::run(release),
        other => bail!("--compare measures the events and remote sections, not {other:?}"),
    }
}

/// A figure in a table cell: `26 ms`, `0.42 ms`, `1,607 ms`, `144 ns`, `9`.
fn figure(cell: &str) -> Option<(f64, &str)> {
    let cell = cell.trim();
    let end = cell
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ','))
        .unwrap_or(cell.len());
    let (number, unit) = cell.split_at(end);
    let unit = unit.trim();
    if number.is_empty() || unit.contains(' ') || unit.len() > 3 {
        return None;
    }
    Some((number.replace(',', "").parse().ok()?, unit))
}

/// The median and the spread of `values`.
fn summary(mut values: Vec<f64>) -> (f64, f64, f64) {
    values.sort_by(f64::total_cmp);
    let median = values[values.len() / 2];
    (median, values[0], values[values.len() - 1])
}

fn shown(value: f64) -> String {
    match value {
        v if v >= 100.0 => format!("{v:.0}"),
        v if v >= 10.0 => format!("{v:.1}"),
        v => format!("{v:.2}"),
    }
}

/// The last run's text on the after side, each table figure replaced by `before →
/// after` over all runs, with the spreads.
fn merged(before: &[String], after: &[String]) -> String {
    let lines = |runs: &[String]| -> Vec<Vec<String>> {
        runs.iter()
            .map(|r| r.lines().map(str::to_owned).collect())
            .collect()
    };
    let (before, after) = (lines(before), lines(after));
    let template = after.last().cloned().unwrap_or_default();
    let mut out = String::new();
    for (n, line) in template.iter().enumerate() {
        if !line.starts_with('|') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let cells: Vec<&str> = line.split('|').collect();
        let row: Vec<String> = (cells.iter().enumerate())
            .map(|(c, cell)| {
                merged_cell(&before, &after, n, c).unwrap_or_else(|| (*cell).to_owned())
            })
            .collect();
        out.push_str(&row.join("|"));
        out.push('\n');
    }
    out
}

/// Cell `c` of line `n`, where every run on both sides has a figure there.
fn merged_cell(
    before: &[Vec<String>],
    after: &[Vec<String>],
    n: usize,
    c: usize,
) -> Option<String> {
    let values = |runs: &[Vec<String>]| -> Option<(Vec<f64>, String)> {
        let mut unit = String::new();
        let mut values = Vec::new();
        for run in runs {
            let cell = run.get(n)?.split('|').nth(c)?.to_owned();
            let (value, u) = figure(&cell)?;
            unit = u.to_owned();
            values.push(value);
        }
        Some((values, unit))
    };
    let (b, unit) = values(before)?;
    let (a, _) = values(after)?;
    let ((bm, blo, bhi), (am, alo, ahi)) = (summary(b), summary(a));
    let unit = if unit.is_empty() {
        String::new()
    } else {
        format!(" {unit}")
    };
    Some(format!(
        " {} → {}{unit} ({}–{}; {}–{}) ",
        shown(bm),
        shown(am),
        shown(blo),
        shown(bhi),
        shown(alo),
        shown(ahi)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_read_with_their_units() {
        assert_eq!(figure(" 26 ms "), Some((26.0, "ms")));
        assert_eq!(figure("1,607 ms"), Some((1607.0, "ms")));
        assert_eq!(figure("0.42 ms"), Some((0.42, "ms")));
        assert_eq!(figure("9"), Some((9.0, "")));
        assert_eq!(figure(" after a burst "), None);
        assert_eq!(figure("lsm"), None);
    }

    #[test]
    fn each_figure_becomes_before_to_after_with_the_spreads() {
        let run = |a: u32, b: u32| {
            format!("# t\n\n| what | min | max |\n|---|---|---|\n| x | {a} ms | {b} ms |\n")
        };
        let before = [run(90, 400), run(100, 435), run(95, 300)];
        let after = [run(20, 30), run(22, 31), run(21, 29)];
        let table = merged(&before, &after);
        assert!(
            table.contains(
                "| x | 95.0 → 21.0 ms (90.0–100; 20.0–22.0) | 400 → 30.0 ms (300–435; 29.0–31.0) |"
            ),
            "{table}"
        );
        assert!(table.starts_with("# t\n"), "{table}");
    }
}
