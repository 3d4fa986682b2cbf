//! The file offsets of the functions a shared library exports, read through its
//! descriptor from the few parts of the file that say so: the ELF header, the section
//! headers, and the dynamic symbol table with its strings. Each size is checked before
//! it is read, so that a hostile file (any user's, mapped by their process) costs at
//! most [`TABLES_LIMIT`] bytes of reads and memory, and a malformed one is an error,
//! never a panic or a long read.

use std::collections::HashMap;
use std::fs::File;

use object::elf::{self, FileHeader64};
use object::read::elf::{FileHeader, SectionHeader, Sym};
use object::{Endianness, ReadCache};

/// The most section headers read: a libcuda has a few dozen.
const MAX_SECTIONS: usize = 4096;
/// The most bytes of symbols and their names read: a libcuda's are well under 1 MiB.
pub const TABLES_LIMIT: u64 = 16 << 20;

/// Why a file's exports could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    #[error("not an ELF shared object for this machine ({0})")]
    NotALibrary(String),
    #[error("malformed ELF: {0}")]
    Malformed(String),
    #[error("its {what} take {bytes} bytes, over {TABLES_LIMIT}")]
    TooLarge { what: &'static str, bytes: u64 },
}

impl From<object::read::Error> for ElfError {
    fn from(e: object::read::Error) -> Self {
        ElfError::Malformed(e.to_string())
    }
}

/// Where each of `wanted` that `file` defines in its dynamic symbols starts in the file
/// (what a uprobe is attached at), for a 64-bit shared object built for this machine.
pub fn exported_offsets(
    file: &File,
    wanted: &[&'static str],
) -> Result<HashMap<&'static str, u64>, ElfError> {
    let cache = ReadCache::new(file);
    let data = &cache;
    let header = FileHeader64::<Endianness>::parse(data)?;
    let endian = library_for_this_machine(header)?;
    let count = header.shnum(endian, data)?;
    if count > MAX_SECTIONS {
        return Err(ElfError::TooLarge {
            what: "section headers",
            bytes: (count as u64).saturating_mul(64),
        });
    }
    let sections = header.section_headers(endian, data)?;
    let dynsym = sections
        .iter()
        .find(|s| s.sh_type(endian) == elf::SHT_DYNSYM)
        .ok_or(ElfError::Malformed("no dynamic symbol table".into()))?;
    let strtab = sections
        .get(dynsym.sh_link(endian) as usize)
        .ok_or(ElfError::Malformed(
            "no string table for the dynamic symbols".into(),
        ))?;
    let bytes = dynsym
        .sh_size(endian)
        .saturating_add(strtab.sh_size(endian));
    if bytes > TABLES_LIMIT {
        return Err(ElfError::TooLarge {
            what: "dynamic symbols",
            bytes,
        });
    }
    let symbols: &[elf::Sym64<Endianness>] = dynsym.data_as_array(endian, data)?;
    let len = object::ReadRef::len(data).map_err(|()| ElfError::Malformed("no length".into()))?;
    let strings = strtab.data(endian, data)?;
    let mut found = HashMap::new();
    for symbol in symbols {
        let Some(name) = name_at(strings, symbol.st_name(endian)) else {
            continue;
        };
        let Some(&wanted) = wanted.iter().find(|w| w.as_bytes() == name) else {
            continue;
        };
        if let Some(offset) = file_offset(symbol, sections, endian).filter(|&o| o < len) {
            found.insert(wanted, offset);
        }
    }
    Ok(found)
}

/// The header's byte order, for a shared object built for this machine.
fn library_for_this_machine(header: &FileHeader64<Endianness>) -> Result<Endianness, ElfError> {
    let endian = header.endian()?;
    if header.e_type(endian) != elf::ET_DYN {
        return Err(ElfError::NotALibrary("not a shared object".into()));
    }
    if header.e_machine(endian) != host_machine() {
        return Err(ElfError::NotALibrary(format!(
            "machine {}, not this one's {}",
            header.e_machine(endian),
            host_machine()
        )));
    }
    Ok(endian)
}

/// Where a symbol's code starts in the file: where its section's bytes sit in the file,
/// plus its distance from the section's start in memory. `None` for one undefined here,
/// absolute, or outside its section.
fn file_offset(
    symbol: &elf::Sym64<Endianness>,
    sections: &[elf::SectionHeader64<Endianness>],
    endian: Endianness,
) -> Option<u64> {
    let index = symbol.st_shndx(endian);
    if index == elf::SHN_UNDEF || index >= elf::SHN_LORESERVE {
        return None;
    }
    let section = sections.get(usize::from(index))?;
    let into = symbol
        .st_value(endian)
        .checked_sub(section.sh_addr(endian))?;
    (section.sh_type(endian) != elf::SHT_NOBITS && into < section.sh_size(endian))
        .then(|| section.sh_offset(endian).checked_add(into))?
}

/// The NUL-terminated name at `at` in a string table.
fn name_at(strings: &[u8], at: u32) -> Option<&[u8]> {
    let rest = strings.get(at as usize..)?;
    rest.iter().position(|&b| b == 0).map(|end| &rest[..end])
}

/// The ELF machine this daemon runs on: a library for another (ldconfig lists the
/// 32-bit one too) passes arguments elsewhere, so the probes would read other
/// registers as sizes.
fn host_machine() -> u16 {
    match std::env::consts::ARCH {
        "x86_64" => elf::EM_X86_64,
        "aarch64" => elf::EM_AARCH64,
        "powerpc64" => elf::EM_PPC64,
        _ => elf::EM_NONE,
    }
}

#[cfg(test)]
mod tests;
