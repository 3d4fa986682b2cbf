//! Running the tools the runner needs (apt-get, dpkg-deb), each said before it runs; the
//! xtask binary runs its own commands through [`run_as`] too.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs `command`, saying so as `vm-test`; an error if it fails.
pub(crate) fn run(command: &mut Command) -> Result<()> {
    run_as("vm-test", command)
}

/// Runs `command`, said on stderr after `who: `; an error naming it if it fails.
pub fn run_as(who: &str, command: &mut Command) -> Result<()> {
    eprintln!("{who}: {command:?}");
    let status = command
        .status()
        .with_context(|| format!("running {command:?}"))?;
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok(())
}
