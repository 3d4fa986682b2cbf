//! How the exec hook finds `GENV_ENVIRONMENT_ID=` in an environment block, eight bytes
//! at a time, shared with the host so that the word arithmetic is tested there.
//!
//! An assignment shows in the block as [`PATTERN`]: the NUL ending the entry before it
//! (the block's start counts as one), then the name and `=`. Those 21 bytes contain,
//! whatever their alignment, one aligned 8-byte word that is `PATTERN[s..s + 8]` for an
//! `s` in 0..8 (its anchor, `s` bytes into the pattern), and the aligned word after it
//! starts with six more pattern bytes (`PATTERN[s + 8..s + 14]`, as `s + 14 <= 21`). So
//! of two consecutive words one is odd, and the hook reads only the odd words of the
//! block: half of them. It looks each one's low six bytes up in [`FILTER`] (one mask,
//! one multiply, one byte load: almost every word of a real block stops there) for the
//! sixteen [`KEYS`] (`PATTERN[t..t + 6]`, `t` in 0..16: an anchor, or the start of the
//! word after one); only the rare word that is one is compared with the whole pattern
//! around its anchor ([`is_anchored_assignment`]).
//!
//! The block is copied into a window a chunk at a time: word 0 holds the 8 bytes before
//! the chunk (zero for the first, as if a NUL preceded the block), then the chunk, then
//! enough of what follows for an entry starting in the chunk's last byte to be read
//! whole. An assignment belongs to the chunk its name starts in.

/// The NUL before an assignment, the name, and `=`.
pub const PATTERN: &[u8; 21] = b"\0GENV_ENVIRONMENT_ID=";

/// Bytes of the block each window holds from its chunk.
pub const CHUNK_BYTES: usize = 8 * 1024;
pub const CHUNK_WORDS: usize = CHUNK_BYTES / 8;
/// Window words one `bpf_loop` step covers (it reads the odd ones).
pub const GROUP_WORDS: usize = 128;
/// Anchor words of a chunk's assignments lie in window words `1..=CHUNK_WORDS + 1`.
pub const SCAN_WORDS: usize = CHUNK_WORDS + 1;
/// Groups covering words `1..=CHUNK_WORDS`; the one odd word past them that may hold a
/// key, [`TAIL_WORD`], is read on its own rather than in a group of its own.
pub const MAX_GROUPS: usize = CHUNK_WORDS / GROUP_WORDS;
const _: () = assert!(CHUNK_WORDS.is_multiple_of(GROUP_WORDS) && GROUP_WORDS.is_multiple_of(2));
/// The last anchor word: odd, so it shows its key itself.
pub const TAIL_WORD: usize = SCAN_WORDS;
const _: () = assert!(!TAIL_WORD.is_multiple_of(2));
/// The window: the word before the chunk, the chunk, and past it the tail word, the two
/// words after it, and room for an assignment starting in the chunk's last byte with
/// the longest id and its NUL.
pub const WINDOW_WORDS: usize = 1 + CHUNK_WORDS + 2 + (20 + crate::MAX_ENV_ID + 1).div_ceil(8);
pub const WINDOW_BYTES: usize = WINDOW_WORDS * 8;
const _: () = assert!(TAIL_WORD + 2 < WINDOW_WORDS);
/// A block longer than the kernel lets argv and the environment have together (6 MiB)
/// is not read.
pub const MAX_CHUNKS: usize = (6 << 20) / CHUNK_BYTES;

/// The last window word an anchor may be in, for a window holding `valid` bytes (the
/// word before the chunk included): anchors of assignments that fit in it.
#[inline(always)]
pub const fn scan_words(valid: usize) -> usize {
    let last = valid.saturating_sub(1) / 8;
    if last < SCAN_WORDS { last } else { SCAN_WORDS }
}

