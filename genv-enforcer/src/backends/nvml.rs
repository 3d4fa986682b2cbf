//! GPU facts from NVML through `nvml-wrapper`: devices (index, UUID, minor number, total
//! memory) and processes with a compute context, with the memory each uses per device.
//!
//! The library is loaded from a configurable path, so the same code runs against the
//! real `libnvidia-ml.so` and against the test suite's fake.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::trust;

/// The library `nvml-wrapper` loads when no path is given.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// NVML index: the index genv uses in `devices.json`.
    pub index: u32,
    pub uuid: String,
    /// The `N` of `/dev/nvidiaN`; in general not the index.
    pub minor: Option<u32>,
    pub total_memory: u64,
}

/// One compute context: a process on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeContext {
    pub pid: u32,
    pub index: u32,
    /// `None` where NVML reports the figure as not available.
    pub used_memory: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
#[error("NVML {call}: {source}")]
pub struct GpuQueryError {
    call: &'static str,
    #[source]
    source: NvmlError,
}

fn at(call: &'static str) -> impl FnOnce(NvmlError) -> GpuQueryError {
    move |source| GpuQueryError { call, source }
}

/// Devices and the compute contexts on them, from one pass over the devices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuView {
    pub devices: Vec<GpuInfo>,
    /// In NVML's order: by device, then as the driver lists them.
    pub contexts: Vec<ComputeContext>,
}

/// Where the enforcer's GPU facts come from; a trait so that snapshot assembly can be
/// tested without any library.
pub trait GpuBackend {
    fn query(&self) -> Result<GpuView, GpuQueryError>;
}

pub struct NvmlBackend {
    nvml: Nvml,
}

#[derive(Debug, thiserror::Error)]
pub enum NvmlLoadError {
    /// A library anyone but root (or this user) could have written: loading it would
    /// run their code in the daemon.
    #[error("refusing to load NVML from {0}")]
    Untrusted(#[from] trust::Untrusted),
    #[error(transparent)]
    Init(#[from] GpuQueryError),
}

/// Where NVML is when the default name does not load: the driver's soname (without a
/// development package there is no `libnvidia-ml.so`), the NVIDIA container toolkit's
/// `/usr/local/nvidia/lib64` (the H100 node checked), and distributions' directories.
pub const FALLBACKS: [&str; 5] = [
    "libnvidia-ml.so.1",
    "/usr/local/nvidia/lib64/libnvidia-ml.so.1",
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    "/usr/lib64/libnvidia-ml.so.1",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1",
];

impl NvmlBackend {
    /// Loads the library; the default name, where the loader does not find it, is
    /// looked for in [`FALLBACKS`] (a library given by name or path is loaded alone).
    pub fn load(library: &OsString) -> Result<Self, NvmlLoadError> {
        let first = Self::load_one(library);
        let not_found = |r: &Result<Self, NvmlLoadError>| {
            matches!(
                r,
                Err(NvmlLoadError::Init(GpuQueryError {
                    source: NvmlError::LibloadingError(_),
                    ..
                }))
            )
        };
        if library != DEFAULT_LIBRARY || !not_found(&first) {
            return first;
        }
        for place in FALLBACKS {
            let absent = place.starts_with('/') && !Path::new(place).exists();
            if absent {
                continue;
            }
            let loaded = Self::load_one(&OsString::from(place));
            if !not_found(&loaded) {
                return loaded;
            }
        }
        first
    }

    /// Loads one library: a path is checked before it is loaded (its constructors run
    /// at load); a bare name is found by the dynamic loader in the system's directories,
    /// and the file it mapped is checked after.
    fn load_one(library: &OsString) -> Result<Self, NvmlLoadError> {
        let path = Path::new(library);
        // A path is loaded as the file the check resolved it to, not looked up again.
        let checked = match path.components().count() > 1 {
            true => trust::check_for_self(path)?.into_os_string(),
            false => library.clone(),
        };
        let nvml = Nvml::builder()
            .lib_path(&checked)
            .init()
            .map_err(at("init"))?;
        if let Some(mapped) = loaded_library() {
            trust::check_for_self(&mapped)?;
        }
        Ok(Self { nvml })
    }
}

/// The NVML library this process mapped, from its maps (read as `backends::maps` reads
/// any process's: the whole path, spaces included).
pub fn loaded_library() -> Option<PathBuf> {
    super::maps::executable_files(std::process::id())
        .ok()?
        .into_iter()
        .map(|mapping| PathBuf::from(mapping.path))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvidia-ml") || n.contains("nvidia_ml"))
        })
}

impl GpuBackend for NvmlBackend {
    fn query(&self) -> Result<GpuView, GpuQueryError> {
        let count = self.nvml.device_count().map_err(at("device count"))?;
        let mut view = GpuView::default();
        for index in 0..count {
            let device = self
                .nvml
                .device_by_index(index)
                .map_err(at("device handle"))?;
            view.devices.push(GpuInfo {
                index,
                uuid: device.uuid().map_err(at("device UUID"))?,
                // MIG and some virtual GPUs have no minor number of their own.
                minor: device.minor_number().ok(),
                total_memory: device.memory_info().map_err(at("memory info"))?.total,
            });
            let processes = device
                .running_compute_processes()
                .map_err(at("running compute processes"))?;
            view.contexts
                .extend(processes.into_iter().map(|p| ComputeContext {
                    pid: p.pid,
                    index,
                    used_memory: match p.used_gpu_memory {
                        UsedGpuMemory::Used(bytes) => Some(bytes),
                        UsedGpuMemory::Unavailable => None,
                    },
                }));
        }
        Ok(view)
    }
}
