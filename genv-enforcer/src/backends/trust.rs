//! Whether a file the root daemon is about to run or load is trustworthy: only its
//! owner could have put it there, and that owner is root (or, for a run by an ordinary
//! user, that user). Anything another user could replace would run with the daemon's
//! privileges, or be allowed where that user is not.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {why}", path.display())]
pub struct Untrusted {
    pub path: PathBuf,
    pub why: String,
}

/// `path` (links followed) and its directory are owned by root or by `owner`, and
/// writable by no one else (no group or other write bit).
pub fn check(path: &Path, owner: u32) -> Result<PathBuf, Untrusted> {
    let untrusted = |path: &Path, why: String| Untrusted {
        path: path.to_owned(),
        why,
    };
    let real = std::fs::canonicalize(path).map_err(|e| untrusted(path, e.to_string()))?;
    let parent = real.parent().unwrap_or(Path::new("/"));
    for (what, p) in [("file", real.as_path()), ("directory", parent)] {
        let meta = std::fs::metadata(p).map_err(|e| untrusted(p, e.to_string()))?;
        let mode = meta.permissions().mode() & 0o7777;
        if (meta.uid() != 0 && meta.uid() != owner) || mode & 0o022 != 0 {
            return Err(untrusted(
                p,
                format!(
                    "the {what} is owned by uid {} with mode {mode:o}: it must be root's (or \
                     this user's) and writable by no one else",
                    meta.uid()
                ),
            ));
        }
    }
    Ok(real)
}

/// [`check`] for the user this process runs as.
pub fn check_for_self(path: &Path) -> Result<PathBuf, Untrusted> {
    check(path, rustix::process::geteuid().as_raw())
}

/// For a binary root runs (`/proc/self/exe`): the file and every directory above it
/// are owned by root and writable by no one else. Above the file's own directory, a
/// root-owned sticky directory (`/tmp`) holding a root-owned entry passes: no one else
/// can rename that entry. The same rule as the `genv` front's `check_trusted`.
///
/// Installed by `pip install --user`, into a conda environment a group shares, or
/// under a home directory, the binary sits where its owner (or that group) can replace
/// it, and root runs whatever is there the next time.
pub fn check_root_binary(exe: &Path) -> Result<(), Untrusted> {
    let untrusted = |path: &Path, why: String| Untrusted {
        path: path.to_owned(),
        why,
    };
    // `/proc/self/exe` is resolved already; a path given otherwise is resolved here, so
    // that every component checked is a file or a directory, not a link.
    let exe = std::fs::canonicalize(exe).map_err(|e| untrusted(exe, e.to_string()))?;
    let mut below: Option<u32> = None;
    for (depth, at) in exe.ancestors().enumerate() {
        let meta = std::fs::symlink_metadata(at).map_err(|e| untrusted(at, e.to_string()))?;
        let mode = meta.permissions().mode() & 0o7777;
        let what = if depth == 0 { "file" } else { "directory" };
        if meta.uid() != 0 {
            return Err(untrusted(
                at,
                format!(
                    "the {what} is owned by uid {}, who could replace what root runs",
                    meta.uid()
                ),
            ));
        }
        let sticky_over_roots = depth >= 2 && mode & 0o1000 != 0 && below == Some(0);
        if mode & 0o022 != 0 && !sticky_over_roots {
            return Err(untrusted(
                at,
                format!(
                    "the {what} has mode {mode:o}: others can write there, and replace what root runs"
                ),
            ));
        }
        below = Some(meta.uid());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_files_are_trusted_and_world_writable_places_are_not() {
        assert!(check(Path::new("/bin/true"), 0).is_ok());
        let dir = std::env::temp_dir().join(format!("trust-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let file = dir.join("lib.so");
        std::fs::write(&file, b"").unwrap();
        let error = check(&file, 0).unwrap_err();
        assert_eq!(error.path, dir);
        assert!(error.why.contains("directory"), "{error}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        let error = check(&file, 0).unwrap_err();
        assert!(
            error.why.contains("the file") && error.why.contains("666"),
            "{error}"
        );
        // Owned by another user (the test runs as root: uid 0 owns it, so ask as if
        // root were someone else is not possible; check the owner rule via a uid).
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        rustix::fs::chown(&file, Some(rustix::fs::Uid::from_raw(4242)), None).unwrap();
        assert!(check(&file, 0).is_err());
        assert!(check(&file, 4242).is_ok());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_binary_root_runs_must_be_roots_all_the_way_up() {
        assert_eq!(check_root_binary(Path::new("/bin/sh")), Ok(()));
        // Under /tmp (root's, sticky), in a root-owned directory: passes.
        let dir = std::env::temp_dir().join(format!("trust-exe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let exe = dir.join("genv-enforcer");
        std::fs::write(&exe, b"").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(check_root_binary(&exe), Ok(()));
        // The directory another uid's: refused, naming it.
        rustix::fs::chown(&dir, Some(rustix::fs::Uid::from_raw(65534)), None).unwrap();
        let error = check_root_binary(&exe).unwrap_err();
        assert_eq!(error.path, dir);
        assert!(error.why.contains("uid 65534"), "{error}");
        rustix::fs::chown(&dir, Some(rustix::fs::Uid::from_raw(0)), None).unwrap();
        // The file group-writable: refused.
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o775)).unwrap();
        let error = check_root_binary(&exe).unwrap_err();
        assert_eq!(error.path, exe);
        assert!(error.why.contains("775"), "{error}");
        // Straight in a sticky world-writable directory: refused (depth 1).
        let loose = std::env::temp_dir().join(format!("trust-exe-loose-{}", std::process::id()));
        std::fs::write(&loose, b"").unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(check_root_binary(&loose).is_err());
        std::fs::remove_file(loose).unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}
