//! What building the kernel programs needs, installed on first use (a fresh machine of
//! this kind has stable and nightly Rust, and nothing else of this):
//! - nightly's `rust-src`, to build `core` for `bpfel-unknown-none` (`-Z build-std`);
//! - `bpf-linker`, built against LLVM 22 from the distribution (about a minute).

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::run;

const LLVM_PACKAGES: [&str; 4] = [
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
];
const LLVM_BIN: &str = "/usr/lib/llvm-22/bin";

pub fn ensure_ebpf_toolchain() -> Result<()> {
    let output = |program: &str, args: &[&str]| -> Result<String> {
        let out = Command::new(program)
            .args(args)
            .output()
            .with_context(|| format!("running {program} (is rustup installed?)"))?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    if !output("rustup", &["toolchain", "list"])?.contains("nightly") {
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    let components = output(
        "rustup",
        &["component", "list", "--toolchain", "nightly", "--installed"],
    )?;
    // rust-src to build `core` for the BPF target; clippy to lint the programs there
    // (`cargo xtask test`'s lints: on the host their code is compiled out).
    for component in ["rust-src", "clippy"] {
        if !components.lines().any(|c| c.starts_with(component)) {
            run(Command::new("rustup").args([
                "component",
                "add",
                component,
                "--toolchain",
                "nightly",
            ]))?;
        }
    }
    ensure_bpf_linker()
}

/// bpf-linker, built against LLVM 22 (installed from apt.llvm.org's packages first).
fn ensure_bpf_linker() -> Result<()> {
    if Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    if !std::path::Path::new(LLVM_BIN).join("llvm-config").exists() {
        if !rustix::process::geteuid().is_root() {
            bail!(
                "bpf-linker needs LLVM 22: run as root, or `apt-get install -y {}`",
                LLVM_PACKAGES.join(" ")
            );
        }
        run(Command::new("apt-get").arg("update"))?;
        run(Command::new("apt-get")
            .args(["install", "-y"])
            .args(LLVM_PACKAGES))?;
    }
    let path = format!("{LLVM_BIN}:{}", std::env::var("PATH").unwrap_or_default());
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("PATH", path))
}

/// `cargo xtask build-ebpf`: the kernel object alone, as genv-enforcer's build script
/// builds it.
pub fn build_ebpf(root: &std::path::Path) -> Result<()> {
    ensure_ebpf_toolchain()?;
    run(Command::new("rustup")
        .args([
            "run",
            "nightly",
            "cargo",
            "build",
            "--package",
            "genv-ebpf",
            "--bins",
            "--release",
        ])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
        .current_dir(root))?;
    let object = crate::target_dir()?.join("bpfel-unknown-none/release/genv-ebpf");
    let size = std::fs::metadata(&object)
        .with_context(|| format!("{}", object.display()))?
        .len();
    println!("{} ({size} bytes)", object.display());
    Ok(())
}
