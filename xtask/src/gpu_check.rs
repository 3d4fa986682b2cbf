//! `cargo xtask gpu-check [-- ARGS]`: the real-GPU check of `--memory-at-alloc`
//! (`tests/gpu-check.py`, which says what it checks) with a release build and genv
//! 1.4.3 from PyPI (the tests' `target/debug/genv-venv`). On a GPU node without cargo,
//! carry the release binary and genv there and run the script itself:
//! `python3 tests/gpu-check.py --enforcer PATH --genv PATH [--report docs/gpu-check.md]`.

use std::process::Command;

use anyhow::{Result, bail};

use crate::{cargo, ensure_python_venv, root, run, target_dir, toolchain};

pub fn run_check(args: &[String]) -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!("gpu-check needs root (the daemon loads kernel programs)");
    }
    toolchain::ensure_ebpf_toolchain()?;
    run(&mut cargo(&["build", "--release", "-p", "genv-enforcer"]))?;
    ensure_python_venv()?;
    let target = target_dir()?;
    let venv = crate::genv_venv(&target)?;
    // The system's python3 runs the check and the workloads (torch and cupy are
    // there); only genv comes from the venv.
    run(Command::new("python3")
        .arg(root().join("tests/gpu-check.py"))
        .arg("--enforcer")
        .arg(target.join("release/genv-enforcer"))
        .arg("--genv")
        .arg(venv.join("bin/genv"))
        .args(args.iter().skip_while(|a| *a == "--")))
}
