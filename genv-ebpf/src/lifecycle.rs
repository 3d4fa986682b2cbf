//! Process lifecycle: what the daemon's process table follows, and the identity
//! (`PROC_ENV`) the open hook decides on: set at exec from the new environment block
//! ([`crate::env_block`]), inherited at fork, dropped at exit.

use aya_ebpf::macros::{raw_tracepoint, tracepoint};
use aya_ebpf::programs::{RawTracePointContext, TracePointContext};
use genv_ebpf_common::{EXEC_UNRESOLVED, Offsets, RawEvent, identity, kind};

use crate::env_block::environment_identity;
use crate::kernel::{current, read};
use crate::maps::{PROC_ENV, Wake, emit, offsets};

/// `sched/sched_process_exec`: the current task has a new program image and a new
/// environment block, whose `GENV_ENVIRONMENT_ID` becomes its identity.
#[tracepoint]
pub fn proc_exec(_ctx: TracePointContext) -> u32 {
    let (pid, tid) = current();
    let identity = environment_identity(&offsets());
    // An update never fails for lack of room on an existing key; a new key may, and the
    // process then counts as outside (the map is sized for far more processes).
    let _ = PROC_ENV.insert(&pid, &identity, 0);
    let arg = if identity == identity::UNRESOLVED {
        EXEC_UNRESOLVED
    } else {
        0
    };
    let wake = if arg == 0 { Wake::Later } else { Wake::Now };
    emit(
        RawEvent {
            kind: kind::EXEC,
            pid,
            tid,
            arg,
            ..RawEvent::default()
        },
        wake,
    );
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
        // The child runs the parent's image with the parent's environment block until
        // it execs: it inherits the parent's identity. It has not run yet.
        // SAFETY: a plain lookup; the value is copied out at once.
        if let Some(identity) = unsafe { PROC_ENV.get(&parent) }.copied() {
            let _ = PROC_ENV.insert(&(tgid as u32), &identity, 0);
        }
        emit(
            RawEvent {
                kind: kind::FORK,
                pid: parent,
                tid,
                arg: tgid as u32,
                ..RawEvent::default()
            },
            Wake::Later,
        );
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
        let _ = PROC_ENV.remove(&pid);
        emit(
            RawEvent {
                kind: kind::EXIT,
                pid,
                tid,
                ..RawEvent::default()
            },
            Wake::Later,
        );
    }
    0
}
