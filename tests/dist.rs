//! `cargo xtask dist`'s four artefacts, as a node gets them: run once per suite (cached
//! under `target/dist/`, copied here before any test reads them), then checked:
//! the same bytes from a second run; a binary that needs no glibc above 2.28 and is the
//! same in all four; `lintian` on the `.deb` with every remaining tag explained; a
//! manual page for every command of the packaged binary, naming every flag, that `man`
//! finds from the `.deb`'s files (`man genv-enforcer enforce`); the RPM
//! installed with `rpm --root` holding exactly the `.deb`'s files, as do the tarball and
//! `cargo xtask install` (the one list, `xtask/src/layout.rs`); and the wheel in a fresh
//! venv beside genv 1.4.3, whose `genv-enforcer` enforces the demo's scenario.
//!
//! The `.deb` under systemd (`dpkg -i`, the unit, `dpkg -r` and `--purge`) is the
//! `systemd_unit` suite's, in the VM.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::events::{EventDaemon, make_gpu_node_for};
use genv_enforcer_tests::{
    Node, device_record, env_record, rust_files, target_dir, unique, workspace_root, xtask,
};
use serde_json::json;

const VERSION: &str = env!("CARGO_PKG_VERSION");

struct Dist {
    /// A copy of the first run's artefacts (a second run rewrites `target/dist`).
    dir: PathBuf,
}

impl Dist {
    fn deb(&self) -> PathBuf {
        self.dir.join(format!("genv-enforcer_{VERSION}_amd64.deb"))
    }
    fn rpm(&self) -> PathBuf {
        self.dir
            .join(format!("genv-enforcer-{VERSION}-1.x86_64.rpm"))
    }
    fn wheel(&self) -> PathBuf {
        (self.dir).join(format!(
            "genv_enforcer-{VERSION}-py3-none-manylinux_2_28_x86_64.whl"
        ))
    }
    fn tarball(&self) -> PathBuf {
        (self.dir).join(format!("genv-enforcer-{VERSION}-x86_64-linux-gnu.tar.gz"))
    }
    fn all(&self) -> [PathBuf; 4] {
        [self.deb(), self.rpm(), self.wheel(), self.tarball()]
    }
}

/// The cargo target directory `cargo xtask dist` writes into (`target/dist`).
fn out_dir() -> PathBuf {
    target_dir().parent().unwrap().join("dist")
}

fn xtask_dist() {
    let status = xtask().arg("dist").status().unwrap();
    assert!(status.success(), "cargo xtask dist failed");
}

fn dist() -> &'static Dist {
    static DIST: OnceLock<Dist> = OnceLock::new();
    DIST.get_or_init(|| {
        xtask_dist();
        // One place, replaced by each run of the suite, so that no copy is left over.
        let dir = target_dir().join("dist-test-artefacts");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let dist = Dist { dir };
        for artefact in dist.all() {
            let name = artefact.file_name().unwrap();
            std::fs::copy(out_dir().join(name), &artefact)
                .unwrap_or_else(|e| panic!("cargo xtask dist made no {name:?}: {e}"));
        }
        dist
    })
}

