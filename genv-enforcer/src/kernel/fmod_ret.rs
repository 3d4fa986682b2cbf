//! The fmod_ret tier's program: `open_fmod_ret`, a `BPF_MODIFY_RETURN` tracing program
//! on `security_file_open`, whose return value replaces the function's, so that it can
//! refuse an open (EPERM) where the BPF LSM is not active.
//!
//! aya 0.14 has no such program type, and aya-obj refuses an object with an `fmod_ret/`
//! section, so the program sits in a section aya-obj reads as fexit (which aya never
//! loads) and is loaded here: the embedded object is parsed again with aya-obj and
//! relocated as aya does it, against the maps aya already created for the other
//! programs (so every program shares them, `.rodata`'s offsets included), then loaded
//! and attached with `bpf()` directly. The program calls no subprogram (its decision is
//! inlined), so it needs no BTF of its own: only the target's id in the kernel's BTF.

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use aya::Ebpf;
use aya::maps::{Map, MapData};
use aya_obj::btf::BtfKind;
use aya_obj::generated::{
    bpf_attach_type, bpf_attr, bpf_cmd, bpf_insn, bpf_prog_info, bpf_prog_type,
};

use super::error::chain;

/// The program's name in the object (and in the kernel: under 16 bytes).
pub(super) const PROGRAM: &str = "open_fmod_ret";
/// The kernel function whose return value it sets.
const TARGET: &str = "security_file_open";

