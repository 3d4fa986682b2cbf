//! The guest kernel: Debian's generic `linux-image-*-amd64`, whichever ABI the
//! `linux-image-amd64` metapackage points at today (Debian bumps the ABI number with
//! security updates, so no version is written down here).
//!
//! From the package we keep two things, cached under `target/vm/<package>/`:
//! - `vmlinux`, the uncompressed kernel pulled out of `vmlinuz`: QEMU boots it through
//!   its PVH entry point, which skips the decompressor (slow under TCG);
//! - the modules the guest's init loads before it can see the host (9p, its virtio
//!   transport, the virtio PCI driver, overlayfs), with their dependencies, in load order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use object::{Object, ObjectSection};

use crate::run;

/// The modules init needs, by name; their dependencies come from each `.ko`'s modinfo.
const NEEDED_MODULES: [&str; 4] = ["virtio_pci", "9pnet_virtio", "9p", "overlay"];

pub struct Kernel {
    /// The package, e.g. `linux-image-6.1.0-56-amd64`.
    pub package: String,
    pub vmlinux: PathBuf,
    /// Module files in load order (dependencies first).
    pub modules: Vec<PathBuf>,
}

/// The kernel's pieces, downloaded and extracted on first use.
pub fn prepare(cache: &Path) -> Result<Kernel> {
    let package = current_package()?;
    let dir = cache.join(&package);
    let vmlinux = dir.join("vmlinux");
    let order = dir.join("modules.order");
    if !order.exists() {
        let started = std::time::Instant::now();
        let _ = std::fs::remove_dir_all(&dir);
        let unpacked = dir.join("unpacked");
        std::fs::create_dir_all(&unpacked)?;
        let deb = download(&package, &dir)?;
        run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
        let vmlinuz = find(&unpacked.join("boot"), |name| name.starts_with("vmlinuz-"))?;
        extract_vmlinux(&vmlinuz, &vmlinux)?;
        let modules = load_order(&modules_by_name(&unpacked.join("lib/modules"))?)?;
        let kept = dir.join("modules");
        std::fs::create_dir_all(&kept)?;
        let mut listed = String::new();
        for module in modules {
            let name = module.file_name().unwrap();
            std::fs::copy(&module, kept.join(name))?;
            listed.push_str(&format!("{}\n", name.to_string_lossy()));
        }
        std::fs::remove_dir_all(&unpacked)?;
        std::fs::remove_file(&deb)?;
        // Written last: its presence says the cache is complete.
        std::fs::write(&order, listed)?;
        eprintln!("vm-test: prepared {package} in {:.0?}", started.elapsed());
    }
    let modules = std::fs::read_to_string(&order)?
        .lines()
        .map(|name| dir.join("modules").join(name))
        .collect();
    Ok(Kernel {
        package,
        vmlinux,
        modules,
    })
}

/// The package `linux-image-amd64` depends on today.
fn current_package() -> Result<String> {
    let depends = || -> Result<Option<String>> {
        let out = Command::new("apt-cache")
            .args(["depends", "linux-image-amd64"])
            .output()
            .context("running apt-cache (the VM kernel comes from Debian's archive)")?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|line| line.trim().strip_prefix("Depends: "))
            .find(|dep| dep.starts_with("linux-image-"))
            .map(str::to_owned))
    };
    if let Some(package) = depends()? {
        return Ok(package);
    }
    run(Command::new("apt-get").arg("update"))?;
    depends()?.context("apt-cache knows no linux-image-amd64 to take the kernel from")
}

fn download(package: &str, dir: &Path) -> Result<PathBuf> {
    let fetch = || {
        Command::new("apt-get")
            // As root, apt would otherwise try to drop to _apt, who cannot write here.
            .args(["-o", "APT::Sandbox::User=root", "download", package])
            .current_dir(dir)
            .status()
    };
    if !fetch()?.success() {
        // Stale package lists name a file the mirror no longer has.
        run(Command::new("apt-get").arg("update"))?;
        if !fetch()?.success() {
            bail!("apt-get download {package} failed");
        }
    }
    find(dir, |name| {
        name.starts_with(package) && name.ends_with(".deb")
    })
}

