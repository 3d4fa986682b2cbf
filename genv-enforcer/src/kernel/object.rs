//! The compiled kernel programs, embedded at build time (see `build.rs`), and the one
//! change the daemon makes to them before loading.

use object::{Object, ObjectSection, ObjectSymbol};

/// The `genv-ebpf` ELF object, aligned as aya requires.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/genv-ebpf"));

/// `BPF_F_NO_PREALLOC`: a hash map whose entries are allocated as they are inserted.
const BPF_F_NO_PREALLOC: u32 = 1;
/// `map_flags` in the legacy `bpf_map_def` aya-ebpf writes into the `maps` section:
/// after the type, key size, value size and capacity (four `u32`s).
const MAP_FLAGS_OFFSET: usize = 16;

/// `object` with map `name` made lazily allocated: its capacity then costs nothing until
/// entries exist. Tracing programs may use such maps from 6.1 on (the BPF memory
/// allocator); the object is built preallocated, which every kernel accepts.
pub fn with_lazy_map(object: &[u8], name: &str) -> Result<Aligned, String> {
    let file = object::File::parse(object).map_err(|e| e.to_string())?;
    let symbol = file
        .symbols()
        .find(|s| s.name() == Ok(name))
        .ok_or_else(|| format!("no symbol {name} in the object"))?;
    let section = symbol
        .section_index()
        .and_then(|i| file.section_by_index(i).ok())
        .ok_or_else(|| format!("{name} is in no section"))?;
    if section.name() != Ok("maps") {
        return Err(format!("{name} is not a legacy map definition"));
    }
    let (start, _) = section
        .file_range()
        .ok_or_else(|| format!("{name}'s section has no data"))?;
    let at = start as usize + symbol.address() as usize + MAP_FLAGS_OFFSET;
    let mut patched = Aligned::copy(object);
    let flags = patched
        .bytes_mut()
        .get_mut(at..at + 4)
        .ok_or_else(|| format!("{name}'s definition is outside the object"))?;
    let old = u32::from_le_bytes(flags.try_into().unwrap());
    flags.copy_from_slice(&(old | BPF_F_NO_PREALLOC).to_le_bytes());
    Ok(patched)
}

/// A copy of an object, 8-byte aligned as the ELF parser requires.
pub struct Aligned {
    words: Vec<u64>,
    len: usize,
}

impl Aligned {
    fn copy(bytes: &[u8]) -> Self {
        let mut aligned = Aligned {
            words: vec![0; bytes.len().div_ceil(8)],
            len: bytes.len(),
        };
        aligned.bytes_mut().copy_from_slice(bytes);
        aligned
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes of the words' own allocation, which is at least that long.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast(), self.len) }
    }
}

/// Lets the kernel take back the pages of [`OBJECT`] that loading read (about 2.5 MiB
/// of this binary's read-only data, otherwise resident for the daemon's life). They are
/// clean pages of the binary's file: a later read (another load) maps them in again.
pub fn release_pages() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let (start, end) = (
        OBJECT.as_ptr() as usize,
        OBJECT.as_ptr() as usize + OBJECT.len(),
    );
    let (first, last) = (start.next_multiple_of(page), end / page * page);
    if first >= last {
        return;
    }
    // SAFETY: whole pages inside OBJECT's own read-only, file-backed range: dropping them
    // changes no content (the file holds it), and nothing can have written them.
    let done = unsafe {
        libc::madvise(
            first as *mut libc::c_void,
            last - first,
            libc::MADV_DONTNEED,
        )
    };
    if done != 0 {
        tracing::debug!(
            "Cannot release the object's pages: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Whether this kernel lets tracing programs use lazily allocated hash maps (6.1).
pub fn lazy_maps_supported() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|p| p.parse::<u32>().ok());
    matches!((parts.next(), parts.next()), (Some(major), Some(minor)) if (major, minor) >= (6, 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_map_becomes_lazy_and_nothing_else_changes() {
        let patched = with_lazy_map(OBJECT, genv_ebpf_common::PROC_ENV_MAP).unwrap();
        let patched = patched.bytes();
        let changed: Vec<usize> = (0..OBJECT.len())
            .filter(|&i| OBJECT[i] != patched[i])
            .collect();
        assert_eq!(changed.len(), 1, "one byte of map_flags: {changed:?}");
        assert_eq!(patched[changed[0]] & 1, 1);
        assert!(with_lazy_map(OBJECT, "NO_SUCH_MAP").is_err());
    }
}
