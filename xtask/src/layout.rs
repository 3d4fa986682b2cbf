//! The one list of what genv-enforcer installs on a node: `cargo xtask install`, the
//! `.deb`, the RPM and the tarball all lay down [`files`], with the final paths (never a
//! staging root) written into the front and the unit.
//!
//! Two prefixes, one list: the packages own `/usr` (`/usr/bin/genv-enforcer`, the unit in
//! `/usr/lib/systemd/system`), as distributions' packages do; `cargo xtask install` builds
//! from source, so it keeps to `/usr/local` and `/etc/systemd/system`, where the FHS puts
//! what the package manager does not own. Every other byte is the same.
//!
//! Nothing goes under `/lib`: on a merged-`/usr` node `/lib` is a link to `usr/lib`, which
//! GNU tar replaces with a directory when the tarball has a `lib/` of its own. systemd
//! reads `/usr/lib/systemd/system` on every distribution the packages are for (Debian
//! 12+, Ubuntu 22.04+, RHEL 8+, Fedora), and Debian's packages move their units there
//! (DEP17, from trixie).

use std::path::Path;

use anyhow::{Context, Result};

/// Where one installation's files go.
#[derive(Clone, Copy)]
pub struct Prefix {
    /// `usr` (packages) or `usr/local` (`cargo xtask install`), without a leading `/`.
    pub usr: &'static str,
    /// The unit's directory: `usr/lib/systemd/system` or `etc/systemd/system`.
    pub units: &'static str,
}

pub const PACKAGE: Prefix = Prefix {
    usr: "usr",
    units: "usr/lib/systemd/system",
};

pub const LOCAL: Prefix = Prefix {
    usr: "usr/local",
    units: "etc/systemd/system",
};

pub const PROFILE: &str = "etc/profile.d/genv-enforcer.sh";
pub const CONFIG: &str = "etc/genv-enforcer/config.toml";

/// One installed path (relative to the root, no leading `/`).
pub struct Entry {
    pub path: String,
    pub content: Content,
}

pub enum Content {
    /// A regular file: its bytes, its mode, and whether it is the admin's to edit (a
    /// conffile for dpkg, `%config(noreplace)` for rpm: kept when changed).
    File {
        bytes: Vec<u8>,
        mode: u32,
        config: bool,
    },
    /// A symbolic link to this target.
    Link(String),
}

impl Prefix {
    pub fn binary(&self) -> String {
        format!("{}/bin/genv-enforcer", self.usr)
    }
    pub fn front_dir(&self) -> String {
        format!("{}/lib/genv-enforcer/front", self.usr)
    }
    pub fn sbin_link(&self) -> String {
        format!("{}/sbin/genv", self.usr)
    }
    pub fn unit(&self) -> String {
        format!("{}/genv-enforcer.service", self.units)
    }
    pub fn doc_dir(&self) -> String {
        format!("{}/share/doc/genv-enforcer", self.usr)
    }
    /// Where man-db looks for the pages of commands under `bin` and `sbin` here.
    pub fn man_dir(&self) -> String {
        format!("{}/share/man", self.usr)
    }
}

fn file(path: String, bytes: Vec<u8>, mode: u32) -> Entry {
    Entry {
        path,
        content: Content::File {
            bytes,
            mode,
            config: false,
        },
    }
}

/// Everything installed, in this order (the binary first: the front names it). The
/// front runs `enforcer_path` (the binary's path on the node: `/` + [`Prefix::binary`]
/// unless `--enforcer-path` said otherwise). The manual pages are `binary`'s own
/// ([`manual_pages`]).
pub fn files(prefix: Prefix, binary: &Path, enforcer_path: &str) -> Result<Vec<Entry>> {
    let pages = manual_pages(binary, &prefix.man_dir())?;
    let binary = std::fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let repo = crate::root();
    let read = |p: &str| std::fs::read(repo.join(p)).with_context(|| format!("reading {p}"));
    let front_dir = prefix.front_dir();
    let doc = prefix.doc_dir();
    let mut entries = vec![
        file(prefix.binary(), binary, 0o755),
        file(
            format!("{front_dir}/genv"),
            front(&repo, enforcer_path)?.into_bytes(),
            0o755,
        ),
        // In /etc: a conffile, as Debian's policy has it.
        config(PROFILE, profile(&front_dir).into_bytes()),
        Entry {
            path: prefix.sbin_link(),
            // Relative, as Debian's policy asks within one top directory.
            content: Content::Link("../lib/genv-enforcer/front/genv".into()),
        },
        file(prefix.unit(), unit(&repo, &prefix)?.into_bytes(), 0o644),
        config(CONFIG, read("deploy/config.toml")?),
        file(format!("{doc}/README.md"), read("README.md")?, 0o644),
        file(
            format!("{doc}/copyright"),
            read("deploy/packaging/copyright")?,
            0o644,
        ),
        file(
            format!("{doc}/changelog.gz"),
            gzip(&read("deploy/packaging/changelog")?)?,
            0o644,
        ),
        // The alerting rules, to load into Prometheus as they are (docs/operations.md),
        // and their promtool tests.
        file(
            format!("{doc}/prometheus/genv-enforcer.rules.yml"),
            read("deploy/prometheus/genv-enforcer.rules.yml")?,
            0o644,
        ),
        file(
            format!("{doc}/prometheus/genv-enforcer.rules.test.yml"),
            read("deploy/prometheus/genv-enforcer.rules.test.yml")?,
            0o644,
        ),
    ];
    entries.extend(pages);
    // The README's links, beside it: SECURITY.md and docs/, as in the source tree.
    for doc_file in documentation(&repo)? {
        let bytes = read(&doc_file)?;
        entries.push(file(format!("{doc}/{doc_file}"), bytes, 0o644));
    }
    Ok(entries)
}