/// Groups to scan for a window holding `valid` bytes: up to the word after the last
/// anchor's, which is odd where the anchor's is not (the tail word aside).
#[inline(always)]
pub const fn scan_groups(valid: usize) -> usize {
    let groups = (scan_words(valid) + 1).div_ceil(GROUP_WORDS);
    if groups < MAX_GROUPS {
        groups
    } else {
        MAX_GROUPS
    }
}

/// Whether [`TAIL_WORD`] is to be read too: an anchor may be at or just before it.
#[inline(always)]
pub const fn scans_tail(valid: usize) -> bool {
    scan_words(valid) >= CHUNK_WORDS
}

/// The little-endian word of `PATTERN` bytes at pattern positions `from..from + 8`
/// (positions outside the pattern masked out), and its mask.
const fn pattern_word(from: isize) -> (u64, u64) {
    let (mut value, mut mask) = (0u64, 0u64);
    let mut b = 0;
    while b < 8 {
        let at = from + b as isize;
        if at >= 0 && at < PATTERN.len() as isize {
            value |= (PATTERN[at as usize] as u64) << (8 * b);
            mask |= 0xff << (8 * b);
        }
        b += 1;
    }
    (value, mask)
}

const fn table(offset: isize) -> [(u64, u64); 8] {
    let mut t = [(0, 0); 8];
    let mut s = 0;
    while s < 8 {
        t[s] = pattern_word(s as isize + offset);
        s += 1;
    }
    t
}

/// `PATTERN[s..s + 8]`, the anchor `s` bytes into the pattern.
pub const ANCHORS: [u64; 8] = {
    let t = table(0);
    let mut a = [0; 8];
    let mut s = 0;
    while s < 8 {
        a[s] = t[s].0;
        s += 1;
    }
    a
};
/// What the words before and after an anchor `s` must hold under their masks.
pub const BEFORE: [(u64, u64); 8] = table(-8);
pub const AFTER: [(u64, u64); 8] = table(8);
pub const AFTER2: [(u64, u64); 8] = table(16);

/// The bytes of a word the filter looks at: its first six (little-endian: the low ones).
pub const KEY_MASK: u64 = 0x0000_ffff_ffff_ffff;
/// Keys a word read may be: `PATTERN[t..t + 6]` for `t` in 0..16; `t < 8` is anchor `t`
/// itself, `t >= 8` the word after anchor `t - 8`.
pub const KEYS: [u64; 16] = {
    let mut k = [0; 16];
    let mut t = 0;
    while t < 16 {
        k[t] = pattern_word(t as isize).0 & KEY_MASK;
        t += 1;
    }
    k
};

/// An odd multiplier whose top eleven bits send the sixteen keys to sixteen different
/// slots. On environment blocks, paths and random text, under 1 % of words land in one
/// of them (a false hit costs a call and four loads, a mispredicted branch most).
const FILTER_MUL: u64 = 0xa076_1d64_78bd_642f;
const FILTER_BITS: u32 = 11;

#[inline(always)]
pub const fn filter_slot(word: u64) -> usize {
    ((word & KEY_MASK).wrapping_mul(FILTER_MUL) >> (64 - FILTER_BITS)) as usize
}

/// Slot → `t + 1` for the key `t` that lands there, 0 for none.
pub static FILTER: [u8; 1 << FILTER_BITS] = {
    let mut f = [0u8; 1 << FILTER_BITS];
    let mut t = 0;
    while t < 16 {
        let slot = filter_slot(KEYS[t]);
        assert!(
            f[slot] == 0,
            "two keys share a filter slot: change FILTER_MUL"
        );
        f[slot] = t as u8 + 1;
        t += 1;
    }
    f
};

/// What the filter says of `word`: 0 for no key (almost every word), else `t + 1` for
/// the key `t` it may be ([`key_of`] tells).
#[inline(always)]
pub fn filter(word: u64) -> u8 {
    FILTER[filter_slot(word)]
}

