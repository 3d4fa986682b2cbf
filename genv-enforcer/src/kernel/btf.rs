//! Struct member offsets from the kernel's BTF (`/sys/kernel/btf/vmlinux`).
//!
//! The kernel programs follow pointers (an fd to its file, inode and device number) whose
//! layout differs between kernels. Instead of hard-coding one kernel's offsets, the loader
//! reads them from the running kernel's BTF and hands them to the programs at load time.
//! aya-obj parses BTF too, but keeps members and strings private, hence this small reader.
//!
//! Format: `Documentation/bpf/btf.rst`: a header, a type section (ids from 1, each type a
//! 12-byte record plus kind-specific data) and a string section.

use std::collections::HashMap;
use std::path::Path;

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("cannot read {path}: {message}")]
    Read { path: String, message: String },
    #[error("not BTF: {0}")]
    Format(&'static str),
    #[error("the kernel's BTF has no struct {0}")]
    NoStruct(String),
    #[error("struct {strukt} has no member {member} in the kernel's BTF")]
    NoMember { strukt: String, member: String },
    #[error("{strukt}.{member} is a bitfield, not an addressable member")]
    Bitfield { strukt: String, member: String },
}

/// A struct or union member: name (empty for anonymous), type id, offset in bits.
#[derive(Clone, Debug)]
struct Member {
    name: String,
    type_id: u32,
    bit_offset: u32,
    bitfield: bool,
}

/// The parsed struct and union types, by id, with names for lookup.
#[derive(Debug, Default)]
pub struct Btf {
    composites: HashMap<u32, Vec<Member>>,
    /// Named structs (first definition wins, as in vmlinux each name is unique).
    structs: HashMap<String, u32>,
    /// Type ids that only qualify another type (typedef, const, volatile...), to see
    /// through them when a member's type is an anonymous struct behind one.
    aliases: HashMap<u32, u32>,
}

impl Btf {
    pub fn from_sys_fs() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX))
    }

    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        let bytes = std::fs::read(path).map_err(|e| BtfError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::parse(&bytes)
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, BtfError> {
        let raw = Raw::new(bytes)?;
        let mut btf = Btf::default();
        let mut at = raw.types.start;
        let mut id = 1u32;
        while at < raw.types.end {
            let (name_off, info, size_or_type) =
                match (raw.u32_at(at), raw.u32_at(at + 4), raw.u32_at(at + 8)) {
                    (Some(a), Some(b), Some(c)) => (a, b, c),
                    _ => return Err(BtfError::Format("truncated type")),
                };
            at += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            match kind {
                KIND_STRUCT | KIND_UNION => {
                    let kind_flag = info >> 31 == 1;
                    btf.composites.insert(id, raw.members(at, vlen, kind_flag)?);
                    if kind == KIND_STRUCT && name_off != 0 {
                        btf.structs.entry(raw.string(name_off)).or_insert(id);
                    }
                    at += vlen * 12;
                }
                // typedef, volatile, const, restrict, type_tag: see through them.
                8..=11 | 18 => {
                    btf.aliases.insert(id, size_or_type);
                }
                _ => at += extra_len(kind, vlen).ok_or(BtfError::Format("unknown type kind"))?,
            }
            id += 1;
        }
        Ok(btf)
    }

    /// Byte offset of `member` in `struct strukt`, looking into anonymous structs and
    /// unions as C does.
    pub fn member_offset(&self, strukt: &str, member: &str) -> Result<u32, BtfError> {
        let id = *self
            .structs
            .get(strukt)
            .ok_or_else(|| BtfError::NoStruct(strukt.to_owned()))?;
        let no_member = || BtfError::NoMember {
            strukt: strukt.to_owned(),
            member: member.to_owned(),
        };
        let (bits, bitfield) = self.find(id, member, 0).ok_or_else(no_member)?;
        if bitfield || bits % 8 != 0 {
            return Err(BtfError::Bitfield {
                strukt: strukt.to_owned(),
                member: member.to_owned(),
            });
        }
        Ok(bits / 8)
    }

    fn find(&self, id: u32, member: &str, depth: u32) -> Option<(u32, bool)> {
        if depth > 8 {
            return None; // no sane kernel nests anonymous members this deep
        }
        for m in self.composites.get(&id)? {
            if m.name == member {
                return Some((m.bit_offset, m.bitfield));
            }
            if m.name.is_empty() {
                if let Some((inner, bitfield)) =
                    self.find(self.resolve(m.type_id), member, depth + 1)
                {
                    return Some((m.bit_offset + inner, bitfield));
                }
            }
        }
        None
    }

    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..16 {
            match self.aliases.get(&id) {
                Some(next) => id = *next,
                None => break,
            }
        }
        id
    }
}

