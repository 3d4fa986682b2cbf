//! A CUDA program, in tests: it loads a libcuda (`GENV_FAKE_CUDA_LIB`, the fake one in
//! `tests/fake-cuda`, or the real one) with `dlopen`, as the CUDA runtime does, and
//! makes the calls its stdin asks for, one per line, answering each on stdout (`ok
//! VALUE` or `err CODE`, `err CODE VALUE` where the failed call wrote a value). A
//! process killed in a call answers nothing more.
//!
//! - `init`: `cuInit(0)`;
//! - `ctx D`: `cuDevicePrimaryCtxRetain` on device D, then `cuCtxSetCurrent` (what the
//!   runtime does); `create D`: `cuCtxCreate_v2`; `push D` / `pop`: the context stack;
//!   `setctx CTX`, `pushctx CTX`: `cuCtxSetCurrent` and `cuCtxPushCurrent_v2` of a
//!   context as answered (in hex); `destroy CTX`: `cuCtxDestroy_v2`;
//! - `alloc MIB`: `cuMemAlloc_v2`; `async MIB`: `cuMemAllocAsync`; `pool MIB`:
//!   `cuMemAllocFromPoolAsync`; `pitch MIB`:
//!   `cuMemAllocPitch_v2` of 1 MiB rows; `vmm MIB D`: `cuMemCreate` on device D;
//!   `managed MIB`: `cuMemAllocManaged`;
//! - `bytes N`: `cuMemAlloc_v2` of N bytes exactly; `pitchw W H`: `cuMemAllocPitch_v2`
//!   of H rows of W bytes;
//! - `free PTR`: `cuMemFree_v2`; `freeasync PTR`: `cuMemFreeAsync`; `release HANDLE`:
//!   `cuMemRelease` (PTR and HANDLE as answered, in hex);
//! - `loop N`: N pairs of `cuMemAlloc_v2` (1 MiB) and `cuMemFree_v2`, answering the
//!   nanoseconds they took in all (the benchmark of the probes' cost); `refusals N
//!   MIB`: N calls of `cuMemAlloc_v2` of MIB that must all return out-of-memory, the
//!   nanoseconds they took (the cost of a refusal);
//! - `peek SYMBOL`: the first byte of SYMBOL's code as this process maps it (`0xcc`
//!   where a uprobe placed its breakpoint);
//! - `open PATH`: opens PATH (a GPU node) and keeps it open, as NVML's init does;
//! - `load`: loads the libcuda, when `GENV_CUDA_USER_LAZY` is set (else it is loaded
//!   at start).

use std::ffi::{CString, c_int, c_uint, c_void};
use std::io::{BufRead, Write};

const MIB: usize = 1 << 20;

#[repr(C)]
struct AllocationProp {
    kind: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

struct Cuda(*mut c_void);

impl Cuda {
    fn open() -> Self {
        let path = std::env::var("GENV_FAKE_CUDA_LIB").unwrap_or_else(|_| "libcuda.so.1".into());
        let name = CString::new(path.clone()).unwrap();
        // SAFETY: a NUL-terminated path; the handle is kept for the process's life.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null(), "cannot load {path}");
        Cuda(handle)
    }

