//! libcuda's memory calls, on uprobes (`--memory-at-alloc`): every CUDA program, the
//! statically linked runtime included, reaches the driver through `libcuda.so.1`, so
//! there is no `LD_PRELOAD` to bypass.
//!
//! - Contexts: which CUDA device each context is on (`cuDevicePrimaryCtxRetain`,
//!   `cuCtxCreate_v2`) and which context each thread has current (`cuCtxSetCurrent`,
//!   `cuCtxPushCurrent_v2`, `cuCtxPopCurrent_v2`, `cuCtxDestroy_v2`, applied when the
//!   call returns success, so a refused switch changes nothing); the device number goes
//!   through the process's `CUDA_VISIBLE_DEVICES` (`PROC_ORDINALS`, from the daemon) to
//!   the NVML index.
//! - Allocations (`cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemAllocAsync`,
//!   `cuMemAllocFromPoolAsync`, `cuMemCreate`): the entry probe charges the size to the
//!   process's environment on that GPU *before* checking the cap, so two processes
//!   racing can both be refused but never both let through; over the cap, the process
//!   is sent SIGKILL in the call (or reported), or, by the refusing forms of these
//!   programs (`refuse`, on kernels that let a uprobe program set registers), the call
//!   returns `CUDA_ERROR_OUT_OF_MEMORY` without running. The return probe takes the
//!   charge back if the call failed, or records the pointer or handle for its free.
//! - Frees (`cuMemFree_v2`, `cuMemFreeAsync`, `cuMemRelease`): the charge is taken back
//!   when the call succeeds.
//!
//! `cuMemAllocManaged` is not counted: managed memory lives where it is touched, and
//! can exceed the GPU's; NVML sees what is resident, and the after-the-fact rule
//! covers it.

use aya_ebpf::helpers::{bpf_get_current_uid_gid, bpf_probe_read_user};
use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, LruHashMap};
use genv_ebpf_common::alloc::{
    Baseline, Charge, CtxStack, Delta, EnvGpu, MAX_ALLOCATIONS, MAX_CUDA_PROCESSES, MAX_ENV_GPUS,
    Ordinals, ProcGpu,
};
use genv_ebpf_common::{MAX_ENVS, RawEvent, cuda_call, hook, kind};

use crate::kernel::current;
use crate::maps::{Wake, emit};

mod account;
mod context;
mod memory;
mod refuse;
mod refusing;

pub(super) const SIGKILL: u32 = 9;
/// `CU_MEM_LOCATION_TYPE_DEVICE`: a `cuMemCreate` on a GPU (not host or NUMA memory).
pub(super) const LOCATION_DEVICE: i32 = 1;
/// `CUmemAllocationProp.location` (`{type, id}`, two `int`s) sits after two enums.
pub(super) const PROP_LOCATION: u64 = 8;

#[map]
pub(crate) static ENV_MEMORY: HashMap<u64, u64> = HashMap::with_max_entries(MAX_ENVS, 0);
#[map]
pub(crate) static ALLOC_DELTA: HashMap<EnvGpu, Delta> = HashMap::with_max_entries(MAX_ENV_GPUS, 0);
#[map]
pub(crate) static ALLOC_BASE: HashMap<EnvGpu, Baseline> =
    HashMap::with_max_entries(MAX_ENV_GPUS, 0);
/// LRU: a flood of processes cannot stop charges from being recorded; an evicted one's
/// exit is not taken off, which over-counts until the next memory poll.
#[map]
pub(crate) static PROC_CHARGE: LruHashMap<ProcGpu, Charge> =
    LruHashMap::with_max_entries(8 * MAX_CUDA_PROCESSES, 0);
/// LRU: an evicted process's devices count as CUDA's own numbering.
#[map]
pub(crate) static PROC_ORDINALS: LruHashMap<u32, Ordinals> =
    LruHashMap::with_max_entries(MAX_CUDA_PROCESSES, 0);
/// LRU: an evicted process is held to its environment's cap alone.
#[map]
pub(crate) static PROC_CAP: LruHashMap<u32, u64> =
    LruHashMap::with_max_entries(MAX_CUDA_PROCESSES, 0);
#[map]
pub(crate) static CUDA_GPUS: Array<u32> = Array::with_max_entries(1, 0);
/// Processes whose CUDA start was reported (one event per program image: a loop of
/// context calls cannot flood the ring buffer); the exec hook forgets them.
#[map]
pub(crate) static ANNOUNCED: LruHashMap<u32, u8> =
    LruHashMap::with_max_entries(MAX_CUDA_PROCESSES, 0);

