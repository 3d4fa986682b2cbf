//! The code's shape, checked: the daemon's modules depend only downward along the data
//! flow (backends and state → snapshot → rules → report → actions → cycle; the kernel
//! programs → intake → service → alloc → sync → daemon → remote → cli), and no file or function grows past
//! what a reader can hold at once. Reads the sources as text; needs no root.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use genv_enforcer_tests::workspace_root;

/// `genv-enforcer/src`'s top-level modules, lowest first: a module may use only
/// modules listed before it. The batch path (backends and state → snapshot → rules →
/// report → actions → cycle), then the event side by stage: the kernel programs'
/// handles, the intake of their events, what the daemon publishes as a service,
/// `--memory-at-alloc`'s userspace half, the sync of the maps with genv's state, the
/// daemon's loop; then the fleet and the command line.
const LAYERS: [&str; 15] = [
    "backends",
    "state",
    "snapshot",
    "rules",
    "report",
    "actions",
    "cycle",
    "kernel",
    "intake",
    "service",
    "alloc",
    "sync",
    "daemon",
    "remote",
    "cli",
];

/// Lines of code in a file, not counting its unit tests.
const MAX_FILE_LINES: usize = 500;
const MAX_FUNCTION_LINES: usize = 80;

/// The Rust sources the limits apply to: everything but the test suites and their
/// harness.
const SOURCE_DIRS: [&str; 4] = [
    "genv-enforcer/src",
    "genv-ebpf/src",
    "genv-ebpf-common/src",
    "xtask/src",
];

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// The file's lines up to its `#[cfg(test)]` module, and without `tests.rs` files
/// (unit tests kept beside their module).
fn code_lines(path: &Path) -> Vec<String> {
    if path.file_name().is_some_and(|n| n == "tests.rs") {
        return Vec::new();
    }
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .take_while(|line| !line.starts_with("#[cfg(test)]"))
        .map(str::to_owned)
        .collect()
}

/// The `crate::<module>` paths a file's code (not its comments) names.
fn crate_modules(lines: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    for line in lines {
        let code = line.split("//").next().unwrap();
        for (at, _) in code.match_indices("crate::") {
            let name: String = code[at + 7..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            found.push(name);
        }
    }
    found
}

#[test]
fn modules_depend_only_downward() {
    let src = workspace_root().join("genv-enforcer/src");
    let rank = |name: &str| LAYERS.iter().position(|l| *l == name);
    let mut upward = BTreeMap::new();
    for file in rust_files(&src) {
        let relative = file.strip_prefix(&src).unwrap();
        let top = relative.iter().next().unwrap().to_str().unwrap();
        let top = top.trim_end_matches(".rs");
        let Some(own) = rank(top) else {
            continue; // lib.rs, main.rs: the crate's root names every module
        };
        for used in crate_modules(&code_lines(&file)) {
            match rank(&used) {
                Some(theirs) if theirs > own => {
                    upward
                        .entry(format!("{} uses crate::{used}", relative.display()))
                        .or_insert(());
                }
                Some(_) => {}
                None => panic!(
                    "{}: crate::{used} is in no layer; add it to LAYERS",
                    relative.display()
                ),
            }
        }
    }
    assert!(
        upward.is_empty(),
        "upward dependencies (a lower stage must not know a higher one): {:#?}",
        upward.keys().collect::<Vec<_>>()
    );
}

#[test]
fn every_module_is_in_a_layer() {
    let src = workspace_root().join("genv-enforcer/src");
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|l| l.trim_end_matches(';'))
        .collect();
    let mut sorted_layers = LAYERS.to_vec();
    sorted_layers.sort();
    let mut sorted = declared.clone();
    sorted.sort();
    assert_eq!(sorted, sorted_layers, "lib.rs's modules and LAYERS differ");
}

