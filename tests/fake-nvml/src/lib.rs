//! A stand-in for `libnvidia-ml.so` on machines without an NVIDIA GPU.
//!
//! The enforcer loads this library exactly as it loads the real NVML (through its
//! configurable library path), so everything above the C ABI runs unchanged in tests.
//!
//! # Configuration
//!
//! `GENV_FAKE_NVML_CONFIG` names a JSON file, re-read whenever it changes (tests replace
//! it atomically while the enforcer runs):
//!
//! ```json
//! {
//!   "devices": [{"uuid": "GPU-aaaa", "minor": 3, "total_memory": 17179869184}],
//!   "processes": [{"pid": 1234, "gpu": 0, "used_memory": 1048576}],
//!   "fail": {"nvmlDeviceGetComputeRunningProcesses_v3": 999}
//! }
//! ```
//!
//! - `devices` are listed in NVML index order; `minor` is the `/dev/nvidiaN` minor number.
//! - `processes` holds compute contexts; `gpu` is the NVML index, `used_memory` is in bytes
//!   (`null` reports NVML's "not available"). Like the real driver, a context disappears
//!   when its process exits: pids that are gone or zombies are not reported.
//! - `fail` makes the named entry point return the given `nvmlReturn_t` code.
//! - `gates`: entry point → a path; while the path exists, that call waits (see
//!   `Config::gates`).
//!
//! A missing or unparsable configuration makes `nvmlInit` fail with
//! `NVML_ERROR_DRIVER_NOT_LOADED`, as on a machine whose driver is not loaded.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_uint, c_ulonglong};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex};

use serde::Deserialize;

type NvmlReturn = c_uint;
const SUCCESS: NvmlReturn = 0;
const ERROR_UNINITIALIZED: NvmlReturn = 1;
const ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
const ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
const VALUE_NOT_AVAILABLE: c_ulonglong = u64::MAX;

/// `nvmlDevice_t` is an opaque pointer; ours encodes `index + 1` so that null stays invalid.
type DeviceHandle = *mut std::ffi::c_void;

#[derive(Clone, Deserialize)]
struct Config {
    #[serde(default)]
    devices: Vec<DeviceConfig>,
    #[serde(default)]
    processes: Vec<ProcessConfig>,
    #[serde(default)]
    fail: HashMap<String, NvmlReturn>,
    /// Device nodes `nvmlInit` opens (and closes), as the real library opens
    /// `/dev/nvidia*`: what the kernel programs see of a process that uses NVML. A
    /// refused open is ignored, as the real library would report it later.
    #[serde(default)]
    open_on_init: Vec<String>,
    /// The fake libcuda's allocations (`tests/fake-cuda`): a directory of
    /// `<pid>-<index>` files, each holding the bytes that process holds on that GPU,
    /// reported as its compute context as the driver would. Read at each enumeration.
    #[serde(default)]
    ledger: Option<String>,
    /// Entry point → a file: while the file exists, a call of that entry point waits
    /// (a minute at most), having made `<file>.waiting`, so that a test can hold the
    /// enforcer in the middle of asking NVML and act meanwhile. An enumeration
    /// (`nvmlDeviceGetCount_v2`) waits before it reads the ledger; `nvmlInit_v2` waits
    /// in init, as a driver does on a failed GPU.
    #[serde(default)]
    gates: HashMap<String, String>,
    /// Every listed process counts as running, unasked (the cycle benchmark's, whose
    /// processes all run: asking ten thousand of them is the fake's cost, not the
    /// enforcer's, and the real driver knows its contexts without asking).
    #[serde(default)]
    assume_live: bool,
}

impl Config {
    /// The configuration with the ledger's contexts added.
    fn with_ledger(&self, dir: &str) -> Config {
        let mut merged = self.clone();
        let Ok(entries) = std::fs::read_dir(dir) else {
            return merged;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some((pid, gpu)) = name.to_str().and_then(|n| n.split_once('-')) else {
                continue;
            };
            let (Ok(pid), Ok(gpu)) = (pid.parse(), gpu.parse()) else {
                continue;
            };
            let Ok(text) = std::fs::read_to_string(entry.path()) else {
                continue;
            };
            if let Ok(bytes) = text.trim().parse::<u64>() {
                merged.processes.push(ProcessConfig {
                    pid,
                    gpu,
                    used_memory: Some(bytes),
                });
            }
        }
        merged
    }
}

#[derive(Clone, Deserialize)]
struct DeviceConfig {
    uuid: String,
    minor: u32,
    total_memory: u64,
    #[serde(default = "default_name")]
    name: String,
}

