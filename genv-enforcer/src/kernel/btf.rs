//! Struct member offsets and function ids from the kernel's BTF (`/sys/kernel/btf/vmlinux`).
//!
//! The kernel programs follow pointers (an fd to its file, inode and device number) whose
//! layout differs between kernels. Instead of hard-coding one kernel's offsets, the loader
//! reads them from the running kernel's BTF and hands them to the programs at load time;
//! the trampoline tiers' programs are loaded against a function's id in it.
//!
//! This is the daemon's only reading of that BTF, and it is kept small: the blob (about
//! 5 MiB) and one offset per type (4 bytes each), looked up in place without a string
//! or a map per type. aya-obj's parser builds every type and member as objects, about
//! 20 MiB for vmlinux, which was most of the daemon's peak memory; the loader keeps aya
//! from parsing it (see `ebpf_loader`).
//!
//! Format: `Documentation/bpf/btf.rst`: a header, a type section (ids from 1, each type a
//! 12-byte record plus kind-specific data) and a string section.

use std::ops::Range;
use std::path::Path;

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_FUNC: u32 = 12;
/// Bigger than any kernel's BTF (vmlinux is 5 to 10 MiB): a bound on what is read.
const MAX_BYTES: u64 = 256 << 20;

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
    #[error("the kernel's BTF has no function {0}")]
    NoFunc(String),
}

/// A BTF blob with the start of each type's record, by id.
#[derive(Debug)]
pub struct Btf {
    bytes: Vec<u8>,
    strings: Range<usize>,
    /// Where type `id`'s record starts in `bytes`, at `id - 1`.
    starts: Vec<u32>,
    /// The ids of the named structs, in id order (where vmlinux names one twice, the
    /// first wins).
    structs: Vec<u32>,
}

impl Btf {
    pub fn from_sys_fs() -> Result<Self, BtfError> {
        Self::from_file(Path::new(VMLINUX))
    }

