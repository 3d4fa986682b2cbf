//! The code's shape, checked: the daemon's modules depend only downward along the data
//! flow (backends and state → snapshot → rules → report → actions → cycle; the kernel
//! programs → intake → service → alloc → sync → react → daemon → remote → cli); no file
//! or function grows past what a reader can hold at once, test suites included; one name
//! is one type, and its inherent `impl` is in one file. Reads the sources as text, each
//! file to its end; needs no root.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use genv_enforcer_tests::{rust_files, workspace_root};

/// `genv-enforcer/src`'s top-level modules, lowest first: a module may use only
/// modules listed before it. What all use (a warning said once, the clocks, the exit
/// codes, genv's lines made safe for a terminal, the bounds kept against users), the batch path (backends and state → snapshot
/// → rules → report → actions → cycle), then the event side by stage: the kernel
/// programs' handles, the intake of their events, what the daemon publishes as a
/// service, `--memory-at-alloc`'s userspace half, the mirror of the maps with genv's
/// state, the reactions to each event, the daemon's loop; then the fleet and the
/// command line. `notify`, which tells users what
/// was done to their processes and why, sits low: it needs only the backends and the
/// snapshot's index formatting, and the rules, the report, the executor and the kernel's
/// side all report through it.
const LAYERS: [&str; 23] = [
    "warn_once",
    "clock",
    "exit_code",
    "genv_lines",
    "limits",
    "backends",
    "state",
    "snapshot",
    "notify",
    "rules",
    "report",
    "actions",
    "cycle",
    "kernel",
    "intake",
    "service",
    "alloc",
    "sync",
    "react",
    "daemon",
    "remote",
    "doctor",
    "cli",
];

/// Lines of code in a file, not counting its unit tests.
const MAX_FILE_LINES: usize = 400;
const MAX_FUNCTION_LINES: usize = 60;

/// The Rust sources the limits apply to: everything but the test suites and their
/// harness.
const SOURCE_DIRS: [&str; 5] = [
    "genv-enforcer/src",
    "genv-ebpf/src",
    "genv-ebpf-common/src",
    "xtask/src",
    "xtask-vm/src",
];

/// The file's product code: every line but its unit tests, read to the end. An item
/// under `#[cfg(test)]` (a `mod tests;` line, or an item to its last brace) is left out
/// wherever it is, and so are files of unit tests whole (`tests.rs`, `*_tests.rs`, and
/// the helpers under a `test_support` folder).
fn code_lines(path: &Path) -> Vec<String> {
    let name = path.file_name().unwrap().to_str().unwrap();
    let helper = path.iter().any(|part| part == "test_support");
    if name == "tests.rs" || name.ends_with("_tests.rs") || helper {
        return Vec::new();
    }
    without_tests(&std::fs::read_to_string(path).unwrap())
}

/// `text`'s lines without the items under `#[cfg(test)]`.
fn without_tests(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut kept = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim_start().starts_with("#[cfg(test)]") {
            i = after_item(&lines, i + 1);
        } else {
            kept.push(lines[i].to_owned());
            i += 1;
        }
    }
    kept
}

/// The line after the item that starts at `start` (its attributes first): after its
/// `;`, or after the brace that closes its first one.
fn after_item(lines: &[&str], start: usize) -> usize {
    let mut depth = 0i32;
    let mut opened = false;
    for (i, line) in lines.iter().enumerate().skip(start) {
        let code = line.split("//").next().unwrap();
        if !opened && code.trim_start().starts_with("#[") {
            continue;
        }
        for c in code.chars() {
            match c {
                '{' => {
                    depth += 1;
                    opened = true;
                }
                '}' => depth -= 1,
                _ => {}
            }
        }
        if (opened && depth <= 0) || (!opened && code.trim_end().ends_with(';')) {
            return i + 1;
        }
    }
    lines.len()
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
            let name = file.strip_prefix(workspace_root()).unwrap().display();
            too_long.extend(over_bounds(&name.to_string(), &code_lines(&file)));
        }
    }
    assert!(
        too_long.is_empty(),
        "over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function: {too_long:#?}"
    );
}

