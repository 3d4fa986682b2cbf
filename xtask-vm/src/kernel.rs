//! The guest kernels ([`KERNELS`]): Debian bookworm's two generic kernels, and the
//! newest Debian has, from trixie-backports. Each is the `linux-image-*-amd64` package
//! its metapackage points at today (`linux-image-amd64` for 6.1,
//! `linux-image-6.12-amd64` for 6.12, trixie-backports' `linux-image-amd64` for 7).
//! Debian bumps the ABI number with security updates, so no ABI is written down here;
//! the resolved package must still be of the series its metapackage is listed for.
//! From 7 on, Debian splits a kernel over four packages: `linux-image-<release>` holds
//! nothing but dependencies on `linux-binary-<release>` (the image), `linux-modules-`
//! and `linux-base-` (`modules.builtin`), all under `/usr/lib/modules/<release>/`;
//! those are fetched with it.
//!
//! From each package we keep two things, cached under `target/vm/<package>/`:
//! - `vmlinux`, the uncompressed kernel pulled out of `vmlinuz` (xz on 6.1, zstd on
//!   6.12): QEMU boots it through its PVH entry point, which skips the decompressor (slow
//!   under TCG);
//! - the modules the guest's init loads before it can see the host (9p, its virtio
//!   transport, the virtio PCI driver, overlayfs; and FUSE, for the tests' hostile
//!   mounts), with their dependencies, in load order,
//!   decompressed (6.12 ships `.ko.xz`). What the package lists in `modules.builtin` is
//!   in the kernel already and is not loaded (6.12 builds the virtio PCI driver in).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use object::{Object, ObjectSection};

use crate::archive::{Apt, Archive, find};
use crate::command::run;

/// The modules init loads, by name; their dependencies come from each `.ko`'s modinfo.
/// `fuse`: the hostile-mount tests (a silent FUSE server) need `/dev/fuse`.
const NEEDED_MODULES: [&str; 5] = ["virtio_pci", "9pnet_virtio", "9p", "overlay", "fuse"];

/// One kernel series the harness boots, and the metapackage that follows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Series {
    /// What `--kernel` calls it, and what the console says: `6.1`, `6.12`, `7`.
    pub version: &'static str,
    /// The metapackage whose dependency is the kernel package to boot.
    pub metapackage: &'static str,
    /// Where apt finds the metapackage.
    pub archive: Archive,
    /// Debian builds it to preempt tasks inside kernel programs (`PREEMPT_LAZY`, from 7
    /// on; 6.1 and 6.12 are `PREEMPT_VOLUNTARY`): the trampoline and tracepoint
    /// programs' recursion guard then skips runs, which the attempt loop must meet
    /// (`guest.rs`).
    pub preempts_programs: bool,
    /// Its verifier lets a uprobe program store to its registers (7 on; 6.1 and 6.12
    /// refuse it), so `--memory-at-alloc refuse` refuses calls there and falls back to
    /// kill elsewhere: the guest tells the tests which to expect
    /// (`GENV_TEST_KERNEL_REFUSES`), so that neither passes for the other.
    pub refuses_at_alloc: bool,
}

/// The kernels, in the order `cargo xtask vm-test` boots them: Debian 12's own (6.1),
/// the one it offers beside it (6.12, Debian 13's series), and the newest Debian has
/// (trixie-backports; 7.3 when this was written: the first series whose uprobe programs
/// may write the registers, `docs/memory-at-alloc.md`).
pub const KERNELS: [Series; 3] = [
    Series {
        version: "6.1",
        metapackage: "linux-image-amd64",
        archive: Archive::HostSources,
        preempts_programs: false,
        refuses_at_alloc: false,
    },
    Series {
        version: "6.12",
        metapackage: "linux-image-6.12-amd64",
        archive: Archive::HostSources,
        preempts_programs: false,
        refuses_at_alloc: false,
    },
    Series {
        version: "7",
        metapackage: "linux-image-amd64",
        archive: Archive::Suite("trixie-backports"),
        preempts_programs: true,
        refuses_at_alloc: true,
    },
];

pub struct Kernel {
    /// The package, e.g. `linux-image-6.1.0-56-amd64`.
    pub package: String,
    pub vmlinux: PathBuf,
    /// Module files in load order (dependencies first).
    pub modules: Vec<PathBuf>,
}

