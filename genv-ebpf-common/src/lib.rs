//! The contract between the kernel programs (`genv-ebpf`) and the daemon: the event
//! record the programs write into the ring buffer, the struct offsets the daemon reads
//! from the kernel's BTF and hands to the programs, and the names of maps and globals.
//!
//! Everything here is `#[repr(C)]` plain data with explicit padding, because both sides
//! see the same bytes: the programs are built for `bpfel-unknown-none`, the daemon for the
//! host.

#![no_std]

/// The ring buffer the programs write [`RawEvent`]s into.
pub const EVENTS_MAP: &str = "EVENTS";
/// Per-CPU count of events the ring buffer had no room for.
pub const LOST_MAP: &str = "LOST";
/// Kernel `dev_t` of each watched GPU node → its NVML index.
pub const GPU_NODES_MAP: &str = "GPU_NODES";
/// The global holding [`Offsets`].
pub const OFFSETS_GLOBAL: &str = "OFFSETS";
/// Process (tgid) → its environment identity ([`identity`]), learnt at exec, inherited
/// at fork, dropped at exit, seeded from `/proc` by the daemon.
pub const PROC_ENV_MAP: &str = "PROC_ENV";
/// Active environments: [`env_id_hash`] of the eid → [`EnvEntry`], mirrored from genv's
/// state by the daemon.
pub const ENVS_MAP: &str = "ENVS";
/// Executables allowed to open GPU nodes outside any environment ([`ExeKey`] → 1).
pub const ALLOWED_EXES_MAP: &str = "ALLOWED_EXES";
/// Processes that may open GPU nodes outside any environment: the enforcers. Keyed by
/// tgid, valued by the process's start time in clock ticks since boot (`/proc/<pid>/stat`
/// field 22): an entry a crashed daemon left in pinned maps names no later process that
/// gets its pid.
pub const EXEMPT_PIDS_MAP: &str = "EXEMPT_PIDS";
/// The kernel's `USER_HZ`: `/proc`'s clock ticks per second (100 on every architecture
/// Linux runs GPUs on), to compare a task's `start_boottime` (ns) with a start time.
pub const USER_HZ: u64 = 100;
pub const MAX_EXEMPT_PIDS: u32 = 64;
/// One `u32` of [`policy`] flags.
pub const POLICY_MAP: &str = "POLICY";
/// Per-CPU counts of in-kernel decisions, by [`decision`] slot: exact even when the
/// ring buffer had no room for the event.
pub const DECISIONS_MAP: &str = "DECISIONS";

/// Capacity of [`PROC_ENV_MAP`] in the object; the daemon sizes it at load time for as
/// many processes as the machine can have (`kernel.pid_max`, `kernel.threads-max`).
pub const MAX_PROCESSES: u32 = 1 << 17;
/// Capacity of [`ENVS_MAP`].
pub const MAX_ENVS: u32 = 4096;
/// Capacity of [`ALLOWED_EXES_MAP`].
pub const MAX_ALLOWED_EXES: u32 = 256;
/// The longest environment id the kernel side reads; a longer one never matches.
pub const MAX_ENV_ID: usize = 255;
/// The variable genv puts its environment id in.
pub const ENV_VAR_PREFIX: &[u8; 20] = b"GENV_ENVIRONMENT_ID=";

/// Upper bound on the GPU nodes one node can have watched (`/dev/nvidia0..N` plus
/// overrides).
pub const MAX_GPU_NODES: u32 = 256;

