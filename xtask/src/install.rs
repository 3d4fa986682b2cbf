//! `cargo xtask install` and `uninstall`: genv-enforcer on a node, idempotently.
//!
//! Lays down, under `--root` (default `/`, for packaging and tests any directory):
//! - `usr/local/bin/genv-enforcer`: the release build (built first if needed), or
//!   `--binary PATH`;
//! - `usr/local/lib/genv-enforcer/front/genv`: the `genv` front (`deploy/genv`), with
//!   `etc/profile.d/genv-enforcer.sh` putting its directory first on users' PATH, and
//!   `usr/local/sbin/genv` linking to it for root and sudo (whose secure_path puts
//!   `/usr/local/sbin` first), unless another file is there already;
//! - `etc/systemd/system/genv-enforcer.service` (`deploy/systemd`), where systemd is, and
//!   its `etc/genv-enforcer/config.toml` (`deploy/config.toml`), unless one is there
//!   (the admin's is kept);
//! - `usr/local/share/doc/genv-enforcer/`: the README, the copyright and the changelog;
//! - `usr/local/share/man/man{1,5,8}/`: the manual pages the binary writes
//!   (`genv-enforcer(1)` and one per command, `genv-enforcer.conf(5)`, `genv(8)`).
//!
//! These are [`layout::files`] under the `/usr/local` prefix: the packages (`cargo xtask
//! dist`) lay down the same list under `/usr`.
//!
//! The front runs the binary by its path on the node (`--enforcer-path`, default
//! `/usr/local/bin/genv-enforcer`), never by its path under `--root`: a staged
//! package copied to a node must not name a staging directory anyone could create.
//!
//! Installing again replaces what it laid down and nothing else. `uninstall` removes
//! it all (the configuration only if it is still the one installed), and the pinned
//! programs (`genv-enforcer unpin`) when `--root` is `/`.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::layout::{self, CONFIG, Content, LOCAL, PROFILE};

// `cargo xtask install`'s paths: the one list's ([`layout`]) under `/usr/local`.
const FRONT_DIR: &str = "usr/local/lib/genv-enforcer/front";
const BINARY: &str = "usr/local/bin/genv-enforcer";
const SBIN_LINK: &str = "usr/local/sbin/genv";
const UNIT: &str = "etc/systemd/system/genv-enforcer.service";
const DOC_DIR: &str = "usr/local/share/doc/genv-enforcer";

/// `install`'s and `uninstall`'s flags.
#[derive(clap::Args, Debug)]
pub struct Options {
    /// Where to lay the files down (an absolute path; `/` on a node).
    #[arg(long, value_name = "DIR", default_value = "/")]
    root: PathBuf,
    /// The binary to install (default: the release build, built first).
    #[arg(long, value_name = "PATH")]
    binary: Option<PathBuf>,
    /// The binary's path on the running node, which the front runs: `/usr/local/bin/
    /// genv-enforcer` whatever `--root` is. A front that named the staging root would
    /// run whatever any user put there once the package is copied to a node.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/usr/local/bin/genv-enforcer"
    )]
    enforcer_path: PathBuf,
}

impl Options {
    fn check(&self) -> Result<()> {
        if !self.root.is_absolute() {
            bail!("--root {}: give an absolute path", self.root.display());
        }
        if !self.enforcer_path.is_absolute() {
            bail!(
                "--enforcer-path {}: give the absolute path the binary has on the node",
                self.enforcer_path.display()
            );
        }
        Ok(())
    }
}

pub fn install(options: &Options) -> Result<()> {
    options.check()?;
    let root = &options.root;
    let binary = match &options.binary {
        Some(binary) => binary.clone(),
        None => {
            crate::toolchain::ensure_ebpf_toolchain()?;
            crate::run(&mut crate::cargo(&[
                "build",
                "--release",
                "-p",
                "genv-enforcer",
            ]))?;
            crate::target_dir()?.join("release/genv-enforcer")
        }
    };
    let enforcer = options
        .enforcer_path
        .to_str()
        .context("--enforcer-path: not UTF-8")?;
    let systemd = root.join("etc/systemd").is_dir() || options.root != Path::new("/");
    for entry in layout::files(LOCAL, &binary, enforcer)? {
        let to = root.join(&entry.path);
        match entry.content {
            Content::Link(_) => link_sbin(root)?,
            _ if entry.path == LOCAL.unit() && !systemd => {}
            // The admin's configuration is kept; the profile snippet is replaced.
            Content::File { .. } if entry.path == CONFIG && (to.exists() || !systemd) => {}
            Content::File { bytes, mode, .. } => write_bytes(&to, &bytes, mode)?,
        }
    }
    eprintln!(
        "xtask: installed under {}: {BINARY}, the genv front ({FRONT_DIR}/genv, first on PATH \
         through {PROFILE}, and {SBIN_LINK}), {UNIT}, the manual pages under /{}",
        root.display(),
        LOCAL.man_dir()
    );
    Ok(())
}