/// The kernel's pieces, downloaded and extracted on first use.
pub fn prepare(cache: &Path, series: Series) -> Result<Kernel> {
    prepare_package(cache, series).with_context(|| {
        format!(
            "preparing the {} kernel (package {})",
            series.version, series.metapackage
        )
    })
}

fn prepare_package(cache: &Path, series: Series) -> Result<Kernel> {
    let apt = Apt::new(cache, series.archive)?;
    let package = current_package(&apt, series)?;
    let dir = cache.join(&package);
    let vmlinux = dir.join("vmlinux");
    let order = dir.join("modules.order");
    // What the cache was made for: a cache made for another list is made again.
    let needed = dir.join("modules.needed");
    let wanted = NEEDED_MODULES.join("\n");
    if !order.exists() || std::fs::read_to_string(&needed).ok().as_deref() != Some(&wanted) {
        let started = std::time::Instant::now();
        let _ = std::fs::remove_dir_all(&dir);
        let unpacked = dir.join("unpacked");
        std::fs::create_dir_all(&unpacked)?;
        // linux-image-6.12.117+deb12-amd64 keeps them under 6.12.117+deb12-amd64/.
        let release = package.strip_prefix("linux-image-").unwrap_or(&package);
        for deb in apt.download(&package, release, &dir)? {
            run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&unpacked))?;
            std::fs::remove_file(&deb)?;
        }
        // Up to 6.12: /boot/vmlinuz-<release> and /lib/modules/<release>/; from 7 on,
        // both under /usr/lib/modules/<release>/.
        let merged = unpacked.join("usr/lib/modules").join(release);
        let (vmlinuz, tree) = if merged.join("vmlinuz").exists() {
            (merged.join("vmlinuz"), merged)
        } else {
            let boot = unpacked.join("boot");
            let vmlinuz = find(&boot, |name| name.starts_with("vmlinuz-"))?;
            (vmlinuz, unpacked.join("lib/modules").join(release))
        };
        extract_vmlinux(&vmlinuz, &vmlinux)?;
        let modules = load_order(&modules_by_name(&tree)?, &builtin(&tree)?)?;
        let kept = dir.join("modules");
        std::fs::create_dir_all(&kept)?;
        let mut listed = String::new();
        for (name, module) in modules {
            let file = format!("{name}.ko");
            std::fs::write(kept.join(&file), read_module(&module)?)?;
            listed.push_str(&format!("{file}\n"));
        }
        std::fs::remove_dir_all(&unpacked)?;
        // Written last: their presence says the cache is complete.
        std::fs::write(&order, listed)?;
        std::fs::write(&needed, &wanted)?;
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

/// The package the series' metapackage depends on today, which must be of that series.
fn current_package(apt: &Apt, series: Series) -> Result<String> {
    let metapackage = series.metapackage;
    let depends = || -> Result<Option<String>> {
        Ok(apt
            .depends(metapackage)?
            .into_iter()
            .find(|dep| dep.starts_with("linux-image-")))
    };
    let package = match depends()? {
        Some(package) => package,
        None => {
            run(apt.command("apt-get").arg("update"))?;
            depends()?.with_context(|| {
                format!(
                    "apt-cache knows no {metapackage} to take the kernel from ({:?})",
                    series.archive
                )
            })?
        }
    };
    // linux-image-6.1.0-56-amd64, linux-image-6.12.117+deb12-amd64.
    let series_prefix = format!("linux-image-{}.", series.version);
    if !package.starts_with(&series_prefix) {
        bail!(
            "{metapackage} depends on {package}, not a {} kernel",
            series.version
        );
    }
    Ok(package)
}

