//! The trampoline tiers' programs, loaded outside aya: `open_lsm` (the BPF LSM's
//! `file_open` hook), `open_fmod_ret` (a `BPF_MODIFY_RETURN` tracing program on
//! `security_file_open`, whose return value replaces the function's, so that it can refuse
//! an open where the BPF LSM is not active) and `open_fentry` (watching the same call).
//!
//! aya 0.14 has no fmod_ret program type, and aya-obj refuses an object with an
//! `fmod_ret/` section, so that program sits in a section aya-obj reads as fexit (which
//! aya never loads). aya would load the other two, but only against its own parse of the
//! kernel's BTF (`Lsm::load`, `FEntry::load` take an `aya::Btf`), about 20 MiB of memory
//! for the one id each needs; the daemon's own reader finds the ids ([`Targets`]). So all
//! three are loaded here alike: the embedded object is parsed again with aya-obj and
//! relocated as aya does it, against the maps aya already created for the other programs
//! (so every program shares them, `.rodata`'s offsets included), then loaded and attached
//! with `bpf()` directly. The programs call no subprogram (their decision is inlined), so
//! they need no BTF of their own: only the target's id in the kernel's BTF.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use aya::Ebpf;
use aya_obj::generated::{
    bpf_attach_type, bpf_attr, bpf_cmd, bpf_insn, bpf_prog_info, bpf_prog_type,
};

use super::btf::Btf;
use super::relocation::{RelocationError, relocated};
use super::verifier_log::LogBuffer;

/// One trampoline tier's program: its name in the object (and in the kernel: under 16
/// bytes), how it is loaded, and the function in vmlinux's BTF it is loaded against.
#[derive(Clone, Copy, Debug)]
pub(super) struct Hook {
    pub(super) program: &'static str,
    prog_type: bpf_prog_type,
    attach_type: bpf_attach_type,
    pub(super) target: &'static str,
}

/// The BPF LSM's `file_open` hook: its BTF function is `bpf_lsm_file_open`.
pub(super) const LSM: Hook = Hook {
    program: "open_lsm",
    prog_type: bpf_prog_type::BPF_PROG_TYPE_LSM,
    attach_type: bpf_attach_type::BPF_LSM_MAC,
    target: "bpf_lsm_file_open",
};

pub(super) const FMOD_RET: Hook = Hook {
    program: "open_fmod_ret",
    prog_type: bpf_prog_type::BPF_PROG_TYPE_TRACING,
    attach_type: bpf_attach_type::BPF_MODIFY_RETURN,
    target: "security_file_open",
};

pub(super) const FENTRY: Hook = Hook {
    program: "open_fentry",
    prog_type: bpf_prog_type::BPF_PROG_TYPE_TRACING,
    attach_type: bpf_attach_type::BPF_TRACE_FENTRY,
    target: "security_file_open",
};

