//! Where apt finds a kernel series' packages: the machine's own sources (Debian 12,
//! bookworm, which this machine runs), or one other Debian suite alone
//! (`trixie-backports`, for the newest kernel), through a sources list and package lists
//! of its own under `target/vm/apt/<suite>/`. The machine's apt configuration is never
//! changed: nothing from that suite can be installed on the host by accident.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::command::run;

/// The archive a [`crate::Series`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Archive {
    /// The host's own `/etc/apt` sources (bookworm and its updates).
    HostSources,
    /// One suite of Debian's main archive, e.g. `trixie-backports`, read alone.
    Suite(&'static str),
}

/// `apt-get` and `apt-cache` pointed at one [`Archive`].
pub(crate) struct Apt {
    options: Vec<String>,
}

/// Debian's archive, as the host's own sources name it.
const MIRROR: &str = "http://deb.debian.org/debian";
/// The key that signs it, installed with apt.
const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

impl Apt {
    /// apt for `archive`; for a suite, its sources list written under `cache` first.
    pub(crate) fn new(cache: &Path, archive: Archive) -> Result<Self> {
        // As root, apt would otherwise drop to _apt, who cannot write here.
        let mut options = vec!["APT::Sandbox::User=root".to_owned()];
        if let Archive::Suite(suite) = archive {
            let dir = cache.join("apt").join(suite);
            let lists = dir.join("lists");
            let parts = dir.join("sources.list.d");
            for made in [
                lists.join("partial"),
                dir.join("cache/archives/partial"),
                parts.clone(),
            ] {
                std::fs::create_dir_all(&made)
                    .with_context(|| format!("creating {}", made.display()))?;
            }
            let list = dir.join("sources.list");
            std::fs::write(
                &list,
                format!("deb [signed-by={KEYRING}] {MIRROR} {suite} main\n"),
            )
            .with_context(|| format!("writing {}", list.display()))?;
            let path = |p: PathBuf| p.display().to_string();
            options.extend([
                format!("Dir::Etc::SourceList={}", path(list)),
                format!("Dir::Etc::SourceParts={}", path(parts)),
                format!("Dir::State::Lists={}", path(lists)),
                format!("Dir::Cache={}", path(dir.join("cache"))),
            ]);
        }
        Ok(Apt { options })
    }

    /// `apt-get` or `apt-cache` (`tool`) with this archive's options.
    pub(crate) fn command(&self, tool: &str) -> Command {
        let mut command = Command::new(tool);
        for option in &self.options {
            command.args(["-o", option]);
        }
        command
    }

    /// What `package` depends on, by name (`apt-cache depends`, alternatives included).
    pub(crate) fn depends(&self, package: &str) -> Result<Vec<String>> {
        let out = self
            .command("apt-cache")
            .args(["depends", package])
            .output()
            .context("running apt-cache (the VM kernel comes from Debian's archive)")?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| {
                line.trim()
                    .trim_start_matches('|')
                    .strip_prefix("Depends: ")
            })
            .map(str::to_owned)
            .collect())
    }

    /// Downloads the kernel package and the packages of its own release it depends on (from
    /// 7 on, the image, the modules and `modules.builtin` are three of them) into `dir`:
    /// their `.deb` files.
    pub(crate) fn download(
        &self,
        package: &str,
        release: &str,
        dir: &Path,
    ) -> Result<Vec<PathBuf>> {
        let mut packages = vec![package.to_owned()];
        let own = |dep: &String| dep.ends_with(&format!("-{release}")) && dep != package;
        packages.extend(self.depends(package)?.into_iter().filter(own));
        let fetch = || {
            self.command("apt-get")
                .arg("download")
                .args(&packages)
                .current_dir(dir)
                .status()
        };
        if !fetch()?.success() {
            // Stale package lists name a file the mirror no longer has.
            run(self.command("apt-get").arg("update"))?;
            if !fetch()?.success() {
                bail!("apt-get download {} failed", packages.join(" "));
            }
        }
        (packages.iter())
            .map(|wanted| {
                find(dir, |name| {
                    name.starts_with(&format!("{wanted}_")) && name.ends_with(".deb")
                })
            })
            .collect()
    }
}

/// The first entry of `dir` whose name `matches`.
pub(crate) fn find(dir: &Path, matches: impl Fn(&str) -> bool) -> Result<PathBuf> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let path = entry?.path();
        if path
            .file_name()
            .is_some_and(|n| matches(&n.to_string_lossy()))
        {
            return Ok(path);
        }
    }
    bail!("nothing expected in {}", dir.display())
}
