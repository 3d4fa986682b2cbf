//! Maps and globals shared with the daemon (names in `genv_ebpf_common`).

use aya_ebpf::bindings::{
    BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_RB_RING_SIZE,
};
use aya_ebpf::helpers::bpf_ktime_get_ns;
use aya_ebpf::macros::map;
use aya_ebpf::maps::{HashMap, PerCpuArray, RingBuf};
use genv_ebpf_common::{MAX_GPU_NODES, Offsets, RawEvent};

/// Events to the daemon. The daemon may resize it at load time (a power of two pages).
#[map]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);

/// Events the ring buffer had no room for; any increase makes the daemon resynchronise.
#[map]
pub static LOST: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Kernel `dev_t` → GPU index, for the nodes the daemon watches.
#[map]
pub static GPU_NODES: HashMap<u32, u32> = HashMap::with_max_entries(MAX_GPU_NODES, 0);

/// Filled in by the daemon before loading; read-only afterwards, so the verifier sees
/// constants.
#[unsafe(no_mangle)]
static OFFSETS: Offsets = Offsets::UNSET;

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
    /// than the event. They are read at the next wake-up (the daemon wakes at least
    /// every 100 ms), or at once when the ring buffer is half full.
    Later,
}

/// Sends an event, counting it as lost if the ring buffer is full.
#[inline(always)]
pub fn emit(kind: u32, pid: u32, tid: u32, arg: u32, index: u32, hook: u32, wake: Wake) {
    let event = RawEvent {
        kind,
        pid,
        tid,
        arg,
        index,
        hook,
        // SAFETY: a helper without arguments.
        ktime_ns: unsafe { bpf_ktime_get_ns() },
    };
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
    if EVENTS.output::<RawEvent>(&event, flags).is_err() {
        if let Some(lost) = LOST.get_ptr_mut(0) {
            // SAFETY: this CPU's slot; programs on one CPU do not preempt each other.
            unsafe { *lost += 1 };
        }
    }
}
