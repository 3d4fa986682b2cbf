//! Executables allowed to open GPU nodes outside any environment: monitoring tools that
//! open the nodes without computing (an allow-listed process that creates a compute
//! context outside an environment is still terminated by the userspace rule). The kernel
//! compares the device and inode of the running executable (`mm->exe_file`), so a
//! renamed copy or another file at the same path is not allowed, and replacing an
//! allowed binary (a package upgrade) drops it until the daemon reloads the list.
//!
//! The enforcer itself is not on this list: it is exempt by process id
//! (`EXEMPT_PIDS`), since anyone can run an allowed executable, with `LD_PRELOAD`
//! or a library of their own.

use std::collections::HashSet;
use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use genv_ebpf_common::{ExeKey, kernel_dev};

use crate::backends::trust;
use crate::kernel::policy_maps::PolicyMaps;

/// NVIDIA's tools that open GPU nodes to monitor or manage them, allowed wherever they
/// are found.
pub const TOOLS: [&str; 5] = [
    "nvidia-smi",
    "nvidia-persistenced",
    "nv-hostengine",
    "dcgmi",
    "dcgm-exporter",
];

/// Where the tools are looked for, beyond the daemon's `PATH` and the NVML library's
/// `../bin`: the distributions' directories and NVIDIA's container layout.
const TOOL_DIRS: [&str; 6] = [
    "/usr/local/nvidia/bin",
    "/usr/bin",
    "/usr/local/bin",
    "/usr/sbin",
    "/bin",
    "/opt/nvidia/bin",
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

/// The allow-list: the tools found in `search` (see [`tool_dirs`]), and the paths
/// given with `--allow-exe` (each of which must exist and be trusted).
pub fn build(search: &[PathBuf], given: &[PathBuf]) -> Result<AllowList, String> {
    let mut list = AllowList::default();
    for path in find_tools(search) {
        if let Err(e) = list.add(&path) {
            list.warnings.push(e);
        }
    }
    for path in given {
        list.add(path).map_err(|e| format!("--allow-exe: {e}"))?;
    }
    Ok(list)
}

/// Where to look for the tools: `PATH`'s directories, the directory beside the NVML
/// library's (`lib64` → `bin`: NVIDIA's container and driver-container layouts), and
/// the usual ones.
pub fn tool_dirs(path_var: Option<OsString>, nvml_dir: Option<&Path>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = path_var
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(lib) = nvml_dir {
        dirs.extend(lib.parent().map(|root| root.join("bin")));
    }
    dirs.extend(TOOL_DIRS.iter().map(PathBuf::from));
    let mut seen = HashSet::new();
    dirs.retain(|d| d.is_absolute() && seen.insert(d.clone()));
    dirs
}

fn find_tools(dirs: &[PathBuf]) -> Vec<PathBuf> {
    dirs.iter()
        .flat_map(|dir| TOOLS.iter().map(move |tool| dir.join(tool)))
        .filter(|path| path.is_file())
        .collect()
}

/// Loads the allow-list into the kernel; what is allowed, for the start-up line.
pub fn install(
    maps: &mut PolicyMaps,
    search: &[PathBuf],
    given: &[PathBuf],
) -> anyhow::Result<String> {
    let list = build(search, given).map_err(anyhow::Error::msg)?;
    for warning in &list.warnings {
        tracing::warn!("{warning}");
    }
    maps.allow_exes(&list.keys)?;
    Ok(match list.described.is_empty() {
        true => "nothing".to_owned(),
        false => list.described.join(", "),
    })
}

/// The kernel's key for an executable file.
pub fn exe_key(path: &Path) -> std::io::Result<ExeKey> {
    let meta = std::fs::metadata(path)?;
    Ok(ExeKey {
        dev: kernel_dev(libc::major(meta.dev()), libc::minor(meta.dev())),
        _pad: 0,
        ino: meta.ino(),
    })
}

impl AllowList {
    fn add(&mut self, path: &Path) -> Result<(), String> {
        // Links followed (the kernel sees the file that runs), and root's alone: anyone
        // who could replace it would be allowed.
        let real = trust::check(path, 0).map_err(|e| e.to_string())?;
        let meta = std::fs::metadata(&real).map_err(|e| format!("{}: {e}", real.display()))?;
        if !meta.is_file() {
            return Err(format!("{}: not a regular file", real.display()));
        }
        let key = exe_key(&real).map_err(|e| format!("{}: {e}", real.display()))?;
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn temp_dir(name: &str, mode: u32) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("allowlist-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        dir
    }

    #[test]
    fn tools_are_found_in_path_beside_nvml_and_in_nvidias_layout() {
        let dirs = tool_dirs(
            Some("/opt/a/bin:relative:/usr/bin".into()),
            Some(Path::new("/usr/local/nvidia/lib64")),
        );
        assert_eq!(dirs[0], Path::new("/opt/a/bin"));
        assert_eq!(dirs[1], Path::new("/usr/bin"));
        assert_eq!(dirs[2], Path::new("/usr/local/nvidia/bin"));
        assert!(!dirs.iter().any(|d| d.ends_with("relative")));
        assert_eq!(
            dirs.iter().filter(|d| *d == Path::new("/usr/bin")).count(),
            1
        );
    }

    #[test]
    fn a_tool_is_allowed_only_where_root_alone_controls_it() {
        let good = temp_dir("good", 0o755);
        let tool = good.join("nvidia-smi");
        std::fs::copy("/bin/true", &tool).unwrap();
        let list = build(std::slice::from_ref(&good), &[]).unwrap();
        assert_eq!(list.keys.len(), 1, "{:?}", list.warnings);
        // A world-writable directory: anyone could put their own nvidia-smi there.
        let open = temp_dir("open", 0o777);
        std::fs::copy("/bin/true", open.join("nvidia-smi")).unwrap();
        let list = build(std::slice::from_ref(&open), &[]).unwrap();
        assert!(list.keys.is_empty());
        assert!(
            list.warnings[0].contains("writable by no one else"),
            "{:?}",
            list.warnings
        );
        let error = build(&[], &[open.join("nvidia-smi")]).unwrap_err();
        assert!(error.starts_with("--allow-exe: "), "{error}");
        let error = build(&[], &[PathBuf::from("/nonexistent/tool")]).unwrap_err();
        assert!(
            error.starts_with("--allow-exe: /nonexistent/tool"),
            "{error}"
        );
        for dir in [good, open] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
