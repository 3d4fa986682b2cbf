//! Allocations and frees: each charged to its environment and GPU before the cap is
//! checked, given back when the call fails or the memory is freed.

use aya_ebpf::helpers::{bpf_get_current_uid_gid, bpf_send_signal};
use aya_ebpf::macros::{uprobe, uretprobe};
use aya_ebpf::programs::{ProbeContext, RetProbeContext};
use genv_ebpf_common::alloc::{Charge, EnvGpu, MAX_CHARGE, ProcGpu};
use genv_ebpf_common::{AllocEvent, RawEvent, decision, hook, identity, kind, policy, verdict};

use super::account::{add, counter, shift};
use super::context::{current_device, nvml_index};
use super::{
    ALLOC_BASE, ALLOC_DELTA, ALLOCS, BPF_NOEXIST, CALL_ALLOC, CALL_ALLOC_UNCHARGED, CALL_FREE,
    CUDA_GPUS, ENV_MEMORY, LOCATION_DEVICE, PENDING, PROC_CAP, PROC_CHARGE, PROP_LOCATION, Pending,
    SIGKILL, handle, held, read_user_u64, take_pending,
};
use crate::kernel::current;
use crate::maps::{ENVS, PROC_ENV, Wake, count_decision, now_ns, offsets, policy, send};
use crate::told::subject;

/// `cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)`, and the two asynchronous ones
/// whose first two arguments are the same (`cuMemAllocAsync`,
/// `cuMemAllocFromPoolAsync`): on the current context's device.
#[uprobe]
pub fn cu_mem_alloc(ctx: ProbeContext) -> u32 {
    alloc_entry::<false>(&ctx)
}

/// The entry probes' bodies, shared with their refusing forms ([`super::refuse`]):
/// `REFUSE` is a constant, so that a plain program holds no store to its registers
/// (which every kernel before 7 refuses at load).
#[inline(always)]
pub(super) fn alloc_entry<const REFUSE: bool>(ctx: &ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    let (Some(out), Some(size)) = (ctx.arg::<u64>(0), ctx.arg::<u64>(1)) else {
        return 0;
    };
    allocating::<REFUSE>(ctx, out, size, None, None);
    0
}

/// `cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height,
/// unsigned int elementSize)`: `pitch × height` bytes, the pitch being the width
/// rounded up to the driver's alignment. Charged at the entry with the width rounded up
/// to 512 bytes (the alignment of every GPU since Fermi), and topped up at the return if
/// the driver chose a larger pitch.
#[uprobe]
pub fn cu_mem_alloc_pitch(ctx: ProbeContext) -> u32 {
    pitch_entry::<false>(&ctx)
}

#[inline(always)]
pub(super) fn pitch_entry<const REFUSE: bool>(ctx: &ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    let (Some(out), Some(pitch_out), Some(width), Some(height)) = (
        ctx.arg::<u64>(0),
        ctx.arg::<u64>(1),
        ctx.arg::<u64>(2),
        ctx.arg::<u64>(3),
    ) else {
        return 0;
    };
    let pitch = width.saturating_add(PITCH_ALIGN - 1) & !(PITCH_ALIGN - 1);
    let rows = Some((pitch_out, height));
    allocating::<REFUSE>(ctx, out, product(pitch, height), None, rows);
    0
}

const PITCH_ALIGN: u64 = 512;

/// `a × b` without a 128-bit multiply (which BPF lacks): factors past 32 bits are taken
/// as the largest size, which no cap allows.
#[inline(always)]
fn product(a: u64, b: u64) -> u64 {
    match a >> 32 == 0 && b >> 32 == 0 {
        true => a * b,
        false => u64::MAX,
    }
}

/// `cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const
/// CUmemAllocationProp *prop, unsigned long long flags)`: on the device the properties
/// name (PyTorch's expandable segments).
#[uprobe]
pub fn cu_mem_create(ctx: ProbeContext) -> u32 {
    create_entry::<false>(&ctx)
}

#[inline(always)]
pub(super) fn create_entry<const REFUSE: bool>(ctx: &ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    let (Some(out), Some(size), Some(prop)) =
        (ctx.arg::<u64>(0), ctx.arg::<u64>(1), ctx.arg::<u64>(2))
    else {
        return 0;
    };
    let location = read_user_u64(prop.wrapping_add(PROP_LOCATION)).unwrap_or(0);
    let (kind, device) = (location as i32, (location >> 32) as i32);
    if kind == LOCATION_DEVICE && device >= 0 {
        allocating::<REFUSE>(ctx, out, size, Some(device as u32), None);
    } else {
        // Host or NUMA memory: not a GPU's. The return probe must still find this
        // call's own record, not an outer call's.
        let (_, tid) = current();
        let _ = PENDING.insert(tid, uncharged(out, size), 0);
    }
    0
}

