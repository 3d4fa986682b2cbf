//! Which GPU a thread's allocations land on: the device of each context made, the
//! context each thread has current, and the process's device numbering.

use aya_ebpf::macros::{map, uprobe, uretprobe};
use aya_ebpf::maps::LruHashMap;
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use genv_ebpf_common::alloc::{CtxStack, MAX_ORDINALS, NO_GPU};
use genv_ebpf_common::cuda_call;

use super::{
    CALL_CTX_CREATE, CALL_CTX_RETAIN, CTX_DEVICE, PENDING, PROC_ORDINALS, Pending, THREAD_CTX,
    handle, held, read_user_u64, started, take_pending,
};
use crate::kernel::current;

#[uprobe]
pub fn cu_init(_ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    started(cuda_call::INIT);
    0
}

/// `cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)`.
#[uprobe]
pub fn cu_ctx_retain(ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    context_made(&ctx, 1, CALL_CTX_RETAIN);
    0
}

/// `cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)`.
#[uprobe]
pub fn cu_ctx_create(ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    context_made(&ctx, 2, CALL_CTX_CREATE);
    0
}

/// Return of the two above: the new context's device; a created context is current.
#[uretprobe]
pub fn cu_ctx_made(ctx: RetProbeContext) -> u32 {
    let (pid, tid) = current();
    let Some(p) = take_pending(tid) else {
        return 0;
    };
    if ctx.ret::<i32>() != 0 || !matches!(p.call, CALL_CTX_RETAIN | CALL_CTX_CREATE) {
        return 0;
    }
    let Some(context) = read_user_u64(p.out) else {
        return 0;
    };
    let _ = CTX_DEVICE.insert(handle(pid, context), p.gpu, 0);
    if p.call == CALL_CTX_CREATE {
        push_context(tid, context);
        started(cuda_call::CTX_CREATE);
    } else {
        started(cuda_call::PRIMARY_CTX_RETAIN);
    }
    0
}

/// A context switch's call, as its entry probe left it for its return probe.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Switch {
    /// The context argument (`cuCtxSetCurrent`, `cuCtxPushCurrent_v2`).
    context: u64,
    call: u32,
    _pad: u32,
}

const SWITCH_SET: u32 = 1;
const SWITCH_PUSH: u32 = 2;
const SWITCH_POP: u32 = 3;
const SWITCH_DESTROY: u32 = 4;

/// Thread → the context switch it is in. A map of its own: a switch made inside an
/// allocation call (the driver's own) leaves that call's record alone.
#[map]
pub(super) static SWITCHES: LruHashMap<u32, Switch> = LruHashMap::with_max_entries(16 * 1024, 0);

/// `cuCtxSetCurrent(CUcontext ctx)`: replaces the top of the stack, on success.
#[uprobe]
pub fn cu_ctx_set_current(ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    switch_called(SWITCH_SET, ctx.arg(0).unwrap_or(0));
    0
}

/// `cuCtxPushCurrent_v2(CUcontext ctx)`.
#[uprobe]
pub fn cu_ctx_push(ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    switch_called(SWITCH_PUSH, ctx.arg(0).unwrap_or(0));
    0
}

/// `cuCtxPopCurrent_v2(CUcontext *pctx)`.
#[uprobe]
pub fn cu_ctx_pop(_ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    switch_called(SWITCH_POP, 0);
    0
}

/// `cuCtxDestroy_v2(CUcontext ctx)`: the context is gone, and popped if it was the
/// calling thread's current one (as the driver does).
#[uprobe]
pub fn cu_ctx_destroy(ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    switch_called(SWITCH_DESTROY, ctx.arg(0).unwrap_or(0));
    0
}