/// Why the fmod_ret program could not be loaded or attached, by step.
#[derive(Debug, thiserror::Error)]
pub enum FmodRetError {
    #[error("parsing the object for {PROGRAM}: {0}")]
    Parse(String),
    #[error("{PROGRAM} is not in the object")]
    Missing,
    #[error("the object has CO-RE relocations, which the {PROGRAM} loader does not apply")]
    CoRe,
    #[error("relocating {PROGRAM}'s {what}: {message}")]
    Relocate { what: &'static str, message: String },
    #[error("finding {TARGET} in the kernel's BTF: {0}")]
    Target(String),
    #[error("BPF_PROG_LOAD (BPF_MODIFY_RETURN on {TARGET}): {error}{log}")]
    Load { error: io::Error, log: String },
    #[error("BPF_RAW_TRACEPOINT_OPEN (attaching {PROGRAM} to {TARGET}): {0}")]
    Attach(io::Error),
    #[error("BPF_OBJ_GET_INFO_BY_FD ({PROGRAM}): {0}")]
    Info(io::Error),
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

/// Loads `open_fmod_ret` from `object` (the bytes aya loaded `ebpf` from), against
/// `ebpf`'s maps, and attaches it; its kernel id and link.
pub(super) fn load_and_attach(ebpf: &Ebpf, object: &[u8]) -> Result<(u32, Link), FmodRetError> {
    let (instructions, license) = relocated(ebpf, object)?;
    let btf = aya::Btf::from_sys_fs().map_err(|e| FmodRetError::Target(chain(&e)))?;
    let target = btf
        .id_by_type_name_kind(TARGET, BtfKind::Func)
        .map_err(|e| FmodRetError::Target(chain(&e)))?;
    let program = load(&instructions, &license, target)?;
    let id = info(program.as_fd().as_raw_fd())
        .map_err(FmodRetError::Info)?
        .id;
    // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    // No name: a tracing program is attached to the target it was loaded for.
    attr.raw_tracepoint.prog_fd = program.as_raw_fd() as u32;
    let link = bpf_fd(bpf_cmd::BPF_RAW_TRACEPOINT_OPEN, &mut attr).map_err(FmodRetError::Attach)?;
    Ok((id, Link(link)))
}

/// The program's instructions, relocated against `ebpf`'s maps as aya relocates its
/// own programs, with the functions it calls linked in after it (`memcpy`, for
/// `--bpf-log`'s records), and its license.
fn relocated(ebpf: &Ebpf, object: &[u8]) -> Result<(Vec<bpf_insn>, CString), FmodRetError> {
    let mut obj = aya_obj::Object::parse(object).map_err(|e| FmodRetError::Parse(chain(&e)))?;
    let program = obj.programs.get(PROGRAM).ok_or(FmodRetError::Missing)?;
    let (key, license) = (program.function_key(), program.license.clone());
    if obj.has_btf_relocations() {
        return Err(FmodRetError::CoRe);
    }
    let fds: HashMap<&str, RawFd> = ebpf
        .maps()
        .map(|(name, map)| (name, map_data(map).fd().as_fd().as_raw_fd()))
        .collect();
    let definitions: Vec<(String, aya_obj::Map)> = obj.maps.drain().collect();
    let text: HashSet<usize> = obj.functions.keys().map(|&(section, _)| section).collect();
    // A map the object names and aya did not create fails here, naming it.
    let maps = definitions
        .iter()
        .filter_map(|(name, map)| Some((name.as_str(), *fds.get(name.as_str())?, map)));
    obj.relocate_maps(maps, &text)
        .map_err(|e| FmodRetError::Relocate {
            what: "map references",
            message: chain(&e),
        })?;
    obj.relocate_calls(&text)
        .map_err(|e| FmodRetError::Relocate {
            what: "calls",
            message: chain(&e),
        })?;
    obj.sanitize_functions(aya::features());
    let function = obj.functions.remove(&key).ok_or(FmodRetError::Missing)?;
    Ok((function.instructions, license))
}

/// `BPF_PROG_LOAD` as a `BPF_MODIFY_RETURN` tracing program on BTF function `target`
/// of vmlinux. Tried without a verifier log first (the common case, and cheaper); a
/// refusal is tried again with one, whose end goes into the error.
fn load(instructions: &[bpf_insn], license: &CStr, target: u32) -> Result<OwnedFd, FmodRetError> {
    let attempt = |log: &mut [u8], log_level: u32| {
        // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the `BPF_PROG_LOAD` member of the union.
        let load = unsafe { &mut attr.__bindgen_anon_3 };
        load.prog_type = bpf_prog_type::BPF_PROG_TYPE_TRACING as u32;
        load.expected_attach_type = bpf_attach_type::BPF_MODIFY_RETURN as u32;
        load.attach_btf_id = target; // in vmlinux: attach_btf_obj_fd stays 0
        load.insn_cnt = instructions.len() as u32;
        load.insns = instructions.as_ptr() as u64;
        load.license = license.as_ptr() as u64;
        for (slot, byte) in load.prog_name.iter_mut().zip(PROGRAM.bytes()) {
            *slot = byte as libc::c_char;
        }
        load.log_level = log_level;
        load.log_buf = log.as_mut_ptr() as u64;
        load.log_size = log.len() as u32;
        bpf_fd(bpf_cmd::BPF_PROG_LOAD, &mut attr)
    };
    attempt(&mut [], 0).or_else(|error| {
        let mut log = vec![0u8; 16 << 20];
        attempt(&mut log, 1).map_err(|_| FmodRetError::Load {
            error,
            log: log_tail(&log),
        })
    })
}

/// The verifier log's last lines (where it says why), as `: verifier: ... | ...`; empty
/// when the kernel refused before verifying.
fn log_tail(log: &[u8]) -> String {
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return String::new();
    }
    let tail = &lines[lines.len().saturating_sub(8)..];
    format!(": verifier: {}", tail.join(" | "))
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
    // SAFETY: all-zero is a valid `bpf_attr` (plain integers).
    let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
    attr.__bindgen_anon_6.__bindgen_anon_1.prog_id = id;
    let program = bpf_fd(bpf_cmd::BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    let record = info(program.as_raw_fd())?;
    Ok((
        record.run_cnt,
        record.run_time_ns,
        record.verified_insns,
        record.xlated_prog_len,
    ))
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

/// The map behind any of aya's map kinds.
fn map_data(map: &Map) -> &MapData {
    match map {
        Map::Array(data)
        | Map::ArrayOfMaps(data)
        | Map::BloomFilter(data)
        | Map::CgroupArray(data)
        | Map::CgroupStorage(data)
        | Map::CgrpStorage(data)
        | Map::CpuMap(data)
        | Map::DevMap(data)
        | Map::DevMapHash(data)
        | Map::HashMap(data)
        | Map::HashOfMaps(data)
        | Map::InodeStorage(data)
        | Map::LpmTrie(data)
        | Map::LruHashMap(data)
        | Map::PerCpuArray(data)
        | Map::PerCpuCgroupStorage(data)
        | Map::PerCpuHashMap(data)
        | Map::PerCpuLruHashMap(data)
        | Map::PerfEventArray(data)
        | Map::ProgramArray(data)
        | Map::Queue(data)
        | Map::ReusePortSockArray(data)
        | Map::RingBuf(data)
        | Map::SockHash(data)
        | Map::SockMap(data)
        | Map::SkStorage(data)
        | Map::Stack(data)
        | Map::StackTraceMap(data)
        | Map::Unsupported(data)
        | Map::XskMap(data) => data,
    }
}
