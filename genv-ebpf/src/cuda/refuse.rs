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
use aya_ebpf::maps::{LruHashMap, PerCpuArray};
use aya_ebpf::programs::ProbeContext;
use genv_ebpf_common::alloc::{MAX_CUDA_PROCESSES, REFUSAL_PACE_NS, RefusalPace};

use super::BPF_NOEXIST;
use super::account::add;

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
    // byte found is read again from the thread's own memory before it is used (a
    // mismatch, which takes that race, kills instead). One search only: a second would
    // double the states the verifier keeps for the loop.
    // SAFETY: this CPU's slot; see above for what may write it meanwhile.
    let bytes = unsafe { &mut (*code).bytes };
    // SAFETY: bpf_probe_read_user checks the address and fails instead of faulting; the
    // page holds the instruction the thread stopped at, so it is mapped.
    if unsafe { bpf_probe_read_user_buf(page as *const u8, bytes) }.is_err() {
        return false;
    }
    let Some(ret) = first_ret(bytes) else {
        return false;
    };
    let target = page + ret as u64;
    if read_byte(target) != Some(RET) {
        return false;
    }
    // SAFETY: stores to the context, which the verifier allows a uprobe program on the
    // kernels that load this one; the thread resumes with these registers.
    unsafe {
        (*regs).rax = OUT_OF_MEMORY;
        (*regs).rip = target;
    }
    true
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

/// Process → when its last refusal was reported, and how many it had since. LRU: a
/// process evicted is reported afresh.
#[map]
pub(crate) static REFUSAL_PACE: LruHashMap<u32, RefusalPace> =
    LruHashMap::with_max_entries(MAX_CUDA_PROCESSES, 0);

/// Whether a refusal of `pid`'s at `now` is reported: `Some(n)`, with the `n` refusals
/// held back since its last report; `None`: held back (counted). A program that lives
/// often retries at once, in a loop: one event a second per process reaches the ring
/// buffer, so that no process can crowd other events out of it.
#[inline(always)]
pub(super) fn paced(pid: u32, now: u64) -> Option<u64> {
    let Some(pace) = REFUSAL_PACE.get_ptr_mut(pid) else {
        let fresh = RefusalPace {
            reported_ns: now,
            held_back: 0,
        };
        let _ = REFUSAL_PACE.insert(pid, fresh, BPF_NOEXIST);
        return Some(0);
    };
    // SAFETY: map memory; threads of one process racing here at most report twice in a
    // second, and the count is moved by atomic adds.
    unsafe {
        if now.wrapping_sub((*pace).reported_ns) < REFUSAL_PACE_NS {
            add((&raw mut (*pace).held_back).cast::<i64>(), 1);
            return None;
        }
        (*pace).reported_ns = now;
        let held_back = core::ptr::read_volatile(&raw const (*pace).held_back);
        add(
            (&raw mut (*pace).held_back).cast::<i64>(),
            -(held_back as i64),
        );
        Some(held_back)
    }
}
