//! Opens of GPU device nodes, in the four tiers the daemon chooses from. Every tier
//! decides by the inode (character device, number in `GPU_NODES`), so symlinks, hard
//! links, private `mknod`s and `/proc/<pid>/fd` re-opens are all the same node. Tier 4,
//! the syscall exit tracepoints, is in `open_exit`.

use aya_ebpf::helpers::{bpf_get_current_task, bpf_get_current_uid_gid, bpf_send_signal};
use core::ffi::c_void;

use aya_ebpf::EbpfContext;
use aya_ebpf::macros::{fentry, lsm};
use aya_ebpf::programs::{FEntryContext, FExitContext, LsmContext};
use aya_log_ebpf::info;
use genv_ebpf_common::{
    EnvEntry, ExeKey, Offsets, RawEvent, USER_HZ, decision, hook, identity, kind, policy, verdict,
};

use crate::kernel::{current, read};
use crate::maps::{
    ALLOWED_EXES, ENVS, EXEMPT_PIDS, GPU_NODES, PROC_ENV, count_decision, now_ns, offset, offsets,
    policy,
};
use crate::told::report_open;

const EPERM: i32 = 1;
const SIGKILL: u32 = 9;

const S_IFMT: u16 = 0o170000;
const S_IFCHR: u16 = 0o020000;
/// `FMODE_PATH`: an `O_PATH` descriptor, which cannot reach the driver. Its value has
/// been part of the kernel's ABI with itself since 2.6.39; BTF does not carry macros.
const FMODE_PATH: u32 = 1 << 14;

/// The GPU index of the node `file` refers to, if it is a watched GPU node. Every open
/// in the system comes through here: the device number is read first and anything but
/// a device (0) returns at once; a device's number is looked up, and the rest is read
/// only for watched numbers.
#[inline(always)]
fn gpu_of(file: *const u8) -> Option<(u32, u32)> {
    let inode: *const u8 = read(file, offset!(file_f_inode))?;
    let rdev: u32 = read(inode, offset!(inode_i_rdev))?;
    if rdev == 0 {
        return None;
    }
    // SAFETY: a plain lookup; the value is copied out at once.
    let index = unsafe { GPU_NODES.get(rdev) }.copied()?;
    let mode: u16 = read(inode, offset!(inode_i_mode))?;
    if mode & S_IFMT != S_IFCHR {
        return None; // a block device with the same number
    }
    Some((rdev, index))
}

/// Decides about, and reports, an open of `file` if it is a watched GPU node; the
/// verdict (one of `verdict`), or 0 for anything else. `O_PATH` descriptors cannot reach
/// the driver and are let through; their mode is read only once the number matched.
///
/// The decision is made here, in the kernel, from the maps alone: the process's
/// identity (`PROC_ENV`), the environment it names (`ENVS`: active, and owned by the
/// process's uid unless that is root), then the enforcer's own processes
/// (`EXEMPT_PIDS`) and the allow-list. With `--deny`, a process outside any environment
/// (root's only with `--deny-root`) is refused on the LSM and fmod_ret tiers (the caller
/// returns -EPERM on `REFUSED`) and sent SIGKILL here on the others, so the open never
/// returns to it.
#[inline(always)]
pub(crate) fn decide<C: EbpfContext>(ctx: &C, file: *const u8, tier: u32) -> u32 {
    let Some((rdev, index)) = gpu_of(file) else {
        return 0;
    };
    let o = &offsets();
    if read::<u32>(file, o.file_f_mode).is_none_or(|mode| mode & FMODE_PATH != 0) {
        return 0;
    }
    let (pid, tid) = current();
    let uid = bpf_get_current_uid_gid() as u32;
    let flags = policy();
    // SAFETY: plain lookups; the values are copied out at once.
    let identity = unsafe { PROC_ENV.get(pid) }.copied();
    // SAFETY: as above.
    let env = identity.and_then(|identity| unsafe { ENVS.get(identity) }.copied());
    let verdict = match environment_of(env, uid) {
        Some(attached) if index < 64 && attached & (1 << index) != 0 => verdict::ATTACHED,
        Some(_) => verdict::NOT_ATTACHED,
        None if exempt(pid, o) => verdict::EXEMPT,
        None if exe_allowed(o) => verdict::ALLOWED_EXE,
        None if flags & policy::DENY == 0 => verdict::OUTSIDE,
        None if uid == 0 && flags & policy::DENY_ROOT == 0 => verdict::ROOT,
        None if hook::refuses(tier) => {
            count_decision(decision::REFUSED);
            verdict::REFUSED
        }
        None => {
            // SAFETY: signals the current process; pending SIGKILL is delivered before
            // the syscall returns to user space.
            if unsafe { bpf_send_signal(SIGKILL) } == 0 {
                count_decision(decision::KILLED);
                verdict::KILLED
            } else {
                count_decision(decision::KILL_FAILED);
                verdict::KILL_FAILED
            }
        }
    };
    report_open(
        RawEvent {
            kind: kind::OPEN,
            pid,
            tid,
            arg: rdev,
            index,
            hook: tier,
            uid,
            verdict,
            ktime_ns: now_ns(),
        },
        o,
    );
    log_decision(ctx, index, pid, uid, identity, env, verdict);
    verdict
}