fn find(dir: &Path, matches: impl Fn(&str) -> bool) -> Result<PathBuf> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("{}", dir.display()))? {
        let path = entry?.path();
        if path
            .file_name()
            .is_some_and(|n| matches(&n.to_string_lossy()))
        {
            return Ok(path);
        }
    }
    bail!("nothing expected in {}", dir.display())
}

/// Pulls the compressed payload out of a bzImage (boot protocol 2.08+: its offset and
/// length are in the setup header) and decompresses it with the matching tool. Debian
/// compresses with xz; the kernel appends the uncompressed size after the stream, hence
/// `--single-stream`.
fn extract_vmlinux(vmlinuz: &Path, out: &Path) -> Result<()> {
    let image = std::fs::read(vmlinuz)?;
    let u16_at = |at: usize| u16::from_le_bytes([image[at], image[at + 1]]);
    let u32_at = |at: usize| u32::from_le_bytes(image[at..at + 4].try_into().unwrap());
    if image.len() < 0x250 || &image[0x202..0x206] != b"HdrS" || u16_at(0x206) < 0x208 {
        bail!(
            "{} is not a bzImage with boot protocol 2.08+",
            vmlinuz.display()
        );
    }
    let setup_sectors = match image[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let start = (setup_sectors + 1) * 512 + u32_at(0x248) as usize;
    let payload = image
        .get(start..start + u32_at(0x24c) as usize)
        .context("the payload lies outside the image")?;
    let (tool, args): (&str, &[&str]) = match payload {
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => ("xz", &["-dc", "--single-stream"]),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => ("zstd", &["-dcq"]),
        [0x1f, 0x8b, ..] => ("gzip", &["-dc"]),
        _ => bail!("{}: unknown compression", vmlinuz.display()),
    };
    let mut child = Command::new(tool)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::fs::File::create(out)?)
        .spawn()
        .with_context(|| format!("running {tool}"))?;
    // zstd and gzip stop at the end of their frame; the trailing size is ignored.
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), payload).ok();
    let status = child.wait()?;
    let elf = std::fs::read(out).map(|b| b.starts_with(b"\x7fELF"))?;
    if !elf {
        bail!(
            "{tool} ({status}) did not turn {} into an ELF kernel",
            vmlinuz.display()
        );
    }
    Ok(())
}

/// Every module under `root`, by its name (`-` and `_` are the same to the kernel).
fn modules_by_name(root: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if let Some(name) = path.file_name().and_then(|n| n.to_str()) {
                if let Some(stem) = name.strip_suffix(".ko") {
                    found.insert(stem.replace('-', "_"), path.clone());
                }
            }
        }
    }
    Ok(found)
}

/// [`NEEDED_MODULES`] and their dependencies, each after what it depends on.
fn load_order(modules: &BTreeMap<String, PathBuf>) -> Result<Vec<PathBuf>> {
    fn visit(
        name: &str,
        modules: &BTreeMap<String, PathBuf>,
        done: &mut BTreeSet<String>,
        order: &mut Vec<PathBuf>,
    ) -> Result<()> {
        if done.contains(name) {
            return Ok(());
        }
        let path = modules
            .get(name)
            .with_context(|| format!("the kernel package has no module {name}"))?;
        for dep in depends(path)? {
            visit(&dep, modules, done, order)?;
        }
        done.insert(name.to_owned());
        order.push(path.clone());
        Ok(())
    }
    let (mut done, mut order) = (BTreeSet::new(), Vec::new());
    for name in NEEDED_MODULES {
        visit(name, modules, &mut done, &mut order)?;
    }
    Ok(order)
}

/// A module's `depends=` entry in its `.modinfo` section.
fn depends(module: &Path) -> Result<Vec<String>> {
    let bytes = std::fs::read(module)?;
    let file = object::File::parse(&*bytes).with_context(|| format!("{}", module.display()))?;
    let modinfo = file
        .section_by_name(".modinfo")
        .with_context(|| format!("{} has no .modinfo", module.display()))?
        .data()?;
    let mut found = Vec::new();
    for entry in modinfo.split(|b| *b == 0) {
        if let Some(list) = entry.strip_prefix(b"depends=") {
            let list = String::from_utf8_lossy(list);
            let deps = list.split(',').filter(|dep| !dep.is_empty());
            found.extend(deps.map(|dep| dep.replace('-', "_")));
        }
    }
    Ok(found)
}
