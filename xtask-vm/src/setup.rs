//! What a boot needs on the host: QEMU, a static busybox and the unpackers from the
//! distribution, and the kernels.

use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::command::run;
use crate::{Kernel, Series, kernel};

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

/// What booting `series` needs, made ready: the packages, and each kernel's pieces
/// (downloaded once, into `<root>/target/vm/`). Before any build, so that a kernel
/// Debian no longer has fails at once.
pub fn prepare(root: &Path, series: &[Series]) -> Result<Vec<(Series, Kernel)>> {
    crate::require_root("vm-test")?;
    let cache = root.join("target/vm");
    std::fs::create_dir_all(&cache)?;
    ensure_packages()?;
    let mut kernels = Vec::new();
    for &series in series {
        kernels.push((series, kernel::prepare(&cache, series)?));
    }
    Ok(kernels)
}
