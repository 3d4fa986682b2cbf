//! `--memory-at-alloc refuse`: an allocation past the cap returns
//! `CUDA_ERROR_OUT_OF_MEMORY` without running, as the driver's own out-of-memory does,
//! and the program lives (PyTorch frees its cache and retries, then raises
//! `torch.OutOfMemoryError`, which scripts catch).
//!
//! The allocation entry probes' refusing forms (`refusing.rs`) call this: its stores to
//! the registers are what only kernels with "bpf: Allow uprobe program to change context
//! registers" (7.x here) load; elsewhere the verifier refuses them, and the daemon loads
//! the plain ones and kills instead (`kernel/cuda/refusal.rs`).
//!
//! The call is made to return through a `ret` instruction (a `0xc3` byte, whatever
//! instruction it sits in) found in the page of the probed one, with the stack left as
//! the call found it, and `ax` set to the error. The `ret` pops the caller's return
//! address or, where a return probe is on the call too, the kernel's trampoline, which
//! runs the return probes and then returns to the caller: the kernel writes that
//! trampoline over the return address *after* every entry handler ran, at the stack
//! pointer as they left it, so a handler that popped the stack itself would have it
//! written over the caller's frame. A `ret` also keeps a shadow stack (CET) in step,
//! which a jump to the return address would not. On arm64 the same needs no stack:
//! `x0` = 2 and `pc` = the link register `x30` (not built).

use aya_ebpf::helpers::{bpf_probe_read_user, bpf_probe_read_user_buf};
use aya_ebpf::macros::map;
use aya_ebpf::maps::PerCpuArray;
use aya_ebpf::programs::ProbeContext;

/// `CUDA_ERROR_OUT_OF_MEMORY`.
const OUT_OF_MEMORY: u64 = 2;
const PAGE: usize = 4096;
/// `ret`.
const RET: u8 = 0xc3;
/// `int3`: the uprobe's breakpoint, where the call was stopped.
const BREAKPOINT: u8 = 0xcc;

/// The page of code the call was stopped in, as the process maps it.
#[repr(C)]
struct CodePage {
    bytes: [u8; PAGE],
}

/// Per CPU: a page is too large for the program's stack.
#[map]
static CODE_PAGE: PerCpuArray<CodePage> = PerCpuArray::with_max_entries(1, 0);

/// Makes the probed call return `CUDA_ERROR_OUT_OF_MEMORY` at once; whether it will
/// (false: it could not be, and the call must be stopped otherwise).
#[inline(always)]
pub(super) fn return_out_of_memory(ctx: &ProbeContext) -> bool {
    let regs = ctx.regs;
    // SAFETY: the context is the stopped thread's registers, which the program may
    // read.
    let ip = unsafe { (*regs).rip };
    let page = ip & !(PAGE as u64 - 1);
    match read_byte(ip) {
        // Moved to a `ret` already, by an earlier run on this call (a program attached
        // twice): refused, and moved once only.
        Some(RET) => return true,
        Some(BREAKPOINT) => {}
        // Somewhere else entirely: not a call this program may move.
        _ => return false,
    }
    let Some(code) = CODE_PAGE.get_ptr_mut(0) else {
        return false;
    };
    // The page is searched in this CPU's buffer, which another run of the program can
    // overwrite if the kernel preempts this one (7.x preempts inside programs): the
    // byte found is read again from the thread's own memory before it is used, and a
    // mismatch searches once more.
    let mut tries = 0;
    while tries < 2 {
        tries += 1;
        // SAFETY: this CPU's slot; see above for what may write it meanwhile.
        let bytes = unsafe { &mut (*code).bytes };
        // SAFETY: bpf_probe_read_user checks the address and fails instead of
        // faulting; the page holds the instruction the thread stopped at, so it is
        // mapped.
        if unsafe { bpf_probe_read_user_buf(page as *const u8, bytes) }.is_err() {
            return false;
        }
        let Some(ret) = first_ret(bytes) else {
            return false;
        };
        let target = page + ret as u64;
        if read_byte(target) != Some(RET) {
            continue;
        }
        // SAFETY: stores to the context, which the verifier allows a uprobe program on
        // the kernels that load this one; the thread resumes with these registers.
        unsafe {
            (*regs).rax = OUT_OF_MEMORY;
            (*regs).rip = target;
        }
        return true;
    }
    false
}

/// One byte of the thread's memory.
#[inline(always)]
fn read_byte(address: u64) -> Option<u8> {
    // SAFETY: bpf_probe_read_user checks the address and fails instead of faulting.
    unsafe { bpf_probe_read_user(address as *const u8) }.ok()
}

/// The offset of the first `ret` byte in the page.
#[inline(always)]
fn first_ret(bytes: &[u8; PAGE]) -> Option<usize> {
    let mut i = 0;
    while i < PAGE {
        if bytes[i] == RET {
            return Some(i);
        }
        i += 1;
    }
    None
}
