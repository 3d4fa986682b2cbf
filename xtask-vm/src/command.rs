//! Running the tools the runner needs (apt-get, dpkg-deb), each said before it runs.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs `command`, saying so; an error if it fails.
pub(crate) fn run(command: &mut Command) -> Result<()> {
    eprintln!("vm-test: {command:?}");
    let status = command
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}
