//! The [`Offsets`] the programs need, from this kernel's BTF and tracefs.

use std::path::Path;

use genv_ebpf_common::Offsets;

use super::btf::{Btf, BtfError};
use super::tracefs::{self, TracefsError};

#[derive(Debug, thiserror::Error)]
pub enum OffsetsError {
    #[error(transparent)]
    Btf(#[from] BtfError),
    #[error(transparent)]
    Tracefs(#[from] TracefsError),
}

pub fn for_running_kernel(btf: &Btf, tracefs_root: &Path) -> Result<Offsets, OffsetsError> {
    let member = |s: &str, m: &str| btf.member_offset(s, m);
    // x86's compat syscalls: only what the 32-bit open hook needs, absent elsewhere.
    let optional = |s: &str, m: &str| member(s, m).unwrap_or(Offsets::ABSENT);
    let task_ti_status = match (
        optional("task_struct", "thread_info"),
        optional("thread_info", "status"),
    ) {
        (Offsets::ABSENT, _) | (_, Offsets::ABSENT) => Offsets::ABSENT,
        (info, status) => info + status,
    };
    Ok(Offsets {
        task_pid: member("task_struct", "pid")?,
        task_tgid: member("task_struct", "tgid")?,
        task_files: member("task_struct", "files")?,
        files_fdt: member("files_struct", "fdt")?,
        fdtable_max_fds: member("fdtable", "max_fds")?,
        fdtable_fd: member("fdtable", "fd")?,
        file_f_inode: member("file", "f_inode")?,
        file_f_mode: member("file", "f_mode")?,
        inode_i_mode: member("inode", "i_mode")?,
        inode_i_rdev: member("inode", "i_rdev")?,
        task_mm: member("task_struct", "mm")?,
        mm_env_start: member("mm_struct", "env_start")?,
        mm_env_end: member("mm_struct", "env_end")?,
        mm_exe_file: member("mm_struct", "exe_file")?,
        inode_i_ino: member("inode", "i_ino")?,
        inode_i_sb: member("inode", "i_sb")?,
        sb_s_dev: member("super_block", "s_dev")?,
        sys_exit_ret: tracefs::required_field_offset(
            tracefs_root,
            "syscalls",
            "sys_exit_openat",
            "ret",
        )?,
        task_signal: member("task_struct", "signal")?,
        signal_live: member("signal_struct", "live")?,
        task_ti_status,
        regs_orig_ax: optional("pt_regs", "orig_ax"),
        task_group_leader: member("task_struct", "group_leader")?,
        task_start_boottime: member("task_struct", "start_boottime")?,
        // The controlling terminal, for the user a refusal or a kill is told to: absent
        // (no terminal told) on a kernel without a TTY layer.
        signal_tty: optional("signal_struct", "tty"),
        tty_index: optional("tty_struct", "index"),
        tty_driver: optional("tty_struct", "driver"),
        driver_major: optional("tty_driver", "major"),
        driver_minor_start: optional("tty_driver", "minor_start"),
        // The open hook's direct loads, which start from `bpf_get_current_task_btf`;
        // without them it walks the table with probe reads.
        files_fdtab: with_func(btf, DIRECT_LOADS_FROM, "files_struct", "fdtab"),
        files_fd_array: with_func(btf, DIRECT_LOADS_FROM, "files_struct", "fd_array"),
    })
}

/// The helper the open hook's direct loads start from (5.11): a kernel without it
/// refuses a program that calls it, even on a path that is never taken unless the
/// offsets it needs are absent (the verifier then drops that path unchecked). The
/// helper's own function is in the kernel's BTF where the helper is.
const DIRECT_LOADS_FROM: &str = "bpf_get_current_task_btf";

/// `strukt.member`'s offset where the kernel has function `func`, else absent.
pub(super) fn with_func(btf: &Btf, func: &str, strukt: &str, member: &str) -> u32 {
    match btf.func_id(func) {
        Ok(_) => btf.member_offset(strukt, member).unwrap_or(Offsets::ABSENT),
        Err(_) => Offsets::ABSENT,
    }
}