/// The key `word`, which the filter said may be one (`filtered`), is: `t`.
#[inline(always)]
pub fn key_of(word: u64, filtered: u8) -> Option<usize> {
    let t = filtered.wrapping_sub(1) as usize & 15;
    if filtered != 0 && word & KEY_MASK == KEYS[t] {
        Some(t)
    } else {
        None
    }
}

/// The key `word` is, if it is one: `t`.
#[inline(always)]
pub fn key(word: u64) -> Option<usize> {
    key_of(word, filter(word))
}

/// Where the anchor of a key `t` read in window word `k` is: `(word, s)`, its word as
/// `k` less 0 or 1 (wrapping below 0), and its shift into the pattern.
#[inline(always)]
pub const fn anchor_of_key(k: usize, t: usize) -> (usize, usize) {
    (k.wrapping_sub(t >> 3 & 1), t & 7)
}

/// Whether the four words from the one before an anchor `s` (the anchor's own word
/// second) complete the pattern.
#[inline(always)]
pub fn is_anchored_assignment(before: u64, anchor: u64, after: u64, after2: u64, s: usize) -> bool {
    let s = s & 7;
    let ((b, bm), (a, am), (a2, a2m)) = (BEFORE[s], AFTER[s], AFTER2[s]);
    anchor == ANCHORS[s] && before & bm == b && after & am == a && after2 & a2m == a2
}

