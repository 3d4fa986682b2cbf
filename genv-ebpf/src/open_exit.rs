//! Tier 4 of the open hook: the syscall exit tracepoints, where the kernel runs no
//! trampoline programs. They fire after every successful open on the machine, so the
//! descriptor is resolved to its device number first with as few helper calls as the
//! kernel allows ([`fd_file`]), and only a watched GPU node's open walks the table with
//! probe reads and is decided on ([`decide`]).

use aya_ebpf::EbpfContext;
use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_kernel};
use aya_ebpf::macros::{raw_tracepoint, tracepoint};
use aya_ebpf::programs::{RawTracePointContext, TracePointContext};
use genv_ebpf_common::{Offsets, hook};

use crate::fd_file::{Slot, rdev_at};
use crate::kernel::read;
use crate::maps::{GPU_NODES, offset, offsets};
use crate::open::decide;

/// Tier 4: the `open`, `openat`, `openat2`, `creat` and `open_by_handle_at` syscall
/// exits, native and 32-bit. Only successful opens return a descriptor; it is resolved
/// through the task's file table to its inode.
#[inline(always)]
fn on_open_exit(ctx: &TracePointContext) {
    // `ret` is at 16 in every kernel's `sys_exit_*` record (`struct syscall_trace_exit`:
    // the common header, the syscall number, then `ret`): a load from the context, where
    // a probe read is a helper call. The offset comes from the tracepoint's format file;
    // the verifier knows it, and drops the branch not taken.
    let ret = if offset!(sys_exit_ret) == 16 {
        // SAFETY: within the tracepoint's record, 8-byte aligned; the verifier checks
        // every context access.
        unsafe { *(ctx.as_ptr().add(16) as *const i64) }
    } else {
        let at = offset!(sys_exit_ret) as usize;
        // SAFETY: the offset comes from the tracepoint's format file.
        let Ok(ret) = (unsafe { ctx.read_at::<i64>(at) }) else {
            return;
        };
        ret
    };
    on_open_returned(ctx, ret);
}

/// The descriptor an open returned (`ret`), if it is one, decided about.
#[inline(always)]
fn on_open_returned<C: EbpfContext>(ctx: &C, ret: i64) {
    if ret < 0 || ret > i32::MAX as i64 {
        return;
    }
    let fd = ret as u32;
    match rdev_at(fd) {
        Slot::Empty | Slot::Rdev(0) => return,
        // SAFETY: a plain lookup.
        Slot::Rdev(rdev) if unsafe { GPU_NODES.get(rdev) }.is_none() => return,
        Slot::Rdev(_) | Slot::Walk => {}
    }
    // A watched node (or a kernel without the members the filter reads): the walk again,
    // by probe reads, whose untyped pointers `decide` reads as every tier's.
    // SAFETY: a helper without arguments; the task is read only through probe reads.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let Some(files) = read::<*const u8>(task, offset!(task_files)) else {
        return;
    };
    let Some(fdt) = read::<*const u8>(files, offset!(files_fdt)) else {
        return;
    };
    let Some((max_fds, fds)) = fd_array(fdt) else {
        return;
    };
    if fd >= max_fds || fds.is_null() {
        return;
    }
    // SAFETY: a probe read of the descriptor's slot, bounded by max_fds above.
    let Ok(file) = (unsafe { bpf_probe_read_kernel(fds.wrapping_add(fd as usize)) }) else {
        return;
    };
    decide(ctx, file, hook::TRACEPOINT);
}

/// `fdt->max_fds` and `fdt->fd`: one probe read where they are next to each other (as
/// in every kernel's `struct fdtable` so far), two otherwise.
#[inline(always)]
fn fd_array(fdt: *const u8) -> Option<(u32, *const *const u8)> {
    let (max_fds, fd) = (offset!(fdtable_max_fds), offset!(fdtable_fd));
    if fd == max_fds + 8 && max_fds % 8 == 0 {
        let [max, array] = read::<[u64; 2]>(fdt, max_fds)?;
        Some((max as u32, array as *const *const u8))
    } else {
        Some((read(fdt, max_fds)?, read(fdt, fd)?))
    }
}

/// `TS_COMPAT` in x86's `thread_info.status`: the task is in a 32-bit syscall
/// (`int 0x80`, or a 32-bit program), whose exits the `sys_exit_open*` tracepoints
/// never report.
const TS_COMPAT: u32 = 0x0002;

/// The 32-bit syscall numbers that open a file (x86 `syscall_32.tbl`): open, creat,
/// openat, open_by_handle_at, openat2.
const COMPAT_OPENS: [u64; 5] = [5, 8, 295, 342, 437];

/// Tier 4, 32-bit opens: `raw_syscalls:sys_exit(regs, ret)`, which fires for every
/// syscall exit; it returns at once unless the task is in a 32-bit syscall.
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn open_exit_compat(ctx: RawTracePointContext) -> i32 {
    let o = offsets();
    if o.task_ti_status == Offsets::ABSENT || o.regs_orig_ax == Offsets::ABSENT {
        return 0;
    }
    // SAFETY: a helper without arguments; the task is read only through probe reads.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    if read::<u32>(task, o.task_ti_status).is_none_or(|status| status & TS_COMPAT == 0) {
        return 0;
    }
    let regs: *const u8 = ctx.arg(0);
    let Some(nr) = read::<u64>(regs, o.regs_orig_ax) else {
        return 0;
    };
    if COMPAT_OPENS.contains(&nr) {
        let ret: i64 = ctx.arg(1);
        on_open_returned(&ctx, ret);
    }
    0
}

#[tracepoint]
pub fn open_exit_open(ctx: TracePointContext) -> u32 {
    on_open_exit(&ctx);
    0
}

#[tracepoint]
pub fn open_exit_at(ctx: TracePointContext) -> u32 {
    on_open_exit(&ctx);
    0
}

#[tracepoint]
pub fn open_exit_at2(ctx: TracePointContext) -> u32 {
    on_open_exit(&ctx);
    0
}

/// `creat(2)` of an existing node opens it for writing.
#[tracepoint]
pub fn open_exit_creat(ctx: TracePointContext) -> u32 {
    on_open_exit(&ctx);
    0
}

#[tracepoint]
pub fn open_exit_by_handle(ctx: TracePointContext) -> u32 {
    on_open_exit(&ctx);
    0
}