/// What an event is about.
pub mod kind {
    /// A process replaced its program image (`execve`).
    pub const EXEC: u32 = 1;
    /// A new process (not a thread) was created; `arg` is the child's pid.
    pub const FORK: u32 = 2;
    /// The last thread of a process exited.
    pub const EXIT: u32 = 3;
    /// A watched GPU node was opened; `arg` is its kernel `dev_t`, `index` its GPU.
    pub const OPEN: u32 = 4;
    /// A process in an environment allocated past its environment's `gpu_memory` on a
    /// GPU (`--memory-at-alloc`), as an [`AllocEvent`]: `index` is the GPU, `verdict` one of
    /// [`verdict::ALLOC_KILLED`], [`verdict::ALLOC_REPORTED`], [`verdict::ALLOC_KILL_FAILED`],
    /// [`verdict::ALLOC_REFUSED`].
    pub const ALLOC: u32 = 5;
    /// A process started using CUDA (`cuInit`, a context retained or created): `arg`
    /// is one of [`crate::cuda_call`]. The daemon learns the process's device numbering
    /// (`CUDA_VISIBLE_DEVICES`) from it.
    pub const CUDA: u32 = 6;
}

/// Which CUDA call a [`kind::CUDA`] event reports.
pub mod cuda_call {
    pub const INIT: u32 = 1;
    pub const PRIMARY_CTX_RETAIN: u32 = 2;
    pub const CTX_CREATE: u32 = 3;
}

/// A process's environment identity in [`PROC_ENV_MAP`]: [`env_id_hash`] of its
/// `GENV_ENVIRONMENT_ID`, or one of these.
pub mod identity {
    /// No `GENV_ENVIRONMENT_ID` in its environment block (or one too long to be real).
    pub const NO_ENV: u64 = 0;
    /// The exec hook could not read the block (a page it could not read, or over 4 KiB
    /// on kernels without `bpf_loop`); the daemon reads `/proc/<pid>/environ` and writes
    /// the answer. Counts as outside until then.
    pub const UNRESOLVED: u64 = u64::MAX;
}

/// FNV-1a (64 bit) of an environment id, never [`identity::NO_ENV`] or
/// [`identity::UNRESOLVED`]. The kernel side hashes the value it finds in the
/// environment block, the daemon the eids in `envs.json`. A collision could at most let
/// a user claim one of their own environments (the owner's uid is checked too), which
/// setting the variable does anyway.
pub const fn env_id_hash(id: &[u8]) -> u64 {
    let mut hash = FNV_OFFSET;
    let mut i = 0;
    while i < id.len() {
        hash = fnv_step(hash, id[i]);
        i += 1;
    }
    avoid_sentinels(hash)
}

/// FNV-1a's starting value; the programs fold bytes in with [`fnv_step`] in a loop the
/// verifier can bound, and finish with [`avoid_sentinels`].
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

#[inline(always)]
pub const fn fnv_step(hash: u64, byte: u8) -> u64 {
    (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3)
}

/// Moves a hash off the two values that mean "no environment" and "unresolved".
#[inline(always)]
pub const fn avoid_sentinels(hash: u64) -> u64 {
    match hash {
        identity::NO_ENV => 1,
        identity::UNRESOLVED => u64::MAX - 1,
        hash => hash,
    }
}

/// Flags in [`POLICY_MAP`].
pub mod policy {
    /// `--deny`: a process outside any environment may not use a GPU node: refused
    /// (LSM, fmod_ret) or killed in the syscall (fentry, tracepoint).
    pub const DENY: u32 = 1;
    /// `--deny-root`: root's processes outside any environment are denied too. Off by
    /// default: the container runtime's hooks, MPS, Xorg, persistenced and DCGM run as
    /// root, and root can unload the programs anyway.
    pub const DENY_ROOT: u32 = 2;
    /// `--memory-at-alloc report`: an allocation past the cap is reported, and goes on.
    pub const MEMORY_REPORT: u32 = 4;
    /// `--memory-at-alloc kill`: the allocating process is sent SIGKILL in the call,
    /// before the driver hands anything out.
    pub const MEMORY_KILL: u32 = 8;
    /// `--memory-at-alloc refuse`, where the kernel loaded the refusing programs: the
    /// call returns `CUDA_ERROR_OUT_OF_MEMORY` without running. Set with
    /// [`MEMORY_KILL`], which a call the program cannot refuse meets instead.
    pub const MEMORY_REFUSE: u32 = 16;
}

