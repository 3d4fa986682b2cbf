//! Executables allowed to open GPU nodes outside any environment: monitoring tools that
//! open the nodes without computing, and the enforcer itself (NVML opens them). The
//! kernel compares the device and inode of the running executable (`mm->exe_file`), so
//! a renamed copy or another file at the same path is not allowed, and replacing an
//! allowed binary (a package upgrade) drops it until the daemon reloads the list.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use genv_ebpf_common::{ExeKey, kernel_dev};

use crate::bpf::policy_maps::PolicyMaps;

/// Allowed by default, where they exist.
pub const DEFAULT_PATHS: [&str; 6] = [
    "/usr/bin/nvidia-smi",
    "/usr/bin/nvidia-persistenced",
    "/usr/bin/nv-hostengine",
    "/usr/bin/dcgmi",
    "/usr/bin/dcgm-exporter",
    "/usr/local/bin/dcgm-exporter",
];

/// `statfs` magic numbers of filesystems whose `stat` reports another device than the
/// kernel's inode has (btrfs subvolumes, overlayfs): an entry there may never match.
const BTRFS_SUPER_MAGIC: i64 = 0x9123_683e;
const OVERLAYFS_SUPER_MAGIC: i64 = 0x794c_7630;

#[derive(Debug, Default)]
pub struct AllowList {
    pub keys: HashSet<ExeKey>,
    /// What is allowed, for the start-up line: `path (dev:ino)`.
    pub described: Vec<String>,
    /// Warnings to print: a given path that cannot be used.
    pub warnings: Vec<String>,
}

/// The allow-list from the enforcer's own executable, the defaults that exist, and the
/// paths given with `--allow-exe` (each of which must exist).
pub fn build(given: &[PathBuf]) -> Result<AllowList, String> {
    let mut list = AllowList::default();
    let own = std::fs::read_link("/proc/self/exe").map_err(|e| format!("/proc/self/exe: {e}"))?;
    list.add(&own)
        .map_err(|e| format!("the enforcer's own executable: {e}"))?;
    for path in DEFAULT_PATHS.iter().map(Path::new).filter(|p| p.exists()) {
        if let Err(e) = list.add(path) {
            list.warnings.push(e);
        }
    }
    for path in given {
        list.add(path).map_err(|e| format!("--allow-exe: {e}"))?;
    }
    Ok(list)
}

impl AllowList {
    fn add(&mut self, path: &Path) -> Result<(), String> {
        // Follow links: the kernel sees the file that runs.
        let real = std::fs::canonicalize(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let meta = std::fs::metadata(&real).map_err(|e| format!("{}: {e}", real.display()))?;
        if !meta.is_file() {
            return Err(format!("{}: not a regular file", real.display()));
        }
        let key = ExeKey {
            dev: kernel_dev(libc::major(meta.dev()), libc::minor(meta.dev())),
            _pad: 0,
            ino: meta.ino(),
        };
        if let Ok(fs) = rustix::fs::statfs(&real) {
            // f_type's width differs between platforms.
            #[allow(clippy::unnecessary_cast)]
            let magic = fs.f_type as i64;
            if magic == BTRFS_SUPER_MAGIC || magic == OVERLAYFS_SUPER_MAGIC {
                self.warnings.push(format!(
                    "{} is on btrfs or overlayfs, whose reported device may not be the \
                     kernel's: the allow-list entry may never match",
                    real.display()
                ));
            }
        }
        if self.keys.insert(key) {
            self.described.push(format!(
                "{} ({}:{})",
                real.display(),
                meta.dev(),
                meta.ino()
            ));
        }
        Ok(())
    }
}

/// Loads the allow-list into the kernel; what is allowed, for the start-up line.
pub fn install(maps: &mut PolicyMaps, given: &[PathBuf]) -> anyhow::Result<String> {
    let list = build(given).map_err(anyhow::Error::msg)?;
    for warning in &list.warnings {
        eprintln!("[WARNING] {warning}");
    }
    maps.allow_exes(&list.keys)?;
    Ok(list.described.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_enforcer_itself_is_always_allowed_and_a_missing_path_is_an_error() {
        let list = build(&[]).unwrap();
        let own = std::fs::metadata("/proc/self/exe").unwrap();
        assert!(list.keys.iter().any(|k| k.ino == own.ino()));
        let error = build(&[PathBuf::from("/nonexistent/tool")]).unwrap_err();
        assert!(
            error.starts_with("--allow-exe: /nonexistent/tool"),
            "{error}"
        );
    }
}