/// Pulls the compressed payload out of a bzImage (boot protocol 2.08+: its offset and
/// length are in the setup header) and decompresses it with the matching tool. Debian
/// compresses 6.1 with xz and 6.12 with zstd. The kernel's build appends the uncompressed
/// size (32 bits) after every stream but gzip's, which carries its own: it is cut off
/// before decompressing (zstd refuses trailing bytes) and checked against the output.
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
        .filter(|payload| payload.len() > 4)
        .context("the payload lies outside the image")?;
    let (stream, size) = payload.split_at(payload.len() - 4);
    let size = u32::from_le_bytes(size.try_into().unwrap()) as u64;
    let (tool, stream, size) = match payload {
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => ("xz", stream, Some(size)),
        [0x28, 0xb5, 0x2f, 0xfd, ..] => ("zstd", stream, Some(size)),
        [0x1f, 0x8b, ..] => ("gzip", payload, None),
        _ => bail!("{}: unknown compression", vmlinuz.display()),
    };
    let mut child = Command::new(tool)
        .args(["-dc"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::fs::File::create(out)?)
        .spawn()
        .with_context(|| format!("running {tool}"))?;
    let written = std::io::Write::write_all(&mut child.stdin.take().unwrap(), stream);
    let status = child.wait()?;
    let kernel = std::fs::read(out)?;
    let whole = size.is_none_or(|size| kernel.len() as u64 == size);
    if written.is_err() || !status.success() || !whole || !kernel.starts_with(b"\x7fELF") {
        bail!(
            "{tool} ({status}) did not turn {} into an ELF kernel ({} bytes{})",
            vmlinuz.display(),
            kernel.len(),
            size.map(|size| format!(", {size} expected"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

/// How a module file may be named: plain, or compressed with the tool that unpacks it.
const MODULE_SUFFIXES: [(&str, Option<&str>); 4] = [
    (".ko", None),
    (".ko.xz", Some("xz")),
    (".ko.zst", Some("zstd")),
    (".ko.gz", Some("gzip")),
];

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
                let stem = MODULE_SUFFIXES
                    .iter()
                    .find_map(|(suffix, _)| name.strip_suffix(suffix));
                if let Some(stem) = stem {
                    found.insert(stem.replace('-', "_"), path.clone());
                }
            }
        }
    }
    Ok(found)
}

/// The modules built into the kernel, by name, from the package's `modules.builtin`
/// (one path a line, `kernel/drivers/virtio/virtio_pci.ko`, whatever the compression).
fn builtin(tree: &Path) -> Result<BTreeSet<String>> {
    let list = tree.join("modules.builtin");
    let text = std::fs::read_to_string(&list).with_context(|| format!("{}", list.display()))?;
    Ok(text
        .lines()
        .filter_map(|line| line.rsplit('/').next()?.strip_suffix(".ko"))
        .map(|stem| stem.replace('-', "_"))
        .collect())
}

/// [`NEEDED_MODULES`] and their dependencies that are not built in, each after what it
/// depends on: (name, file).
fn load_order(
    modules: &BTreeMap<String, PathBuf>,
    builtin: &BTreeSet<String>,
) -> Result<Vec<(String, PathBuf)>> {
    fn visit(
        name: &str,
        modules: &BTreeMap<String, PathBuf>,
        done: &mut BTreeSet<String>,
        order: &mut Vec<(String, PathBuf)>,
    ) -> Result<()> {
        if done.contains(name) {
            return Ok(());
        }
        let path = modules.get(name).with_context(|| {
            format!("the kernel package has no module {name}, and does not build it in")
        })?;
        for dep in depends(path)? {
            visit(&dep, modules, done, order)?;
        }
        done.insert(name.to_owned());
        order.push((name.to_owned(), path.clone()));
        Ok(())
    }
    let (mut done, mut order) = (builtin.clone(), Vec::new());
    for name in NEEDED_MODULES {
        visit(name, modules, &mut done, &mut order)?;
    }
    Ok(order)
}

/// A module file's ELF bytes, decompressed if it is compressed (the guest's busybox
/// `insmod` hands the kernel the file as it is).
fn read_module(module: &Path) -> Result<Vec<u8>> {
    let name = module.file_name().unwrap_or_default().to_string_lossy();
    let tool = MODULE_SUFFIXES
        .iter()
        .find(|(suffix, _)| name.ends_with(suffix))
        .and_then(|(_, tool)| *tool);
    let bytes = match tool {
        None => std::fs::read(module)?,
        Some(tool) => {
            let out = Command::new(tool)
                .arg("-dc")
                .arg(module)
                .output()
                .with_context(|| format!("running {tool}"))?;
            if !out.status.success() {
                bail!(
                    "{tool} -dc {} failed: {}",
                    module.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            out.stdout
        }
    };
    if !bytes.starts_with(b"\x7fELF") {
        bail!("{} is not an ELF module", module.display());
    }
    Ok(bytes)
}

/// A module's `depends=` entry in its `.modinfo` section.
fn depends(module: &Path) -> Result<Vec<String>> {
    let bytes = read_module(module)?;
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
