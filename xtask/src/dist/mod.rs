//! `cargo xtask dist`: the four artefacts a node installs from, in `target/dist/`:
//!
//! - `genv-enforcer_<version>_amd64.deb` ([`deb`]), cargo-deb's layout, built with
//!   `dpkg-deb`;
//! - `genv-enforcer-<version>-1.x86_64.rpm` ([`rpm`]), cargo-generate-rpm's layout, built
//!   with `rpmbuild` (Debian's `rpm` package);
//! - `genv_enforcer-<version>-py3-none-manylinux_2_28_x86_64.whl` ([`wheel`]): maturin,
//!   `bindings = "bin"`;
//! - `genv-enforcer-<version>-x86_64-linux-gnu.tar.gz`: `root/` (the package's files, to
//!   extract into `/`), `deploy/` and the README.
//!
//! One binary for all four: maturin's build for the wheel (`cargo zigbuild --profile dist`
//! for `x86_64-unknown-linux-gnu.2.28`: zig links against glibc 2.28's symbols; NVML is
//! `dlopen`ed, so glibc stays dynamic), checked for its symbol versions ([`glibc_floor`])
//! and for the kernel programs' object it embeds (built by bpf-linker, not zig). The `.deb`, the RPM and the tarball
//! hold the same files: [`crate::layout::files`] under `/usr`.
//!
//! Reproducible: `SOURCE_DATE_EPOCH` is the last commit's time (or the caller's), every
//! file's time is it, entries are sorted and owned by root; two runs give the same bytes.

mod deb;
mod rpm;
mod wheel;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use crate::layout::{self, PACKAGE};

/// The oldest glibc the binary runs on.
pub const GLIBC_FLOOR: (u32, u32) = (2, 28);

/// What every artefact is built from.
pub struct Build {
    pub version: String,
    pub package: Package,
    pub epoch: u64,
    pub binary: PathBuf,
    /// The package's files, staged (mtimes at `epoch`).
    pub stage: PathBuf,
    pub out: PathBuf,
    /// The newest glibc symbol version the binary needs (the packages' dependency).
    pub glibc: (u32, u32),
}

pub fn run() -> Result<()> {
    for artefact in build_all()? {
        eprintln!("xtask: dist: {}", artefact.display());
    }
    Ok(())
}

/// The four artefacts, built: the wheel, the tarball, the `.deb`, the RPM.
pub fn build_all() -> Result<[PathBuf; 4]> {
    crate::toolchain::ensure_ebpf_toolchain()?;
    crate::ensure_python_venv()?;
    crate::ensure_apt(&["rpm"], "rpmbuild")?;
    crate::ensure_apt(&["binutils"], "objdump")?;
    let target = crate::target_dir()?;
    // One build at a time: `cargo xtask test` builds the `.deb` for the VM while the
    // dist suite may be running `cargo xtask dist` beside it, into the same stage.
    std::fs::create_dir_all(&target)?;
    let lock = std::fs::File::create(target.join("dist.lock"))?;
    // SAFETY: flock on a descriptor this function owns; released when it is dropped.
    if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("locking dist.lock");
    }
    let tools = wheel::ensure_tools(&target)?;
    let epoch = source_date_epoch()?;
    let package = package()?;
    let version = package.version.clone();
    let out = target.join("dist");
    let stage = out.join("stage");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(&stage)?;
    // maturin's build is the one build: the wheel's binary is the packages' too.
    let (wheel, binary) = wheel::build(&tools, &stage, &out, &version, epoch)?;
    let checked = glibc_floor(&binary).and_then(|glibc| {
        embeds_kernel_programs(&binary)?;
        Ok(glibc)
    });
    let glibc = match checked {
        Ok(glibc) => glibc,
        Err(e) => {
            let _ = std::fs::remove_file(&wheel);
            return Err(e);
        }
    };
    let enforcer = format!("/{}", PACKAGE.binary());
    layout::stage(
        &stage.join("root"),
        &layout::files(PACKAGE, &binary, &enforcer)?,
    )?;
    clamp_times(&stage.join("root"), epoch)?;
    let build = Build {
        version,
        package,
        epoch,
        binary,
        stage,
        out,
        glibc,
    };
    let made = [
        wheel,
        tarball(&build)?,
        deb::build(&build)?,
        rpm::build(&build)?,
    ];
    Ok(made)
}

