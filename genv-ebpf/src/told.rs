//! What a decision's user is told comes from here: the process as the program reads it
//! at a refusal or a kill (its controlling terminal, its name), carried in the event,
//! since the process is often gone (killed, reaped) by the time the daemon reads it.

use aya_ebpf::helpers::{bpf_get_current_comm, bpf_get_current_task};
use genv_ebpf_common::{Offsets, OpenEvent, RawEvent, Subject, kernel_dev, verdict};

use crate::kernel::read;
use crate::maps::{Wake, send};

/// Sends an open's event: with the process as the program reads it (its terminal, its
/// name) when it is refused or killed, since its user is told of it and the process
/// may be gone by the time the daemon reads the event.
#[inline(always)]
pub fn report_open(head: RawEvent, o: &Offsets) {
    match head.verdict {
        verdict::REFUSED | verdict::KILLED | verdict::KILL_FAILED => send(
            &OpenEvent {
                head,
                subject: subject(o),
            },
            Wake::Now,
        ),
        _ => send(&head, Wake::Now),
    }
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