/// A pointer or handle (or a context) of one process.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Handle {
    pub(super) tgid: u32,
    pub(super) _pad: u32,
    pub(super) handle: u64,
}

/// Live allocations, for their frees.
#[map]
pub(super) static ALLOCS: LruHashMap<Handle, Charge> =
    LruHashMap::with_max_entries(MAX_ALLOCATIONS, 0);
/// Context → the CUDA device number it is on.
#[map]
pub(super) static CTX_DEVICE: LruHashMap<Handle, u32> = LruHashMap::with_max_entries(16 * 1024, 0);
/// Thread → its context stack. LRU: threads' exits are not followed.
#[map]
pub(super) static THREAD_CTX: LruHashMap<u32, CtxStack> =
    LruHashMap::with_max_entries(16 * 1024, 0);

/// What a call's entry probe left for its return probe, by thread.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Pending {
    /// Where the call writes its result (a pointer, handle or context), or the handle
    /// being freed.
    pub(super) out: u64,
    pub(super) size: u64,
    pub(super) env: u64,
    pub(super) gpu: u32,
    pub(super) call: u32,
    /// `cuMemAllocPitch_v2`: where the pitch is written, and the rows; 0 otherwise.
    pub(super) pitch_out: u64,
    pub(super) rows: u64,
}

pub(super) const CALL_ALLOC: u32 = 1;
/// An allocation charged to nobody (outside an environment, or killed at the call).
pub(super) const CALL_ALLOC_UNCHARGED: u32 = 2;
pub(super) const CALL_FREE: u32 = 3;
pub(super) const CALL_CTX_RETAIN: u32 = 4;
pub(super) const CALL_CTX_CREATE: u32 = 5;

#[map]
pub(super) static PENDING: LruHashMap<u32, Pending> = LruHashMap::with_max_entries(16 * 1024, 0);

#[inline(always)]
pub(super) fn take_pending(tid: u32) -> Option<Pending> {
    // SAFETY: a plain lookup; the value is copied out at once.
    let pending = unsafe { PENDING.get(tid) }.copied()?;
    let _ = PENDING.remove(tid);
    Some(pending)
}

/// The process started using CUDA: at `cuInit` the daemon reads its device numbering;
/// once a context is made (the call returned success) it is computing, and a process
/// outside any environment is judged as such. Each is said once per program image.
#[inline(always)]
pub(super) fn started(call: u32) {
    let (pid, tid) = current();
    let bit: u8 = if call == cuda_call::INIT { 1 } else { 2 };
    match ANNOUNCED.get_ptr_mut(pid) {
        // SAFETY: this process's entry; a race with another thread of it at most says
        // the same thing twice.
        Some(said) if unsafe { *said } & bit != 0 => return,
        // SAFETY: as above.
        Some(said) => unsafe { *said |= bit },
        None => {
            let _ = ANNOUNCED.insert(pid, bit, 0);
        }
    }
    emit(
        RawEvent {
            kind: kind::CUDA,
            pid,
            tid,
            arg: call,
            hook: hook::UPROBE,
            uid: bpf_get_current_uid_gid() as u32,
            ..RawEvent::default()
        },
        Wake::Now,
    );
}

pub(super) const BPF_NOEXIST: u64 = 1;

/// Whether the calling process is held at its allocations (its environment has a cap
/// and its uid may claim it). The probes are registered system-wide, so every process
/// that maps libcuda runs them: each entry probe returns here at once for any other,
/// leaving nothing for its return probe.
#[inline(always)]
pub(super) fn held() -> bool {
    memory::capped_environment(current().0).is_some()
}

/// The exec hook: a new program image starts CUDA anew.
#[inline(always)]
pub fn forget_image(pid: u32) {
    // Every exec and exit of the machine comes here: a lookup (lock-free) first, the
    // delete (which locks its bucket) only for the processes that used CUDA.
    // SAFETY: a plain lookup.
    if unsafe { ANNOUNCED.get(pid) }.is_some() {
        let _ = ANNOUNCED.remove(pid);
    }
}

#[inline(always)]
pub(super) fn handle(tgid: u32, handle: u64) -> Handle {
    Handle {
        tgid,
        _pad: 0,
        handle,
    }
}

#[inline(always)]
pub(super) fn read_user_u64(address: u64) -> Option<u64> {
    // SAFETY: bpf_probe_read_user checks the address and fails instead of faulting.
    unsafe { bpf_probe_read_user(address as *const u64) }.ok()
}