fn source_date_epoch() -> Result<u64> {
    if let Ok(epoch) = std::env::var("SOURCE_DATE_EPOCH") {
        return epoch.parse().context("SOURCE_DATE_EPOCH: not a number");
    }
    let output = Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .current_dir(crate::root())
        .output()
        .context("git log (SOURCE_DATE_EPOCH is the last commit's time)")?;
    ensure!(output.status.success(), "git log failed: {}", output.status);
    let text = String::from_utf8_lossy(&output.stdout);
    text.trim().parse().context("git log's commit time")
}

/// genv-enforcer's package fields, from `cargo metadata` (`[package]` and its
/// `[package.metadata.deb]` and `[package.metadata.generate-rpm]`).
pub struct Package {
    pub version: String,
    /// One line: the `.deb`'s synopsis, the RPM's summary.
    pub description: String,
    pub license: String,
    /// `[package.metadata.deb]`.
    pub deb: serde_json::Value,
    /// `[package.metadata.generate-rpm]`'s `release`.
    pub release: String,
}

impl Package {
    /// `[package.metadata.deb]`'s `key`.
    pub fn deb(&self, key: &str) -> Result<&str> {
        self.deb[key]
            .as_str()
            .with_context(|| format!("[package.metadata.deb] names no {key}"))
    }

    /// The long description, wrapped at 72 columns.
    pub fn long_description(&self) -> Result<Vec<String>> {
        let mut lines: Vec<String> = vec![];
        for word in self.deb("extended-description")?.split_whitespace() {
            match lines.last_mut() {
                Some(line) if line.len() + 1 + word.len() <= 72 => {
                    line.push(' ');
                    line.push_str(word);
                }
                _ => lines.push(word.to_owned()),
            }
        }
        Ok(lines)
    }
}

fn package() -> Result<Package> {
    let output = crate::cargo(&["metadata", "--no-deps", "--format-version", "1"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running cargo metadata")?;
    ensure!(output.status.success(), "cargo metadata failed");
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let package = (metadata["packages"].as_array().context("no packages")?)
        .iter()
        .find(|p| p["name"] == "genv-enforcer")
        .context("cargo metadata lists no genv-enforcer")?;
    let text = |key: &str| {
        package[key]
            .as_str()
            .map(str::to_owned)
            .with_context(|| format!("genv-enforcer/Cargo.toml names no {key}"))
    };
    let version = text("version")?;
    // The changelog's newest entry is this version: packagers' rule, checked here.
    let changelog = std::fs::read_to_string(crate::root().join("deploy/packaging/changelog"))?;
    ensure!(
        changelog.starts_with(&format!("genv-enforcer ({version}) ")),
        "deploy/packaging/changelog's first entry is not {version}: add one"
    );
    let release = package["metadata"]["generate-rpm"]["release"].as_str();
    Ok(Package {
        version,
        description: text("description")?,
        license: text("license")?,
        deb: package["metadata"]["deb"].clone(),
        release: release.unwrap_or("1").to_owned(),
    })
}

/// The newest `GLIBC_x.y` the binary's dynamic symbols ask for: at most [`GLIBC_FLOOR`].
pub fn glibc_floor(binary: &Path) -> Result<(u32, u32)> {
    let output = Command::new("objdump")
        .arg("-T")
        .arg(binary)
        .output()
        .context("running objdump -T (binutils)")?;
    ensure!(
        output.status.success(),
        "objdump -T failed: {}",
        output.status
    );
    let text = String::from_utf8_lossy(&output.stdout);
    let versions = glibc_versions(&text);
    let newest = versions.iter().max().context("no GLIBC_ symbol versions")?;
    if *newest > GLIBC_FLOOR {
        let over: Vec<&str> = (text.lines())
            .filter(|l| glibc_versions(l).iter().any(|v| *v > GLIBC_FLOOR))
            .collect();
        bail!(
            "{} needs glibc {}.{}, above the floor {}.{}: {over:#?}",
            binary.display(),
            newest.0,
            newest.1,
            GLIBC_FLOOR.0,
            GLIBC_FLOOR.1
        );
    }
    eprintln!(
        "xtask: dist: newest glibc symbol version {}.{} (floor {}.{})",
        newest.0, newest.1, GLIBC_FLOOR.0, GLIBC_FLOOR.1
    );
    Ok(*newest)
}

fn glibc_versions(text: &str) -> Vec<(u32, u32)> {
    text.split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|word| word.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
            Some((parts.next()??, parts.next().flatten().unwrap_or(0)))
        })
        .collect()
}

