//! The trampoline tiers' programs relocated as aya relocates its own: the embedded
//! object parsed again with aya-obj, its map references pointed at the maps aya already
//! created (so every program shares them, `.rodata`'s offsets included) and its calls
//! linked, for [`super::trampoline`] to load with `bpf()` directly.

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, RawFd};

use aya::Ebpf;
use aya::maps::{Map, MapData};
use aya_obj::generated::bpf_insn;

use super::error::chain;

/// Why a program could not be relocated, by step.
#[derive(Debug, thiserror::Error)]
pub enum RelocationError {
    #[error("parsing the object for {0}: {1}")]
    Parse(&'static str, String),
    #[error("{0} is not in the object")]
    Missing(&'static str),
    #[error("the object has CO-RE relocations, which the trampoline loader does not apply")]
    CoRe,
    #[error("relocating {program}'s {what}: {message}")]
    Relocate {
        program: &'static str,
        what: &'static str,
        message: String,
    },
}

/// The programs' instructions, relocated against `ebpf`'s maps as aya relocates its
/// own programs, each with the functions it calls linked in after it (`memcpy`, for
/// `--bpf-log`'s records), and its license; in the order of `names`. The object is
/// parsed and relocated once for them all (`doctor` loads every tier).
pub(super) fn relocated(
    ebpf: &Ebpf,
    object: &[u8],
    names: &[&'static str],
) -> Result<Vec<(Vec<bpf_insn>, CString)>, RelocationError> {
    let first = names.first().copied().unwrap_or_default();
    let mut obj =
        aya_obj::Object::parse(object).map_err(|e| RelocationError::Parse(first, chain(&e)))?;
    let mut keys = Vec::new();
    for &name in names {
        let program = obj
            .programs
            .get(name)
            .ok_or(RelocationError::Missing(name))?;
        keys.push((name, program.function_key(), program.license.clone()));
    }
    if obj.has_btf_relocations() {
        return Err(RelocationError::CoRe);
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
    let relocate = |what, e: &dyn std::error::Error| RelocationError::Relocate {
        program: first,
        what,
        message: chain(e),
    };
    obj.relocate_maps(maps, &text)
        .map_err(|e| relocate("map references", &e))?;
    obj.relocate_calls(&text)
        .map_err(|e| relocate("calls", &e))?;
    obj.sanitize_functions(aya::features());
    keys.into_iter()
        .map(|(name, key, license)| {
            let function = obj
                .functions
                .remove(&key)
                .ok_or(RelocationError::Missing(name))?;
            Ok((function.instructions, license))
        })
        .collect()
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
