//! The RPM: the `.deb`'s files (the same staged tree), cargo-generate-rpm's layout, built
//! with `rpmbuild` from Debian's `rpm` package. The scriptlets are the expansions of
//! Fedora's `%systemd_post`, `%systemd_preun` and `%systemd_postun_with_restart` (Debian
//! has no systemd-rpm-macros), with `/usr/bin/genv-enforcer unpin` at erase as in the
//! `.deb`. As the `.deb`'s: the presets apply on a first install only (`$1` is 1; RHEL's
//! and Fedora's disable what they do not name), an upgrade keeps the admin's choice.
//!
//! Reproducible: the build time and file times are `SOURCE_DATE_EPOCH`
//! (`use_source_date_epoch_as_buildtime`, `clamp_mtime_to_source_epoch`), the build host
//! a fixed name.

use std::path::PathBuf;

use anyhow::{Context, Result};

use super::Build;
use crate::layout::{self, CONFIG, Content, PACKAGE};

pub fn build(build: &Build) -> Result<PathBuf> {
    let top = build.stage.join("rpmbuild");
    let _ = std::fs::remove_dir_all(&top);
    std::fs::create_dir_all(top.join("SPECS"))?;
    let spec_path = top.join("SPECS/genv-enforcer.spec");
    std::fs::write(&spec_path, spec(build)?)?;
    let epoch = build.epoch.to_string();
    let defines = [
        format!("_topdir {}", top.display()),
        "_buildhost reproducible".into(),
        "use_source_date_epoch_as_buildtime 1".into(),
        "clamp_mtime_to_source_epoch 1".into(),
        "_build_id_links none".into(),
    ];
    let mut command = std::process::Command::new("rpmbuild");
    command.args(["-bb", "--target", "x86_64-linux"]);
    for define in &defines {
        command.arg("--define").arg(define);
    }
    command.arg(&spec_path).env("SOURCE_DATE_EPOCH", &epoch);
    crate::run(&mut command)?;
    let name = format!(
        "genv-enforcer-{}-{}.x86_64.rpm",
        build.version, build.package.release
    );
    let made = top.join("RPMS/x86_64").join(&name);
    let to = build.out.join(&name);
    std::fs::rename(&made, &to).with_context(|| format!("rpmbuild made no {}", made.display()))?;
    std::fs::remove_dir_all(&top)?;
    Ok(to)
}

/// `%files`: every path of the one list, and the directories only this package has.
fn files_section(build: &Build) -> Result<String> {
    let entries = layout::files(PACKAGE, &build.binary, &format!("/{}", PACKAGE.binary()))?;
    let mut lines = vec![
        "%dir /etc/genv-enforcer".to_owned(),
        format!("%dir /{}", PACKAGE.front_dir().trim_end_matches("/front")),
        format!("%dir /{}", PACKAGE.front_dir()),
        format!("%dir /{}", PACKAGE.doc_dir()),
    ];
    for entry in entries {
        lines.push(match entry.content {
            Content::File { config: true, .. } => format!("%config(noreplace) /{}", entry.path),
            _ => format!("/{}", entry.path),
        });
    }
    anyhow::ensure!(lines.iter().any(|l| l.ends_with(CONFIG)));
    Ok(lines.join("\n"))
}

fn spec(build: &Build) -> Result<String> {
    let stage = build.stage.join("root");
    let stage = stage.to_str().context("the staging path is not UTF-8")?;
    Ok(format!(
        "# Written by `cargo xtask dist`.\n\
         %global debug_package %{{nil}}\n\
         %global __os_install_post %{{nil}}\n\
         Name: genv-enforcer\n\
         Version: {version}\n\
         Release: {release}\n\
         Summary: {summary}\n\
         License: {license}\n\
         \n\
         %description\n\
         {description}\n\
         \n\
         %install\n\
         mkdir -p %{{buildroot}}\n\
         cp -a '{stage}/.' %{{buildroot}}/\n\
         \n\
         %post\n\
         if [ $1 -eq 1 ] && [ -x /usr/bin/systemctl ]; then\n\
         \x20   /usr/bin/systemctl --no-reload preset genv-enforcer.service >/dev/null 2>&1 || :\n\
         fi\n\
         \n\
         %preun\n\
         if [ $1 -eq 0 ]; then\n\
         \x20   if [ -x /usr/bin/systemctl ]; then\n\
         \x20       /usr/bin/systemctl --no-reload disable --now genv-enforcer.service >/dev/null 2>&1 || :\n\
         \x20   fi\n\
         \x20   /usr/bin/genv-enforcer unpin || echo 'genv-enforcer: could not remove the pinned programs' >&2\n\
         fi\n\
         \n\
         %postun\n\
         if [ -x /usr/bin/systemctl ]; then\n\
         \x20   /usr/bin/systemctl daemon-reload >/dev/null 2>&1 || :\n\
         \x20   if [ $1 -ge 1 ]; then\n\
         \x20       /usr/bin/systemctl try-restart genv-enforcer.service >/dev/null 2>&1 || :\n\
         \x20   fi\n\
         fi\n\
         if [ $1 -eq 0 ]; then rm -rf /run/genv-enforcer; fi\n\
         \n\
         %files\n\
         {files}\n\
         \n\
         %changelog\n\
         * Wed Nov 25 2026 {maintainer} - {version}-{release}\n\
         - First packaged release (cargo xtask dist), built against glibc 2.28.\n",
        version = build.version,
        release = build.package.release,
        summary = build.package.description,
        license = build.package.license,
        description = build.package.long_description()?.join("\n"),
        maintainer = build.package.deb("maintainer")?,
        files = files_section(build)?,
    ))
}