fn default_name() -> String {
    "Fake NVIDIA GPU".to_owned()
}

#[derive(Clone, Deserialize)]
struct ProcessConfig {
    pid: u32,
    gpu: u32,
    used_memory: Option<u64>,
}

/// Identity of the configuration file last parsed, so an unchanged file is not re-read.
type FileStamp = (u64, u64, i64, i64, u64);

struct State {
    initialized: u32,
    stamp: Option<FileStamp>,
    config: Option<Arc<Config>>,
    /// Pids whose contexts are alive, decided once per enumeration (at each
    /// `nvmlDeviceGetCount`), as the driver's list is one consistent view; checking
    /// `/proc` on every per-device call would make the fake, not the enforcer, the cost
    /// that benchmarks measure.
    live: Option<Arc<HashSet<u32>>>,
    pidfds: Option<HashMap<u32, Option<OwnedFd>>>,
    /// The configuration with the ledger's contexts, as of the last enumeration.
    merged: Option<Arc<Config>>,
}

static STATE: Mutex<State> = Mutex::new(State {
    initialized: 0,
    stamp: None,
    config: None,
    live: None,
    pidfds: None,
    merged: None,
});

fn config_path() -> Option<String> {
    std::env::var("GENV_FAKE_NVML_CONFIG").ok()
}

/// Returns the current configuration, re-reading the file when its identity changed.
fn load(state: &mut State) -> Option<Arc<Config>> {
    let path = config_path()?;
    let meta = std::fs::metadata(&path).ok()?;
    let stamp = (
        meta.dev(),
        meta.ino(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.size(),
    );
    if state.stamp != Some(stamp) || state.config.is_none() {
        let text = std::fs::read_to_string(&path).ok()?;
        let config: Config = serde_json::from_str(&text).ok()?;
        state.config = Some(Arc::new(config));
        state.stamp = Some(stamp);
    }
    state.config.clone()
}

/// Runs `body` with the current configuration, applying `fail` injection for `name`.
fn with_config(name: &str, body: impl FnOnce(&Config, &HashSet<u32>) -> NvmlReturn) -> NvmlReturn {
    let (config, live) = {
        let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
        if state.initialized == 0 {
            return ERROR_UNINITIALIZED;
        }
        let Some(config) = load(&mut state) else {
            return ERROR_DRIVER_NOT_LOADED;
        };
        if let Some(gate) = config.gates.get(name) {
            wait_at(gate);
        }
        if name == "nvmlDeviceGetCount_v2" || state.live.is_none() || state.merged.is_none() {
            let merged = match &config.ledger {
                Some(dir) => Arc::new(config.with_ledger(dir)),
                None => config.clone(),
            };
            let pidfds = state.pidfds.get_or_insert_with(HashMap::new);
            let live = match merged.assume_live {
                true => merged.processes.iter().map(|p| p.pid).collect(),
                false => live_pids(&merged, pidfds),
            };
            state.live = Some(Arc::new(live));
            state.merged = Some(merged);
        }
        let config = match &config.ledger {
            Some(_) => state.merged.clone().unwrap_or(config),
            None => config,
        };
        (config, state.live.clone().unwrap_or_default())
    };
    if let Some(code) = config.fail.get(name) {
        return *code;
    }
    body(&config, &live)
}

/// Waits (a minute at most) while `gate` exists, `<gate>.waiting` saying so.
fn wait_at(gate: &str) {
    let gate = std::path::Path::new(gate);
    if !gate.exists() {
        return;
    }
    let waiting = format!("{}.waiting", gate.display());
    let _ = std::fs::write(&waiting, b"");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while gate.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let _ = std::fs::remove_file(&waiting);
}

fn device(config: &Config, handle: DeviceHandle) -> Option<(u32, &DeviceConfig)> {
    let index = (handle as usize).checked_sub(1)?;
    config
        .devices
        .get(index)
        .map(|device| (index as u32, device))
}

/// Pids whose contexts are alive: a process owns its GPU context until it exits (a
/// zombie owns none). Like a driver, the fake learns of exits without scanning `/proc`:
/// it holds a pidfd per configured pid (they poll readable at exit) and asks them all
/// with one `poll`.
fn live_pids(config: &Config, pidfds: &mut HashMap<u32, Option<OwnedFd>>) -> HashSet<u32> {
    // A set, not a scan per entry: the benchmarks list ten thousand processes, and the
    // fake's own cost must not be what they measure.
    let listed: HashSet<u32> = config.processes.iter().map(|p| p.pid).collect();
    pidfds.retain(|pid, _| listed.contains(pid));
    // At most 1,024 descriptors: the process it is loaded into (an enforcer keeping a
    // `stat` handle per GPU process) needs the rest of its limit.
    let mut held = pidfds.values().filter(|fd| fd.is_some()).count();
    for p in &config.processes {
        pidfds.entry(p.pid).or_insert_with(|| {
            let fd = (held < 1024).then(|| pidfd_open(p.pid)).flatten();
            held += usize::from(fd.is_some());
            fd
        });
    }
    let open: Vec<(u32, &OwnedFd)> = pidfds
        .iter()
        .filter_map(|(pid, fd)| Some((*pid, fd.as_ref()?)))
        .collect();
    let mut polled: Vec<libc::pollfd> = open
        .iter()
        .map(|(_, fd)| libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `polled` is a valid array of its length; timeout 0 never blocks.
    unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 0) };
    let mut live: HashSet<u32> = open
        .iter()
        .zip(&polled)
        .filter(|(_, p)| p.revents == 0)
        .map(|((pid, _), _)| *pid)
        .collect();
    // Past those, a process is asked by signal 0.
    for (pid, _) in pidfds.iter().filter(|(_, fd)| fd.is_none()) {
        // SAFETY: kill(2) with signal 0 sends nothing and takes no pointer.
        if unsafe { libc::kill(*pid as libc::pid_t, 0) } == 0 {
            live.insert(*pid);
        }
    }
    live
}

fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a non-negative return is a descriptor we now own.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Copies `text` NUL-terminated into a caller buffer of `length` bytes.
///
/// # Safety
/// `out` must be valid for `length` bytes.
unsafe fn write_c_string(text: &str, out: *mut c_char, length: c_uint) -> NvmlReturn {
    if out.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let bytes = text.as_bytes();
    if bytes.len() + 1 > length as usize {
        return ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: `out` is not null and, by the caller's contract, valid for `length`
    // bytes, which holds the text and its NUL (checked above).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), out, bytes.len());
        *out.add(bytes.len()) = 0;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    nvmlInitWithFlags(0)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(config) = load(&mut state) else {
        return ERROR_DRIVER_NOT_LOADED;
    };
    // A driver whose init hangs (a failed GPU): the caller never gets an answer.
    if let Some(gate) = config.gates.get("nvmlInit_v2") {
        drop(state);
        wait_at(gate);
        state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    }
    if let Some(code) = config.fail.get("nvmlInit_v2") {
        return *code;
    }
    for node in &config.open_on_init {
        drop(std::fs::File::open(node));
    }
    state.initialized += 1;
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    let mut state = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if state.initialized == 0 {
        return ERROR_UNINITIALIZED;
    }
    state.initialized -= 1;
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    let text: &'static [u8] = match result {
        SUCCESS => b"Success\0",
        ERROR_UNINITIALIZED => b"Uninitialized\0",
        ERROR_INVALID_ARGUMENT => b"Invalid Argument\0",
        ERROR_INSUFFICIENT_SIZE => b"Insufficient Size\0",
        ERROR_DRIVER_NOT_LOADED => b"Driver Not Loaded\0",
        _ => b"Unknown Error (fake NVML)\0",
    };
    text.as_ptr().cast()
}

/// # Safety
/// `count` must be a valid pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    with_config("nvmlDeviceGetCount_v2", |config, _| {
        if count.is_null() {
            return ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: `count` is not null (checked above) and, by NVML's contract, points
        // to a writable uint.
        unsafe { *count = config.devices.len() as c_uint };
        SUCCESS
    })
}

/// # Safety
/// `handle` must be a valid pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    handle: *mut DeviceHandle,
) -> NvmlReturn {
    with_config("nvmlDeviceGetHandleByIndex_v2", |config, _| {
        if handle.is_null() || index as usize >= config.devices.len() {
            return ERROR_INVALID_ARGUMENT;
        }
        // SAFETY: `handle` is not null (checked above) and, by NVML's contract,
        // writable.
        unsafe { *handle = (index as usize + 1) as DeviceHandle };
        SUCCESS
    })
}

/// # Safety
/// `index` must be a valid pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(
    handle: DeviceHandle,
    index: *mut c_uint,
) -> NvmlReturn {
    with_config("nvmlDeviceGetIndex", |config, _| {
        match device(config, handle) {
            Some((i, _)) if !index.is_null() => {
                // SAFETY: `index` is not null (the guard) and, by NVML's contract,
                // writable.
                unsafe { *index = i };
                SUCCESS
            }
            _ => ERROR_INVALID_ARGUMENT,
        }
    })
}