/// What in a file (`name`, its code `lines`) is over the bounds, one line each.
fn over_bounds(name: &str, lines: &[String]) -> Vec<String> {
    let mut too_long = Vec::new();
    if lines.len() > MAX_FILE_LINES {
        too_long.push(format!("{name}: {} lines", lines.len()));
    }
    for (start, length, signature) in functions(lines) {
        if length > MAX_FUNCTION_LINES {
            too_long.push(format!("{name}:{start}: {signature}: {length} lines"));
        }
    }
    too_long
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

/// A function of `body` lines between its signature and its closing brace, indented
/// as a method.
fn planted_function(body: usize) -> Vec<String> {
    std::iter::once("    pub(crate) fn planted(&self) -> u32 {".to_owned())
        .chain((0..body).map(|i| format!("        let x{i} = {i};")))
        .chain(std::iter::once("    }".to_owned()))
        .collect()
}

#[test]
fn a_function_one_line_over_the_bound_fails() {
    let at_bound = planted_function(MAX_FUNCTION_LINES - 2);
    assert_eq!(over_bounds("planted.rs", &at_bound), Vec::<String>::new());
    let over = planted_function(MAX_FUNCTION_LINES - 1);
    assert_eq!(
        over_bounds("planted.rs", &over),
        [format!(
            "planted.rs:1: pub(crate) fn planted(&self) -> u32 {{: {} lines",
            MAX_FUNCTION_LINES + 1
        )]
    );
}

#[test]
fn a_file_one_line_over_the_bound_fails() {
    let file = |lines: usize| -> Vec<String> { (0..lines).map(|i| format!("// {i}")).collect() };
    assert_eq!(
        over_bounds("planted.rs", &file(MAX_FILE_LINES)),
        Vec::<String>::new()
    );
    assert_eq!(
        over_bounds("planted.rs", &file(MAX_FILE_LINES + 1)),
        [format!("planted.rs: {} lines", MAX_FILE_LINES + 1)]
    );
    // Unit tests after `#[cfg(test)]` are not counted.
    let dir = std::env::temp_dir().join(format!("architecture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("planted.rs");
    let mut text = file(MAX_FILE_LINES).join("\n");
    text.push_str("\n#[cfg(test)]\nmod tests {\n}\n");
    std::fs::write(&path, text).unwrap();
    assert_eq!(code_lines(&path).len(), MAX_FILE_LINES);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Planted files: `(path under src, code)`.
fn planted(files: &[(&str, &str)]) -> Vec<Source> {
    files
        .iter()
        .map(|(path, code)| Source {
            module: module_path(Path::new(path)),
            code: (*code).to_owned(),
        })
        .collect()
}

#[test]
fn a_circle_inside_a_folder_fails() {
    // Two files that use each other, one through a `use` group spread over lines.
    let two = planted(&[
        ("a/mod.rs", "mod x;\nmod y;\n"),
        ("a/x.rs", "use super::y::Thing;\n"),
        (
            "a/y.rs",
            "use super::{\n    other,\n    x::{self, f as g},\n};\n",
        ),
    ]);
    assert_eq!(circles(&sibling_uses(&two)), ["a: x -> y -> x"]);
    // Three, by `crate::` paths, one of them deeper (`a/z/inner.rs` is part of `z`),
    // and one through a name the parent re-exports from its child.
    let three = planted(&[
        ("a/mod.rs", "mod x;\nmod y;\nmod z;\npub use x::Shared;\n"),
        ("a/x.rs", "fn f() { crate::a::y::g() }\n"),
        ("a/y.rs", "use crate::a::z::inner::h;\n"),
        ("a/z.rs", "mod inner;\n"),
        ("a/z/inner.rs", "use super::super::Shared;\n"),
    ]);
    assert_eq!(circles(&sibling_uses(&three)), ["a: x -> y -> z -> x"]);
    // Not circles: a parent and its children (`super::Item` from a child, the parent
    // declaring and using it), a chain one way, and the same names in comments.
    let fine = planted(&[
        (
            "a/mod.rs",
            "mod x;\nmod y;\npub struct Item;\nfn f() { x::run() }\n",
        ),
        ("a/x.rs", "use super::Item;\nuse super::y::leaf;\n"),
        ("a/y.rs", "use super::Item;\n"),
    ]);
    assert_eq!(circles(&sibling_uses(&fine)), Vec::<String>::new());
}

/// A module's path from the crate root, from its file's path under `src`:
/// `kernel/cuda/library.rs` → `[kernel, cuda, library]`, `kernel/mod.rs` → `[kernel]`.
fn module_path(relative: &Path) -> Vec<String> {
    let mut path: Vec<String> = relative
        .iter()
        .map(|part| part.to_str().unwrap().trim_end_matches(".rs").to_owned())
        .collect();
    if matches!(
        path.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        path.pop();
    }
    path
}

/// Code without its comments, up to the unit tests, as one text (a `use` may span
/// lines).
fn code_text(lines: &[String]) -> String {
    let code: Vec<&str> = lines
        .iter()
        .map(|l| l.split("//").next().unwrap())
        .collect();
    code.join("\n")
}

/// Every path a code text names from `crate::`, `super::` or `self::`, or from `from`
/// (a bare first segment, as a parent's `pub use child::…` names its children), with
/// `{…}` groups spelt out: `use super::{a, b::{C, D as E}}` gives `super::a`,
/// `super::b::C` and `super::b::E`'s path (the name it is known by last).
fn named_paths(code: &str, from: &[&str]) -> Vec<Vec<String>> {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let bytes: Vec<char> = code.chars().collect();
    let mut found = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let starts_word = at == 0 || !(ident(bytes[at - 1]) || bytes[at - 1] == ':');
        let word: String = bytes[at..].iter().take_while(|c| ident(**c)).collect();
        let is_root =
            ["crate", "super", "self"].contains(&word.as_str()) || from.contains(&word.as_str());
        let then_path = bytes[at + word.len()..].starts_with(&[':', ':']);
        if starts_word && !word.is_empty() && is_root && then_path {
            let (paths, end) = path_tree(&bytes, at);
            found.extend(paths);
            at = end;
        } else {
            at += word.len().max(1);
        }
    }
    found
}

/// The paths of the tree starting at `bytes[at]` (`a::b::{c, d::e}`), and where it ends.
fn path_tree(bytes: &[char], mut at: usize) -> (Vec<Vec<String>>, usize) {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let skip_space = |at: &mut usize| {
        while *at < bytes.len() && bytes[*at].is_whitespace() {
            *at += 1;
        }
    };
    let mut prefix = Vec::new();
    loop {
        skip_space(&mut at);
        if bytes.get(at) == Some(&'{') {
            at += 1;
            let mut paths = Vec::new();
            loop {
                skip_space(&mut at);
                match bytes.get(at) {
                    Some('}') => return (paths, at + 1),
                    Some(',') => at += 1,
                    None => return (paths, at),
                    _ => {
                        let (inner, end) = path_tree(bytes, at);
                        for tail in inner {
                            let whole: Vec<String> = prefix.iter().cloned().chain(tail).collect();
                            paths.push(whole);
                        }
                        at = end;
                    }
                }
            }
        }
        let word: String = bytes[at..].iter().take_while(|c| ident(**c)).collect();
        if word.is_empty() {
            return (vec![prefix], at);
        }
        at += word.len();
        prefix.push(word);
        skip_space(&mut at);
        if bytes[at..].starts_with(&[':', ':']) {
            at += 2;
            continue;
        }
        // `x as y`: known by `y` from here on.
        let rest: String = bytes[at..].iter().take(3).collect();
        if rest == "as " {
            at += 3;
            skip_space(&mut at);
            let alias: String = bytes[at..].iter().take_while(|c| ident(**c)).collect();
            at += alias.len();
            if let Some(last) = prefix.last_mut() {
                *last = alias;
            }
        }
        return (vec![prefix], at);
    }
}

/// The `pub use …;` statements of `code`: what a module re-exports (a call such as
/// `child::run()` in a crate's root is a use of the child, not a re-export of `run`).
fn reexports(code: &str) -> String {
    let mut found = String::new();
    for (at, _) in code.match_indices("use ") {
        let before = code[..at].trim_end();
        if ["pub", "pub(crate)", "pub(super)"]
            .iter()
            .any(|v| before.ends_with(v))
        {
            let end = code[at..].find(';').map_or(code.len(), |e| at + e + 1);
            found.push_str(&code[at..end]);
            found.push('\n');
        }
    }
    found
}

/// `path` (as written in module `module`) from the crate root; `None` for a bare path
/// (an outside crate, or a name brought in by a `use`, which is itself followed).
fn absolute(module: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut base = module.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                base.pop()?;
                rest = &rest[1..];
            }
        }
        _ => return None,
    }
    Some(base.into_iter().chain(rest.iter().cloned()).collect())
}