/// Slots of [`DECISIONS_MAP`].
pub mod decision {
    pub const REFUSED: u32 = 0;
    pub const KILLED: u32 = 1;
    /// `bpf_send_signal` failed: the open returned to a process that should have died.
    pub const KILL_FAILED: u32 = 2;
    /// A process's identity could not be recorded (`PROC_ENV` full): it counts as
    /// outside until the daemon's resynchronisation records it.
    pub const IDENTITY_LOST: u32 = 3;
    /// An allocation past its cap returned out-of-memory (`--memory-at-alloc refuse`):
    /// every one, reported or held back (see [`crate::alloc::REFUSAL_PACE_NS`]).
    pub const ALLOC_REFUSED: u32 = 4;
    pub const SLOTS: u32 = 5;
}

/// What the kernel side decided about a GPU open ([`RawEvent::verdict`]).
pub mod verdict {
    /// A process of an active environment it may claim, on a GPU attached to it.
    pub const ATTACHED: u32 = 1;
    /// A process of an active environment, on a GPU not attached to it (never refused:
    /// CUDA opens every node; the env-devices rule decides on actual use).
    pub const NOT_ATTACHED: u32 = 2;
    /// Outside any environment, let through (no `--deny`).
    pub const OUTSIDE: u32 = 3;
    /// Outside any environment, run by an allow-listed executable.
    pub const ALLOWED_EXE: u32 = 4;
    /// Outside any environment: the open failed with EPERM (LSM and fmod_ret tiers,
    /// `--deny`).
    pub const REFUSED: u32 = 5;
    /// Outside any environment: SIGKILL sent from the program, before the open
    /// returned (fentry and tracepoint tiers, `--deny`).
    pub const KILLED: u32 = 6;
    /// Outside any environment, run by root: let through under `--deny` unless
    /// `--deny-root`; root's compute processes are left to the userspace rules.
    pub const ROOT: u32 = 7;
    /// The enforcer itself (by process id, in `EXEMPT_PIDS`): NVML opens the nodes.
    pub const EXEMPT: u32 = 8;
    /// Outside any environment: the program's SIGKILL could not be sent, so the open
    /// returned; the daemon must act.
    pub const KILL_FAILED: u32 = 9;
    /// An allocation past the environment's cap: the process was sent SIGKILL in the
    /// call ([`kind::ALLOC`]).
    pub const ALLOC_KILLED: u32 = 10;
    /// An allocation past the environment's cap, let through (`--memory-at-alloc report`).
    pub const ALLOC_REPORTED: u32 = 11;
    /// An allocation past the cap whose SIGKILL could not be sent: the call went on.
    pub const ALLOC_KILL_FAILED: u32 = 12;
    /// An allocation past the cap that returned `CUDA_ERROR_OUT_OF_MEMORY` without
    /// running (`--memory-at-alloc refuse`): the process lives, nothing was charged.
    pub const ALLOC_REFUSED: u32 = 13;
}

/// An active environment, as the kernel side sees it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnvEntry {
    /// The uid that owns it; only that uid (or root) may claim it.
    pub uid: u32,
    pub _pad: u32,
    /// Bit `i` set: GPU index `i` is attached.
    pub attached: u64,
}

/// An executable, by the device (kernel `dev_t` of its filesystem) and inode of the file.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExeKey {
    pub dev: u32,
    pub _pad: u32,
    pub ino: u64,
}

/// Which program saw an open; tells the daemon which guarantees it has.
pub mod hook {
    pub const NONE: u32 = 0;
    /// BPF LSM `file_open`: every attempt, before the driver sees it.
    pub const LSM: u32 = 1;
    /// fentry on `security_file_open`: every attempt, before the driver sees it.
    pub const FENTRY: u32 = 2;
    /// `sys_exit_open*` tracepoints: successful `open`/`openat`/`openat2` only.
    pub const TRACEPOINT: u32 = 3;
    /// fmod_ret on `security_file_open`: every attempt, before the driver sees it; its
    /// return value replaces the function's, so it can refuse where BPF LSM is off.
    pub const FMOD_RET: u32 = 4;
    /// A uprobe on libcuda (allocations and CUDA start-up, not opens).
    pub const UPROBE: u32 = 5;

