//! Process lifecycle: what the daemon's process table follows.

use aya_ebpf::macros::{raw_tracepoint, tracepoint};
use aya_ebpf::programs::{RawTracePointContext, TracePointContext};
use genv_ebpf_common::{Offsets, kind};

use crate::kernel::{current, read};
use crate::maps::{Wake, emit, offsets};

/// `sched/sched_process_exec`: the current task has a new program image (and, for the
/// daemon, possibly a new environment block and uid).
#[tracepoint]
pub fn proc_exec(_ctx: TracePointContext) -> u32 {
    let (pid, tid) = current();
    emit(kind::EXEC, pid, tid, 0, 0, 0, Wake::Later);
    0
}

/// Raw tracepoint `sched_process_fork(parent, child)`: the raw form gives the child's
/// task, so that new threads (pid ≠ tgid) can be told from new processes.
#[raw_tracepoint(tracepoint = "sched_process_fork")]
pub fn proc_fork(ctx: RawTracePointContext) -> i32 {
    let child: *const u8 = ctx.arg(1);
    let o = offsets();
    let (Some(pid), Some(tgid)) = (
        read::<i32>(child, o.task_pid),
        read::<i32>(child, o.task_tgid),
    ) else {
        return 0;
    };
    if pid == tgid {
        let (parent, tid) = current();
        emit(kind::FORK, parent, tid, tgid as u32, 0, 0, Wake::Later);
    }
    0
}

/// `sched/sched_process_exit`: reported once per process, when its thread group dies.
#[tracepoint]
pub fn proc_exit(ctx: TracePointContext) -> u32 {
    let (pid, tid) = current();
    let o = offsets();
    let group_dead = if o.exit_group_dead == Offsets::ABSENT {
        // Kernels before 6.15 do not say; the leader's exit stands for the group's.
        pid == tid
    } else {
        // SAFETY: the offset comes from this tracepoint's format file.
        unsafe { ctx.read_at::<u8>(o.exit_group_dead as usize) }.is_ok_and(|dead| dead != 0)
    };
    if group_dead {
        emit(kind::EXIT, pid, tid, 0, 0, 0, Wake::Later);
    }
    0
}