/// Where the pattern an anchor `s` in window word `k` belongs to starts (its NUL), if
/// it belongs to this window's chunk and lies within the `valid` bytes read.
#[inline(always)]
pub const fn pattern_start(k: usize, s: usize, valid: usize) -> Option<usize> {
    let q = 8 * k - s;
    // The name starts at q + 1, in the chunk's bytes 8..8 + CHUNK_BYTES.
    if q < 7 || q >= 7 + CHUNK_BYTES || q + PATTERN.len() > valid {
        None
    } else {
        Some(q)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::{MAX_ENV_ID, env_id_hash, identity};
    use proptest::prelude::*;
    use std::vec::Vec;

    /// The identity genv would read: the last entry named `GENV_ENVIRONMENT_ID`.
    fn reference(block: &[u8]) -> u64 {
        let mut found = identity::NO_ENV;
        for entry in block.split(|&b| b == 0) {
            if let Some(value) = entry.strip_prefix(&PATTERN[1..]) {
                found = if value.len() > MAX_ENV_ID {
                    identity::NO_ENV
                } else {
                    env_id_hash(value)
                };
            }
        }
        found
    }

    /// The exec hook's walk, window by window from the block's end until one holds an
    /// assignment, with stale bytes past each window's end (as the per-CPU buffer keeps
    /// them).
    fn scanned(block: &[u8]) -> u64 {
        let mut window = [0x47u8; WINDOW_BYTES];
        for chunk in (0..block.len().div_ceil(CHUNK_BYTES)).rev() {
            let offset = chunk * CHUNK_BYTES;
            let (from, to) = if chunk == 0 { (0, 8) } else { (offset - 8, 0) };
            let n = (block.len() - from).min(WINDOW_BYTES - to);
            if chunk == 0 {
                window[..8].fill(0);
            }
            window[to..to + n].copy_from_slice(&block[from..from + n]);
            let valid = to + n;
            let word = |k: usize| u64::from_le_bytes(window[8 * k..8 * k + 8].try_into().unwrap());
            let mut last = None;
            let tail = scans_tail(valid).then_some(TAIL_WORD);
            for k in (1..scan_groups(valid) * GROUP_WORDS).step_by(2).chain(tail) {
                let Some(t) = key(word(k)) else { continue };
                let (a, s) = anchor_of_key(k, t);
                // As the hook: the word before the anchor, bounded (word 0's key has none).
                let before = a.wrapping_sub(1);
                if before >= WINDOW_WORDS - 3 {
                    continue;
                }
                let around = [word(before), word(a), word(a + 1), word(a + 2)];
                if !is_anchored_assignment(around[0], around[1], around[2], around[3], s) {
                    continue;
                }
                if let Some(q) = pattern_start(a, s, valid) {
                    last = Some(q + PATTERN.len());
                }
            }
            if let Some(value) = last {
                let bytes = &window[value..valid];
                let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                return if end > MAX_ENV_ID {
                    identity::NO_ENV
                } else {
                    env_id_hash(&bytes[..end])
                };
            }
        }
        identity::NO_ENV
    }

    fn entry() -> impl Strategy<Value = Vec<u8>> {
        let name = prop_oneof![
            Just(b"GENV_ENVIRONMENT_ID".to_vec()),
            Just(b"XGENV_ENVIRONMENT_ID".to_vec()),
            Just(b"GENV_ENVIRONMENT_IDX".to_vec()),
            Just(b"GENV_ENVIRONMENT_I".to_vec()),
            "[A-Z_G]{0,30}".prop_map(|s| s.into_bytes()),
        ];
        let value = prop_oneof![
            "[a-z0-9-]{0,20}".prop_map(|s| s.into_bytes()),
            Just(b"GENV_ENVIRONMENT_ID=x".to_vec()),
            (250usize..262).prop_map(|n| std::vec![b'v'; n]),
            (0usize..9000).prop_map(|n| std::vec![b'x'; n]),
        ];
        (name, value).prop_map(|(mut n, v)| {
            n.push(b'=');
            n.extend(v);
            n.push(0);
            n
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn the_word_scan_reads_blocks_as_genv_does(
            pad in 0usize..16,
            entries in proptest::collection::vec(entry(), 0..12),
        ) {
            // A leading entry shifts everything through every alignment (none: the
            // block starts with the first generated entry).
            let mut block = std::vec![b'P'; pad];
            if pad > 0 {
                block.push(0);
            }
            for e in &entries {
                block.extend(e);
            }
            prop_assert_eq!(scanned(&block), reference(&block));
        }
    }

    #[test]
    fn assignments_are_found_at_every_alignment_and_chunk_edge() {
        for lead in (0..24).chain(CHUNK_BYTES - 30..CHUNK_BYTES + 10) {
            let mut block = std::vec![b'a'; lead];
            block.extend_from_slice(b"=\0GENV_ENVIRONMENT_ID=env-1\0B=2\0");
            if lead == 0 {
                block.drain(..2);
            }
            assert_eq!(scanned(&block), env_id_hash(b"env-1"), "lead {lead}");
            assert_eq!(scanned(&block), reference(&block), "lead {lead}");
        }
    }

    #[test]
    fn the_filter_knows_every_key() {
        for (t, &k) in KEYS.iter().enumerate() {
            assert_eq!(
                key(k | 0xabcd << 48),
                Some(t),
                "whatever the last two bytes"
            );
        }
        for (s, &a) in ANCHORS.iter().enumerate() {
            assert_eq!(key(a), Some(s));
        }
        assert_eq!(key(u64::from_le_bytes(*b"PATH=/us")), None);
    }

    /// The claim the odd-word scan rests on: at every alignment, the anchor and the word
    /// after it both show their key, so the odd one of the two is found.
    #[test]
    fn an_anchor_and_the_word_after_it_both_show_a_key() {
        for lead in 0..8usize {
            let mut block = std::vec![b'a'; lead + 8];
            block.extend_from_slice(PATTERN);
            block.extend_from_slice(b"xyzzy\0");
            let s = (8 - (lead + 8) % 8) % 8;
            let k = (lead + 8 + s) / 8;
            let word = |k: usize| u64::from_le_bytes(block[8 * k..8 * k + 8].try_into().unwrap());
            assert_eq!(key(word(k)), Some(s), "lead {lead}");
            assert_eq!(key(word(k + 1)), Some(s + 8), "lead {lead}");
            assert_eq!(anchor_of_key(k + 1, s + 8), (k, s));
        }
    }
}
