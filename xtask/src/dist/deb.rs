//! The `.deb`: the staged files, cargo-deb's layout and metadata (`[package.metadata.deb]`
//! in `genv-enforcer/Cargo.toml` says the same), built with `dpkg-deb --root-owner-group`.
//!
//! The maintainer scripts are what `dh_installsystemd --no-enable --no-start
//! --restart-after-upgrade` writes, by hand: a first install leaves the unit disabled (the
//! admin edits the configuration, then enables it: the README's three commands); an
//! upgrade keeps the admin's choice, enabled or disabled, and restarts a running unit.
//! Removal stops it and removes the pinned programs (`/usr/bin/genv-enforcer unpin`: with
//! `keep-pinned`, they go on refusing outsiders when the daemon is gone); purge removes
//! the configuration and what the daemon left in `/run`.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::Build;
use crate::layout::{self, Content, PACKAGE};

pub fn build(build: &Build) -> Result<PathBuf> {
    let tree = build.stage.join("deb");
    let _ = std::fs::remove_dir_all(&tree);
    crate::run(
        std::process::Command::new("cp")
            .arg("-a")
            .arg(build.stage.join("root"))
            .arg(&tree),
    )?;
    let control = tree.join("DEBIAN");
    std::fs::create_dir_all(&control)?;
    let size_kib = installed_size(&tree)?;
    write(
        &control.join("control"),
        &control_file(build, size_kib)?,
        0o644,
    )?;
    write(&control.join("conffiles"), &conffiles(build)?, 0o644)?;
    write(&control.join("md5sums"), &md5sums(&tree)?, 0o644)?;
    write(&control.join("postinst"), POSTINST, 0o755)?;
    write(&control.join("prerm"), PRERM, 0o755)?;
    write(&control.join("postrm"), POSTRM, 0o755)?;
    super::clamp_times(&tree, build.epoch)?;
    let to = build
        .out
        .join(format!("genv-enforcer_{}_amd64.deb", build.version));
    crate::run(
        std::process::Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&tree)
            .arg(&to)
            .env("SOURCE_DATE_EPOCH", build.epoch.to_string()),
    )?;
    std::fs::remove_dir_all(&tree)?;
    Ok(to)
}

