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
}

/// One event, as the programs write it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawEvent {
    /// One of [`kind`].
    pub kind: u32,
    /// Thread-group id (the process's pid, as userspace sees it).
    pub pid: u32,
    /// The thread that acted.
    pub tid: u32,
    /// Kind-specific: the child's pid for `FORK`, the node's `dev_t` for `OPEN`.
    pub arg: u32,
    /// The GPU index for `OPEN`.
    pub index: u32,
    /// One of [`hook`] for `OPEN`.
    pub hook: u32,
    /// `bpf_ktime_get_ns()` when the event happened (CLOCK_MONOTONIC).
    pub ktime_ns: u64,
}

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
    /// `ret` in the `syscalls/sys_exit_open*` tracepoints.
    pub sys_exit_ret: u32,
    /// `group_dead` in `sched/sched_process_exit` (6.15 and later); `ABSENT` before.
    pub exit_group_dead: u32,
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
        sys_exit_ret: 0,
        exit_group_dead: Self::ABSENT,
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

#[cfg(feature = "user")]
mod pod {
    // SAFETY: plain `#[repr(C)]` integers with no padding holes.
    unsafe impl aya::Pod for super::RawEvent {}
    unsafe impl aya::Pod for super::Offsets {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_have_the_layout_both_sides_compile() {
        // The programs and the daemon are built by different compilers for different
        // targets; a size change means one side was not rebuilt or a field is unaligned.
        assert_eq!(size_of::<RawEvent>(), 32);
        assert_eq!(size_of::<Offsets>(), 12 * 4);
    }

    #[test]
    fn kernel_device_numbers_round_trip() {
        assert_eq!(kernel_dev(195, 255), (195 << 20) | 255);
        assert_eq!(split_kernel_dev(kernel_dev(1, 7)), (1, 7));
        assert_eq!(split_kernel_dev(kernel_dev(4095, 0xfffff)), (4095, 0xfffff));
    }
}