/// A new directory under the target directory (`/tmp` may be noexec or small).
fn scratch(what: &str) -> PathBuf {
    let dir = target_dir().join(format!(
        "dist-test-{}-{what}-{}",
        std::process::id(),
        unique()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn output(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sha256(path: &Path) -> String {
    output("sha256sum", &[path.to_str().unwrap()])[..64].to_owned()
}

/// The `.deb`'s contents, extracted.
fn deb_tree() -> PathBuf {
    let tree = scratch("deb");
    let tree_arg = tree.to_str().unwrap();
    output(
        "dpkg-deb",
        &["-x", dist().deb().to_str().unwrap(), tree_arg],
    );
    tree
}

#[test]
fn dist_makes_the_same_bytes_twice() {
    let first: Vec<String> = dist().all().iter().map(|a| sha256(a)).collect();
    xtask_dist();
    for (artefact, hash) in dist().all().iter().zip(&first) {
        let again = out_dir().join(artefact.file_name().unwrap());
        assert_eq!(
            &sha256(&again),
            hash,
            "{} differs from the first run's",
            again.display()
        );
    }
}

/// The newest `GLIBC_x.y` among `objdump -T`'s symbol versions.
fn newest_glibc(binary: &Path) -> (u32, u32) {
    let symbols = output("objdump", &["-T", binary.to_str().unwrap()]);
    (symbols.split(|c: char| c.is_whitespace() || c == '(' || c == ')'))
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
            Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
        })
        .max()
        .expect("no GLIBC_ symbol versions: not linked against glibc")
}

#[test]
fn the_binary_needs_no_glibc_above_2_28_and_is_the_same_in_every_artefact() {
    let tree = deb_tree();
    let binary = tree.join("usr/bin/genv-enforcer");
    let newest = newest_glibc(&binary);
    assert!(newest <= (2, 28), "needs glibc {newest:?}, above 2.28");
    let dynamic = output("readelf", &["-d", binary.to_str().unwrap()]);
    assert!(
        dynamic.contains("Shared library: [libc.so.6]"),
        "not dynamically linked against glibc (NVML is dlopen'ed): {dynamic}"
    );
    // The tarball's and the wheel's binary are the same bytes.
    let other = scratch("others");
    let other_arg = other.to_str().unwrap();
    output(
        "tar",
        &["-xzf", dist().tarball().to_str().unwrap(), "-C", other_arg],
    );
    output(
        "python3",
        &[
            "-m",
            "zipfile",
            "-e",
            dist().wheel().to_str().unwrap(),
            other_arg,
        ],
    );
    let hash = sha256(&binary);
    for copy in [
        other.join(format!(
            "genv-enforcer-{VERSION}-x86_64-linux-gnu/root/usr/bin/genv-enforcer"
        )),
        other.join(format!(
            "genv_enforcer-{VERSION}.data/scripts/genv-enforcer"
        )),
    ] {
        assert_eq!(sha256(&copy), hash, "{}", copy.display());
    }
    let _ = std::fs::remove_dir_all(tree);
    let _ = std::fs::remove_dir_all(other);
}

/// lintian's tags on the `.deb` that are explained (the README's packaging note):
/// rustc's `.comment` section; no
/// `_FORTIFY_SOURCE` functions (Rust calls none); no init.d script (the daemon's
/// service is systemd's `Type=notify` unit); and, experimental, the front in `/usr/lib`
/// (its directory goes first on users' `PATH` and holds only `genv`: where the issue
/// and `cargo xtask install` put it, `/usr/libexec` would do as well). lintian's spelling
/// check of the binary is explained only where the word it found is written nowhere in
/// our sources ([`misspelt_words_are_ours`]).
const EXPLAINED: [&str; 4] = [
    "executable-in-usr-lib",
    "binary-has-unneeded-section",
    "hardening-no-fortify-functions",
    "package-supports-alternative-init-but-no-init.d-script",
];

/// lintian's spelling check of a binary: it matches words anywhere in the file's bytes,
/// machine code and tables included.
const SPELLING: &str = "spelling-error-in-binary";

/// The words lintian's spelling check found in the binary (`I: genv-enforcer:
/// spelling-error-in-binary wTH with [usr/bin/genv-enforcer]`) that the product's own
/// sources write: a real misspelling in one of our messages. A word written nowhere in
/// them is bytes of code or data that happen to spell it (`wTH`), not a message.
fn misspelt_words_are_ours(lintian: &str) -> Vec<String> {
    let sources: Vec<String> = ["genv-enforcer/src", "genv-ebpf-common/src"]
        .iter()
        .flat_map(|dir| rust_files(&workspace_root().join(dir)))
        .map(|file| std::fs::read_to_string(file).unwrap())
        .collect();
    lintian
        .lines()
        .filter_map(|l| l.split(&format!("{SPELLING} ")).nth(1))
        .filter_map(|rest| rest.split(' ').next())
        .filter(|word| sources.iter().any(|text| text.contains(word)))
        .map(str::to_owned)
        .collect()
}

/// lintian's warning for a command a maintainer script runs by its path. The prerm runs
/// the package's own binary so (`/usr/bin/genv-enforcer unpin`): through `PATH`, a copy
/// earlier there (`cargo xtask install`'s `/usr/local/bin`) would be what removes the
/// pins; the tag's text allows a path the package controls. Explained for that binary
/// alone ([`by_path_only_ours`]).
const BY_PATH: &str = "command-with-path-in-maintainer-script";

/// Whether every command lintian found run by its path is the package's own binary.
fn by_path_only_ours(lintian: &str) -> bool {
    (lintian.lines())
        .filter_map(|l| l.split(&format!("{BY_PATH} ")).nth(1))
        .all(|rest| rest.starts_with("/usr/bin/genv-enforcer "))
}

#[test]
fn a_misspelling_lintian_finds_counts_only_in_our_own_words() {
    let line =
        |word: &str| format!("I: genv-enforcer: {SPELLING} {word} with [usr/bin/genv-enforcer]");
    assert!(
        misspelt_words_are_ours(&line("wTH")).is_empty(),
        "bytes that spell it"
    );
    assert_eq!(
        misspelt_words_are_ours(&line("Terminating")),
        ["Terminating"],
        "a word of our messages is ours to fix"
    );
}

#[test]
fn a_command_lintian_finds_run_by_its_path_is_explained_only_for_ours() {
    let line =
        |command: &str| format!("W: genv-enforcer: {BY_PATH} {command} (plain script) [prerm:9]\n");
    assert!(by_path_only_ours(&line("/usr/bin/genv-enforcer")));
    let both = line("/usr/bin/genv-enforcer") + &line("/usr/bin/systemctl");
    assert!(!by_path_only_ours(&both));
}

/// Debian's `package`, installed unless its `program` answers `--version`.
fn apt_install(package: &str, program: &str) {
    if Command::new(program).arg("--version").output().is_err() {
        let status = Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .unwrap();
        assert!(status.success(), "apt-get install {package} failed");
    }
}

#[test]
fn lintian_finds_nothing_unexplained_in_the_deb() {
    apt_install("lintian", "lintian");
    let out = Command::new("lintian")
        .args(["--display-info", "--pedantic", "--display-experimental"])
        .arg(dist().deb())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!("lintian:\n{said}");
    let tags: BTreeSet<&str> = (said.lines())
        .filter(|l| {
            ["E: ", "W: ", "I: ", "P: ", "X: "]
                .iter()
                .any(|k| l.starts_with(k))
        })
        .filter_map(|l| l.split(": ").nth(2)?.split(' ').next())
        .collect();
    let unexplained: Vec<&&str> = tags
        .iter()
        .filter(|t| !EXPLAINED.contains(t))
        .filter(|t| **t != SPELLING || !misspelt_words_are_ours(&said).is_empty())
        .filter(|t| **t != BY_PATH || !by_path_only_ours(&said))
        .collect();
    assert!(
        unexplained.is_empty(),
        "lintian: {unexplained:?} in\n{said}"
    );
    assert!(!said.lines().any(|l| l.starts_with("E: ")), "{said}");
}

/// The packaged binary's commands at every depth, as `-h` lists them under
/// `Commands:` (clap's own `help` left out), each as its words after `genv-enforcer`.
fn commands(binary: &Path, path: Vec<String>, found: &mut Vec<Vec<String>>) {
    let help = help(binary, &path);
    let mut listed = false;
    for line in help.lines() {
        if !line.starts_with(' ') {
            listed = line == "Commands:";
        } else if let Some(name) = line.split_whitespace().next().filter(|_| listed) {
            if name != "help" {
                let sub = [path.clone(), vec![name.to_owned()]].concat();
                commands(binary, sub, found);
            }
        }
    }
    found.push(path);
}

fn help(binary: &Path, path: &[String]) -> String {
    let out = Command::new(binary).args(path).arg("-h").output().unwrap();
    assert!(out.status.success(), "{path:?} -h: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The flags `-h` lists: each option line's `-v` and `--verbose` (an option line is
/// indented 2 with a short flag, 6 without; its help follows two spaces on).
fn flags(help: &str) -> Vec<String> {
    (help.lines())
        .filter(|l| l.starts_with("  -") || l.starts_with("      --"))
        .flat_map(|l| {
            let spec = l.trim_start().split("  ").next().unwrap();
            spec.split(", ")
                .map(|f| f.split([' ', '=', '<', '[']).next().unwrap().to_owned())
        })
        .collect()
}

/// A manual page's text, gzip'd roff: escaped hyphens (`\-`) and font changes out.
fn page_text(page: &Path) -> String {
    let roff = output("gzip", &["-dc", page.to_str().unwrap()]);
    (roff
        .replace("\\-", "-")
        .replace("\\fB", "")
        .replace("\\fI", ""))
    .replace("\\fR", "")
}

/// Whether `text` holds `flag` as a whole word (`--deny`, not `--deny-root`).
fn names_flag(text: &str, flag: &str) -> bool {
    text.match_indices(flag).any(|(at, _)| {
        let next = text[at + flag.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

/// Every command of the binary the `.deb` ships, nested ones included, has its page in
/// the `.deb` (`genv-enforcer-remote-enforce.1.gz`), naming every flag its `-h` lists.
#[test]
fn every_flag_of_every_command_is_in_its_manual_page() {
    let tree = deb_tree();
    let binary = tree.join("usr/bin/genv-enforcer");
    let mut found = vec![];
    commands(&binary, vec![], &mut found);
    assert!(
        found.contains(&vec!["remote".into(), "enforce".into()]),
        "{found:?}"
    );
    for path in found {
        let name = [vec!["genv-enforcer".to_owned()], path.clone()]
            .concat()
            .join("-");
        let page = tree.join(format!("usr/share/man/man1/{name}.1.gz"));
        assert!(page.exists(), "no {}", page.display());
        let text = page_text(&page);
        let flags = flags(&help(&binary, &path));
        assert!(flags.contains(&"--help".to_owned()), "{path:?}: {flags:?}");
        for flag in flags {
            assert!(names_flag(&text, &flag), "{name}(1) does not name {flag}");
        }
    }
    let _ = std::fs::remove_dir_all(tree);
}

/// `man genv-enforcer enforce` (man-db's page for a command's subcommand), `man genv`
/// and `man 5 genv-enforcer.conf`, from the `.deb`'s files.
#[test]
fn man_finds_the_debs_pages_by_command() {
    apt_install("man-db", "man");
    let tree = deb_tree();
    for (words, expected) in [
        (
            &["genv-enforcer", "enforce"][..],
            "genv-enforcer-enforce - Enforce GPU usage",
        ),
        (&["genv"], "genv-enforcer's genv-compatible front"),
        (
            &["5", "genv-enforcer.conf"],
            "max-devices-for-user = [USERNAME=MAXIMUM",
        ),
    ] {
        let out = Command::new("man")
            .arg("-M")
            .arg(tree.join("usr/share/man"))
            .args(words)
            .env("MANWIDTH", "200")
            .env("LC_ALL", "C.UTF-8")
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "man {words:?}: {out:?}");
        assert!(said.contains(expected), "man {words:?}:\n{said}");
    }
    let _ = std::fs::remove_dir_all(tree);
}

/// Every non-directory path under `root`, with what it is (a file's hash, a link's
/// target resolved to an absolute path).
fn contents(root: &Path) -> Vec<(String, String)> {
    let mut found = vec![];
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = path.symlink_metadata().unwrap();
            let name = format!("/{}", path.strip_prefix(root).unwrap().display());
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_symlink() {
                let target = std::fs::read_link(&path).unwrap();
                let at = Path::new(&name).parent().unwrap().join(target);
                found.push((name, format!("-> {}", normal(&at))));
            } else {
                found.push((name, sha256(&path)));
            }
        }
    }
    found.sort();
    found
}

/// `/usr/sbin/../lib/x` → `/usr/lib/x`.
fn normal(path: &Path) -> String {
    let mut parts: Vec<&str> = vec![];
    for part in path.to_str().unwrap().split('/').filter(|p| !p.is_empty()) {
        match part {
            ".." => drop(parts.pop()),
            "." => {}
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

/// What the package database says the package owns that is not a directory.
fn owned(listing: &str, root: &Path) -> BTreeSet<String> {
    (listing.lines())
        .map(|l| l.trim().trim_start_matches('.').to_owned())
        .filter(|p| !p.is_empty() && p != "/")
        .filter(|p| {
            let at = root.join(p.trim_start_matches('/'));
            !at.symlink_metadata().unwrap().is_dir()
        })
        .collect()
}

#[test]
fn the_rpm_the_deb_the_tarball_and_xtask_install_lay_down_the_same_files() {
    let deb = deb_tree();
    let deb_files = contents(&deb);
    // The RPM, into a scratch root: its database's list and the files themselves.
    let rpm_root = scratch("rpm-root");
    let root_arg = rpm_root.to_str().unwrap();
    output("rpm", &["--root", root_arg, "--initdb"]);
    output(
        "rpm",
        &[
            "--root",
            root_arg,
            "-i",
            "--nodeps",
            "--noscripts",
            dist().rpm().to_str().unwrap(),
        ],
    );
    let rpm_list = output("rpm", &["--root", root_arg, "-ql", "genv-enforcer"]);
    let rpm_owned = owned(&rpm_list, &rpm_root);
    let deb_owned: BTreeSet<String> = deb_files.iter().map(|(p, _)| p.clone()).collect();
    assert_eq!(rpm_owned, deb_owned, "the RPM's files are not the .deb's");
    // Under /usr, not /lib: a merged-/usr node's /lib is a link, which a tarball's lib/
    // replaces.
    assert!(
        deb_owned.contains("/usr/lib/systemd/system/genv-enforcer.service")
            && deb_owned.iter().all(|p| !p.starts_with("/lib/")),
        "{deb_owned:#?}"
    );
    let rpm_files: Vec<(String, String)> = (contents(&rpm_root).into_iter())
        .filter(|(p, _)| deb_owned.contains(p))
        .collect();
    assert_eq!(
        rpm_files, deb_files,
        "the RPM's contents are not the .deb's"
    );
    // The front runs the binary where the package puts it.
    let front = std::fs::read_to_string(deb.join("usr/lib/genv-enforcer/front/genv")).unwrap();
    assert!(front.contains("\ninstalled_enforcer='/usr/bin/genv-enforcer'\n"));
    // The tarball's root/.
    let tar = scratch("tarball");
    let tar_arg = tar.to_str().unwrap();
    output(
        "tar",
        &["-xzf", dist().tarball().to_str().unwrap(), "-C", tar_arg],
    );
    let top = tar.join(format!("genv-enforcer-{VERSION}-x86_64-linux-gnu"));
    assert_eq!(
        contents(&top.join("root")),
        deb_files,
        "the tarball's root/"
    );
    assert!(top.join("README.md").exists());
    // The image is built from this tarball, by this version.
    let containerfile = std::fs::read_to_string(top.join("deploy/Containerfile")).unwrap();
    assert!(
        containerfile.contains(&format!("\nARG VERSION={VERSION}\n"))
            && containerfile
                .contains("ADD target/dist/genv-enforcer-${VERSION}-x86_64-linux-gnu.tar.gz"),
        "{containerfile}"
    );
    // `cargo xtask install`: the same list under /usr/local (the front naming the
    // package's binary path, to compare the bytes).
    let installed = scratch("install");
    let binary = deb.join("usr/bin/genv-enforcer");
    let status = xtask()
        .args(["install", "--root", installed.to_str().unwrap(), "--binary"])
        .arg(&binary)
        .args(["--enforcer-path", "/usr/bin/genv-enforcer"])
        .status()
        .unwrap();
    assert!(status.success());
    let local: BTreeSet<String> = (contents(&installed).into_iter())
        .map(|(p, _)| {
            p.replacen("/usr/local/", "/usr/", 1).replacen(
                "/etc/systemd/system/",
                "/usr/lib/systemd/system/",
                1,
            )
        })
        .collect();
    assert_eq!(
        local, deb_owned,
        "cargo xtask install's files (under /usr/local)"
    );
    for dir in [deb, rpm_root, tar, installed] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// docs/install.md's command putting the tarball's `root/` into `/`, as words.
fn documented_extraction() -> Vec<String> {
    let doc = std::fs::read_to_string(workspace_root().join("docs/install.md")).unwrap();
    let line = (doc.lines().find(|l| l.starts_with("tar ")))
        .expect("docs/install.md shows no `tar` command putting the tarball into /");
    line.split_whitespace().map(str::to_owned).collect()
}

/// A scratch root laid out as a merged-`/usr` node's: `lib` a link to `usr/lib`.
fn merged_usr_root() -> PathBuf {
    let root = scratch("merged-usr");
    std::fs::create_dir_all(root.join("usr/lib")).unwrap();
    std::os::unix::fs::symlink("usr/lib", root.join("lib")).unwrap();
    root
}

/// Extracts the tarball into a merged-`/usr` root as docs/install.md says (GNU tar, into
/// `/`: here the scratch root), and with plain `tar -xzf` (no `--keep-directory-symlink`,
/// as one would without the doc): either way `lib` is still the link, and the unit is in
/// `usr/lib/systemd/system`.
#[test]
fn the_tarball_extracted_as_documented_leaves_a_merged_usr_nodes_lib_link() {
    let documented = documented_extraction();
    let tarball = dist().tarball();
    let name = tarball.file_name().unwrap().to_str().unwrap();
    assert!(
        documented.iter().any(|w| w == name),
        "docs/install.md's command extracts no {name}: {documented:?}"
    );
    for keep in [true, false] {
        let root = merged_usr_root();
        let mut args: Vec<String> = vec![];
        for word in &documented[1..] {
            let word = match word.as_str() {
                w if w == name => tarball.to_str().unwrap().to_owned(),
                "/" if args.last().is_some_and(|a| a == "-C") => root.display().to_string(),
                "--keep-directory-symlink" if !keep => continue,
                w => w.to_owned(),
            };
            args.push(word);
        }
        assert!(
            args.contains(&root.display().to_string()),
            "no `-C /`: {documented:?}"
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        output("tar", &args);
        let lib = std::fs::read_link(root.join("lib"));
        assert_eq!(
            lib.ok().as_deref(),
            Some(Path::new("usr/lib")),
            "tar {args:?} replaced the lib -> usr/lib link"
        );
        let unit = root.join("usr/lib/systemd/system/genv-enforcer.service");
        assert!(
            unit.symlink_metadata().is_ok_and(|m| m.is_file()),
            "no {}",
            unit.display()
        );
        assert!(root.join("usr/bin/genv-enforcer").is_file(), "tar {args:?}");
        let _ = std::fs::remove_dir_all(root);
    }
}

/// The `.deb`'s control area (`dpkg-deb -e`): its maintainer scripts.
fn deb_control() -> PathBuf {
    let control = scratch("control");
    let deb = dist().deb();
    output(
        "dpkg-deb",
        &["-e", deb.to_str().unwrap(), control.to_str().unwrap()],
    );
    control
}

/// The words of `script` that run genv-enforcer other than as `/usr/bin/genv-enforcer`: a
/// bare `genv-enforcer` (whatever comes first on `PATH`, a `/usr/local/bin` copy
/// included) or another `bin/` directory's. Comments and single-quoted text (unit names,
/// messages) run nothing; paths such as `/run/genv-enforcer` are not a binary's.
fn not_by_its_path(script: &str) -> Vec<String> {
    let mut found = vec![];
    for line in script.lines().map(str::trim_start) {
        if line.starts_with('#') {
            continue;
        }
        let unquoted: Vec<&str> = line.split('\'').step_by(2).collect();
        let words = unquoted.join(" ");
        for word in words.split(|c: char| c.is_whitespace() || ";&|()!`\"$".contains(c)) {
            let runs = word == "genv-enforcer" || word.ends_with("bin/genv-enforcer");
            if runs && word != "/usr/bin/genv-enforcer" {
                found.push(word.to_owned());
            }
        }
    }
    found
}

#[test]
fn a_maintainer_script_running_genv_enforcer_through_path_is_found() {
    assert_eq!(
        not_by_its_path("if ! genv-enforcer unpin; then\n    :\nfi\n"),
        ["genv-enforcer"]
    );
    assert_eq!(
        not_by_its_path("x=$(/usr/local/bin/genv-enforcer status)"),
        ["/usr/local/bin/genv-enforcer"]
    );
    let fine = "# genv-enforcer: a comment\n\
                echo 'genv-enforcer: could not' >&2\n\
                rm -rf /run/genv-enforcer /etc/genv-enforcer\n\
                deb-systemd-invoke stop 'genv-enforcer.service'\n\
                if ! /usr/bin/genv-enforcer unpin; then :; fi\n";
    assert_eq!(not_by_its_path(fine), Vec::<String>::new());
}

/// The `.deb`'s maintainer scripts and the RPM's scriptlets run genv-enforcer as the
/// package installed it, `/usr/bin/genv-enforcer`, never through `PATH`; both remove
/// the pins with it. The RPM applies the presets on a first install only
/// (`%systemd_post`): an upgrade keeps the admin's choice.
#[test]
fn the_maintainer_scripts_run_the_packages_own_binary() {
    let control = deb_control();
    let mut scripts = vec![];
    for name in ["preinst", "postinst", "prerm", "postrm"] {
        if let Ok(text) = std::fs::read_to_string(control.join(name)) {
            scripts.push((format!("the .deb's {name}"), text));
        }
    }
    let rpm = output("rpm", &["-qp", "--scripts", dist().rpm().to_str().unwrap()]);
    scripts.push(("the RPM's scriptlets".to_owned(), rpm.clone()));
    for (what, text) in &scripts {
        let wrong = not_by_its_path(text);
        assert!(
            wrong.is_empty(),
            "{what} runs {wrong:?}, not /usr/bin/genv-enforcer:\n{text}"
        );
    }
    let prerm = &scripts
        .iter()
        .find(|(w, _)| w.ends_with("prerm"))
        .unwrap()
        .1;
    for (what, text) in [("the .deb's prerm", prerm), ("the RPM's scriptlets", &rpm)] {
        assert!(
            text.contains("/usr/bin/genv-enforcer unpin"),
            "{what}:\n{text}"
        );
    }
    let post = rpm.split("preuninstall scriptlet").next().unwrap();
    assert!(
        post.starts_with("postinstall scriptlet (using /bin/sh):\nif [ $1 -eq 1 ] ")
            && post.contains("preset genv-enforcer.service")
            && !post.contains(" enable "),
        "the RPM's %post:\n{rpm}"
    );
    let _ = std::fs::remove_dir_all(control);
}

/// Runs the `.deb`'s postinst for `configure` on the node's files under `root`
/// (`DPKG_ROOT`: deb-systemd-helper and systemctl act on that tree, not on this
/// machine), after `old` (the version configured before; none on a first install).
fn configure(postinst: &Path, root: &Path, old: Option<&str>) {
    let status = Command::new("sh")
        .arg(postinst)
        .arg("configure")
        .args(old)
        .env("DPKG_ROOT", root)
        .env("DPKG_MAINTSCRIPT_PACKAGE", "genv-enforcer")
        .env("DPKG_MAINTSCRIPT_NAME", "postinst")
        .status()
        .unwrap();
    assert!(status.success(), "postinst configure {old:?}: {status}");
}

/// dh_installsystemd's `--no-enable`: a first install leaves the unit disabled (without
/// deb-systemd-helper's state, `was-enabled` says yes and `enable` applies systemd's
/// presets, "enable" by default); an upgrade keeps it enabled or disabled as the admin
/// left it. On the `.deb`'s files in a scratch root (`DPKG_ROOT`); the `systemd_unit`
/// suite does the same under systemd, in the VM.
#[test]
fn the_debs_postinst_leaves_a_first_install_disabled_and_keeps_the_admins_choice() {
    let root = deb_tree();
    let control = deb_control();
    let postinst = control.join("postinst");
    let wants = root.join("etc/systemd/system/multi-user.target.wants/genv-enforcer.service");
    let enabled = || wants.symlink_metadata().is_ok();
    let systemctl = |verb: &str| {
        let root = format!("--root={}", root.display());
        output("systemctl", &[&root, verb, "genv-enforcer.service"]);
    };
    configure(&postinst, &root, None);
    assert!(
        !enabled(),
        "a first install enabled the unit: {}",
        wants.display()
    );
    systemctl("enable");
    configure(&postinst, &root, Some(VERSION));
    assert!(enabled(), "an upgrade disabled the unit the admin enabled");
    systemctl("disable");
    configure(&postinst, &root, Some(VERSION));
    assert!(!enabled(), "an upgrade enabled the unit the admin disabled");
    let _ = std::fs::remove_dir_all(root);
    let _ = std::fs::remove_dir_all(control);
}

#[test]
fn the_wheel_beside_genv_enforces_the_demo_scenario() {
    let auditwheel = target_dir()
        .parent()
        .unwrap()
        .join("dist-tools/bin/auditwheel");
    let shown = output(
        auditwheel.to_str().unwrap(),
        &["show", dist().wheel().to_str().unwrap()],
    );
    assert!(
        shown.contains("manylinux_2_28_x86_64"),
        "auditwheel show: {shown}"
    );
    let venv = scratch("venv");
    output("python3", &["-m", "venv", venv.to_str().unwrap()]);
    let pip = venv.join("bin/pip");
    output(
        pip.to_str().unwrap(),
        &[
            "install",
            "-q",
            "--disable-pip-version-check",
            "genv==1.4.3",
        ],
    );
    output(
        pip.to_str().unwrap(),
        &["install", "-q", dist().wheel().to_str().unwrap()],
    );
    let ours = venv.join("bin/genv-enforcer");
    assert!(venv.join("bin/genv").exists(), "genv is not in the venv");
    let said = output(ours.to_str().unwrap(), &["--version"]);
    assert_eq!(said.trim(), format!("genv-enforcer {VERSION}"));
    // Its pages, where man-db looks for those of the venv's `bin`.
    let page = venv.join("share/man/man1/genv-enforcer-enforce.1.gz");
    assert!(page.exists(), "no {}", page.display());

    // The demo: `demo` attached to GPU 0, an outsider and one of `demo`'s processes
    // opening GPU 1, one of `demo`'s on GPU 0 left alone.
    let mut node = Node::new(2);
    node.enforcer_binary = Some(ours);
    let gpu1 = make_gpu_node_for(&node.dir.join("nvidia1"), 1);
    let shell = node.shell();
    node.write_state(
        json!([env_record("demo", 0, "root", None, shell)]),
        json!([device_record(0, &["demo"]), device_record(1, &[])]),
    );
    let worker = node.spawn(Some("demo"), &[(0, 100)]);
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let gpu1 = gpu1.to_str().unwrap();
    let outsider = node.spawn_with(None, &[(1, 100)], &["--open", gpu1], None);
    daemon.expect(&format!(
        "Terminating process {outsider} from environment N/A that is running on GPU(s) 1"
    ));
    assert_eq!(node.wait_exit(outsider, DEATH), Some(libc::SIGTERM));
    let stray = node.spawn_with(Some("demo"), &[(1, 100)], &["--open", gpu1], None);
    daemon.expect(&format!(
        "Process {stray} from environment demo is using non-attached GPU(s) 1"
    ));
    assert_eq!(node.wait_exit(stray, DEATH), Some(libc::SIGTERM));
    assert!(node.alive(worker), "demo's process on GPU 0 was terminated");
    drop(daemon);
    let _ = std::fs::remove_dir_all(venv);
}