/// A file's module path and code (comments and unit tests left out).
struct Source {
    module: Vec<String>,
    code: String,
}

fn sources(src: &Path) -> Vec<Source> {
    rust_files(src)
        .into_iter()
        .map(|file| Source {
            module: module_path(file.strip_prefix(src).unwrap()),
            code: code_text(&code_lines(&file)),
        })
        .collect()
}

/// Within each module, which of its child modules use which: `(parent, user, used)`.
/// A child's use of a name its parent re-exports (`pub use child::Name`) counts as a
/// use of the child that defines it; the parent itself (a folder's `mod.rs`, which
/// declares the children and may hold what they share) is no member of the graph.
fn sibling_uses(sources: &[Source]) -> BTreeSet<(Vec<String>, String, String)> {
    let modules: BTreeSet<&[String]> = sources.iter().map(|s| s.module.as_slice()).collect();
    let children = |parent: &[String]| -> Vec<String> {
        modules
            .iter()
            .filter(|m| m.len() == parent.len() + 1 && m.starts_with(parent))
            .map(|m| m.last().unwrap().clone())
            .collect()
    };
    // Names a parent re-exports, by the child they come from.
    let mut reexported: BTreeMap<(Vec<String>, String), String> = BTreeMap::new();
    for source in sources {
        let kids = children(&source.module);
        let kids: Vec<&str> = kids.iter().map(String::as_str).collect();
        for path in named_paths(&reexports(&source.code), &kids) {
            if path.len() > 1 && kids.contains(&path[0].as_str()) {
                let name = path.last().unwrap().clone();
                reexported.insert((source.module.clone(), name), path[0].clone());
            }
        }
    }
    let mut uses = BTreeSet::new();
    for source in sources {
        for path in named_paths(&source.code, &[]) {
            let Some(target) = absolute(&source.module, &path) else {
                continue;
            };
            let common = source
                .module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            // Both below the module they share, in different children of it.
            let (Some(user), Some(used)) = (source.module.get(common), target.get(common)) else {
                continue;
            };
            let parent = source.module[..common].to_vec();
            let used = if modules.contains(&target[..=common]) {
                used.clone()
            } else if let Some(child) = reexported.get(&(parent.clone(), used.clone())) {
                child.clone()
            } else {
                continue; // an item the parent itself defines
            };
            if *user != used {
                uses.insert((parent, user.clone(), used));
            }
        }
    }
    uses
}