/// Return of every allocation call: a failed one gives its charge back; a successful
/// one is recorded by its pointer or handle.
#[uretprobe]
pub fn cu_mem_alloc_ret(ctx: RetProbeContext) -> u32 {
    let (pid, tid) = current();
    let Some(p) = take_pending(tid) else {
        return 0;
    };
    if p.call != CALL_ALLOC {
        return 0;
    }
    if ctx.ret::<i32>() != 0 {
        uncharge(pid, p.env, p.gpu, p.size as i64);
        return 0;
    }
    let mut bytes = p.size as i64;
    if p.pitch_out != 0 {
        // The driver's pitch, if larger than the one charged: the rest is charged now
        // (the allocation is made; the next one is judged with it).
        let pitch = read_user_u64(p.pitch_out).unwrap_or(0);
        let actual = product(pitch, p.rows).min(MAX_CHARGE) as i64;
        if actual > bytes {
            if let Some(delta) = ALLOC_DELTA.get_ptr_mut(EnvGpu {
                env: p.env,
                gpu: p.gpu,
                _pad: 0,
            }) {
                shift(delta, actual - bytes);
            }
            charge_process(pid, p.env, p.gpu, actual - bytes);
            bytes = actual;
        }
    }
    if let Some(ptr) = read_user_u64(p.out) {
        let charge = Charge {
            env: p.env,
            bytes,
            gpu: p.gpu,
            _pad: 0,
        };
        // Never over a live record: a pointer written over by another thread between
        // the driver's write and this probe must not file this charge under another
        // allocation. (Not recorded, it stays charged until the process exits or the
        // next memory poll.)
        let _ = ALLOCS.insert(handle(pid, ptr), charge, BPF_NOEXIST);
    }
    0
}

/// `cuMemFree_v2(CUdeviceptr)`, `cuMemFreeAsync(CUdeviceptr, CUstream)`,
/// `cuMemRelease(CUmemGenericAllocationHandle)`.
#[uprobe]
pub fn cu_mem_free(ctx: ProbeContext) -> u32 {
    if !held() {
        return 0;
    }
    let (_, tid) = current();
    let Some(ptr) = ctx.arg::<u64>(0) else {
        return 0;
    };
    let pending = Pending {
        call: CALL_FREE,
        ..uncharged(ptr, 0)
    };
    let _ = PENDING.insert(tid, pending, 0);
    0
}

#[uretprobe]
pub fn cu_mem_free_ret(ctx: RetProbeContext) -> u32 {
    let (pid, tid) = current();
    let Some(p) = take_pending(tid) else {
        return 0;
    };
    if p.call != CALL_FREE || ctx.ret::<i32>() != 0 {
        return 0;
    }
    let key = handle(pid, p.out);
    // SAFETY: a plain lookup; the value is copied out at once.
    if let Some(charge) = unsafe { ALLOCS.get(key) }.copied() {
        let _ = ALLOCS.remove(key);
        uncharge(pid, charge.env, charge.gpu, charge.bytes);
    }
    0
}

#[inline(always)]
fn uncharged(out: u64, size: u64) -> Pending {
    Pending {
        out,
        size,
        env: 0,
        gpu: 0,
        call: CALL_ALLOC_UNCHARGED,
        pitch_out: 0,
        rows: 0,
    }
}

/// An allocation of `size` bytes is starting; `device` is the CUDA device number when
/// the call names one, otherwise the current context's. Sizes are charged up to
/// [`MAX_CHARGE`], kept as charged for the return probe.
#[inline(always)]
fn allocating<const REFUSE: bool>(
    ctx: &ProbeContext,
    out: u64,
    size: u64,
    device: Option<u32>,
    pitch: Option<(u64, u64)>,
) {
    let (pid, tid) = current();
    let size = size.min(MAX_CHARGE);
    let mut pending = uncharged(out, size);
    if let Some((pitch_out, rows)) = pitch {
        pending.pitch_out = pitch_out;
        pending.rows = rows;
    }
    // A thread with no context known (made before the programs were attached) is on
    // device 0, CUDA's default.
    let device = device.unwrap_or_else(|| current_device(pid, tid).unwrap_or(0));
    let gpus = CUDA_GPUS.get(0).copied().unwrap_or(0);
    let gpu = nvml_index(pid, device).filter(|gpu| *gpu < gpus);
    if let (Some(env), Some(gpu)) = (capped_environment(pid), gpu) {
        if charge::<REFUSE>(ctx, Account { pid, env, gpu }, size) {
            pending.env = env;
            pending.gpu = gpu;
            pending.call = CALL_ALLOC;
        }
    }
    let _ = PENDING.insert(tid, pending, 0);
}

/// Whose allocation: the process, and its environment on a GPU.
#[derive(Clone, Copy)]
struct Account {
    pid: u32,
    env: u64,
    gpu: u32,
}