/// The binary carries the kernel programs' object (an ELF for `EM_BPF`), as the
/// release build does: zig links the daemon, not the programs (bpf-linker does).
fn embeds_kernel_programs(binary: &Path) -> Result<()> {
    const EM_BPF: u16 = 247;
    let bytes = std::fs::read(binary)?;
    let found = (bytes.windows(4).enumerate())
        .filter(|(_, w)| *w == b"\x7fELF")
        .any(|(at, _)| {
            let machine = bytes.get(at + 18..at + 20);
            machine.is_some_and(|m| u16::from_le_bytes([m[0], m[1]]) == EM_BPF)
        });
    ensure!(
        found,
        "{} embeds no BPF object: the kernel programs are missing",
        binary.display()
    );
    Ok(())
}

/// Every file and directory under `dir` at `epoch` (links too, not their targets).
pub fn clamp_times(dir: &Path, epoch: u64) -> Result<()> {
    crate::run(
        Command::new("find")
            .arg(dir)
            .args(["-exec", "touch", "-h", "-d"])
            .arg(format!("@{epoch}"))
            .args(["{}", "+"]),
    )
}

/// A reproducible `tar.gz` of `dir`'s `entries` (relative names), sorted, owned by root.
pub fn tar_gz(dir: &Path, entries: &[&str], epoch: u64, to: &Path) -> Result<()> {
    let tar = Command::new("tar")
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--format=gnu",
            "--mode=u+w,go-w",
        ])
        .arg(format!("--mtime=@{epoch}"))
        .arg("-C")
        .arg(dir)
        .arg("-cf")
        .arg("-")
        .args(entries)
        .output()
        .context("running tar")?;
    ensure!(tar.status.success(), "tar failed: {}", tar.status);
    std::fs::write(to, layout::gzip(&tar.stdout)?)?;
    Ok(())
}

/// The tarball: `genv-enforcer-<v>-x86_64-linux-gnu/` with `root/` (what the packages
/// install, to copy into `/`), `deploy/` and the README.
fn tarball(build: &Build) -> Result<PathBuf> {
    let name = format!("genv-enforcer-{}-x86_64-linux-gnu", build.version);
    let dir = build.out.join("tarball");
    let _ = std::fs::remove_dir_all(&dir);
    let top = dir.join(&name);
    std::fs::create_dir_all(&top)?;
    crate::run(
        Command::new("cp")
            .arg("-a")
            .arg(build.stage.join("root"))
            .arg(crate::root().join("deploy"))
            .arg(crate::root().join("README.md"))
            .arg(&top),
    )?;
    clamp_times(&dir, build.epoch)?;
    let to = build.out.join(format!("{name}.tar.gz"));
    tar_gz(&dir, &[&name], build.epoch, &to)?;
    std::fs::remove_dir_all(&dir)?;
    Ok(to)
}