/// Each circle among siblings, as `parent: a -> b -> a` (one per group of modules that
/// reach each other).
fn circles(uses: &BTreeSet<(Vec<String>, String, String)>) -> Vec<String> {
    let mut by_parent: BTreeMap<&Vec<String>, BTreeMap<&str, Vec<&str>>> = BTreeMap::new();
    for (parent, user, used) in uses {
        let graph = by_parent.entry(parent).or_default();
        graph.entry(user.as_str()).or_default().push(used.as_str());
    }
    let mut found = Vec::new();
    for (parent, graph) in by_parent {
        let mut reported: BTreeSet<&str> = BTreeSet::new();
        for &start in graph.keys() {
            if reported.contains(start) {
                continue;
            }
            if let Some(circle) = path_back(&graph, start) {
                reported.extend(circle.iter().copied());
                let folder = if parent.is_empty() {
                    "src".to_owned()
                } else {
                    parent.join("/")
                };
                found.push(format!("{folder}: {} -> {start}", circle.join(" -> ")));
            }
        }
    }
    found
}

/// A way from `start` back to itself through `graph`, breadth first (the shortest).
fn path_back<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>, start: &'a str) -> Option<Vec<&'a str>> {
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(at) = queue.pop_front() {
        for &next in graph.get(at).map_or(&[][..], Vec::as_slice) {
            if next == start {
                let mut circle = vec![at];
                while let Some(&before) = came_from.get(circle.last().unwrap()) {
                    circle.push(before);
                }
                circle.reverse();
                return Some(circle);
            }
            if next != start && !came_from.contains_key(next) {
                came_from.insert(next, at);
                queue.push_back(next);
            }
        }
    }
    None
}