/// The attached-GPU mask of the active environment `env` (the one the process's
/// identity names), for a process running as `uid`; `None` outside any: no identity, an
/// unknown environment, or one owned by another uid (root may claim any).
#[inline(always)]
fn environment_of(env: Option<EnvEntry>, uid: u32) -> Option<u64> {
    env.filter(|env| uid == 0 || env.uid == uid)
        .map(|env| env.attached)
}

/// `--bpf-log`: why the decision went as it did, one line per GPU open. Off (the
/// default), the log level is a read-only 0 and the verifier drops all of this.
#[inline(always)]
fn log_decision<C: EbpfContext>(
    ctx: &C,
    index: u32,
    pid: u32,
    uid: u32,
    identity: Option<u64>,
    env: Option<EnvEntry>,
    verdict: u32,
) {
    let found = match (identity, env) {
        (None, _) => "no identity recorded (a process older than the programs, not seeded)",
        (Some(identity::NO_ENV), _) => "no GENV_ENVIRONMENT_ID at its exec",
        (Some(identity::UNRESOLVED), _) => "its environment block is not read yet",
        (Some(_), None) => "its GENV_ENVIRONMENT_ID names no active environment",
        (Some(_), Some(env)) if uid != 0 && env.uid != uid => {
            "its environment belongs to another uid"
        }
        (Some(_), Some(_)) => "its environment is active and may be used by its uid",
    };
    let decided = match verdict {
        verdict::ATTACHED => "allowed: the GPU is attached to its environment",
        verdict::NOT_ATTACHED => "allowed: not attached (CUDA opens every node; NVML decides)",
        verdict::EXEMPT => "allowed: an enforcer process",
        verdict::ALLOWED_EXE => "allowed: an allow-listed executable (device and inode)",
        verdict::OUTSIDE => "outside any environment: reported (no --deny)",
        verdict::ROOT => "outside any environment: root, reported (no --deny-root)",
        verdict::REFUSED => "outside any environment: refused with EPERM (--deny)",
        verdict::KILLED => "outside any environment: SIGKILL in the open (--deny)",
        _ => "outside any environment: SIGKILL failed (--deny)",
    };
    let (owner, attached) = env.map_or((u32::MAX, 0), |env| (env.uid, env.attached));
    info!(
        ctx,
        "GPU {} opened by pid {} uid {}: identity {:x}, {} (owner uid {}, attached {:x}); {}",
        index,
        pid,
        uid,
        identity.unwrap_or(0),
        found,
        owner,
        attached,
        decided
    );
}

