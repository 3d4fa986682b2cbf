//! Process lifecycle: what the daemon's process table follows.

use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_user_str_bytes};
use aya_ebpf::macros::{raw_tracepoint, tracepoint};
use aya_ebpf::programs::{RawTracePointContext, TracePointContext};
use genv_ebpf_common::{
    ENV_VAR_PREFIX, EXEC_UNRESOLVED, MAX_ENV_ID, Offsets, RawEvent, env_id_hash, identity, kind,
};

use crate::kernel::{current, read};
use crate::maps::{PROC_ENV, SCRATCH, SCRATCH_BYTES, Wake, emit, offsets};

/// Reads of the environment block the exec hook makes at most. Each read takes one
/// entry (or `SCRATCH_BYTES - 1` bytes of a longer one): a few hundred variables,
/// more than real environments carry. A larger block is left to the daemon.
const MAX_READS: u32 = 512;

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

/// The identity in the current task's environment block: the last
/// `GENV_ENVIRONMENT_ID=` entry wins, as in genv (a Python dict built from it).
#[inline(always)]
fn environment_identity(o: &Offsets) -> u64 {
    // SAFETY: a helper without arguments; the task is read only through probe reads.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let Some(mm) = read::<*const u8>(task, o.task_mm) else {
        return identity::NO_ENV;
    };
    let (Some(start), Some(end)) = (
        read::<u64>(mm, o.mm_env_start),
        read::<u64>(mm, o.mm_env_end),
    ) else {
        return identity::NO_ENV;
    };
    let Some(buf) = SCRATCH.get_ptr_mut(0) else {
        return identity::NO_ENV;
    };
    // SAFETY: this CPU's scratch slot, used by this program alone.
    let buf = unsafe { &mut *buf };

    // Walk the entries; remember where the last match's value starts.
    let mut at = start;
    let mut entry_start = true;
    let mut found: u64 = 0;
    let mut complete = false;
    for _ in 0..MAX_READS {
        if at >= end {
            complete = true;
            break;
        }
        // SAFETY: the helper checks the user address and fails instead of faulting.
        let len = match unsafe { bpf_probe_read_user_str_bytes(at as *const u8, buf) } {
            Ok(entry) => entry.len() as u64,
            // A page not present: the daemon reads /proc/<pid>/environ instead.
            Err(_) => break,
        };
        if entry_start && len >= ENV_VAR_PREFIX.len() as u64 && has_prefix(buf) {
            found = at + ENV_VAR_PREFIX.len() as u64;
        }
        if len == (SCRATCH_BYTES - 1) as u64 {
            // Possibly cut short: go on within the same entry.
            at += len;
            entry_start = false;
        } else {
            at += len + 1;
            entry_start = true;
        }
    }
    if !complete {
        return identity::UNRESOLVED;
    }
    if found == 0 {
        return identity::NO_ENV;
    }
    // SAFETY: as above.
    let len = match unsafe { bpf_probe_read_user_str_bytes(found as *const u8, buf) } {
        Ok(value) => value.len(),
        Err(_) => return identity::UNRESOLVED,
    };
    if len > MAX_ENV_ID {
        return identity::NO_ENV; // longer than any id the daemon mirrors
    }
    hash_prefix(buf, len)
}

#[inline(always)]
fn has_prefix(buf: &[u8; SCRATCH_BYTES]) -> bool {
    let mut i = 0;
    while i < ENV_VAR_PREFIX.len() {
        if buf[i] != ENV_VAR_PREFIX[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// `env_id_hash(&buf[..len])`, in a loop the verifier can bound.
#[inline(always)]
fn hash_prefix(buf: &[u8; SCRATCH_BYTES], len: usize) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for i in 0..MAX_ENV_ID {
        if i >= len {
            break;
        }
        hash ^= buf[i] as u64;
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // The sentinels, mapped away exactly as `env_id_hash` does.
    match hash {
        identity::NO_ENV => 1,
        identity::UNRESOLVED => u64::MAX - 1,
        hash => hash,
    }
}

/// Keeps the hash above in step with the daemon's.
const _: () = assert!(env_id_hash(b"") == 0xcbf2_9ce4_8422_2325);

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