/// Charges `size` bytes to the account, then checks its cap; whether the charge stands
/// (false: the call was refused or its process killed, and the charge taken back).
#[inline(always)]
fn charge<const REFUSE: bool>(ctx: &ProbeContext, account: Account, size: u64) -> bool {
    let Account { pid, env, gpu } = account;
    let key = EnvGpu { env, gpu, _pad: 0 };
    // SAFETY: a plain lookup; the value is copied out at once.
    let Some(cap) = (unsafe { ENV_MEMORY.get(env) }).copied() else {
        return false;
    };
    // Never below what the process was started with: another user's edit of the
    // environment's cap cannot have its allocations killed.
    // SAFETY: a plain lookup; the value is copied out at once.
    let cap = cap.max(unsafe { PROC_CAP.get(pid) }.copied().unwrap_or(0));
    let Some(delta) = counter(&key) else {
        return false;
    };
    let size = size as i64; // at most MAX_CHARGE
    shift(delta, size);
    // SAFETY: map memory, read after our own add: at least everything charged before.
    let total = unsafe { core::ptr::read_volatile(&raw const (*delta).bytes) };
    // SAFETY: a plain lookup; the value is copied out at once.
    let base = unsafe { ALLOC_BASE.get(key) }.copied().unwrap_or_default();
    // Charges are bounded, so the delta since the baseline never wraps.
    let usage =
        (base.nvml_bytes.min(MAX_CHARGE) as i64).wrapping_add(total.wrapping_sub(base.delta_at));
    let over = (usage > cap.min(i64::MAX as u64) as i64).then_some(usage);
    let flags = policy();
    let Some(usage) = over else {
        charge_process(pid, env, gpu, size);
        return true;
    };
    let say = |verdict| report(account, usage, (size, 0), verdict);
    // Refused only by a refusing program (a constant: the plain ones hold no store to
    // their registers); one that cannot refuse this call kills it instead.
    if REFUSE && flags & policy::MEMORY_REFUSE != 0 && super::refuse::return_out_of_memory(ctx) {
        shift(delta, -size);
        count_decision(decision::ALLOC_REFUSED);
        if let Some(held_back) = super::refuse::paced(pid, now_ns()) {
            report(account, usage, (size, held_back), verdict::ALLOC_REFUSED);
        }
        return false;
    }
    if flags & policy::MEMORY_KILL != 0 {
        // SAFETY: signals the current process; SIGKILL is delivered before the call
        // returns to user space, so the driver never sees it.
        if unsafe { bpf_send_signal(SIGKILL) } == 0 {
            shift(delta, -size);
            say(verdict::ALLOC_KILLED);
            return false;
        }
        say(verdict::ALLOC_KILL_FAILED);
    } else if flags & policy::MEMORY_REPORT != 0 {
        say(verdict::ALLOC_REPORTED);
    }
    charge_process(pid, env, gpu, size);
    true
}

#[inline(always)]
fn uncharge(pid: u32, env: u64, gpu: u32, size: i64) {
    if let Some(delta) = ALLOC_DELTA.get_ptr_mut(EnvGpu { env, gpu, _pad: 0 }) {
        shift(delta, -size);
    }
    charge_process(pid, env, gpu, -size);
}

/// What the process holds on the GPU, for the daemon to take off when it exits.
#[inline(always)]
fn charge_process(pid: u32, env: u64, gpu: u32, size: i64) {
    let key = ProcGpu { tgid: pid, gpu };
    if PROC_CHARGE.get_ptr_mut(key).is_none() {
        let fresh = Charge {
            env,
            bytes: 0,
            gpu,
            _pad: 0,
        };
        let _ = PROC_CHARGE.insert(key, fresh, BPF_NOEXIST);
    }
    if let Some(charge) = PROC_CHARGE.get_ptr_mut(key) {
        // SAFETY: map memory; `bytes` is an aligned i64.
        add(unsafe { &raw mut (*charge).bytes }, size);
    }
}

/// `held_back`: refusals of the process's not reported since its last one.
#[inline(always)]
fn report(account: Account, usage: i64, (size, held_back): (i64, u64), verdict: u32) {
    let Account { pid, env, gpu } = account;
    let (_, tid) = current();
    let event = AllocEvent {
        head: RawEvent {
            kind: kind::ALLOC,
            pid,
            tid,
            index: gpu,
            hook: hook::UPROBE,
            uid: bpf_get_current_uid_gid() as u32,
            verdict,
            arg: held_back.min(u32::MAX as u64) as u32,
            ktime_ns: now_ns(),
        },
        env,
        would_use: usage.max(0) as u64,
        size: size as u64,
        subject: subject(&offsets()),
    };
    send(&event, Wake::Now);
}

/// The process's environment identity, when it names an active environment its uid may
/// claim (as the open hook decides) and that environment has a cap; `None` otherwise
/// (nothing is charged: an environment without a cap makes no entries).
#[inline(always)]
pub(super) fn capped_environment(pid: u32) -> Option<u64> {
    // SAFETY: plain lookups; the values are copied out at once.
    let identity = unsafe { PROC_ENV.get(pid) }.copied()?;
    if matches!(identity, identity::NO_ENV | identity::UNRESOLVED) {
        return None;
    }
    // SAFETY: as above.
    let env = unsafe { ENVS.get(identity) }.copied()?;
    let uid = bpf_get_current_uid_gid() as u32;
    // SAFETY: a plain lookup.
    let capped = unsafe { ENV_MEMORY.get(identity) }.is_some();
    (capped && (uid == 0 || env.uid == uid)).then_some(identity)
}