pub fn uninstall(options: &Options) -> Result<()> {
    options.check()?;
    let root = &options.root;
    let binary = root.join(BINARY);
    let systemd = options.root == Path::new("/") && Path::new("/run/systemd/system").exists();
    if systemd && root.join(UNIT).exists() {
        // Stopped first: Restart=always would start it again as its files go.
        crate::run(Command::new("systemctl").args(["disable", "--now", "genv-enforcer"]))?;
    }
    if options.root == Path::new("/") && binary.exists() {
        crate::run(Command::new(&binary).arg("unpin"))?;
    }
    if is_our_link(root)? {
        std::fs::remove_file(root.join(SBIN_LINK))?;
    }
    // The pages `install` laid down, by name: nothing is run to uninstall (a binary
    // that no longer runs, or one in a staging tree, must not stop or steer it).
    for page in installed_pages(&root.join(LOCAL.man_dir()))? {
        remove(&page)?;
    }
    for file in [BINARY, PROFILE, UNIT] {
        remove(&root.join(file))?;
    }
    let config = root.join(CONFIG);
    let shipped = std::fs::read(crate::root().join("deploy/config.toml"))?;
    match std::fs::read(&config) {
        Ok(text) if text == shipped => {
            remove(&config)?;
            let _ = std::fs::remove_dir(config.parent().unwrap());
        }
        Ok(_) => eprintln!("xtask: {} was changed: kept", config.display()),
        Err(_) => {}
    }
    for dir in ["usr/local/lib/genv-enforcer", DOC_DIR] {
        match std::fs::remove_dir_all(root.join(dir)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", root.join(dir).display()));
            }
            _ => {}
        }
    }
    if systemd {
        crate::run(Command::new("systemctl").arg("daemon-reload"))?;
    }
    eprintln!("xtask: uninstalled from {}", root.display());
    Ok(())
}

/// Writes through a temporary file renamed into place (a running binary is replaced,
/// not overwritten).
fn write_bytes(to: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    let dir = to.parent().expect("a file in a directory");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let temp = dir.join(format!(
        ".{}.xtask-new",
        to.file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&temp, bytes).with_context(|| format!("writing {}", temp.display()))?;
    std::fs::set_permissions(&temp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&temp, to).with_context(|| format!("installing {}", to.display()))
}

/// `usr/local/sbin/genv` → the front, unless something else is there.
fn link_sbin(root: &Path) -> Result<()> {
    let link = root.join(SBIN_LINK);
    if is_our_link(root)? {
        return Ok(());
    }
    if link.symlink_metadata().is_ok() {
        eprintln!(
            "xtask: {} exists and is not genv-enforcer's front: left alone (root's and sudo's \
             `genv` is not the front; put /{FRONT_DIR} first on their PATH)",
            link.display()
        );
        return Ok(());
    }
    std::fs::create_dir_all(link.parent().unwrap())?;
    symlink(format!("/{FRONT_DIR}/genv"), &link)
        .with_context(|| format!("linking {}", link.display()))
}

fn is_our_link(root: &Path) -> Result<bool> {
    match std::fs::read_link(root.join(SBIN_LINK)) {
        Ok(target) => Ok(target == Path::new(&format!("/{FRONT_DIR}/genv"))),
        Err(_) => Ok(false),
    }
}

/// genv-enforcer's pages under `man_dir`: `man1/genv-enforcer*.1.gz`,
/// `man5/genv-enforcer.conf.5.gz` and `man8/genv.8.gz` (the front's).
fn installed_pages(man_dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut pages = vec![
        man_dir.join("man5/genv-enforcer.conf.5.gz"),
        man_dir.join("man8/genv.8.gz"),
    ];
    let section1 = man_dir.join("man1");
    let entries = match std::fs::read_dir(&section1) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(pages),
        Err(e) => return Err(e).with_context(|| format!("reading {}", section1.display())),
    };
    for entry in entries {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("genv-enforcer") && name.ends_with(".1.gz") {
            pages.push(section1.join(&*name));
        }
    }
    Ok(pages)
}

fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}
