//! The device number of the file behind a descriptor an open just returned, with as
//! few helper calls as the kernel allows: the tracepoint tier's filter, which every
//! open on the machine pays.
//!
//! `bpf_get_current_task_btf()` returns a BTF-typed task pointer. Loads through such a
//! pointer at a constant offset are direct loads (the verifier checks them against the
//! kernel's BTF and makes them exception-protected `PROBE_MEM` loads), where a
//! `bpf_probe_read_kernel` is a helper call (25–28 ns each on a host with AMD's SRSO
//! mitigations). A member that points to a struct stays typed (`task->files->fdt`), but
//! `fdtable.fd` is a `struct file **`, an untyped scalar. So:
//!
//! - while the task's table is the one embedded in its `files_struct` (`fdt ==
//!   &files->fdtab`: it never had a descriptor past `NR_OPEN_DEFAULT` open, nor did the
//!   process it was forked from at the fork), the file is read from
//!   `files_struct.fd_array`, typed, and so are its inode and number: no helper call at
//!   all. The verifier refuses variable offsets on typed pointers, so the slot's offset
//!   is built from one constant per bit of the descriptor: a constant on every path.
//! - a grown table is reached by direct loads down to `fdt->fd`; the slot, the inode
//!   and its number take three probe reads.
//!
//! A thread that grows the table between the check and the slot's read leaves
//! `fd_array` as it was (the kernel copies it and never clears it), so the file read is
//! still the one the open installed, unless the process closed it meanwhile: the race a
//! descriptor closed by another thread before the hook runs always was.
//!
//! The offsets are the daemon's (`OFFSETS`, read-only, so the verifier sees constants);
//! where the kernel lacks a member they are `Offsets::ABSENT` and this path is dead code
//! the verifier never walks.

use aya_ebpf::helpers::{bpf_get_current_task_btf, bpf_probe_read_kernel};
use genv_ebpf_common::Offsets;

use crate::kernel::read;
use crate::maps::offset;

/// `NR_OPEN_DEFAULT` (`BITS_PER_LONG`): the descriptors `fd_array` holds, on every
/// 64-bit kernel.
const INLINE_FDS: u32 = 64;

/// What the loads found at a descriptor.
pub enum Slot {
    /// The file's device number (0 for anything but a device).
    Rdev(u32),
    /// A kernel without the members: walk the table with probe reads, as before.
    Walk,
    /// No file there (closed since, by another thread), or unreadable.
    Empty,
}

/// The device number of the file at descriptor `fd` of the current task.
#[inline(always)]
pub fn rdev_at(fd: u32) -> Slot {
    let (fdtab, fd_array) = (offset!(files_fdtab), offset!(files_fd_array));
    if fdtab == Offsets::ABSENT || fd_array == Offsets::ABSENT {
        return Slot::Walk;
    }
    let (task_files, files_fdt) = (offset!(task_files), offset!(files_fdt));
    let (f_inode, i_rdev) = (offset!(file_f_inode), offset!(inode_i_rdev));
    // SAFETY: a helper without arguments.
    let task = unsafe { bpf_get_current_task_btf() } as *const u8;
    // SAFETY: a BTF-typed pointer at a constant offset of one of its members, which
    // the verifier checks and which cannot fault (`PROBE_MEM`); likewise each `load` below.
    let files: *const u8 = unsafe { load(task, task_files) };
    if files.is_null() {
        return Slot::Empty; // an exiting task
    }
    // SAFETY: as above.
    let fdt: *const u8 = unsafe { load(files, files_fdt) };
    if fdt != files.wrapping_add(fdtab as usize) || fd >= INLINE_FDS {
        return grown(fdt, fd);
    }
    // SAFETY: as above.
    let file: *const u8 = unsafe { load(files, fd_array + slot_offset(fd)) };
    if file.is_null() {
        return Slot::Empty;
    }
    // SAFETY: as above.
    let inode: *const u8 = unsafe { load(file, f_inode) };
    // SAFETY: as above.
    Slot::Rdev(unsafe { load(inode, i_rdev) })
}

/// The device number at `fd` in a table past the embedded one (or a descriptor past
/// it): `fdt` is typed, the slot's contents are not.
#[inline(always)]
fn grown(fdt: *const u8, fd: u32) -> Slot {
    let (max_fds, fds) = (offset!(fdtable_max_fds), offset!(fdtable_fd));
    let (f_inode, i_rdev) = (offset!(file_f_inode), offset!(inode_i_rdev));
    // SAFETY: as in `rdev_at`: `fdt` is typed, the offsets are its members'.
    let (max_fds, fds): (u32, *const *const u8) = unsafe { (load(fdt, max_fds), load(fdt, fds)) };
    if fd >= max_fds || fds.is_null() {
        return Slot::Empty;
    }
    // SAFETY: a probe read of the descriptor's slot, bounded by max_fds above.
    let Ok(file) = (unsafe { bpf_probe_read_kernel(fds.wrapping_add(fd as usize)) }) else {
        return Slot::Empty;
    };
    let rdev = read::<*const u8>(file, f_inode).and_then(|inode| read::<u32>(inode, i_rdev));
    rdev.map_or(Slot::Empty, Slot::Rdev)
}

/// `8 * fd` for `fd` below 64, built so that the verifier sees a constant on every
/// path: one branch per bit, each adding a constant the compiler cannot see through
/// (it would otherwise fold the branches into `fd << 3`, a variable offset).
#[inline(always)]
fn slot_offset(fd: u32) -> u32 {
    let mut at = 0;
    for bit in [32, 16, 8, 4, 2, 1] {
        if fd & bit != 0 {
            at += opaque(bit * 8);
        }
    }
    at
}

/// `value`, hidden from the optimiser by a move to itself. (Not an empty sequence: the
/// kernel refuses line info of two source lines at one instruction.)
#[inline(always)]
fn opaque(mut value: u32) -> u32 {
    // SAFETY: a register move to itself.
    unsafe { core::arch::asm!("{0} = {0}", inout(reg) value, options(nostack)) };
    value
}

/// A `T` at `base + offset`, by a plain load.
///
/// # Safety
/// `base` must be a BTF-typed kernel pointer and `offset` a constant the verifier can
/// match to a member of its type.
#[inline(always)]
unsafe fn load<T>(base: *const u8, offset: u32) -> T {
    // SAFETY: the caller's; the verifier checks the access.
    unsafe { core::ptr::read_volatile(base.wrapping_add(offset as usize) as *const T) }
}
