//! Reading kernel memory at offsets learnt from BTF.

use aya_ebpf::helpers::{
    bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_get_current_task, bpf_probe_read_kernel,
};
use genv_ebpf_common::{Offsets, Subject, kernel_dev};

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

/// The current process as a decision's user is told of it: its controlling terminal
/// (`MKDEV(driver->major, driver->minor_start + index)`, as the kernel's `tty_devnum`
/// makes it; 0 for none, or where a field cannot be read) and its `comm`.
#[inline(always)]
pub fn subject(o: &Offsets) -> Subject {
    Subject {
        tty: controlling_tty(o).unwrap_or(0),
        _pad: 0,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    }
}

#[inline(always)]
fn controlling_tty(o: &Offsets) -> Option<u32> {
    // SAFETY: a helper without arguments; the pointer is only read through
    // bpf_probe_read_kernel.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let signal: *const u8 = read(task, o.task_signal)?;
    let tty: *const u8 = read(signal, o.signal_tty)?;
    let index: i32 = read(tty, o.tty_index)?;
    let driver: *const u8 = read(tty, o.tty_driver)?;
    let major: i32 = read(driver, o.driver_major)?;
    let minor_start: i32 = read(driver, o.driver_minor_start)?;
    Some(kernel_dev(
        major as u32,
        minor_start.wrapping_add(index) as u32,
    ))
}
