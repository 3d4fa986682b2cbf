//! A stand-in for `libcuda.so.1` on machines without an NVIDIA GPU: the memory and
//! context calls `--memory-at-alloc` probes, with the real signatures, handing out fake
//! pointers and handles. The enforcer's uprobes attach to it exactly as to the real
//! library (by symbol, in this file's inode), so everything above the C ABI runs as it
//! would on a GPU node.
//!
//! Like a driver, it numbers devices through `CUDA_VISIBLE_DEVICES` (device numbers, or
//! `GPU-` UUIDs, whole or a prefix only one device has, of the fake NVML's devices in
//! `GENV_FAKE_NVML_CONFIG`) and
//! reports what each process holds: with `GENV_FAKE_CUDA_LEDGER` set to a directory, it
//! keeps a file `<pid>-<nvml index>` there holding the bytes the process holds on that
//! GPU, which the fake NVML (its `ledger` setting) reports as the process's compute
//! context. With `GENV_FAKE_CUDA_OPENS` (paths separated by `:`), `cuInit` opens those
//! device nodes and keeps them open, as the driver opens `/dev/nvidiactl` and the GPUs.

#![allow(non_snake_case)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_ulonglong};
use std::sync::Mutex;

type CuResult = c_int;
const SUCCESS: CuResult = 0;
const ERROR_INVALID_VALUE: CuResult = 1;
const ERROR_OUT_OF_MEMORY: CuResult = 2;
/// Each device's memory, as the fake NVML's test nodes have it: more is out of memory.
const DEVICE_MEMORY: u64 = 16 << 30;
const ERROR_INVALID_CONTEXT: CuResult = 201;
const ERROR_INVALID_DEVICE: CuResult = 101;