    /// Whether a program on this hook refuses an open (EPERM) rather than killing the
    /// opener.
    pub const fn refuses(hook: u32) -> bool {
        matches!(hook, LSM | FMOD_RET)
    }
}

mod record;
pub use record::{AllocEvent, OpenEvent, RawEvent, Subject};

/// `RawEvent::arg` of an `EXEC` whose environment block could not be read in full.
pub const EXEC_UNRESOLVED: u32 = 1;

/// `RawEvent::index` of a `FORK` whose parent's identity was still unresolved: the
/// child inherited that, and the daemon must read the child's too (resolving the
/// parent later would not reach it).
pub const FORK_UNRESOLVED: u32 = 1;

/// Struct member offsets (bytes) in the running kernel, read from its BTF by the daemon,
/// and tracepoint field offsets, read from tracefs. `ABSENT` marks a field this kernel
/// does not have.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offsets {
    pub task_pid: u32,
    pub task_tgid: u32,
    pub task_files: u32,
    pub files_fdt: u32,
    pub fdtable_max_fds: u32,
    pub fdtable_fd: u32,
    pub file_f_inode: u32,
    pub file_f_mode: u32,
    pub inode_i_mode: u32,
    pub inode_i_rdev: u32,
    pub task_mm: u32,
    pub mm_env_start: u32,
    pub mm_env_end: u32,
    pub mm_exe_file: u32,
    pub inode_i_ino: u32,
    pub inode_i_sb: u32,
    pub sb_s_dev: u32,
    /// `ret` in the `syscalls/sys_exit_open*` tracepoints.
    pub sys_exit_ret: u32,
    /// `task_struct.signal` and `signal_struct.live` (an `atomic_t`): the exit hook
    /// counts a thread group dead when no thread of it is live. (The tracepoint's own
    /// `group_dead` exists only from 6.15; before, a leader that calls `pthread_exit`
    /// while its other threads run looks like the whole process's exit.)
    pub task_signal: u32,
    pub signal_live: u32,
    /// `task_struct.thread_info.status` (x86: `TS_COMPAT` marks a 32-bit syscall);
    /// `ABSENT` where the architecture has none.
    pub task_ti_status: u32,
    /// `pt_regs.orig_ax`: the syscall number (x86); `ABSENT` elsewhere.
    pub regs_orig_ax: u32,
    pub task_group_leader: u32,
    /// `task_struct.start_boottime` (5.5 and later): ns since boot, suspend included.
    pub task_start_boottime: u32,
    /// The controlling terminal, for a decision's [`Subject`]: `signal_struct.tty`,
    /// `tty_struct.index` and `.driver`, `tty_driver.major` and `.minor_start` (its
    /// number is `MKDEV(major, minor_start + index)`, as `tty_devnum` makes it). Each
    /// `ABSENT` where the kernel has no TTY layer; the terminal is then 0.
    pub signal_tty: u32,
    pub tty_index: u32,
    pub tty_driver: u32,
    pub driver_major: u32,
    pub driver_minor_start: u32,
    /// `files_struct.fdtab` and `.fd_array`: the table embedded in every task's
    /// `files_struct` and the file pointers it holds inline, which the open hook reads
    /// by direct loads (`ABSENT`: it walks the table with probe reads).
    pub files_fdtab: u32,
    pub files_fd_array: u32,
}