fn write(path: &std::path::Path, text: &str, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// Every file the one list marks as the admin's, all under `/etc`.
fn conffiles(build: &Build) -> Result<String> {
    let entries = layout::files(PACKAGE, &build.binary, &format!("/{}", PACKAGE.binary()))?;
    let mut text = String::new();
    for entry in entries {
        if let Content::File { config: true, .. } = entry.content {
            anyhow::ensure!(
                entry.path.starts_with("etc/"),
                "{} is not in /etc",
                entry.path
            );
            text.push_str(&format!("/{}\n", entry.path));
        }
    }
    Ok(text)
}

fn control_file(build: &Build, size_kib: u64) -> Result<String> {
    let package = &build.package;
    let (major, minor) = build.glibc;
    let depends = match package.deb("depends")? {
        "$auto" => format!("libc6 (>= {major}.{minor})"),
        other => other.to_owned(),
    };
    let long: Vec<String> = (package.long_description()?.iter())
        .map(|l| format!(" {l}\n"))
        .collect();
    Ok(format!(
        "Package: genv-enforcer\n\
         Version: {version}\n\
         Architecture: amd64\n\
         Maintainer: {maintainer}\n\
         Installed-Size: {size_kib}\n\
         Depends: {depends}\n\
         Recommends: {recommends}\n\
         Section: {section}\n\
         Priority: {priority}\n\
         Description: {synopsis}\n{long}",
        version = build.version,
        maintainer = package.deb("maintainer")?,
        recommends = package.deb("recommends")?,
        section = package.deb("section")?,
        priority = package.deb("priority")?,
        synopsis = package.description,
        long = long.concat(),
    ))
}

/// `du`'s apparent size in KiB, as dpkg-gencontrol counts it (one per file at least).
fn installed_size(tree: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for path in walk(tree)? {
        let meta = path.symlink_metadata()?;
        total += meta.len().div_ceil(1024).max(1);
    }
    Ok(total)
}

/// Every path under `dir`, sorted.
fn walk(dir: &std::path::Path) -> Result<Vec<PathBuf>> {
    let mut found = vec![];
    let mut stack = vec![dir.to_owned()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at)? {
            let path = entry?.path();
            if path.symlink_metadata()?.is_dir() {
                stack.push(path.clone());
            }
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

fn md5sums(tree: &std::path::Path) -> Result<String> {
    let files: Vec<PathBuf> = (walk(tree)?.into_iter())
        .filter(|p| p.symlink_metadata().is_ok_and(|m| m.is_file()))
        .filter(|p| !p.starts_with(tree.join("DEBIAN")))
        .map(|p| p.strip_prefix(tree).unwrap().to_owned())
        .collect();
    let output = std::process::Command::new("md5sum")
        .args(&files)
        .current_dir(tree)
        .output()
        .context("running md5sum")?;
    anyhow::ensure!(output.status.success(), "md5sum failed");
    Ok(String::from_utf8(output.stdout)?)
}

/// debhelper's `postinst-systemd-dont-enable` and `postinst-systemd-restartnostart`.
/// `was-enabled` says yes for a unit it has no state for, and `enable` then applies
/// systemd's presets (Debian's: enable everything): hence `debian-installed` first, true
/// only once an earlier configure recorded the state (`update-state`), so an upgrade.
const POSTINST: &str = "#!/bin/sh
# genv-enforcer: dh_installsystemd's steps (--no-enable --no-start
# --restart-after-upgrade). A first install leaves the unit disabled: edit
# /etc/genv-enforcer/config.toml, then `systemctl enable --now genv-enforcer`. An
# upgrade keeps it enabled or disabled, as the admin left it.
set -e
case \"$1\" in
configure|abort-upgrade|abort-deconfigure|abort-remove)
    if deb-systemd-helper debian-installed 'genv-enforcer.service'; then
        # Only removes the mask deb-systemd-helper put on at removal.
        deb-systemd-helper unmask 'genv-enforcer.service' >/dev/null || true
        if deb-systemd-helper --quiet was-enabled 'genv-enforcer.service'; then
            # Creates the new unit's links, if any.
            deb-systemd-helper enable 'genv-enforcer.service' >/dev/null || true
        fi
    fi
    # Records the links an enable makes, for purge to remove; forgets old ones.
    deb-systemd-helper update-state 'genv-enforcer.service' >/dev/null || true
    if [ -z \"${DPKG_ROOT:-}\" ] && [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        if [ -n \"$2\" ]; then
            deb-systemd-invoke try-restart 'genv-enforcer.service' >/dev/null || true
        fi
    fi
    ;;
esac
exit 0
";

/// The package's own binary, by its path: a `genv-enforcer` earlier on root's `PATH` (a
/// `/usr/local/bin` copy) is not the one whose pins this package's daemon made.
const PRERM: &str = "#!/bin/sh
# genv-enforcer: removal stops the unit, then removes the pinned programs, which
# otherwise go on refusing outsiders' opens with no daemon left to answer for them.
set -e
if [ \"$1\" = remove ]; then
    if [ -d /run/systemd/system ]; then
        deb-systemd-invoke stop 'genv-enforcer.service' >/dev/null || true
    fi
    if ! /usr/bin/genv-enforcer unpin; then
        echo 'genv-enforcer: could not remove the pinned programs; see /sys/fs/bpf/genv-enforcer' >&2
    fi
fi
exit 0
";

const POSTRM: &str = "#!/bin/sh
# genv-enforcer: dh_installsystemd's steps; purge also removes the configuration
# (dpkg removes the conffile itself; this removes what it leaves beside it) and the
# daemon's runtime directory (the unit preserves it across restarts).
set -e
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
if [ \"$1\" = remove ] && command -v deb-systemd-helper >/dev/null; then
    deb-systemd-helper mask 'genv-enforcer.service' >/dev/null || true
fi
if [ \"$1\" = purge ]; then
    if command -v deb-systemd-helper >/dev/null; then
        deb-systemd-helper purge 'genv-enforcer.service' >/dev/null || true
        deb-systemd-helper unmask 'genv-enforcer.service' >/dev/null || true
    fi
    rm -f /etc/genv-enforcer/config.toml /etc/genv-enforcer/config.toml.dpkg-*
    rmdir /etc/genv-enforcer 2>/dev/null || true
    rm -rf /run/genv-enforcer
fi
exit 0
";
