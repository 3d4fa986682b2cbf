//! The GPU side of the checkup: the NVML library the daemon would load, the libcuda
//! copies `--memory-at-alloc` would probe, and the NVIDIA device nodes present.

use std::ffi::OsStr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::checked_item::{CheckedItem, ItemStatus};
use crate::backends::devmap::{NVIDIA_MAJOR, nvidia_major};
use crate::backends::nvml::{GpuBackend, NvmlBackend, loaded_library};
use crate::kernel::cuda;

/// The NVML library, loaded as the daemon loads it (`--nvml-lib`,
/// `GENV_ENFORCER_NVML_LIB`, then the driver's usual places), and the GPUs it lists;
/// the directory it was loaded from, where libcuda is looked for beside it.
pub fn nvml(library: &OsStr) -> (CheckedItem, Option<PathBuf>) {
    let shown = library.to_string_lossy();
    let backend = match NvmlBackend::load(&library.to_owned()) {
        Ok(backend) => backend,
        Err(e) => {
            let finding = CheckedItem::new("nvml", ItemStatus::Warn, format!("{shown}: {e}"))
                .with_fix(
                    "install the NVIDIA driver, or give its libnvidia-ml.so.1 with --nvml-lib \
                 (GENV_ENFORCER_NVML_LIB); until then the full cycle cannot see GPU processes",
                );
            return (finding, None);
        }
    };
    let path = loaded_library();
    let from = path
        .as_ref()
        .map_or(shown.to_string(), |p| p.display().to_string());
    let finding = match backend.query() {
        Ok(view) => CheckedItem::ok("nvml", format!("{from}: {} GPUs", view.devices.len())),
        Err(e) => CheckedItem::new("nvml", ItemStatus::Warn, format!("{from} loads, but {e}"))
            .with_fix("see nvidia-smi: the driver does not answer"),
    };
    (finding, path.and_then(|p| p.parent().map(Path::to_owned)))
}

/// The libcuda copies `--memory-at-alloc` would probe from the start (`ldconfig`'s, the
/// one beside NVML, `--cuda-lib`); copies processes map from elsewhere are found as
/// they open a GPU.
pub fn libcuda(given: &[PathBuf], beside_nvml: Option<&Path>, needed: bool) -> CheckedItem {
    let found = cuda::libraries(given, beside_nvml);
    if found.is_empty() {
        // Only --memory-at-alloc looks for it.
        let status = if needed {
            ItemStatus::Warn
        } else {
            ItemStatus::Absent
        };
        return CheckedItem::new(
            "libcuda",
            status,
            "none found (ldconfig -p lists no libcuda.so.1, none beside NVML)",
        )
        .with_fix("install the NVIDIA driver's libcuda.so.1, or give one with --cuda-lib");
    }
    let names: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
    CheckedItem::ok("libcuda", names.join(", "))
}

/// NVIDIA's character major in `/proc/devices` and its nodes under `/dev`.
pub fn device_nodes() -> CheckedItem {
    let major = std::fs::read_to_string("/proc/devices")
        .ok()
        .and_then(|text| nvidia_major(&text));
    let nodes = nvidia_nodes(Path::new("/dev"));
    let listed: Vec<String> = nodes
        .iter()
        .map(|(name, major, minor)| format!("/dev/{name} ({major}:{minor})"))
        .collect();
    let driver = match major {
        Some(major) => format!("nvidia major {major} in /proc/devices"),
        None => "no nvidia major in /proc/devices".to_owned(),
    };
    match (major, listed.is_empty()) {
        (Some(_), false) => {
            CheckedItem::ok("gpu nodes", format!("{driver}; {}", listed.join(", ")))
        }
        (_, true) => CheckedItem::new(
            "gpu nodes",
            ItemStatus::Warn,
            format!("{driver}; no /dev/nvidia*"),
        )
        .with_fix("load the NVIDIA driver (nvidia-modprobe, or nvidia-smi once)"),
        (None, false) => CheckedItem::new(
            "gpu nodes",
            ItemStatus::Warn,
            format!("{driver}; {}", listed.join(", ")),
        )
        .with_fix(format!(
            "load the NVIDIA driver (its major is {NVIDIA_MAJOR}; --gpu-node names other nodes)"
        )),
    }
}

/// `/dev/nvidia*` character devices: name, major and minor (`nvidiactl` is 195:255).
fn nvidia_nodes(dev: &Path) -> Vec<(String, u32, u32)> {
    let Ok(entries) = std::fs::read_dir(dev) else {
        return Vec::new();
    };
    let mut nodes: Vec<(String, u32, u32)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_owned();
            let meta = entry.metadata().ok()?;
            let rdev = meta.rdev();
            (name.starts_with("nvidia") && meta.file_type().is_char_device())
                .then(|| (name, rustix::fs::major(rdev), rustix::fs::minor(rdev)))
        })
        .collect();
    nodes.sort();
    nodes
}
