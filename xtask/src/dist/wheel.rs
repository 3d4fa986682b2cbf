//! The Python wheel (`deploy/python/pyproject.toml`: maturin, `bindings = "bin"`), and
//! the tools the whole of `dist` uses, pinned, in a venv under the target directory
//! (`target/dist-tools`) that later runs and the test suite reuse.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

/// Pinned: a new release changes the artefacts' bytes.
const TOOLS: [&str; 4] = [
    "maturin==1.16.0",
    "ziglang==0.17.1",
    "cargo-zigbuild==0.24.0",
    "auditwheel==6.8.2",
];

/// The venv holding [`TOOLS`] (made or completed if needed).
pub fn ensure_tools(target: &Path) -> Result<PathBuf> {
    let venv = target.join("dist-tools");
    let stamp = venv.join("xtask-tools");
    let wanted = TOOLS.join("\n");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(venv);
    }
    if !venv.join("bin/pip").exists() {
        crate::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    }
    crate::run(
        Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "--disable-pip-version-check"])
            .args(TOOLS),
    )
    .context("installing the packaging tools (maturin, zig, cargo-zigbuild, auditwheel)")?;
    std::fs::write(&stamp, wanted)?;
    Ok(venv)
}

/// `PATH` with the tools' venv first (cargo-zigbuild finds zig through `python -m
/// ziglang` there).
pub fn path_with(tools: &Path) -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    format!("{}:{path}", tools.join("bin").display())
}

/// The wheel in `out`, and the binary maturin built into it (in the target directory).
/// The wheel holds the manual pages too (`<name>.data/data/share/man`, which pip puts
/// under the venv's `share/man`, where man-db looks for the pages of its `bin`). The
/// binary writes them, so maturin runs twice: once to build it, then to make the wheel
/// with its pages, over the same build (cargo finds it fresh).
pub fn build(
    tools: &Path,
    stage: &Path,
    out: &Path,
    version: &str,
    epoch: u64,
) -> Result<(PathBuf, PathBuf)> {
    let wheels = stage.join("wheel");
    maturin(tools, &crate::root().join("deploy/python"), &wheels, epoch)?;
    std::fs::remove_dir_all(&wheels)?;
    let binary = crate::target_dir()?.join("x86_64-unknown-linux-gnu/dist/genv-enforcer");
    let project = project_with_pages(stage, &binary, epoch)?;
    maturin(tools, &project, &wheels, epoch)?;
    let name = format!("genv_enforcer-{version}-py3-none-manylinux_2_28_x86_64.whl");
    let made: Vec<PathBuf> = (std::fs::read_dir(&wheels)?)
        .filter_map(|e| Some(e.ok()?.path()))
        .collect();
    ensure!(
        made.len() == 1 && made[0].file_name().is_some_and(|n| *n == *name),
        "maturin made {made:?}, not {name}"
    );
    let to = out.join(&name);
    std::fs::rename(&made[0], &to)?;
    std::fs::remove_dir_all(&wheels)?;
    std::fs::remove_dir_all(&project)?;
    Ok((to, binary))
}

fn maturin(tools: &Path, project: &Path, wheels: &Path, epoch: u64) -> Result<()> {
    crate::run(
        Command::new(tools.join("bin/maturin"))
            .args(["build", "--zig", "--target", "x86_64-unknown-linux-gnu"])
            .arg("--out")
            .arg(wheels)
            .current_dir(project)
            .env("PATH", path_with(tools))
            .env("SOURCE_DATE_EPOCH", epoch.to_string()),
    )
}

/// `deploy/python` copied under `stage`, naming the crate by its absolute path, with
/// the binary's manual pages as the wheel's data (`data` in `[tool.maturin]`).
fn project_with_pages(stage: &Path, binary: &Path, epoch: u64) -> Result<PathBuf> {
    let source = crate::root().join("deploy/python");
    let project = stage.join("python");
    let _ = std::fs::remove_dir_all(&project);
    std::fs::create_dir_all(&project)?;
    std::fs::copy(source.join("README.md"), project.join("README.md"))?;
    let text = std::fs::read_to_string(source.join("pyproject.toml"))
        .context("reading deploy/python/pyproject.toml")?;
    let relative = "manifest-path = \"../../genv-enforcer/Cargo.toml\"\n";
    ensure!(text.contains(relative), "pyproject.toml: no {relative}");
    let manifest = crate::root().join("genv-enforcer/Cargo.toml");
    let manifest = manifest
        .to_str()
        .context("the work tree's path is not UTF-8")?;
    let text = text.replacen(
        relative,
        &format!("manifest-path = \"{manifest}\"\ndata = \"data\"\n"),
        1,
    );
    std::fs::write(project.join("pyproject.toml"), text)?;
    let pages = crate::layout::manual_pages(binary, "data/data/share/man")?;
    crate::layout::stage(&project, &pages)?;
    crate::dist::clamp_times(&project, epoch)?;
    Ok(project)
}
