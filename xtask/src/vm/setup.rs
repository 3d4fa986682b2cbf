//! What a boot needs on the host: QEMU, a static busybox and the unpackers from the
//! distribution, and the test executables built.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Result, bail};

use crate::{cargo, run};

pub const BUSYBOX: &str = "/bin/busybox";

/// QEMU and a static busybox from the distribution; xz and zstd to unpack the kernels
/// (6.1's image and 6.12's modules are xz, 6.12's image zstd).
pub fn ensure_packages() -> Result<()> {
    let have = |path: &str| Path::new(path).exists();
    let static_busybox = have(BUSYBOX)
        && Command::new("file")
            .arg(BUSYBOX)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("statically linked"))
            .unwrap_or(true);
    if have("/usr/bin/qemu-system-x86_64")
        && static_busybox
        && have("/usr/bin/xz")
        && have("/usr/bin/zstd")
    {
        return Ok(());
    }
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(["qemu-system-x86", "busybox-static", "xz-utils", "zstd"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
    };
    if !install()?.success() {
        run(Command::new("apt-get").arg("update"))?;
        if !install()?.success() {
            bail!("apt-get install qemu-system-x86 busybox-static xz-utils zstd failed");
        }
    }
    Ok(())
}

/// Builds the binaries the tests run and the test executables of `suites`; their names
/// and paths.
pub fn build_suites(suites: &[&str]) -> Result<Vec<(String, PathBuf)>> {
    crate::build_node_artefacts(&[])?;
    // The suites run the real genv from the venv the host's run installs; the guest has
    // no network to install it from, so it is made here when no host run has yet.
    crate::genv_venv(&crate::target_dir()?)?;
    let mut build = cargo(&[
        "test",
        "--no-run",
        "--message-format=json",
        "-p",
        "genv-enforcer-tests",
    ]);
    for suite in suites {
        build.args(["--test", suite]);
    }
    let output = build.stderr(Stdio::inherit()).output()?;
    if !output.status.success() {
        bail!("building the test suites {suites:?} failed");
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let name = message["target"]["name"].as_str().unwrap_or_default();
        if let Some(exe) = message["executable"].as_str() {
            if suites.contains(&name) {
                found.push((name.to_owned(), PathBuf::from(exe)));
            }
        }
    }
    if found.len() != suites.len() {
        bail!("cargo built {found:?}, expected the suites {suites:?}");
    }
    Ok(found)
}