/// Whether the current process is an enforcer's: its tgid is in `EXEMPT_PIDS` with its
/// start time, so that a process given a crashed daemon's pid is not.
#[inline(always)]
fn exempt(pid: u32, o: &Offsets) -> bool {
    // SAFETY: a plain lookup; the value is copied out at once.
    let Some(ticks) = (unsafe { EXEMPT_PIDS.get(pid) }).copied() else {
        return false;
    };
    // SAFETY: a helper without arguments; the task is read only through probe reads.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let started = read::<*const u8>(task, o.task_group_leader)
        .and_then(|leader| read::<u64>(leader, o.task_start_boottime));
    started.is_some_and(|ns| ns / (1_000_000_000 / USER_HZ) == ticks)
}

/// Whether the current process runs an allow-listed executable (by the device and inode
/// of `mm->exe_file`, so a copy or a same-named file elsewhere is not allowed).
#[inline(always)]
fn exe_allowed(o: &Offsets) -> bool {
    // SAFETY: a helper without arguments; the task is read only through probe reads.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let key = || -> Option<ExeKey> {
        let mm = read::<*const u8>(task, o.task_mm)?;
        let exe = read::<*const u8>(mm, o.mm_exe_file)?;
        let inode = read::<*const u8>(exe, o.file_f_inode)?;
        let sb = read::<*const u8>(inode, o.inode_i_sb)?;
        Some(ExeKey {
            dev: read::<u32>(sb, o.sb_s_dev)?,
            _pad: 0,
            ino: read::<u64>(inode, o.inode_i_ino)?,
        })
    };
    // SAFETY: a plain lookup.
    key().is_some_and(|key| unsafe { ALLOWED_EXES.get(key) }.is_some())
}

/// Tier 1, BPF LSM `file_open`: runs for every open attempt, before the driver's
/// `open`, whatever the syscall (io_uring and `openat2` included).
#[lsm(hook = "file_open")]
pub fn open_lsm(ctx: LsmContext) -> i32 {
    // An earlier BPF LSM program's verdict stands.
    let previous: i32 = ctx.arg(1);
    if previous != 0 {
        return previous;
    }
    match decide(&ctx, ctx.arg(0), hook::LSM) {
        verdict::REFUSED => -EPERM,
        _ => 0,
    }
}

/// Tier 2, fmod_ret on `security_file_open`: the same call site as the LSM hook, and
/// the same refusal, where BPF LSM is not enabled (the verifier lets fmod_ret programs
/// change the return value of any `security_*` function). A nonzero return skips the
/// function (every LSM's hook) and the later fmod_ret programs, and `do_dentry_open`
/// fails with it; 0 lets the real function run.
///
/// aya 0.14 has no fmod_ret programs, and aya-obj refuses an object holding an
/// `fmod_ret/` section, so this is written without a macro in a section aya-obj reads
/// as fexit and never loads: the daemon loads it itself as `BPF_MODIFY_RETURN`
/// (`kernel/trampoline.rs`). The context is the function's arguments followed by the return
/// value so far: `file`, then 0 (the trampoline runs no fmod_ret program after a nonzero
/// one). Its only subprogram is `memcpy` (aya-log's copies, dead unless `--bpf-log`),
/// which the loader links in as aya does; the kernel takes static subprograms without
/// BTF function records, which that loader does not pass (6.1 and 6.12 checked).
#[unsafe(no_mangle)]
#[unsafe(link_section = "fexit/security_file_open")]
pub fn open_fmod_ret(ctx: *mut c_void) -> i32 {
    let ctx = FExitContext::new(ctx);
    match decide(&ctx, ctx.arg(0), hook::FMOD_RET) {
        verdict::REFUSED => -EPERM,
        _ => 0,
    }
}

/// Tier 3, fentry on `security_file_open`: the same call site, where the kernel runs
/// tracing programs but not fmod_ret ones (before 5.7, or where a policy refuses them);
/// it cannot refuse, so `decide` kills.
#[fentry(function = "security_file_open")]
pub fn open_fentry(ctx: FEntryContext) -> u32 {
    decide(&ctx, ctx.arg(0), hook::FENTRY);
    0
}
