//! What the tests need installed on this machine, from the distribution and PyPI: python3
//! with venv, genv 1.4.3, openssh-server and sudo, and single packages on demand.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::run;

/// The real genv 1.4.3 is installed from PyPI into a venv under target/: that needs
/// python3 with `venv` and `ensurepip` (Debian splits them into python3-venv).
pub fn ensure_python_venv() -> Result<()> {
    which("python3").context("the end-to-end tests run the real genv, which needs python3")?;
    let has_venv = Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .status()?
        .success();
    if !has_venv {
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get").args(["install", "-y", "python3-venv"]))?;
    }
    Ok(())
}

/// genv 1.4.3 in a venv: the one the test suite installs (`target/debug/genv-venv`,
/// where the tests' `Genv::get` looks), or a new one.
pub fn genv_venv(target: &Path) -> Result<PathBuf> {
    let venv = target.join("debug/genv-venv");
    // The tests' lock: a suite installing it at the same time waits, and so does this.
    std::fs::create_dir_all(target.join("debug"))?;
    let lock = std::fs::File::create(target.join("debug/genv-venv.lock"))?;
    // SAFETY: flock on a descriptor this function owns; released when it is dropped.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("locking genv-venv.lock");
    }
    if !venv.join("bin/genv").exists() {
        ensure_python_venv()?;
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/pip")).args(["install", "-q", "genv==1.4.3"]))?;
    }
    Ok(venv)
}

/// The remote-enforcement tests run Debian's real sshd (one per simulated host, in
/// network namespaces) and sudo on the hosts' side, installed without starting the
/// system's own ssh service.
pub fn ensure_openssh() -> Result<()> {
    let tools = [
        "/usr/sbin/sshd",
        "/usr/bin/ssh",
        "/usr/bin/ssh-keygen",
        "/usr/bin/sudo",
    ];
    if tools.iter().all(|t| Path::new(t).exists()) {
        return Ok(());
    }
    let packages = ["openssh-server", "openssh-client", "sudo"];
    install_without_starting(&packages)
        .context("installing openssh-server, openssh-client and sudo for the remote tests")
}

/// Where [`ensure_promtool`] puts promtool (the alerting suite looks there first).
pub const PROMTOOL: &str = "tools/prometheus/usr/bin/promtool";

/// The alerting suite checks the shipped rules and real scrapes with `promtool`, which
/// Debian ships in `prometheus`. The package is downloaded and unpacked under
/// `target/tools`, not installed: installing it would bring 30-odd packages and a
/// Prometheus server enabled at boot to whatever machine runs the tests. promtool needs
/// nothing but libc.
pub fn ensure_promtool(target: &Path) -> Result<()> {
    if target.join(PROMTOOL).is_file() {
        return Ok(());
    }
    let tools = target.join("tools");
    std::fs::create_dir_all(&tools)?;
    let download = || {
        run(Command::new("apt-get")
            .args(["download", "prometheus"])
            .current_dir(&tools))
    };
    // A fresh machine has no package lists yet.
    download()
        .or_else(|_| run(Command::new("apt-get").arg("update")).and_then(|()| download()))
        .context("downloading Debian's prometheus package for promtool")?;
    let deb = std::fs::read_dir(&tools)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .context("apt-get download left no prometheus .deb")?;
    let unpacked = run(Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(tools.join("prometheus")));
    std::fs::remove_file(&deb)?;
    unpacked.context("unpacking Debian's prometheus package")
}

/// Debian `packages`, with no service started while installing: a `policy-rc.d` that
/// refuses service starts is put in place for the install where none exists, and
/// removed after.
fn install_without_starting(packages: &[&str]) -> Result<()> {
    let policy = Path::new("/usr/sbin/policy-rc.d");
    let ours = !policy.exists();
    if ours {
        std::fs::write(
            policy,
            "#!/bin/sh\n# genv-enforcer's xtask: no service starts while installing\nexit 101\n",
        )?;
        std::fs::set_permissions(
            policy,
            <std::fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o755),
        )?;
    }
    let installed = run(Command::new("apt-get").arg("update")).and_then(|()| {
        run(Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(packages)
            .env("DEBIAN_FRONTEND", "noninteractive"))
    });
    if ours {
        let _ = std::fs::remove_file(policy);
    }
    installed
}

/// Debian `packages`, installed from apt unless `tool` (a command) is already there.
pub fn ensure_apt(packages: &[&str], tool: &str) -> Result<()> {
    if which(tool).is_ok() {
        return Ok(());
    }
    run(Command::new("apt-get").arg("update"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .with_context(|| format!("installing {packages:?} for {tool}"))
}

pub fn which(program: &str) -> Result<()> {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()?
        .status
        .success();
    if !found {
        bail!("{program} is not installed");
    }
    Ok(())
}