/// Each hook's target id, found in the kernel's BTF before aya loads the object (so that
/// the blob is freed by then), or why there is none.
#[derive(Debug)]
pub(super) struct Targets(Vec<(&'static str, Result<u32, String>)>);

impl Targets {
    pub(super) fn find(btf: &Btf) -> Self {
        let names = [LSM.target, FMOD_RET.target, FENTRY.target];
        let mut found: Vec<(&str, Result<u32, String>)> = Vec::new();
        for name in names {
            if !found.iter().any(|(n, _)| *n == name) {
                found.push((name, btf.func_id(name).map_err(|e| e.to_string())));
            }
        }
        Self(found)
    }

    pub(super) fn id(&self, hook: &Hook) -> Result<u32, TrampolineError> {
        match self.0.iter().find(|(name, _)| *name == hook.target) {
            Some((_, Ok(id))) => Ok(*id),
            Some((_, Err(why))) => Err(TrampolineError::Target(why.clone())),
            None => Err(TrampolineError::Target(format!(
                "{} not looked up",
                hook.target
            ))),
        }
    }
}

/// Why a trampoline program could not be loaded or attached, by step.
#[derive(Debug, thiserror::Error)]
pub enum TrampolineError {
    #[error(transparent)]
    Relocation(#[from] RelocationError),
    #[error("finding the target in the kernel's BTF: {0}")]
    Target(String),
    #[error("BPF_PROG_LOAD ({:?} on {}): {error}{log}", hook.attach_type, hook.target)]
    Load {
        hook: Hook,
        error: io::Error,
        log: String,
    },
    #[error("BPF_RAW_TRACEPOINT_OPEN (attaching {0} to {1}): {2}")]
    Attach(&'static str, &'static str, io::Error),
    #[error("BPF_OBJ_GET_INFO_BY_FD ({0}): {1}")]
    Info(&'static str, io::Error),
}

/// The attached program's link. Dropping it detaches the program, which the link holds
/// the last reference to, and the kernel unloads it; pinned, it stays.
#[derive(Debug)]
pub(super) struct Link(OwnedFd);

impl Link {
    /// Pins the link at `path` (in bpffs): it stays attached after this descriptor and
    /// the daemon are gone, until the pin is removed.
    pub(super) fn pin(self, path: &Path) -> io::Result<()> {
        let path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the `BPF_OBJ_PIN` member of the union.
        let pin = unsafe { &mut attr.__bindgen_anon_4 };
        pin.pathname = path.as_ptr() as u64;
        pin.bpf_fd = self.0.as_raw_fd() as u32;
        bpf(bpf_cmd::BPF_OBJ_PIN, &mut attr).map(drop)
    }
}

/// Loads `hook`'s program from `object` (the bytes aya loaded `ebpf` from), against
/// `ebpf`'s maps and the target id in `targets`, and attaches it; its kernel id and link.
pub(super) fn load_and_attach(
    ebpf: &Ebpf,
    object: &[u8],
    hook: Hook,
    targets: &Targets,
) -> Result<(u32, Link), TrampolineError> {
    let target = targets.id(&hook)?;
    let (instructions, license) = relocated(ebpf, object, &[hook.program])?
        .pop()
        .ok_or(RelocationError::Missing(hook.program))?;
    let program = load(&instructions, &license, hook, target)?;
    let id = info(program.as_fd().as_raw_fd())
        .map_err(|e| TrampolineError::Info(hook.program, e))?
        .id;
    // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // No name: a tracing or LSM program is attached to the target it was loaded for.
    attr.raw_tracepoint.prog_fd = program.as_raw_fd() as u32;
    let link = bpf_fd(bpf_cmd::BPF_RAW_TRACEPOINT_OPEN, &mut attr)
        .map_err(|e| TrampolineError::Attach(hook.program, hook.target, e))?;
    Ok((id, Link(link)))
}

/// `BPF_PROG_LOAD` as `hook` says, on BTF function `target` of vmlinux. Tried without a
/// verifier log first (the common case, and cheaper); a refusal is tried again with one,
/// whose end, and that attempt's error, go into the error.
pub(super) fn load(
    instructions: &[bpf_insn],
    license: &CStr,
    hook: Hook,
    target: u32,
) -> Result<OwnedFd, TrampolineError> {
    let attempt =
        |log: &mut [u8], log_level| prog_load(instructions, license, hook, target, log, log_level);
    attempt(&mut [], 0).or_else(|error| {
        let Ok(mut log) = LogBuffer::new() else {
            let log = String::new();
            return Err(TrampolineError::Load { hook, error, log });
        };
        attempt(log.as_mut_slice(), 1).map_err(|error| TrampolineError::Load {
            hook,
            error,
            log: log.tail(),
        })
    })
}

/// One `BPF_PROG_LOAD`. An empty `log` is no log at all: a null buffer, as the kernel
/// wants with size 0 (an empty slice's pointer is not null, and the kernel refuses a
/// buffer of size 0 with `EINVAL`).
fn prog_load(
    instructions: &[bpf_insn],
    license: &CStr,
    hook: Hook,
    target: u32,
    log: &mut [u8],
    log_level: u32,
) -> io::Result<OwnedFd> {
    // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the `BPF_PROG_LOAD` member of the union.
    let load = unsafe { &mut attr.__bindgen_anon_3 };
    load.prog_type = hook.prog_type as u32;
    load.expected_attach_type = hook.attach_type as u32;
    load.attach_btf_id = target; // in vmlinux: attach_btf_obj_fd stays 0
    load.insn_cnt = instructions.len() as u32;
    load.insns = instructions.as_ptr() as u64;
    load.license = license.as_ptr() as u64;
    for (slot, byte) in load.prog_name.iter_mut().zip(hook.program.bytes()) {
        *slot = byte as libc::c_char;
    }
    if !log.is_empty() {
        load.log_level = log_level;
        load.log_buf = log.as_mut_ptr() as u64;
        load.log_size = log.len() as u32;
    }
    bpf_fd(bpf_cmd::BPF_PROG_LOAD, &mut attr)
}

/// The kernel's record of the program `fd`.
fn info(fd: RawFd) -> io::Result<bpf_prog_info> {
    // SAFETY: all-zero is a valid `bpf_prog_info` and `bpf_attr` (plain integers).
    let mut record: bpf_prog_info = unsafe { std::mem::zeroed() };
    // SAFETY: all-zero is a valid `bpf_attr` (a union of plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the `BPF_OBJ_GET_INFO_BY_FD` member of the union.
    let info = unsafe { &mut attr.info };
    info.bpf_fd = fd as u32;
    info.info_len = size_of::<bpf_prog_info>() as u32;
    info.info = &mut record as *mut bpf_prog_info as u64;
    bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(record)
}

/// What the kernel counts of the loaded program `id`, for a program aya did not load:
/// runs and run time (ns; counted while `kernel.bpf_stats_enabled` is 1), and the
/// instructions the verifier processed, and the bytes of the program it left.
pub(super) fn counters(id: u32) -> io::Result<(u64, u64, u32, u32)> {
    let record = info_by_id(id)?;
    Ok((
        record.run_cnt,
        record.run_time_ns,
        record.verified_insns,
        record.xlated_prog_len,
    ))
}

/// How many times the kernel skipped the loaded program `id` (`recursion_misses`,
/// [`super::skipped_runs`]).
pub(super) fn recursion_misses(id: u32) -> io::Result<u64> {
    Ok(info_by_id(id)?.recursion_misses)
}

/// The kernel's record of the loaded program `id`.
fn info_by_id(id: u32) -> io::Result<bpf_prog_info> {
    // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.__bindgen_anon_6.__bindgen_anon_1.prog_id = id;
    let program = bpf_fd(bpf_cmd::BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    info(program.as_raw_fd())
}

/// Whether a program with this id is loaded (ids are handed out cyclically, so a freed
/// one is not soon another's; a lookup that fails other than with ENOENT counts as
/// loaded).
pub(super) fn program_loaded(id: u32) -> bool {
    // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.__bindgen_anon_6.__bindgen_anon_1.prog_id = id;
    exists(bpf_fd(bpf_cmd::BPF_PROG_GET_FD_BY_ID, &mut attr))
}

/// Whether a link with this id exists, as [`program_loaded`] for programs.
pub(super) fn link_exists(id: u32) -> bool {
    // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.__bindgen_anon_6.__bindgen_anon_1.link_id = id;
    exists(bpf_fd(bpf_cmd::BPF_LINK_GET_FD_BY_ID, &mut attr))
}

fn exists(lookup: io::Result<OwnedFd>) -> bool {
    match lookup {
        Ok(_) => true,
        Err(e) => e.raw_os_error() != Some(libc::ENOENT),
    }
}

/// The `bpf()` system call.
fn bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<i64> {
    // SAFETY: `attr` is a whole `bpf_attr`; the pointers in it point at buffers the
    // caller keeps alive across the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            size_of::<bpf_attr>(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A `bpf()` command that returns a new descriptor.
fn bpf_fd(cmd: bpf_cmd, attr: &mut bpf_attr) -> io::Result<OwnedFd> {
    let fd = bpf(cmd, attr)?;
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A load without a log asks for none: the kernel loads it at once (this kernel loads
    /// socket filters), where a non-null buffer of size 0 is refused with `EINVAL` and
    /// every load went to the second attempt, at log level 1, its first error reported.
    #[test]
    fn a_load_without_a_log_passes_no_log_buffer() {
        let exit_0 = [
            bpf_insn {
                code: 0xb7, // BPF_ALU64 | BPF_MOV | BPF_K: r0 = 0
                ..unsafe_zeroed_insn()
            },
            bpf_insn {
                code: 0x95, // BPF_JMP | BPF_EXIT
                ..unsafe_zeroed_insn()
            },
        ];
        let filter = Hook {
            program: "genv_log_test",
            prog_type: bpf_prog_type::BPF_PROG_TYPE_SOCKET_FILTER,
            attach_type: bpf_attach_type::BPF_CGROUP_INET_INGRESS,
            target: "",
        };
        let loaded = prog_load(&exit_0, c"GPL", filter, 0, &mut [], 0);
        assert!(loaded.is_ok(), "{loaded:?}");
    }

    fn unsafe_zeroed_insn() -> bpf_insn {
        // SAFETY: all-zero is a valid `bpf_insn` (plain integers and bitfields).
        unsafe { std::mem::zeroed() }
    }
}