/// Contexts by handle: the device ordinal each is on.
struct Driver {
    contexts: HashMap<u64, c_int>,
    /// Live allocations: pointer or handle → (NVML index, bytes).
    allocations: HashMap<u64, (u32, u64)>,
    /// Bytes this process holds per NVML index.
    held: HashMap<u32, u64>,
    next: u64,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    static STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

fn with_driver<T>(body: impl FnOnce(&mut Driver) -> T) -> T {
    let mut guard = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    let driver = guard.get_or_insert_with(|| Driver {
        contexts: HashMap::new(),
        allocations: HashMap::new(),
        held: HashMap::new(),
        next: 0x7f00_0000_0000,
    });
    body(driver)
}

/// The NVML index of device ordinal `ordinal`, as `CUDA_VISIBLE_DEVICES` numbers them:
/// the list ends at its first entry that names no device.
fn nvml_index(ordinal: c_int) -> Option<u32> {
    let ordinal = usize::try_from(ordinal).ok()?;
    let Ok(visible) = std::env::var("CUDA_VISIBLE_DEVICES") else {
        return Some(ordinal as u32);
    };
    let uuids = nvml_uuids();
    visible
        .split(',')
        .map(|entry| visible_device(entry.trim(), &uuids))
        .take_while(Option::is_some)
        .nth(ordinal)?
}

/// One entry of `CUDA_VISIBLE_DEVICES`: a device number (as `strtoul` reads it: `1gpu`
/// is 1), or a UUID (a prefix will do) only one device has.
fn visible_device(entry: &str, uuids: &[String]) -> Option<u32> {
    let digits = entry.strip_prefix('+').unwrap_or(entry);
    let end = digits
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(digits.len());
    if let Ok(index) = digits[..end].parse() {
        return Some(index);
    }
    if entry.len() <= "GPU-".len() || !entry.starts_with("GPU-") {
        return None;
    }
    let mut named = (0u32..).zip(uuids).filter(|(_, uuid)| {
        uuid.get(..entry.len())
            .is_some_and(|h| h.eq_ignore_ascii_case(entry))
    });
    match (named.next(), named.next()) {
        (Some((index, _)), None) => Some(index),
        _ => None,
    }
}

/// The UUIDs of the fake NVML's devices, by index.
fn nvml_uuids() -> Vec<String> {
    let Some(text) = std::env::var_os("GENV_FAKE_NVML_CONFIG").and_then(|p| std::fs::read(p).ok())
    else {
        return Vec::new();
    };
    let config: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
    config["devices"]
        .as_array()
        .map(|devices| {
            devices
                .iter()
                .map(|d| d["uuid"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn current_ordinal(driver: &Driver) -> Option<c_int> {
    let ctx = STACK.with(|s| s.borrow().last().copied())?;
    driver.contexts.get(&ctx).copied()
}

fn record(driver: &mut Driver, index: u32, delta: i64) {
    let held = driver.held.entry(index).or_insert(0);
    *held = held.saturating_add_signed(delta);
    let Ok(dir) = std::env::var("GENV_FAKE_CUDA_LEDGER") else {
        return;
    };
    let path = format!("{dir}/{}-{index}", std::process::id());
    let tmp = format!("{path}.tmp");
    if std::fs::write(&tmp, held.to_string()).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

/// Hands out `size` bytes on device `ordinal` (the current context's when `None`).
fn allocate(out: *mut u64, size: usize, ordinal: Option<c_int>, tag: u64) -> CuResult {
    if out.is_null() || size == 0 {
        return ERROR_INVALID_VALUE;
    }
    if size as u64 > DEVICE_MEMORY {
        return ERROR_OUT_OF_MEMORY;
    }
    with_driver(|driver| {
        let Some(ordinal) = ordinal.or_else(|| current_ordinal(driver)) else {
            return ERROR_INVALID_CONTEXT;
        };
        let Some(index) = nvml_index(ordinal) else {
            return ERROR_INVALID_DEVICE;
        };
        let pointer = driver.next | tag;
        driver.next += 0x1_0000_0000;
        driver.allocations.insert(pointer, (index, size as u64));
        record(driver, index, size as i64);
        // SAFETY: the caller passes a writable CUdeviceptr (checked non-null).
        unsafe { out.write(pointer) };
        SUCCESS
    })
}

fn release(pointer: u64) -> CuResult {
    with_driver(|driver| match driver.allocations.remove(&pointer) {
        Some((index, size)) => {
            record(driver, index, -(size as i64));
            SUCCESS
        }
        None => ERROR_INVALID_VALUE,
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CuResult {
    if let Ok(paths) = std::env::var("GENV_FAKE_CUDA_OPENS") {
        for path in paths.split(':').filter(|p| !p.is_empty()) {
            // Kept open for the process's life, as the driver's descriptors are.
            if let Ok(file) = std::fs::File::open(path) {
                std::mem::forget(file);
            }
        }
    }
    SUCCESS
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CuResult {
    if device.is_null() || nvml_index(ordinal).is_none() {
        return ERROR_INVALID_DEVICE;
    }
    // SAFETY: checked non-null; the caller's CUdevice.
    unsafe { device.write(ordinal) };
    SUCCESS
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut u64, device: c_int) -> CuResult {
    if ctx.is_null() || nvml_index(device).is_none() {
        return ERROR_INVALID_DEVICE;
    }
    let handle = 0x1000 + device as u64;
    with_driver(|driver| driver.contexts.insert(handle, device));
    // SAFETY: checked non-null; the caller's CUcontext.
    unsafe { ctx.write(handle) };
    SUCCESS
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(ctx: *mut u64, _flags: c_uint, device: c_int) -> CuResult {
    if ctx.is_null() || nvml_index(device).is_none() {
        return ERROR_INVALID_DEVICE;
    }
    let handle = with_driver(|driver| {
        let handle = 0x2000 + driver.contexts.len() as u64;
        driver.contexts.insert(handle, device);
        handle
    });
    STACK.with(|s| s.borrow_mut().push(handle));
    // SAFETY: checked non-null; the caller's CUcontext.
    unsafe { ctx.write(handle) };
    SUCCESS
}

/// Whether `ctx` is a context made and not destroyed.
fn valid(ctx: u64) -> bool {
    with_driver(|driver| driver.contexts.contains_key(&ctx))
}

/// As the driver: a context not made, or destroyed, is refused; NULL unbinds the
/// current one.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: u64) -> CuResult {
    if ctx != 0 && !valid(ctx) {
        return ERROR_INVALID_CONTEXT;
    }
    STACK.with(|s| {
        let mut stack = s.borrow_mut();
        stack.pop();
        if ctx != 0 {
            stack.push(ctx);
        }
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: u64) -> CuResult {
    if !valid(ctx) {
        return ERROR_INVALID_CONTEXT;
    }
    STACK.with(|s| s.borrow_mut().push(ctx));
    SUCCESS
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut u64) -> CuResult {
    let Some(popped) = STACK.with(|s| s.borrow_mut().pop()) else {
        return ERROR_INVALID_CONTEXT;
    };
    if !ctx.is_null() {
        // SAFETY: checked non-null; the caller's CUcontext.
        unsafe { ctx.write(popped) };
    }
    SUCCESS
}

/// Destroys a context; current to the calling thread, it is popped too.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: u64) -> CuResult {
    if with_driver(|driver| driver.contexts.remove(&ctx)).is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    STACK.with(|s| {
        let mut stack = s.borrow_mut();
        if stack.last() == Some(&ctx) {
            stack.pop();
        }
    });
    SUCCESS
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, size: usize) -> CuResult {
    allocate(dptr, size, None, 0x1)
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut u64,
    pitch: *mut usize,
    width: usize,
    height: usize,
    _element: c_uint,
) -> CuResult {
    if pitch.is_null() {
        return ERROR_INVALID_VALUE;
    }
    let aligned = width.div_ceil(512) * 512;
    // SAFETY: checked non-null; the caller's pitch.
    unsafe { pitch.write(aligned) };
    allocate(dptr, aligned.saturating_mul(height), None, 0x2)
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut u64, size: usize, _stream: u64) -> CuResult {
    allocate(dptr, size, None, 0x3)
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut u64,
    size: usize,
    _pool: u64,
    _stream: u64,
) -> CuResult {
    allocate(dptr, size, None, 0x4)
}

/// `CUmemAllocationProp`'s head: two enums, then `CUmemLocation { type, id }`.
#[repr(C)]
pub struct AllocationProp {
    pub kind: c_int,
    pub handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
}

/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const AllocationProp,
    _flags: c_ulonglong,
) -> CuResult {
    if prop.is_null() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: checked non-null; the caller's properties.
    let device = unsafe { (*prop).location_id };
    allocate(handle, size, Some(device), 0x5)
}

/// Managed memory: handed out, not charged to a GPU (it lives where it is touched).
/// # Safety
/// The pointers are the caller's, valid for what libcuda writes through them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut u64,
    size: usize,
    _flags: c_uint,
) -> CuResult {
    if dptr.is_null() || size == 0 {
        return ERROR_INVALID_VALUE;
    }
    let pointer = with_driver(|driver| {
        driver.next += 0x1_0000_0000;
        driver.next | 0x6
    });
    // SAFETY: checked non-null.
    unsafe { dptr.write(pointer) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CuResult {
    release(dptr)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeAsync(dptr: u64, _stream: u64) -> CuResult {
    // A body of its own, so that no linker folds it into cuMemFree_v2.
    std::hint::black_box(_stream);
    release(dptr)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: u64) -> CuResult {
    if handle & 0xf != 0x5 {
        return ERROR_INVALID_VALUE;
    }
    release(handle)
}