    fn symbol(&self, name: &str) -> *mut c_void {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle and a NUL-terminated name.
        let f = unsafe { libc::dlsym(self.0, c.as_ptr()) };
        assert!(!f.is_null(), "no {name}");
        f
    }
}

macro_rules! call {
    ($cuda:expr, $name:literal, fn($($t:ty),*), $($arg:expr),*) => {{
        // SAFETY: the symbol has this C signature in libcuda.
        let f: extern "C" fn($($t),*) -> c_int = unsafe { std::mem::transmute($cuda.symbol($name)) };
        f($($arg),*)
    }};
}

/// `cuDevicePrimaryCtxRetain` on `device`, the context into `context`.
fn retain(cuda: &Cuda, device: u64, context: &mut u64) -> c_int {
    call!(
        cuda,
        "cuDevicePrimaryCtxRetain",
        fn(*mut u64, c_int),
        context,
        device as c_int
    )
}

/// `cuMemAlloc_v2` of `bytes`, the pointer into `pointer`.
fn alloc(cuda: &Cuda, bytes: usize, pointer: &mut u64) -> c_int {
    call!(cuda, "cuMemAlloc_v2", fn(*mut u64, usize), pointer, bytes)
}

/// `cuMemAllocPitch_v2` of `height` rows of `width` bytes.
fn pitched(cuda: &Cuda, width: usize, height: usize, pointer: &mut u64) -> c_int {
    let mut pitch = 0usize;
    call!(
        cuda,
        "cuMemAllocPitch_v2",
        fn(*mut u64, *mut usize, usize, usize, c_uint),
        pointer,
        &mut pitch,
        width,
        height,
        1
    )
}

/// The commands that are no CUDA call: `open` and `load`.
fn outside_cuda(
    command: &str,
    words: &[&str],
    loaded: &mut Option<Cuda>,
    value: &mut u64,
) -> Option<c_int> {
    match command {
        "open" => {
            let file = std::fs::File::open(words.get(1).copied().unwrap_or_default());
            Some(match file {
                Ok(file) => {
                    // Kept open for the process's life, as NVML keeps its descriptors.
                    *value = std::os::fd::IntoRawFd::into_raw_fd(file) as u64;
                    0
                }
                Err(e) => e.raw_os_error().unwrap_or(-1),
            })
        }
        "load" => {
            loaded.get_or_insert_with(Cuda::open);
            Some(0)
        }
        _ => None,
    }
}

/// `ok VALUE`; `err CODE`, with the value where a failed call wrote one (it starts at
/// 0: a refused allocation leaves its out-pointer untouched).
fn answer(code: c_int, value: u64) -> String {
    match (code, value) {
        (0, value) => format!("ok {value:#x}"),
        (code, 0) => format!("err {code}"),
        (code, value) => format!("err {code} {value:#x}"),
    }
}

fn main() {
    let mut loaded = std::env::var_os("GENV_CUDA_USER_LAZY")
        .is_none()
        .then(Cuda::open);
    let mut out = std::io::stdout();
    writeln!(out, "ready {}", std::process::id()).unwrap();
    out.flush().unwrap();
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let number = |i: usize| -> u64 {
            let w: &str = words.get(i).copied().unwrap_or("0");
            match w.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
                None => w.parse().unwrap(),
            }
        };
        let mut value: u64 = 0;
        let command = words.first().copied().unwrap_or("");
        if let Some(code) = outside_cuda(command, &words, &mut loaded, &mut value) {
            writeln!(out, "{}", answer(code, value)).unwrap();
            out.flush().unwrap();
            continue;
        }
        let cuda = loaded
            .as_ref()
            .expect("libcuda is not loaded: say `load` first");
        match in_cuda(cuda, command, &words, &number, &mut value) {
            Some(code) => writeln!(out, "{}", answer(code, value)).unwrap(),
            None => writeln!(out, "unknown {command}").unwrap(),
        }
        out.flush().unwrap();
    }
}

