//! The accounts' arithmetic: an environment's delta on a GPU moved by atomic adds only,
//! its move counted first.

use genv_ebpf_common::alloc::{Delta, EnvGpu};

use super::{ALLOC_DELTA, BPF_NOEXIST};

/// The environment's delta on a GPU, created at 0 (two CPUs creating it at once: one
/// insert fails, both find the same entry).
#[inline(always)]
pub(super) fn counter(key: &EnvGpu) -> Option<*mut Delta> {
    if let Some(delta) = ALLOC_DELTA.get_ptr_mut(key) {
        return Some(delta);
    }
    let _ = ALLOC_DELTA.insert(key, Delta::default(), BPF_NOEXIST);
    ALLOC_DELTA.get_ptr_mut(key)
}

/// Moves an account by `bytes`, the move counted first: a reader that sees the bytes
/// changed sees the count changed too (the daemon tells a poll with an allocation or
/// free in flight by the count).
#[inline(always)]
pub(super) fn shift(delta: *mut Delta, bytes: i64) {
    // SAFETY: map memory, two aligned 8-byte fields; `moves` only ever grows, and as a
    // u64 it wraps as the i64 add does.
    unsafe {
        add((&raw mut (*delta).moves).cast::<i64>(), 1);
        add(&raw mut (*delta).bytes, bytes);
    }
}

/// An atomic add whose result is not used (BPF's `XADD`, on every kernel and CPU
/// version): the cap is checked on a read after it, which sees at least this add and
/// every earlier one.
#[inline(always)]
pub(super) fn add(at: *mut i64, value: i64) {
    // SAFETY: an aligned i64 in map memory, which lives as long as the map. (The BPF
    // target has no `AtomicI64::fetch_add`: its atomics are these instructions.)
    unsafe {
        core::arch::asm!(
            "lock *(u64 *)({at} + 0) += {value}",
            at = in(reg) at,
            value = in(reg) value,
            options(nostack),
        )
    };
}