/// The manual pages under `man_dir` (`usr/share/man`), gzip'd as Debian's policy asks
/// (`man1/genv-enforcer.1.gz`): `binary` writes them (its hidden `manual-pages DIR`)
/// from the definitions it parses with, so that every command and flag it has, and
/// only those, has its page, and nothing written by hand can fall behind.
pub fn manual_pages(binary: &Path, man_dir: &str) -> Result<Vec<Entry>> {
    // In the target directory, the builder's: a name in a shared /tmp could be another
    // user's link, which root would write through.
    let dir = (crate::target_dir()?).join(format!("manual-pages-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let written = crate::run(
        std::process::Command::new(binary)
            .arg("manual-pages")
            .arg(&dir)
            // It only writes text, and it is the binary being installed: whoever runs
            // this chose it. Root's refusal of a binary in a tree others can write (a
            // build tree) is for running the daemon.
            .env("GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY", "1"),
    );
    let pages = written
        .and_then(|()| gzip_pages(&dir, man_dir))
        .with_context(|| format!("{} manual-pages", binary.display()));
    let _ = std::fs::remove_dir_all(&dir);
    pages
}

/// `dir`'s pages (`name.section`), sorted, each gzip'd into `man_dir/man<section>/`.
fn gzip_pages(dir: &Path, man_dir: &str) -> Result<Vec<Entry>> {
    let mut names = vec![];
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        names.push(entry?.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    anyhow::ensure!(!names.is_empty(), "no manual pages written");
    let mut pages = vec![];
    for name in names {
        let section = (name.rsplit_once('.').map(|(_, s)| s.to_owned()))
            .with_context(|| format!("{name}: no section"))?;
        let bytes = std::fs::read(dir.join(&name))?;
        let path = format!("{man_dir}/man{section}/{name}.gz");
        pages.push(file(path, gzip(&bytes)?, 0o644));
    }
    Ok(pages)
}

/// A configuration file under `/etc` (mode 0644).
fn config(path: &str, bytes: Vec<u8>) -> Entry {
    Entry {
        path: path.into(),
        content: Content::File {
            bytes,
            mode: 0o644,
            config: true,
        },
    }
}

/// The `genv` front (`deploy/genv`), naming the binary it runs: `enforcer`, absolute
/// and quotable.
fn front(repo: &std::path::Path, enforcer: &str) -> Result<String> {
    let enforcer = Some(enforcer).filter(|p| !p.contains('\'') && p.starts_with('/'));
    let enforcer = enforcer.context("the enforcer's path: absolute, and quotable (no ')")?;
    let text = std::fs::read_to_string(repo.join("deploy/genv")).context("reading deploy/genv")?;
    Ok(text.replacen(
        "installed_enforcer=genv-enforcer\n",
        &format!("installed_enforcer='{enforcer}'\n"),
        1,
    ))
}

/// The profile snippet putting the front's directory first on users' `PATH`.
fn profile(front_dir: &str) -> String {
    format!(
        "# genv-enforcer's genv front first on PATH\n\
         case \":$PATH:\" in *:/{front_dir}:*) ;; *) PATH=\"/{front_dir}:$PATH\" ;; esac\n\
         export PATH\n"
    )
}

/// The systemd unit, naming the binary and the docs where `prefix` puts them.
fn unit(repo: &std::path::Path, prefix: &Prefix) -> Result<String> {
    let path = "deploy/systemd/genv-enforcer.service";
    let text =
        std::fs::read_to_string(repo.join(path)).with_context(|| format!("reading {path}"))?;
    Ok(text
        .replace(
            "/usr/local/bin/genv-enforcer",
            &format!("/{}", prefix.binary()),
        )
        .replace(
            "/usr/local/share/doc/genv-enforcer",
            &format!("/{}", prefix.doc_dir()),
        ))
}

/// The documents the README links to, relative to the work tree, sorted: SECURITY.md
/// and every `.md` under docs/.
fn documentation(repo: &std::path::Path) -> Result<Vec<String>> {
    let mut found = vec!["SECURITY.md".to_owned()];
    let mut dirs = vec!["docs".to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(repo.join(&dir)).with_context(|| format!("reading {dir}"))? {
            let entry = entry?;
            let name = format!("{dir}/{}", entry.file_name().to_string_lossy());
            if entry.file_type()?.is_dir() {
                dirs.push(name);
            } else if name.ends_with(".md") {
                found.push(name);
            }
        }
    }
    found.sort();
    Ok(found)
}

/// `gzip -9n`: no name, no time stamp, so the same text gives the same bytes.
pub fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write;
    let mut child = std::process::Command::new("gzip")
        .args(["-9n", "-c"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("running gzip")?;
    let mut stdin = child.stdin.take().unwrap();
    let input = bytes.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let output = child.wait_with_output()?;
    writer.join().unwrap()?;
    anyhow::ensure!(output.status.success(), "gzip failed: {}", output.status);
    Ok(output.stdout)
}

/// Writes `entries` under `root` (a staging tree), as they are.
pub fn stage(root: &Path, entries: &[Entry]) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for entry in entries {
        let to = root.join(&entry.path);
        std::fs::create_dir_all(to.parent().unwrap())?;
        match &entry.content {
            Content::File { bytes, mode, .. } => {
                std::fs::write(&to, bytes).with_context(|| format!("{}", to.display()))?;
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(*mode))?;
            }
            Content::Link(target) => std::os::unix::fs::symlink(target, &to)?,
        }
    }
    Ok(())
}