#[test]
fn files_and_functions_stay_small() {
    let mut too_long = Vec::new();
    for dir in SOURCE_DIRS {
        for file in rust_files(&workspace_root().join(dir)) {
            let lines = code_lines(&file);
            let name = file.strip_prefix(workspace_root()).unwrap().display();
            if lines.len() > MAX_FILE_LINES {
                too_long.push(format!("{name}: {} lines", lines.len()));
            }
            for (start, length, signature) in functions(&lines) {
                if length > MAX_FUNCTION_LINES {
                    too_long.push(format!("{name}:{start}: {signature}: {length} lines"));
                }
            }
        }
    }
    assert!(
        too_long.is_empty(),
        "over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: {too_long:#?}"
    );
}

/// Each function's first line (1-based), length and signature, in rustfmt'd code: a
/// function ends at the first line holding only its own indentation and `}`.
fn functions(lines: &[String]) -> Vec<(usize, usize, String)> {
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let indent = &line[..line.len() - trimmed.len()];
        let after_qualifiers = [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
        ]
        .iter()
        .fold(trimmed, |rest, q| rest.strip_prefix(q).unwrap_or(rest));
        let after_extern = after_qualifiers
            .strip_prefix("extern \"C\" ")
            .unwrap_or(after_qualifiers);
        if !after_extern.starts_with("fn ") || trimmed.ends_with(';') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = lines[i + 1..].iter().position(|l| *l == close) {
            found.push((i + 1, end + 2, trimmed.chars().take(60).collect()));
        }
    }
    found
}

#[test]
fn the_checks_see_what_they_check() {
    // A check that reads nothing passes anything: make sure these read real code.
    let lines = code_lines(&workspace_root().join("genv-enforcer/src/cycle.rs"));
    assert!(crate_modules(&lines).iter().any(|m| m == "rules"));
    let long: Vec<String> = std::iter::once("fn big() {".to_owned())
        .chain((0..100).map(|i| format!("    let x{i} = {i};")))
        .chain(std::iter::once("}".to_owned()))
        .collect();
    assert_eq!(functions(&long), [(1, 102, "fn big() {".to_owned())]);
}

/// The suites whose tests run on every BPF tier in the VM (xtask's `TIER_SUITES`).
const TIER_SUITES: [&str; 2] = ["tests/event_driven.rs", "tests/prevention.rs"];

/// The `#[test]` functions of a suite's source, by name.
fn test_names(source: &str) -> Vec<String> {
    let lines: Vec<&str> = source.lines().map(str::trim).collect();
    let mut names = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if *line != "#[test]" {
            continue;
        }
        let Some(signature) = lines[i + 1..].iter().find(|l| !l.starts_with("#[")) else {
            continue;
        };
        if let Some(name) = signature
            .strip_prefix("fn ")
            .and_then(|s| s.split('(').next())
        {
            names.push(name.to_owned());
        }
    }
    names
}

/// Tests in the tier suites that do not say whether they depend on the tier.
fn ungrouped(source: &str) -> Vec<String> {
    test_names(source)
        .into_iter()
        .filter(|n| !n.starts_with("tier_") && !n.starts_with("any_tier_"))
        .collect()
}

/// Every test of a tier suite says in its name which group it is in: `tier_` (runs on
/// every tier of every kernel) or `any_tier_` (its outcome is the same whatever program
/// sees the opens: run with the first tier of each kernel only). A new test can then
/// never run once when it needed every tier, nor every tier by accident.
#[test]
fn every_test_of_a_tier_suite_names_its_group() {
    for suite in TIER_SUITES {
        let source = std::fs::read_to_string(workspace_root().join(suite)).unwrap();
        let names = test_names(&source);
        assert!(names.len() > 5, "{suite}: read {names:?}");
        let loose = ungrouped(&source);
        assert!(
            loose.is_empty(),
            "{suite}: tests that do not say whether they depend on the BPF tier (name them \
             tier_… or any_tier_…): {loose:?}"
        );
    }
    // The check sees an ungrouped test, behind other attributes too.
    let planted = "#[test]\n#[ignore]\nfn a_new_test() {}\n#[test]\nfn tier_x() {}\n";
    assert_eq!(ungrouped(planted), ["a_new_test"]);
}