    pub fn from_file(path: &Path) -> Result<Self, BtfError> {
        use std::io::Read;
        let error = |e: std::io::Error| BtfError::Read {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .map_err(error)?
            .take(MAX_BYTES)
            .read_to_end(&mut bytes)
            .map_err(error)?;
        Self::parse(bytes)
    }

    /// Indexes the type section of `bytes`, checking every record's bounds.
    pub fn parse(bytes: Vec<u8>) -> Result<Self, BtfError> {
        let (types, strings) = sections(&bytes)?;
        let (mut starts, mut structs) = (Vec::new(), Vec::new());
        let mut at = types.start;
        while at < types.end {
            let record = Record::at(&bytes, at).ok_or(BtfError::Format("truncated type"))?;
            let id = starts.len() as u32 + 1;
            starts.push(at as u32);
            if record.kind() == KIND_STRUCT && record.name_off != 0 {
                structs.push(id);
            }
            at += 12 + record.extra_len()?;
        }
        if at > types.end || bytes.len() > u32::MAX as usize {
            return Err(BtfError::Format("types run past their section"));
        }
        Ok(Self {
            bytes,
            strings,
            starts,
            structs,
        })
    }

    /// Byte offset of `member` in `struct strukt`, looking into anonymous structs and
    /// unions as C does.
    pub fn member_offset(&self, strukt: &str, member: &str) -> Result<u32, BtfError> {
        let id = self
            .structs
            .iter()
            .copied()
            .find(|&id| {
                self.record(id)
                    .is_some_and(|r| self.name_is(r.name_off, strukt))
            })
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

    /// The id of function `name` (a `BTF_KIND_FUNC`): what a tracing or LSM program is
    /// loaded against (`attach_btf_id`).
    pub fn func_id(&self, name: &str) -> Result<u32, BtfError> {
        (1..=self.starts.len() as u32)
            .find(|&id| {
                self.record(id)
                    .is_some_and(|r| r.kind() == KIND_FUNC && self.name_is(r.name_off, name))
            })
            .ok_or_else(|| BtfError::NoFunc(name.to_owned()))
    }

    fn record(&self, id: u32) -> Option<Record> {
        let at = *self.starts.get(id.checked_sub(1)? as usize)?;
        Record::at(&self.bytes, at as usize)
    }

    /// Whether the string at `offset` is `name`.
    fn name_is(&self, offset: u32, name: &str) -> bool {
        let start = self.strings.start.saturating_add(offset as usize);
        let end = start.saturating_add(name.len());
        end < self.strings.end && &self.bytes[start..end] == name.as_bytes() && self.bytes[end] == 0
    }

    /// Bit offset of `member` in composite `id` (and whether it is a bitfield).
    fn find(&self, id: u32, member: &str, depth: u32) -> Option<(u32, bool)> {
        if depth > 8 {
            return None; // no sane kernel nests anonymous members this deep
        }
        let record = self.record(id)?;
        if !matches!(record.kind(), KIND_STRUCT | KIND_UNION) {
            return None;
        }
        let first = self.starts[id as usize - 1] as usize + 12;
        for i in 0..record.vlen() {
            let m = Record::at(&self.bytes, first + i * 12)?;
            // (name, type, offset); with kind_flag, the offset's low 24 bits are the
            // offset and its high 8 the bitfield's size.
            let (bit_offset, bitfield) = match record.kind_flag() {
                true => (m.size_or_type & 0x00ff_ffff, m.size_or_type >> 24 != 0),
                false => (m.size_or_type, false),
            };
            if m.name_off != 0 && self.name_is(m.name_off, member) {
                return Some((bit_offset, bitfield));
            }
            if m.name_off == 0 {
                if let Some((inner, bitfield)) = self.find(self.resolve(m.info), member, depth + 1)
                {
                    return Some((bit_offset + inner, bitfield));
                }
            }
        }
        None
    }

    /// Sees through typedef, volatile, const, restrict and type_tag to the type behind.
    fn resolve(&self, mut id: u32) -> u32 {
        for _ in 0..16 {
            match self.record(id) {
                Some(r) if matches!(r.kind(), 8..=11 | 18) => id = r.size_or_type,
                _ => break,
            }
        }
        id
    }
}

/// The type and string sections of a BTF blob, bounds-checked.
fn sections(bytes: &[u8]) -> Result<(Range<usize>, Range<usize>), BtfError> {
    if bytes.get(0..2).map(|b| u16::from_le_bytes([b[0], b[1]])) != Some(MAGIC) {
        return Err(BtfError::Format(
            "bad magic (only little-endian BTF is read)",
        ));
    }
    let header = |offset| {
        u32_at(bytes, offset)
            .map(|v| v as usize)
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
    Ok((types, strings))
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    bytes
        .get(at..at.checked_add(4)?)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Three words of a type record (name, info, size or type), or of a member (name,
/// type, offset).
#[derive(Clone, Copy)]
struct Record {
    name_off: u32,
    info: u32,
    size_or_type: u32,
}

impl Record {
    fn at(bytes: &[u8], at: usize) -> Option<Self> {
        Some(Self {
            name_off: u32_at(bytes, at)?,
            info: u32_at(bytes, at + 4)?,
            size_or_type: u32_at(bytes, at + 8)?,
        })
    }

    fn kind(self) -> u32 {
        (self.info >> 24) & 0x1f
    }

    fn vlen(self) -> usize {
        (self.info & 0xffff) as usize
    }

    fn kind_flag(self) -> bool {
        self.info >> 31 == 1
    }

    /// Bytes that follow the record.
    fn extra_len(self) -> Result<usize, BtfError> {
        let vlen = self.vlen();
        Ok(match self.kind() {
            1 => 4,                        // int
            2 | 7 | 8..=12 | 16 | 18 => 0, // ptr, fwd, aliases, func, float
            3 => 12,                       // array
            4 | 5 => vlen * 12,            // struct, union
            6 => vlen * 8,                 // enum
            13 => vlen * 8,                // func_proto
            14 => 4,                       // var
            15 => vlen * 12,               // datasec
            17 => 4,                       // decl_tag
            19 => vlen * 12,               // enum64
            _ => return Err(BtfError::Format("unknown type kind")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built BTF: `struct outer { int a; union { int b; struct { int c; int d; }; };
    /// unsigned e:3; }` behind a typedef for the inner struct.
    fn sample() -> Vec<u8> {
        let strings = b"\0outer\0a\0b\0c\0d\0e\0int\0open\0";
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
        record(&[name("open"), 12 << 24, 0]); // 6: func open
        record(&[name("outer"), 12 << 24, 0]); // 7: func outer (named as the struct)
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
        let btf = Btf::parse(sample()).unwrap();
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
    fn finds_functions_by_name_and_kind() {
        let btf = Btf::parse(sample()).unwrap();
        assert_eq!(btf.func_id("open"), Ok(6));
        assert_eq!(btf.func_id("outer"), Ok(7), "the func, not the struct");
        assert_eq!(btf.func_id("int"), Err(BtfError::NoFunc("int".into())));
        assert_eq!(btf.func_id("ope"), Err(BtfError::NoFunc("ope".into())));
    }

    /// The open hook's direct-load offsets are given only where the kernel has the
    /// helper they start from (`bpf_get_current_task_btf`, 5.11): before it, a program
    /// calling it does not load, and the tracepoint tier with it.
    #[test]
    fn an_offset_that_needs_a_function_is_absent_without_it() {
        use super::super::offsets::with_func;
        let btf = Btf::parse(sample()).unwrap();
        assert_eq!(with_func(&btf, "open", "outer", "d"), 8);
        assert_eq!(
            with_func(&btf, "bpf_get_current_task_btf", "outer", "d"),
            genv_ebpf_common::Offsets::ABSENT
        );
        assert_eq!(
            with_func(&btf, "open", "outer", "nothing"),
            genv_ebpf_common::Offsets::ABSENT
        );
    }

    #[test]
    fn refuses_what_is_not_btf() {
        assert!(matches!(
            Btf::parse(b"\x7fELF....".to_vec()),
            Err(BtfError::Format(_))
        ));
        let mut truncated = sample();
        truncated.truncate(40);
        assert!(matches!(Btf::parse(truncated), Err(BtfError::Format(_))));
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
        // From 5.11 the open hook's direct loads are on: the helper they start from is
        // found by its function, as `offsets` looks for it.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut version = release.split(|c: char| !c.is_ascii_digit());
        let (major, minor) = (version.next(), version.next());
        let at_least_5_11 = match (major.and_then(|v| v.parse::<u32>().ok()), minor) {
            (Some(major), Some(minor)) => (major, minor.parse().unwrap_or(0)) >= (5, 11),
            _ => false,
        };
        if at_least_5_11 {
            assert!(btf.func_id("bpf_get_current_task_btf").is_ok(), "{release}");
        }
        assert_eq!(btf.member_offset("fdtable", "fd"), Ok(8));
        // The trampoline tiers' targets, at the ids aya's own parser finds.
        let aya = aya::Btf::from_sys_fs().unwrap();
        for name in ["security_file_open", "bpf_lsm_file_open"] {
            let kind = aya_obj::btf::BtfKind::Func;
            match (btf.func_id(name), aya.id_by_type_name_kind(name, kind)) {
                (Ok(ours), Ok(theirs)) => assert_eq!(ours, theirs, "{name}"),
                (Err(BtfError::NoFunc(_)), Err(_)) => {} // no BPF LSM in this kernel
                (ours, theirs) => panic!("{name}: ours {ours:?}, aya's {theirs:?}"),
            }
        }
    }
}
