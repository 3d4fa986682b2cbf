//! Reading kernel memory at offsets learnt from BTF.

use aya_ebpf::helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel};

/// Reads a `T` at `base + offset`; `None` if the memory cannot be read.
#[inline(always)]
pub fn read<T>(base: *const u8, offset: u32) -> Option<T> {
    if base.is_null() {
        return None;
    }
    // SAFETY: bpf_probe_read_kernel checks the address and fails instead of faulting.
    unsafe { bpf_probe_read_kernel(base.wrapping_add(offset as usize) as *const T).ok() }
}

/// `(tgid, tid)` of the current task: the process's pid and the thread's.
#[inline(always)]
pub fn current() -> (u32, u32) {
    let id = bpf_get_current_pid_tgid();
    ((id >> 32) as u32, id as u32)
}