/// # Safety
/// `name` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    handle: DeviceHandle,
    name: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    with_config("nvmlDeviceGetName", |config, _| {
        match device(config, handle) {
            // SAFETY: the caller gives `name` valid for `length` bytes (NVML's
            // contract).
            Some((_, d)) => unsafe { write_c_string(&d.name, name, length) },
            None => ERROR_INVALID_ARGUMENT,
        }
    })
}

/// # Safety
/// `uuid` must be valid for `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    handle: DeviceHandle,
    uuid: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    with_config("nvmlDeviceGetUUID", |config, _| {
        match device(config, handle) {
            // SAFETY: the caller gives `uuid` valid for `length` bytes (NVML's
            // contract).
            Some((_, d)) => unsafe { write_c_string(&d.uuid, uuid, length) },
            None => ERROR_INVALID_ARGUMENT,
        }
    })
}

/// # Safety
/// `minor` must be a valid pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    handle: DeviceHandle,
    minor: *mut c_uint,
) -> NvmlReturn {
    with_config("nvmlDeviceGetMinorNumber", |config, _| {
        match device(config, handle) {
            Some((_, d)) if !minor.is_null() => {
                // SAFETY: `minor` is not null (the guard) and, by NVML's contract,
                // writable.
                unsafe { *minor = d.minor };
                SUCCESS
            }
            _ => ERROR_INVALID_ARGUMENT,
        }
    })
}

/// NVML's `nvmlMemory_v2_t`.
#[repr(C)]
pub struct MemoryV2 {
    version: c_uint,
    total: c_ulonglong,
    reserved: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

/// # Safety
/// `memory` must be a valid pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    handle: DeviceHandle,
    memory: *mut MemoryV2,
) -> NvmlReturn {
    with_config("nvmlDeviceGetMemoryInfo_v2", |config, live| {
        let Some((index, d)) = device(config, handle) else {
            return ERROR_INVALID_ARGUMENT;
        };
        if memory.is_null() {
            return ERROR_INVALID_ARGUMENT;
        }
        let used: u64 = live_processes(config, live, index)
            .filter_map(|p| p.used_memory)
            .sum::<u64>()
            .min(d.total_memory);
        // SAFETY: `memory` is not null (checked above) and, by NVML's contract, a
        // writable `nvmlMemory_t`.
        unsafe {
            (*memory).total = d.total_memory;
            (*memory).reserved = 0;
            (*memory).used = used;
            (*memory).free = d.total_memory - used;
        }
        SUCCESS
    })
}

/// NVML's `nvmlProcessInfo_t` (v2 layout, used by the `_v3` entry point).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

fn live_processes<'a>(
    config: &'a Config,
    live: &'a HashSet<u32>,
    index: u32,
) -> impl Iterator<Item = &'a ProcessConfig> {
    config
        .processes
        .iter()
        .filter(move |p| p.gpu == index && live.contains(&p.pid))
}

/// Follows NVML's contract: with too small a buffer (or none), report the count and
/// `NVML_ERROR_INSUFFICIENT_SIZE`.
///
/// # Safety
/// `count` must be a valid pointer; `infos` valid for `*count` entries when not null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    handle: DeviceHandle,
    count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    with_config("nvmlDeviceGetComputeRunningProcesses_v3", |config, live| {
        let Some((index, _)) = device(config, handle) else {
            return ERROR_INVALID_ARGUMENT;
        };
        if count.is_null() {
            return ERROR_INVALID_ARGUMENT;
        }
        let found: Vec<ProcessInfo> = live_processes(config, live, index)
            .map(|p| ProcessInfo {
                pid: p.pid,
                used_gpu_memory: p.used_memory.unwrap_or(VALUE_NOT_AVAILABLE),
                gpu_instance_id: u32::MAX,
                compute_instance_id: u32::MAX,
            })
            .collect();
        // SAFETY: `count` is not null (checked above) and, by NVML's contract, readable
        // and writable.
        let capacity = unsafe { *count } as usize;
        // SAFETY: as above: `count` is a valid, writable pointer.
        unsafe { *count = found.len() as c_uint };
        if infos.is_null() || capacity < found.len() {
            return if found.is_empty() {
                SUCCESS
            } else {
                ERROR_INSUFFICIENT_SIZE
            };
        }
        // SAFETY: `infos` is not null and holds `capacity` entries (NVML's contract),
        // at least `found.len()` (checked above).
        unsafe { std::ptr::copy_nonoverlapping(found.as_ptr(), infos, found.len()) };
        SUCCESS
    })
}