impl Offsets {
    pub const ABSENT: u32 = u32::MAX;
    /// What the object carries before the daemon fills it in.
    pub const UNSET: Self = Self {
        task_pid: 0,
        task_tgid: 0,
        task_files: 0,
        files_fdt: 0,
        fdtable_max_fds: 0,
        fdtable_fd: 0,
        file_f_inode: 0,
        file_f_mode: 0,
        inode_i_mode: 0,
        inode_i_rdev: 0,
        task_mm: 0,
        mm_env_start: 0,
        mm_env_end: 0,
        mm_exe_file: 0,
        inode_i_ino: 0,
        inode_i_sb: 0,
        sb_s_dev: 0,
        sys_exit_ret: 0,
        task_signal: 0,
        signal_live: 0,
        task_ti_status: Self::ABSENT,
        regs_orig_ax: Self::ABSENT,
        task_group_leader: 0,
        task_start_boottime: 0,
        signal_tty: Self::ABSENT,
        tty_index: Self::ABSENT,
        tty_driver: Self::ABSENT,
        driver_major: Self::ABSENT,
        driver_minor_start: Self::ABSENT,
        files_fdtab: Self::ABSENT,
        files_fd_array: Self::ABSENT,
    };
}

/// The kernel's internal `dev_t` (`MKDEV`): 12 bits of major above 20 bits of minor. It
/// differs from the userspace encoding `stat` returns.
pub const fn kernel_dev(major: u32, minor: u32) -> u32 {
    (major << 20) | (minor & 0xfffff)
}

/// `(major, minor)` of a kernel `dev_t`.
pub const fn split_kernel_dev(dev: u32) -> (u32, u32) {
    (dev >> 20, dev & 0xfffff)
}

pub mod alloc;
pub mod env_scan;

#[cfg(feature = "user")]
mod pod {
    // Each type below is `#[repr(C)]` with integer fields (or arrays of them) only,
    // its padding written out as `_pad` fields, and its size pinned by the tests
    // below: every bit pattern is a valid value, and no byte is left uninitialised.
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::RawEvent {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::AllocEvent {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::OpenEvent {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::Subject {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::Offsets {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::EnvEntry {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::ExeKey {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::alloc::EnvGpu {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::alloc::Baseline {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::alloc::Delta {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::alloc::Charge {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::alloc::ProcGpu {}
    // SAFETY: integers only, no implicit padding (see above).
    unsafe impl aya::Pod for super::alloc::Ordinals {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_have_the_layout_both_sides_compile() {
        // The programs and the daemon are built by different compilers for different
        // targets; a size change means one side was not rebuilt or a field is unaligned.
        assert_eq!(size_of::<RawEvent>(), 40);
        assert_eq!(size_of::<Subject>(), 24);
        assert_eq!(size_of::<OpenEvent>(), 64);
        assert_eq!(size_of::<AllocEvent>(), 88);
        assert_eq!(size_of::<alloc::RefusalPace>(), 16);
        assert_eq!(size_of::<alloc::EnvGpu>(), 16);
        assert_eq!(size_of::<alloc::Baseline>(), 16);
        assert_eq!(size_of::<alloc::Delta>(), 16);
        assert_eq!(size_of::<alloc::Charge>(), 24);
        assert_eq!(size_of::<alloc::Ordinals>(), alloc::MAX_ORDINALS);
        assert_eq!(size_of::<alloc::CtxStack>(), 40);
        assert_eq!(size_of::<alloc::ProcGpu>(), 8);
        assert_eq!(size_of::<Offsets>(), 31 * 4);
        assert_eq!(size_of::<EnvEntry>(), 16);
        assert_eq!(size_of::<ExeKey>(), 16);
    }

    #[test]
    fn environment_ids_hash_as_fnv1a_and_never_to_a_sentinel() {
        // FNV-1a 64 test vectors.
        assert_eq!(env_id_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(env_id_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_ne!(env_id_hash(b"21210"), env_id_hash(b"21211"));
    }

    #[test]
    fn kernel_device_numbers_round_trip() {
        assert_eq!(kernel_dev(195, 255), (195 << 20) | 255);
        assert_eq!(split_kernel_dev(kernel_dev(1, 7)), (1, 7));
        assert_eq!(split_kernel_dev(kernel_dev(4095, 0xfffff)), (4095, 0xfffff));
    }
}
