//! The node's side of the checkup: who runs it, genv's state directory, the systemd
//! unit, and pins a daemon left in bpffs.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use super::checked_item::{CheckedItem, ItemStatus};
use crate::backends::users;
use crate::kernel::pins;
use crate::state::StateDir;

/// The daemon loads programs and signals any process: it runs as root, and so must the
/// doctor for the kernel to answer as it would answer the daemon.
pub fn root() -> CheckedItem {
    let euid = rustix::process::geteuid().as_raw();
    match euid {
        0 => CheckedItem::ok("root", "running as root, as the daemon does"),
        _ => CheckedItem::new(
            "root",
            ItemStatus::Fail,
            format!("running as uid {euid}: the kernel answers a user, not the daemon"),
        )
        .with_fix("sudo genv-enforcer doctor ..."),
    }
}

/// genv's state directory (`GENV_TMPDIR`, `--genv-tmpdir`): its owner and mode, and
/// whether the enforcer opens it (never through a link or on FUSE).
pub fn state_dir(dir: &Path) -> CheckedItem {
    let item = "state dir";
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return CheckedItem::new(
                item,
                ItemStatus::Absent,
                format!(
                    "{} does not exist yet: genv makes it at its first use",
                    dir.display()
                ),
            );
        }
        Err(e) => {
            return CheckedItem::new(item, ItemStatus::Warn, format!("{}: {e}", dir.display()))
                .with_fix("make it readable by root (GENV_TMPDIR names it)");
        }
    };
    let owner = match users::name_of(meta.uid()) {
        Some(name) => format!("{name} (uid {})", meta.uid()),
        None => format!("uid {}", meta.uid()),
    };
    let seen = format!(
        "{}: owner {owner}, mode {:04o}",
        dir.display(),
        meta.mode() & 0o7777
    );
    match StateDir::new(dir).open_checked() {
        Ok(_) => CheckedItem::ok(item, seen),
        Err(e) => CheckedItem::new(item, ItemStatus::Warn, format!("{seen}: {e}"))
            .with_fix("a plain directory on a local file system, as genv makes it"),
    }
}

/// `genv-enforcer.service`, where systemd runs the machine.
pub fn systemd_unit() -> CheckedItem {
    let item = "systemd unit";
    if !Path::new("/run/systemd/system").is_dir() {
        return CheckedItem::new(
            item,
            ItemStatus::Absent,
            "systemd does not run this machine",
        );
    }
    let ask = |verb: &str| {
        std::process::Command::new("systemctl")
            .args([verb, "genv-enforcer.service"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_else(|e| format!("systemctl: {e}"))
    };
    let (enabled, active) = (ask("is-enabled"), ask("is-active"));
    let seen = format!("genv-enforcer.service: {enabled}, {active}");
    match (enabled.as_str(), active.as_str()) {
        ("enabled", "active") => CheckedItem::ok(item, seen),
        _ => CheckedItem::new(item, ItemStatus::Warn, seen)
            .with_fix("systemctl enable --now genv-enforcer"),
    }
}

/// Generations pinned under `root` (`--keep-pinned`): their programs decide about GPU
/// opens with no daemon running, until a daemon takes them over or `unpin` removes them.
pub fn pins(root: &Path) -> CheckedItem {
    let generations = pins::other_generations(root, None);
    let names: Vec<String> = generations
        .iter()
        .map(|g| g.display().to_string())
        .collect();
    match names.is_empty() {
        true => CheckedItem::new(
            "pins",
            ItemStatus::Absent,
            format!("nothing pinned under {}", root.display()),
        ),
        false => CheckedItem::ok(
            "pins",
            format!(
                "{} generation(s) pinned: {}: their programs keep deciding; a starting \
                 daemon takes them over, `genv-enforcer unpin` removes them",
                names.len(),
                names.join(", ")
            ),
        ),
    }
}
