//! Maps and globals shared with the daemon (names in `genv_ebpf_common`).

use aya_ebpf::bindings::{
    BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_RB_RING_SIZE,
};
use aya_ebpf::helpers::bpf_ktime_get_ns;
use aya_ebpf::macros::map;
use aya_ebpf::maps::{Array, HashMap, PerCpuArray, RingBuf};
use genv_ebpf_common::env_scan::WINDOW_WORDS;
use genv_ebpf_common::{
    EnvEntry, ExeKey, MAX_ALLOWED_EXES, MAX_ENVS, MAX_EXEMPT_PIDS, MAX_GPU_NODES, MAX_PROCESSES,
    Offsets, RawEvent, decision,
};

/// Events to the daemon. The daemon may resize it at load time (a power of two pages).
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Events the ring buffer had no room for; any increase makes the daemon resynchronise.
#[map]
pub static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Kernel `dev_t` → GPU index, for the nodes the daemon watches.
#[map]
pub static GPU_NODES: HashMap<u32, u32> = HashMap::with_max_entries(MAX_GPU_NODES, 0);

/// tgid → environment identity (see `genv_ebpf_common::identity`).
#[map]
pub static PROC_ENV: HashMap<u32, u64> = HashMap::with_max_entries(MAX_PROCESSES, 0);

/// Active environments by eid hash, mirrored from genv's state by the daemon.
#[map]
pub static ENVS: HashMap<u64, EnvEntry> = HashMap::with_max_entries(MAX_ENVS, 0);

/// Executables that may open GPU nodes outside any environment.
#[map]
pub static ALLOWED_EXES: HashMap<ExeKey, u8> = HashMap::with_max_entries(MAX_ALLOWED_EXES, 0);

/// The enforcers' own processes (tgid → start time in clock ticks), exempt by process,
/// not by executable: an executable allowed by inode could be run by anyone, with
/// `LD_PRELOAD` or a library of their own.
#[map]
pub static EXEMPT_PIDS: HashMap<u32, u64> = HashMap::with_max_entries(MAX_EXEMPT_PIDS, 0);

/// `genv_ebpf_common::policy` flags, written by the daemon once identities are seeded.
#[map]
pub static POLICY: Array<u32> = Array::with_max_entries(1, 0);

/// In-kernel decisions by `genv_ebpf_common::decision` slot.
#[map]
pub static DECISIONS: PerCpuArray<u64> = PerCpuArray::with_max_entries(decision::SLOTS, 0);

/// Per-CPU scratch for the exec hook (too large for the 512-byte BPF stack): a window of
/// the environment block (`genv_ebpf_common::env_scan`), and the walk's state. The
/// state lives here, not on the stack: the `bpf_loop` steps then read plain map values,
/// and the verifier has no pointer into another frame to follow.
#[repr(C)]
pub struct EnvScratch {
    pub words: [u64; WINDOW_WORDS],
    /// The block being walked (user address and length), and the identity so far.
    pub start: u64,
    pub len: u64,
    pub found: u64,
    /// Bytes of the window read, the word before the chunk included.
    pub valid: u64,
    /// Window offset of the value of the chunk's last assignment; 0 for none.
    pub value: u64,
}

#[map]
pub static SCRATCH: PerCpuArray<EnvScratch> = PerCpuArray::with_max_entries(1, 0);

/// Adds one to this CPU's count in `DECISIONS`.
#[inline(always)]
pub fn count_decision(slot: u32) {
    if let Some(count) = DECISIONS.get_ptr_mut(slot) {
        // SAFETY: this CPU's slot; programs on one CPU do not preempt each other.
        unsafe { *count += 1 };
    }
}

/// The `POLICY` flags.
#[inline(always)]
pub fn policy() -> u32 {
    POLICY.get(0).copied().unwrap_or(0)
}

/// Filled in by the daemon before loading; read-only afterwards, so the verifier sees
/// constants.
#[unsafe(no_mangle)]
pub(crate) static OFFSETS: Offsets = Offsets::UNSET;

/// One member of `OFFSETS`, read as [`offsets`] reads them all: for the paths every open
/// of the machine takes, where copying all of them cost more than the rest.
macro_rules! offset {
    ($member:ident) => {
        // SAFETY: a plain read of our own global; volatile, as in `offsets`.
        unsafe { core::ptr::read_volatile(&$crate::maps::OFFSETS.$member) }
    };
}
pub(crate) use offset;

#[inline(always)]
pub fn offsets() -> Offsets {
    // SAFETY: a plain read of our own global; volatile so that the compiler does not
    // fold in the placeholder value.
    unsafe { core::ptr::read_volatile(&OFFSETS) }
}

/// Whether the daemon is woken for an event.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// At once: a GPU open, which the daemon acts on within milliseconds.
    Now,
    /// Lifecycle events only keep the daemon's process table current; waking it for
    /// each (an inter-processor interrupt per exec, fork and exit) would cost far more
    /// than the event. They are read at the next wake-up (a GPU open's, or the daemon's
    /// own: every 100 ms while they come, backing off to 1 s), or at once when the ring
    /// buffer is half full.
    Later,
}

/// Sends an event (its time is stamped here), counting it as lost if the ring buffer is
/// full.
#[inline(always)]
pub fn emit(mut event: RawEvent, wake: Wake) {
    event.ktime_ns = now_ns();
    send(&event, wake);
}

/// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC.
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: a helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// Writes a record (time already stamped) into the ring buffer, counting it as lost if
/// there is no room.
#[inline(always)]
pub fn send<T>(record: &T, wake: Wake) {
    let flags = match wake {
        Wake::Now => BPF_RB_FORCE_WAKEUP,
        Wake::Later
            if EVENTS.query(BPF_RB_AVAIL_DATA as u64)
                >= EVENTS.query(BPF_RB_RING_SIZE as u64) / 2 =>
        {
            BPF_RB_FORCE_WAKEUP
        }
        Wake::Later => BPF_RB_NO_WAKEUP,
    } as u64;
    if EVENTS.output::<T>(record, flags).is_err() {
        if let Some(lost) = LOST.get_ptr_mut(0) {
            // SAFETY: this CPU's slot; programs on one CPU do not preempt each other.
            unsafe { *lost += 1 };
        }
    }
}
