use std::io::Write;

use object::{Object, ObjectSection, ObjectSymbol};
use proptest::prelude::*;

use super::*;

const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";

/// `bytes` as a file (in memory).
fn file_of(bytes: &[u8]) -> File {
    let fd = rustix::fs::memfd_create("elf", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    let mut file = File::from(fd);
    file.write_all(bytes).unwrap();
    file
}

fn libc_bytes() -> Vec<u8> {
    let path = if cfg!(target_arch = "x86_64") {
        LIBC.to_owned()
    } else {
        format!("/lib/{}-linux-gnu/libc.so.6", std::env::consts::ARCH)
    };
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The offsets a whole-file parse (the `object` crate's own, over every byte) gives.
fn whole_file_offsets(bytes: &[u8]) -> HashMap<String, u64> {
    let file = object::File::parse(bytes).unwrap();
    let mut offsets = HashMap::new();
    for symbol in file.dynamic_symbols().filter(|s| s.is_definition()) {
        let (Ok(name), Some(index)) = (symbol.name(), symbol.section_index()) else {
            continue;
        };
        let section = file.section_by_index(index).unwrap();
        // Thread-local and other sections without bytes in the file.
        let Some((start, _)) = section.file_range() else {
            continue;
        };
        offsets.insert(
            name.to_owned(),
            start + symbol.address() - section.address(),
        );
    }
    offsets
}

#[test]
fn finds_what_a_whole_file_parse_finds_reading_only_the_tables() {
    let bytes = libc_bytes();
    let expected = whole_file_offsets(&bytes);
    let names: Vec<&'static str> = ["malloc", "free", "dlopen", "printf", "no_such_symbol"].into();
    let found = exported_offsets(&file_of(&bytes), &names).unwrap();
    for name in &names[..4] {
        assert_eq!(found.get(name), expected.get(*name), "{name}");
    }
    assert!(found.contains_key("malloc"));
    assert!(!found.contains_key("no_such_symbol"));
}

#[test]
fn refuses_what_is_not_a_shared_object_for_this_machine() {
    let mut bytes = libc_bytes();
    bytes[16] = elf::ET_EXEC as u8;
    let not_dyn = exported_offsets(&file_of(&bytes), &["malloc"]).unwrap_err();
    assert!(matches!(not_dyn, ElfError::NotALibrary(_)), "{not_dyn}");
    let mut bytes = libc_bytes();
    bytes[18] = 3; // EM_386
    bytes[19] = 0;
    let other = exported_offsets(&file_of(&bytes), &["malloc"]).unwrap_err();
    assert!(matches!(other, ElfError::NotALibrary(_)), "{other}");
    for junk in [&b""[..], b"\x7fELF", b"#!/bin/sh\nexit 0\n"] {
        assert!(exported_offsets(&file_of(junk), &["malloc"]).is_err());
    }
}

/// The section headers' offset and the dynamic symbol table's header in `bytes`.
fn dynsym_header_at(bytes: &[u8]) -> usize {
    let shoff = u64::from_le_bytes(bytes[0x28..0x30].try_into().unwrap()) as usize;
    let shnum = u16::from_le_bytes(bytes[0x3c..0x3e].try_into().unwrap()) as usize;
    (0..shnum)
        .map(|i| shoff + i * 64)
        .find(|at| u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) == elf::SHT_DYNSYM)
        .unwrap()
}

#[test]
fn a_table_larger_than_the_limit_is_refused_unread() {
    let mut bytes = libc_bytes();
    let at = dynsym_header_at(&bytes);
    // sh_size: 1 TiB of symbols, which the file does not even hold.
    bytes[at + 32..at + 40].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let error = exported_offsets(&file_of(&bytes), &["malloc"]).unwrap_err();
    assert!(matches!(error, ElfError::TooLarge { .. }), "{error}");
    let mut bytes = libc_bytes();
    bytes[0x3c..0x3e].copy_from_slice(&0u16.to_le_bytes()); // e_shnum 0: read from section 0
    let at = u64::from_le_bytes(bytes[0x28..0x30].try_into().unwrap()) as usize;
    bytes[at + 32..at + 40].copy_from_slice(&(1u64 << 30).to_le_bytes());
    let error = exported_offsets(&file_of(&bytes), &["malloc"]).unwrap_err();
    assert!(matches!(error, ElfError::TooLarge { .. }), "{error}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Bytes changed anywhere in what is read (the header, the section headers, the
    /// dynamic symbols' header) give an answer or an error, never a panic, and never
    /// an offset past the file's end.
    #[test]
    fn a_mangled_library_never_panics(
        changes in prop::collection::vec((0u8..3, any::<u16>(), any::<u8>()), 1..12)
    ) {
        let mut bytes = libc_bytes();
        let shoff = u64::from_le_bytes(bytes[0x28..0x30].try_into().unwrap()) as usize;
        let dynsym = dynsym_header_at(&bytes);
        for (region, at, value) in changes {
            let at = usize::from(at);
            let index = match region {
                0 => at % 64,
                1 => shoff + at % (bytes.len() - shoff),
                _ => dynsym + at % 64,
            };
            bytes[index] = value;
        }
        if let Ok(found) = exported_offsets(&file_of(&bytes), &["malloc", "free"]) {
            prop_assert!(found.values().all(|&o| o < bytes.len() as u64));
        }
    }
}