/// The raw BTF blob: its type and string sections, bounds-checked.
struct Raw<'a> {
    bytes: &'a [u8],
    types: std::ops::Range<usize>,
    strings: std::ops::Range<usize>,
}

impl<'a> Raw<'a> {
    fn new(bytes: &'a [u8]) -> Result<Self, BtfError> {
        let at = |at: usize| bytes.get(at..at + 4);
        if bytes.get(0..2).map(|b| u16::from_le_bytes([b[0], b[1]])) != Some(MAGIC) {
            return Err(BtfError::Format(
                "bad magic (only little-endian BTF is read)",
            ));
        }
        let header = |offset| {
            at(offset)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
                .ok_or(BtfError::Format("truncated header"))
        };
        let (hdr_len, type_off, type_len, str_off, str_len) = (
            header(4)?,
            header(8)?,
            header(12)?,
            header(16)?,
            header(20)?,
        );
        let types = hdr_len + type_off..hdr_len + type_off + type_len;
        let strings = hdr_len + str_off..hdr_len + str_off + str_len;
        if bytes.len() < types.end || bytes.len() < strings.end {
            return Err(BtfError::Format("sections run past the end"));
        }
        Ok(Self {
            bytes,
            types,
            strings,
        })
    }

    fn u32_at(&self, at: usize) -> Option<u32> {
        self.bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn string(&self, offset: u32) -> String {
        let start = self.strings.start + offset as usize;
        let tail = &self.bytes[start.min(self.strings.end)..self.strings.end];
        let end = tail.iter().position(|b| *b == 0).unwrap_or(tail.len());
        String::from_utf8_lossy(&tail[..end]).into_owned()
    }

    /// The `vlen` members of a struct or union, starting at `at`.
    fn members(&self, at: usize, vlen: usize, kind_flag: bool) -> Result<Vec<Member>, BtfError> {
        (0..vlen)
            .map(|i| {
                let m = at + i * 12;
                let (Some(name), Some(type_id), Some(offset)) =
                    (self.u32_at(m), self.u32_at(m + 4), self.u32_at(m + 8))
                else {
                    return Err(BtfError::Format("truncated member"));
                };
                // With kind_flag, the low 24 bits are the offset and the high 8 the
                // bitfield size.
                let (bit_offset, bitfield) = if kind_flag {
                    (offset & 0x00ff_ffff, offset >> 24 != 0)
                } else {
                    (offset, false)
                };
                Ok(Member {
                    name: self.string(name),
                    type_id,
                    bit_offset,
                    bitfield,
                })
            })
            .collect()
    }
}

/// Bytes that follow a type record of `kind` (other than struct, union and aliases).
fn extra_len(kind: u32, vlen: usize) -> Option<usize> {
    Some(match kind {
        1 => 4,               // int
        2 | 7 | 12 | 16 => 0, // ptr, fwd, func, float
        3 => 12,              // array
        6 => vlen * 8,        // enum
        13 => vlen * 8,       // func_proto
        14 => 4,              // var
        15 => vlen * 12,      // datasec
        17 => 4,              // decl_tag
        19 => vlen * 12,      // enum64
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built BTF: `struct outer { int a; union { int b; struct { int c; int d; }; };
    /// unsigned e:3; }` behind a typedef for the inner struct.
    fn sample() -> Vec<u8> {
        let strings = b"\0outer\0a\0b\0c\0d\0e\0int\0";
        let name = |s: &str| {
            let needle = format!("\0{s}\0");
            strings
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
                .unwrap() as u32
                + 1
        };
        let mut types = Vec::new();
        let mut record = |words: &[u32]| types.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        record(&[name("int"), 1 << 24, 4, 0x0100_0020]); // 1: int, 4 bytes, 32 bits
        record(&[0, (4 << 24) | 2, 8, name("c"), 1, 0, name("d"), 1, 32]); // 2: anon struct {c, d}
        record(&[0, 8 << 24, 2]); // 3: typedef (anonymous) of 2
        record(&[0, (5 << 24) | 2, 8, name("b"), 1, 0, 0, 3, 0]); // 4: anon union {b, <3>}
        let e = name("e");
        record(&[
            name("outer"),
            (1 << 31) | (4 << 24) | 3,
            16,
            name("a"),
            1,
            0,
            0,
            4,
            32,
            e,
            1,
            (3 << 24) | 96,
        ]); // 5: outer
        let mut blob = Vec::new();
        let header: [u32; 5] = [
            24,
            0,
            types.len() as u32,
            types.len() as u32,
            strings.len() as u32,
        ];
        blob.extend(MAGIC.to_le_bytes());
        blob.extend([1u8, 0]);
        for word in header {
            blob.extend(word.to_le_bytes());
        }
        blob.extend(&types);
        blob.extend(strings);
        blob
    }

    #[test]
    fn finds_members_through_anonymous_unions_structs_and_typedefs() {
        let btf = Btf::parse(&sample()).unwrap();
        assert_eq!(btf.member_offset("outer", "a"), Ok(0));
        assert_eq!(btf.member_offset("outer", "b"), Ok(4));
        assert_eq!(btf.member_offset("outer", "c"), Ok(4));
        assert_eq!(btf.member_offset("outer", "d"), Ok(8));
        assert!(matches!(
            btf.member_offset("outer", "e"),
            Err(BtfError::Bitfield { .. })
        ));
        assert!(matches!(
            btf.member_offset("outer", "zz"),
            Err(BtfError::NoMember { .. })
        ));
        assert!(matches!(
            btf.member_offset("nope", "a"),
            Err(BtfError::NoStruct(_))
        ));
    }

    #[test]
    fn refuses_what_is_not_btf() {
        assert!(matches!(
            Btf::parse(b"\x7fELF...."),
            Err(BtfError::Format(_))
        ));
        let mut truncated = sample();
        truncated.truncate(40);
        assert!(matches!(Btf::parse(&truncated), Err(BtfError::Format(_))));
    }

    /// The chain the open hook follows, on the running kernel. Its BTF is a documented
    /// requirement of the BPF tiers; a kernel without it really lacks the feature.
    #[test]
    fn the_running_kernel_has_the_open_hook_chain() {
        if !Path::new(VMLINUX).exists() {
            assert!(
                std::env::var_os("GENV_REQUIRE_BPF").is_none(),
                "GENV_REQUIRE_BPF is set but {VMLINUX} is missing"
            );
            eprintln!("skipping: this kernel exposes no BTF at {VMLINUX}");
            return;
        }
        let btf = Btf::from_sys_fs().unwrap();
        for (strukt, member) in [
            ("task_struct", "files"),
            ("task_struct", "tgid"),
            ("files_struct", "fdt"),
            ("fdtable", "fd"),
            ("fdtable", "max_fds"),
            ("file", "f_inode"),
            ("inode", "i_rdev"),
        ] {
            let offset = btf
                .member_offset(strukt, member)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(offset < 16384, "{strukt}.{member} at {offset}");
        }
        // fdtable starts with max_fds, then the fd array pointer: a layout stable since 2.6.
        assert_eq!(btf.member_offset("fdtable", "max_fds"), Ok(0));
        assert_eq!(btf.member_offset("fdtable", "fd"), Ok(8));
    }
}
