//! Process lifecycle: what the daemon's process table follows, and the identity
//! (`PROC_ENV`) the open hook decides on: set at exec from the new environment block
//! ([`crate::env_block`]), inherited at fork, dropped at exit.

use aya_ebpf::helpers::bpf_get_current_task;
use aya_ebpf::macros::{raw_tracepoint, tracepoint};
use aya_ebpf::programs::{RawTracePointContext, TracePointContext};
use genv_ebpf_common::{EXEC_UNRESOLVED, FORK_UNRESOLVED, RawEvent, decision, identity, kind};

use crate::env_block::{Scan, environment_identity};
use crate::kernel::{current, read};
use crate::maps::{PROC_ENV, Wake, count_decision, now_ns, offsets, send};

/// `sched/sched_process_exec`: the current task has a new program image and a new
/// environment block, whose `GENV_ENVIRONMENT_ID` becomes its identity. The whole block
/// is read, in `bpf_loop` steps (5.17 and later).
#[tracepoint]
pub fn proc_exec(_ctx: TracePointContext) -> u32 {
    exec(environment_identity(&offsets(), Scan::Whole))
}

/// [`proc_exec`] for kernels without `bpf_loop`: blocks over 4 KiB are left to the
/// daemon, which reads `/proc/<pid>/environ`.
#[tracepoint]
pub fn proc_exec_4k(_ctx: TracePointContext) -> u32 {
    exec(environment_identity(&offsets(), Scan::First4K))
}

#[inline(always)]
fn exec(identity: u64) -> u32 {
    let (pid, tid) = current();
    overwrite(pid, identity);
    crate::cuda::forget_image(pid);
    let arg = if identity == identity::UNRESOLVED {
        EXEC_UNRESOLVED
    } else {
        0
    };
    // A process of an environment with a cap (`--memory-at-alloc`) carries the libcuda
    // probes only once the daemon has this event: it is woken now, not at its next
    // batch, so that the probes are in before the program can reach CUDA.
    let wake = if arg == 0 && !capped(identity) {
        Wake::Later
    } else {
        Wake::Now
    };
    // Stamped: the daemon hears of the exec after the fact, and what it read of the
    // process since is the new image's (`alloc`).
    lifecycle_event(
        RawEvent {
            kind: kind::EXEC,
            pid,
            tid,
            arg,
            ktime_ns: now_ns(),
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
        let inherited = unsafe { PROC_ENV.get(parent) }.copied();
        if let Some(identity) = inherited {
            record(tgid as u32, identity);
        }
        // A child of a process whose identity the daemon has not read yet inherits
        // "unresolved": the daemon must read the child's too, and soon.
        let unresolved = inherited == Some(identity::UNRESOLVED);
        lifecycle_event(
            RawEvent {
                kind: kind::FORK,
                pid: parent,
                tid,
                arg: tgid as u32,
                index: if unresolved { FORK_UNRESOLVED } else { 0 },
                ..RawEvent::default()
            },
            // Now, too, for a child of an environment with a cap: it carries the libcuda
            // probes only once the daemon has this event (see `exec`).
            if unresolved || inherited.is_some_and(capped) {
                Wake::Now
            } else {
                Wake::Later
            },
        );
    }
    0
}

/// Whether processes of the environment `identity` are held to a cap at the
/// allocation (`--memory-at-alloc`; without it the map holds nothing).
#[inline(always)]
fn capped(identity: u64) -> bool {
    // SAFETY: a plain lookup; nothing is kept of it.
    identity != identity::NO_ENV && unsafe { crate::cuda::ENV_MEMORY.get(identity) }.is_some()
}

/// Records the identity of process `pid` found at its exec. The process is almost
/// always known (its parent's identity was copied at fork): the value is then
/// overwritten in place, one lookup, where an update allocates an element and frees the
/// old one (the map is `BPF_F_NO_PREALLOC`; 0.8 µs of each exec on the bench machine).
/// An aligned 8-byte store: a reader sees the old identity or the new one.
#[inline(always)]
fn overwrite(pid: u32, identity: u64) {
    match PROC_ENV.get_ptr_mut(pid) {
        // SAFETY: the element's value, valid while this program runs (RCU).
        Some(slot) => unsafe { core::ptr::write_volatile(slot, identity) },
        None => record(pid, identity),
    }
}

/// Sends a lifecycle event. It carries no time (`ktime_ns` 0): the daemon orders them
/// by the ring alone, and the clock read cost more than the rest of the event (about
/// 130 ns on the bench machine).
#[inline(always)]
fn lifecycle_event(event: RawEvent, wake: Wake) {
    send(&event, wake);
}

/// Records `identity` for process `pid`. An update never fails for lack of room on an
/// existing key; a new key may (the map is sized for every process the machine can
/// have), and is counted: the daemon then resynchronises.
#[inline(always)]
fn record(pid: u32, identity: u64) {
    if PROC_ENV.insert(pid, identity, 0).is_err() {
        count_decision(decision::IDENTITY_LOST);
    }
}

/// `sched/sched_process_exit`: reported once per process, when its thread group dies.
/// Every exiting thread fires it, after `do_exit` took itself off `signal->live`: the
/// group is dead when no thread is live. (A leader that calls `pthread_exit` exits
/// first, while its other threads still run and still use the GPU.) Two threads
/// exiting at once may both see 0: the removal is idempotent and the daemon ignores an
/// exit it already had; the tgid cannot be reused before every thread is gone.
#[tracepoint]
pub fn proc_exit(_ctx: TracePointContext) -> u32 {
    let (pid, tid) = current();
    let o = offsets();
    // SAFETY: a helper without arguments; the task is read only through probe reads.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let live = read::<*const u8>(task, o.task_signal).and_then(|s| read::<i32>(s, o.signal_live));
    // Unreadable: fall back to the leader's exit standing for the group's.
    let group_dead = live.map_or(pid == tid, |live| live == 0);
    if group_dead {
        let _ = PROC_ENV.remove(pid);
        crate::cuda::forget_image(pid);
        lifecycle_event(
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