/// No two files of a folder use each other, directly or through others of it: each
/// folder reads in one direction too, from the files that use to the files used.
#[test]
fn no_folder_has_a_circle() {
    let mut found = Vec::new();
    for dir in SOURCE_DIRS {
        let uses = sibling_uses(&sources(&workspace_root().join(dir)));
        found.extend(circles(&uses).into_iter().map(|c| format!("{dir}: {c}")));
    }
    assert!(
        found.is_empty(),
        "files that use each other (move what both need into a file of its own): {found:#?}"
    );
}

/// The suites whose tests run on every BPF tier in the VM: `xtask-vm`'s `TIER_SUITES`,
/// read from its source (one list, kept there).
fn tier_suites() -> Vec<String> {
    let source = std::fs::read_to_string(workspace_root().join("xtask-vm/src/lib.rs")).unwrap();
    let line = source
        .lines()
        .find(|l| l.starts_with("pub const TIER_SUITES"))
        .expect("xtask-vm/src/lib.rs defines TIER_SUITES on one line");
    let list = line.split('=').nth(1).unwrap();
    let suites: Vec<String> = list
        .split('"')
        .skip(1)
        .step_by(2)
        .map(|name| format!("tests/{name}.rs"))
        .collect();
    assert!(suites.len() >= 3, "TIER_SUITES read as {suites:?}");
    suites
}

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

/// The groups of the tier suites' tests (`xtask-vm`'s `GROUPS`), longest first: a name
/// is in the group of the longest prefix it starts with.
const GROUPS: [&str; 4] = ["each_tier_", "any_tier_", "kernel_", "tier_"];
/// The groups the VM skips somewhere with libtest's `--skip`, which matches anywhere in a
/// name, not only at its start.
const SKIPPED_GROUPS: [&str; 3] = ["each_tier_", "any_tier_", "kernel_"];

/// Tests in the tier suites that do not say whether they depend on the tier.
fn ungrouped(source: &str) -> Vec<String> {
    test_names(source)
        .into_iter()
        .filter(|n| !GROUPS.iter().any(|g| n.starts_with(g)))
        .collect()
}

/// Tests whose name holds, after its own group's prefix, the prefix of another group the
/// VM skips: `--skip kernel_` would skip `tier_…_the_kernel_decided…` too.
fn skipped_by_another_group(source: &str) -> Vec<String> {
    test_names(source)
        .into_iter()
        .filter(|n| {
            let own = GROUPS.iter().find(|g| n.starts_with(*g)).copied();
            let rest = &n[own.map_or(0, str::len)..];
            (SKIPPED_GROUPS.iter()).any(|g| Some(*g) != own && rest.contains(g))
        })
        .collect()
}

/// Every test of a tier suite says in its name which group it is in, and so where it
/// runs (`xtask-vm`'s `TIER_SUITES`, `docs/dev/testing.md`): `tier_` (every tier of every
/// kernel), `each_tier_` (every tier of one kernel), `kernel_` (the first tier of each
/// kernel) or `any_tier_` (the host). A new test can then never run once when it needed
/// every tier, nor every tier by accident; and no name holds another group's prefix,
/// which the VM's `--skip` would match.
#[test]
fn every_test_of_a_tier_suite_names_its_group() {
    for suite in tier_suites() {
        let source = std::fs::read_to_string(workspace_root().join(&suite)).unwrap();
        let names = test_names(&source);
        assert!(names.len() > 5, "{suite}: read {names:?}");
        let loose = ungrouped(&source);
        assert!(
            loose.is_empty(),
            "{suite}: tests that do not say whether they depend on the BPF tier (name them \
             tier_…, each_tier_…, kernel_… or any_tier_…): {loose:?}"
        );
        let caught = skipped_by_another_group(&source);
        assert!(
            caught.is_empty(),
            "{suite}: tests whose name holds another group's prefix, which `--skip` matches \
             anywhere (reword them): {caught:?}"
        );
    }
    // The check sees an ungrouped test, behind other attributes too.
    let planted = "#[test]\n#[ignore]\nfn a_new_test() {}\n#[test]\nfn tier_x() {}\n";
    assert_eq!(ungrouped(planted), ["a_new_test"]);
    // And a name another group's `--skip` would catch, but not a group's own prefix.
    let planted = "#[test]\nfn tier_why_the_kernel_decided() {}\n\
                   #[test]\nfn each_tier_x() {}\n#[test]\nfn kernel_the_kernel_x() {}\n";
    assert_eq!(
        skipped_by_another_group(planted),
        ["tier_why_the_kernel_decided"]
    );
}