/// One call on the loaded libcuda, by `command` and its `words`: its result code (its
/// value, if any, into `value`); `None` for a command it does not know.
fn in_cuda(
    cuda: &Cuda,
    command: &str,
    words: &[&str],
    number: &dyn Fn(usize) -> u64,
    value: &mut u64,
) -> Option<c_int> {
    Some(match command {
        "init" => call!(cuda, "cuInit", fn(c_uint), 0),
        "ctx" => match retain(cuda, number(1), value) {
            0 => call!(cuda, "cuCtxSetCurrent", fn(u64), *value),
            code => code,
        },
        "create" => call!(
            cuda,
            "cuCtxCreate_v2",
            fn(*mut u64, c_uint, c_int),
            &mut *value,
            0,
            number(1) as c_int
        ),
        "push" => match retain(cuda, number(1), value) {
            0 => call!(cuda, "cuCtxPushCurrent_v2", fn(u64), *value),
            code => code,
        },
        "pop" => call!(cuda, "cuCtxPopCurrent_v2", fn(*mut u64), &mut *value),
        "setctx" => call!(cuda, "cuCtxSetCurrent", fn(u64), number(1)),
        "pushctx" => call!(cuda, "cuCtxPushCurrent_v2", fn(u64), number(1)),
        "destroy" => call!(cuda, "cuCtxDestroy_v2", fn(u64), number(1)),
        "alloc" => alloc(cuda, number(1) as usize * MIB, value),
        "bytes" => alloc(cuda, number(1) as usize, value),
        "pitchw" => pitched(cuda, number(1) as usize, number(2) as usize, &mut *value),
        "async" => call!(
            cuda,
            "cuMemAllocAsync",
            fn(*mut u64, usize, u64),
            &mut *value,
            number(1) as usize * MIB,
            0
        ),
        "pool" => call!(
            cuda,
            "cuMemAllocFromPoolAsync",
            fn(*mut u64, usize, u64, u64),
            &mut *value,
            number(1) as usize * MIB,
            0,
            0
        ),
        "pitch" => pitched(cuda, MIB, number(1) as usize, &mut *value),
        "vmm" => vmm(cuda, number(1) as usize * MIB, number(2) as c_int, value),
        "loop" => alloc_free_loop(cuda, number(1), value),
        "refusals" => refused_loop(cuda, number(1), number(2) as usize * MIB, value),
        "managed" => call!(
            cuda,
            "cuMemAllocManaged",
            fn(*mut u64, usize, c_uint),
            &mut *value,
            number(1) as usize * MIB,
            1
        ),
        "free" => call!(cuda, "cuMemFree_v2", fn(u64), number(1)),
        "freeasync" => call!(cuda, "cuMemFreeAsync", fn(u64, u64), number(1), 0),
        "release" => call!(cuda, "cuMemRelease", fn(u64), number(1)),
        "peek" => peek(cuda, words.get(1).copied().unwrap_or(""), value),
        _ => return None,
    })
}

/// `cuMemCreate` of `bytes` on device `device` (the handle into `value`).
fn vmm(cuda: &Cuda, bytes: usize, device: c_int, value: &mut u64) -> c_int {
    let prop = AllocationProp {
        kind: 1,
        handle_types: 0,
        location_type: 1,
        location_id: device,
        win32: std::ptr::null_mut(),
        flags: [0; 8],
    };
    call!(
        cuda,
        "cuMemCreate",
        fn(*mut u64, usize, *const AllocationProp, u64),
        &mut *value,
        bytes,
        &prop,
        0
    )
}

/// `times` allocations of 1 MiB, each freed at once; the nanoseconds they took into
/// `value` (the benchmark's loop).
fn alloc_free_loop(cuda: &Cuda, times: u64, value: &mut u64) -> c_int {
    let alloc: extern "C" fn(*mut u64, usize) -> c_int =
        // SAFETY: the symbols have these C signatures in libcuda.
        unsafe { std::mem::transmute(cuda.symbol("cuMemAlloc_v2")) };
    let free: extern "C" fn(u64) -> c_int =
        // SAFETY: as above.
        unsafe { std::mem::transmute(cuda.symbol("cuMemFree_v2")) };
    let started = std::time::Instant::now();
    let mut code = 0;
    for _ in 0..times {
        let mut pointer = 0u64;
        code = alloc(&mut pointer, MIB);
        if code == 0 {
            code = free(pointer);
        }
        if code != 0 {
            break;
        }
    }
    *value = started.elapsed().as_nanos() as u64;
    code
}

/// `times` calls of `cuMemAlloc_v2` of `bytes` each that must all be refused
/// (`CUDA_ERROR_OUT_OF_MEMORY`, a cap's refusal), the nanoseconds they took into
/// `value`; the first other answer ends it, as its code (1 for a success).
fn refused_loop(cuda: &Cuda, times: u64, bytes: usize, value: &mut u64) -> c_int {
    const OUT_OF_MEMORY: c_int = 2;
    let started = std::time::Instant::now();
    for _ in 0..times {
        let mut pointer = 0u64;
        match alloc(cuda, bytes, &mut pointer) {
            OUT_OF_MEMORY => {}
            0 => return 1,
            code => return code,
        }
    }
    *value = started.elapsed().as_nanos() as u64;
    0
}

/// The first instruction byte of `symbol` into `value` (where a uprobe writes its
/// breakpoint, 0xcc).
fn peek(cuda: &Cuda, symbol: &str, value: &mut u64) -> c_int {
    // SAFETY: the symbol's first instruction byte, in the library's mapped text.
    *value = unsafe { *(cuda.symbol(symbol) as *const u8) } as u64;
    0
}
