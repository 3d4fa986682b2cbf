//! tracefs: where tracepoints are attached by name, and where each tracepoint's record
//! layout is published (`events/<category>/<name>/format`). Field offsets are read from
//! there, not compiled in: they differ between kernels (`sched_process_fork` switched
//! its comm fields to `__data_loc` in 6.x; `sched_process_exit` gained `group_dead`).

use std::io;
use std::path::{Path, PathBuf};

const TRACEFS: &str = "/sys/kernel/tracing";
const DEBUGFS_TRACING: &str = "/sys/kernel/debug/tracing";

#[derive(Debug, thiserror::Error)]
pub enum TracefsError {
    #[error("tracefs is not mounted and mounting it at {TRACEFS} failed: {0}")]
    Mount(io::Error),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} has no field {field}")]
    NoField { path: PathBuf, field: String },
}

/// The tracefs root, mounting it where the system has not (aya looks in the same two
/// places).
pub fn ensure_mounted() -> Result<PathBuf, TracefsError> {
    for root in [TRACEFS, DEBUGFS_TRACING] {
        if Path::new(root).join("events").is_dir() {
            return Ok(root.into());
        }
    }
    std::fs::create_dir_all(TRACEFS).map_err(TracefsError::Mount)?;
    let mounted = rustix::mount::mount(
        "nodev",
        TRACEFS,
        "tracefs",
        rustix::mount::MountFlags::empty(),
        None,
    );
    match mounted {
        Ok(()) => Ok(TRACEFS.into()),
        // Another process (a second loader starting at the same moment) mounted it
        // between our look and our mount.
        Err(_) if Path::new(TRACEFS).join("events").is_dir() => Ok(TRACEFS.into()),
        Err(e) => Err(TracefsError::Mount(e.into())),
    }
}

/// Byte offset of `field` in the record of tracepoint `category/name`; `Ok(None)` if the
/// tracepoint exists but has no such field.
pub fn field_offset(
    root: &Path,
    category: &str,
    name: &str,
    field: &str,
) -> Result<Option<u32>, TracefsError> {
    let path = root.join("events").join(category).join(name).join("format");
    let text = std::fs::read_to_string(&path).map_err(|source| TracefsError::Read {
        path: path.clone(),
        source,
    })?;
    Ok(parse_field_offset(&text, field))
}

/// Like [`field_offset`], for a field the programs cannot do without.
pub fn required_field_offset(
    root: &Path,
    category: &str,
    name: &str,
    field: &str,
) -> Result<u32, TracefsError> {
    field_offset(root, category, name, field)?.ok_or_else(|| TracefsError::NoField {
        path: root.join("events").join(category).join(name).join("format"),
        field: field.to_owned(),
    })
}

/// Lines look like `\tfield:long ret;\toffset:16;\tsize:8;\tsigned:1;`; the field's
/// name is the last word of its declaration, before any array suffix.
fn parse_field_offset(format: &str, field: &str) -> Option<u32> {
    format.lines().find_map(|line| {
        let mut parts = line.trim().split(';').map(str::trim);
        let declaration = parts.next()?.strip_prefix("field:")?;
        let name = declaration.rsplit(' ').next()?;
        let name = name.split('[').next()?;
        if name != field {
            return None;
        }
        parts.find_map(|p| p.strip_prefix("offset:")?.parse().ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXIT: &str = "name: sched_process_exit\nID: 312\nformat:\n\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\n\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n";

    #[test]
    fn reads_offsets_of_plain_and_array_fields() {
        assert_eq!(parse_field_offset(EXIT, "group_dead"), Some(32));
        assert_eq!(parse_field_offset(EXIT, "comm"), Some(8));
        assert_eq!(parse_field_offset(EXIT, "pid"), Some(24));
        assert_eq!(parse_field_offset(EXIT, "prio"), None);
        assert_eq!(parse_field_offset(EXIT, "common_type"), Some(0));
    }

    #[test]
    fn the_running_kernel_publishes_the_open_exit_record() {
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: reading tracefs needs root");
            return;
        }
        let root = ensure_mounted().unwrap();
        let ret = required_field_offset(&root, "syscalls", "sys_exit_openat", "ret").unwrap();
        assert_eq!(ret % 8, 0, "ret is a long");
    }
}