/// The crates whose product code must keep one name to one type, and each type's
/// inherent `impl` in one file.
const PRODUCT_CRATES: [&str; 3] = ["genv-enforcer/src", "genv-ebpf/src", "genv-ebpf-common/src"];

/// The type a line defines (`struct`, `enum`, `union`, `trait`), if it defines one.
fn defined_type(line: &str) -> Option<String> {
    let mut rest = line.trim_start();
    for visibility in ["pub(crate) ", "pub(super) ", "pub "] {
        rest = rest.strip_prefix(visibility).unwrap_or(rest);
    }
    let rest = ["struct ", "enum ", "union ", "trait "]
        .iter()
        .find_map(|kind| rest.strip_prefix(kind))?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The type an inherent `impl` block is for (`impl<T> Name<T> {`), if the line opens
/// one; trait impls (`impl Trait for Name`) are not inherent.
fn inherent_impl(line: &str) -> Option<String> {
    let rest = line.trim_start().strip_prefix("impl")?;
    let rest = match rest.strip_prefix('<') {
        Some(generics) => {
            let mut depth = 1;
            let end = generics.char_indices().find_map(|(i, c)| {
                match c {
                    '<' => depth += 1,
                    '>' => depth -= 1,
                    _ => {}
                }
                (depth == 0).then_some(i + 1)
            })?;
            &generics[end..]
        }
        None => rest,
    };
    if !rest.starts_with(' ') {
        return None; // `implement…`, not `impl`
    }
    let header = rest.split('{').next().unwrap();
    if header.contains(" for ") {
        return None;
    }
    let name: String = header
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// Each name's files, for what `find` finds in each file's product code.
fn by_name(
    files: &[(String, Vec<String>)],
    find: fn(&str) -> Option<String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mut found: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, lines) in files {
        for name in lines.iter().filter_map(|l| find(l)) {
            found.entry(name).or_default().insert(file.clone());
        }
    }
    found
}

/// Names defined in more than one file (`defines`: every definition, with repeats).
fn shared_names(defines: &[(String, String)]) -> Vec<String> {
    let mut files: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (file, name) in defines {
        files.entry(name).or_default().push(file);
    }
    files
        .into_iter()
        .filter(|(_, places)| places.len() > 1)
        .map(|(name, places)| format!("{name}: {}", places.join(", ")))
        .collect()
}

fn product_files(dir: &str) -> Vec<(String, Vec<String>)> {
    let root = workspace_root().join(dir);
    rust_files(&root)
        .into_iter()
        .map(|file| {
            let name = file
                .strip_prefix(workspace_root())
                .unwrap()
                .display()
                .to_string();
            (name, code_lines(&file))
        })
        .collect()
}

/// What breaks "one name, one type, one file for its inherent `impl`" in `files`.
fn one_name_one_type(files: &[(String, Vec<String>)]) -> Vec<String> {
    let defines: Vec<(String, String)> = files
        .iter()
        .flat_map(|(file, lines)| {
            lines
                .iter()
                .filter_map(|l| defined_type(l))
                .map(move |name| (file.clone(), name))
        })
        .collect();
    let mut broken: Vec<String> = shared_names(&defines)
        .into_iter()
        .map(|line| format!("two types share a name: {line}"))
        .collect();
    for (name, places) in by_name(files, inherent_impl) {
        if places.len() > 1 {
            let places: Vec<&str> = places.iter().map(String::as_str).collect();
            broken.push(format!(
                "{name}'s inherent impl spans files: {}",
                places.join(", ")
            ));
        }
    }
    broken
}

/// A type's methods are found in one file, under one name: a reader who finds `Mirror`
/// finds all it does, and no other `Mirror`.
#[test]
fn one_name_one_type_and_one_file_for_its_impl() {
    let mut broken = Vec::new();
    for dir in PRODUCT_CRATES {
        broken.extend(one_name_one_type(&product_files(dir)));
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

#[test]
fn a_second_type_of_one_name_or_a_split_impl_fails() {
    let file = |name: &str, text: &str| (name.to_owned(), without_tests(text));
    let planted = [
        file("a.rs", "pub struct Item;\nimpl Item {\n    fn f() {}\n}\n"),
        file(
            "b.rs",
            "pub(crate) enum Item {}\nimpl<T: Copy> Holder<T> {}\n",
        ),
        file("c.rs", "impl<T> Holder<T> {\n}\nimpl Clone for Item {}\n"),
        file(
            "d.rs",
            "#[cfg(test)]\nmod tests {\n    struct Item;\n}\nstruct Other;\n",
        ),
    ];
    assert_eq!(
        one_name_one_type(&planted),
        [
            "two types share a name: Item: a.rs, b.rs",
            "Holder's inherent impl spans files: b.rs, c.rs",
        ]
    );
}

/// The product code after a `#[cfg(test)]` item is read: a `mod tests;` line, or a test
/// module in the middle of a file, hides nothing after it.
#[test]
fn code_after_a_test_item_is_read() {
    let text = "mod a;\n#[cfg(test)]\nmod tests;\nuse crate::cli::x;\n#[cfg(test)]\n#[allow(dead_code)]\nfn helper() {\n    if x {\n    }\n}\nfn after() {}\n";
    let lines = without_tests(text);
    assert_eq!(lines, ["mod a;", "use crate::cli::x;", "fn after() {}"]);
    assert_eq!(crate_modules(&lines), ["cli"]);
}

/// A test suite's file, lines in all (its setup is part of what a reader must hold).
const MAX_SUITE_LINES: usize = 1000;
/// One test's function, or one helper's: a scenario a reader follows to its end.
const MAX_TEST_FUNCTION_LINES: usize = 120;

/// The test suites and their harness: `tests/*.rs`, their modules, and `tests/src`.
fn suite_files() -> Vec<PathBuf> {
    let tests = workspace_root().join("tests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&tests)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    for dir in ["src", "remote"] {
        files.extend(rust_files(&tests.join(dir)));
    }
    files.sort();
    files
}

/// What in a suite's file (`name`, all its `lines`) is over the suites' bounds.
fn suite_over_bounds(name: &str, lines: &[String]) -> Vec<String> {
    let mut too_long = Vec::new();
    if lines.len() > MAX_SUITE_LINES {
        too_long.push(format!("{name}: {} lines", lines.len()));
    }
    for (start, length, signature) in functions(lines) {
        if length > MAX_TEST_FUNCTION_LINES {
            too_long.push(format!("{name}:{start}: {signature}: {length} lines"));
        }
    }
    too_long
}

/// The suites have bounds of their own, looser than the product's (a scenario's setup
/// is spelt out): a suite past them is split by what its tests prove, and what suites
/// share goes to the harness.
#[test]
fn test_suites_and_their_tests_stay_small() {
    let mut too_long = Vec::new();
    for file in suite_files() {
        let name = file.strip_prefix(workspace_root()).unwrap().display();
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        too_long.extend(suite_over_bounds(&name.to_string(), &lines));
    }
    assert!(
        too_long.is_empty(),
        "over {MAX_SUITE_LINES} lines a suite or {MAX_TEST_FUNCTION_LINES} a test: {too_long:#?}"
    );
}

#[test]
fn a_suite_or_a_test_one_line_over_its_bound_fails() {
    let test = |body: usize| -> Vec<String> {
        std::iter::once("#[test]".to_owned())
            .chain(std::iter::once("fn planted() {".to_owned()))
            .chain((0..body).map(|i| format!("    let _x{i} = {i};")))
            .chain(std::iter::once("}".to_owned()))
            .collect()
    };
    assert!(suite_over_bounds("s.rs", &test(MAX_TEST_FUNCTION_LINES - 2)).is_empty());
    let over = MAX_TEST_FUNCTION_LINES + 1;
    assert_eq!(
        suite_over_bounds("s.rs", &test(MAX_TEST_FUNCTION_LINES - 1)),
        [format!("s.rs:2: fn planted() {{: {over} lines")]
    );
    let suite: Vec<String> = (0..=MAX_SUITE_LINES).map(|_| String::new()).collect();
    assert_eq!(
        suite_over_bounds("s.rs", &suite),
        [format!("s.rs: {} lines", MAX_SUITE_LINES + 1)]
    );
    assert!(suite_over_bounds("s.rs", &suite[1..]).is_empty());
}