/// Return of the four above: the thread's stack changes only if the call succeeded
/// (a refused context, or a pop of an empty stack, leaves the driver's as it was).
#[uretprobe]
pub fn cu_ctx_switched(ctx: RetProbeContext) -> u32 {
    let (_, tid) = current();
    // SAFETY: a plain lookup; the value is copied out at once.
    let Some(switch) = (unsafe { SWITCHES.get(tid) }).copied() else {
        return 0;
    };
    let _ = SWITCHES.remove(tid);
    if ctx.ret::<i32>() != 0 {
        return 0;
    }
    match switch.call {
        SWITCH_SET => {
            let mut stack = thread_stack(tid);
            stack.ctx[0] = switch.context;
            if stack.depth == 0 {
                stack.depth = 1;
            }
            let _ = THREAD_CTX.insert(tid, stack, 0);
        }
        SWITCH_PUSH => push_context(tid, switch.context),
        SWITCH_POP => pop_context(tid),
        SWITCH_DESTROY => {
            let (pid, _) = current();
            let _ = CTX_DEVICE.remove(handle(pid, switch.context));
            let stack = thread_stack(tid);
            if stack.depth > 0 && stack.ctx[0] == switch.context {
                pop_context(tid);
            }
        }
        _ => {}
    }
    0
}

#[inline(always)]
fn pop_context(tid: u32) {
    let mut stack = thread_stack(tid);
    stack.ctx = [stack.ctx[1], stack.ctx[2], stack.ctx[3], 0];
    stack.depth = stack.depth.saturating_sub(1);
    let _ = THREAD_CTX.insert(tid, stack, 0);
}

#[inline(always)]
fn switch_called(call: u32, context: u64) {
    let (_, tid) = current();
    let switch = Switch {
        context,
        call,
        _pad: 0,
    };
    let _ = SWITCHES.insert(tid, switch, 0);
}

/// The NVML index of the process's CUDA device `device`.
#[inline(always)]
pub(super) fn nvml_index(pid: u32, device: u32) -> Option<u32> {
    // SAFETY: a plain lookup; the value is copied out at once.
    let Some(map) = (unsafe { PROC_ORDINALS.get(pid) }).copied() else {
        return Some(device);
    };
    // Compared slot by slot (constant offsets): an index computed from `device` would
    // be bounded in one register and used from another, which the verifier refuses.
    let mut slot = 0;
    while slot < MAX_ORDINALS {
        if slot as u32 == device {
            let index = map.index[slot];
            return (index != NO_GPU).then_some(index as u32);
        }
        slot += 1;
    }
    None
}

#[inline(always)]
pub(super) fn current_device(pid: u32, tid: u32) -> Option<u32> {
    // SAFETY: plain lookups; the values are copied out at once.
    let stack = unsafe { THREAD_CTX.get(tid) }.copied()?;
    if stack.depth == 0 {
        return None;
    }
    // SAFETY: as above.
    unsafe { CTX_DEVICE.get(handle(pid, stack.ctx[0])) }.copied()
}

#[inline(always)]
fn thread_stack(tid: u32) -> CtxStack {
    // SAFETY: a plain lookup; the value is copied out at once.
    unsafe { THREAD_CTX.get(tid) }.copied().unwrap_or_default()
}

#[inline(always)]
fn push_context(tid: u32, context: u64) {
    let mut stack = thread_stack(tid);
    stack.ctx = [context, stack.ctx[0], stack.ctx[1], stack.ctx[2]];
    stack.depth = (stack.depth + 1).min(4);
    let _ = THREAD_CTX.insert(tid, stack, 0);
}

/// A context-making call's entry: where it writes the context, and the device argument.
#[inline(always)]
fn context_made(ctx: &ProbeContext, device_arg: usize, call: u32) {
    let (_, tid) = current();
    let (Some(out), Some(device)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(device_arg)) else {
        return;
    };
    let pending = Pending {
        out,
        size: 0,
        env: 0,
        gpu: device as u32,
        call,
        pitch_out: 0,
        rows: 0,
    };
    let _ = PENDING.insert(tid, pending, 0);
}
