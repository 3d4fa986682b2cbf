//! Reading `GENV_ENVIRONMENT_ID` out of the current task's environment block at exec,
//! as genv reads `/proc/<pid>/environ`: the last assignment wins, look-alike names do
//! not count. The block is read whole, 4 KiB at a time, in `bpf_loop` steps (5.17 and
//! later); without `bpf_loop` only blocks up to 4 KiB are read and larger ones are left
//! to the daemon.

use aya_ebpf::cty::c_void;
use aya_ebpf::helpers::generated as raw;
use aya_ebpf::helpers::{bpf_get_current_task, bpf_probe_read_user};
use genv_ebpf_common::{
    ENV_VAR_PREFIX, FNV_OFFSET, MAX_ENV_ID, Offsets, avoid_sentinels, fnv_step, identity,
};

use crate::kernel::read;
use crate::maps::{
    ENV_CANDIDATES, ENV_SCAN_BYTES, ENV_SCAN_PAD_WORDS, ENV_SCAN_WORDS, EnvScratch, SCRATCH,
};

/// How much of the block the exec hook reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// All of it, one 4 KiB chunk per `bpf_loop` step.
    Whole,
    /// Blocks up to 4 KiB; larger ones are unresolved (kernels without `bpf_loop`).
    First4K,
}

/// Bytes the scratch holds: a chunk plus the longest entry that can start in it (the
/// prefix and `MAX_ENV_ID` bytes of value), so that an entry straddling two chunks is
/// read whole by the chunk it starts in.
const WINDOW_BYTES: u64 = ((ENV_SCAN_WORDS + ENV_SCAN_PAD_WORDS) * 8 - 8) as u64;
const TOTAL_WORDS: usize = ENV_SCAN_WORDS + ENV_SCAN_PAD_WORDS;
/// More chunks than the kernel lets argv and the environment have together (6 MiB).
const MAX_CHUNKS: u64 = 2048;

/// The identity in the current task's environment block: the last
/// `GENV_ENVIRONMENT_ID=` entry wins, as in genv (a Python dict built from it).
///
/// Each chunk is copied in one read and scanned eight bytes at a time: entry starts are
/// the bytes after a NUL, and only starts holding a `G` are compared with the prefix.
/// (One `bpf_probe_read_user_str` per entry instead cost ~100 ns an entry.)
#[inline(always)]
pub(crate) fn environment_identity(o: &Offsets, scan: Scan) -> u64 {
    // SAFETY: a helper without arguments; the task is read only through probe reads.
    let task = unsafe { bpf_get_current_task() } as *const u8;
    let Some(mm) = read::<*const u8>(task, o.task_mm) else {
        return identity::NO_ENV;
    };
    let (Some(start), Some(end)) = (
        read::<u64>(mm, o.mm_env_start),
        read::<u64>(mm, o.mm_env_end),
    ) else {
        return identity::NO_ENV;
    };
    let len = end.saturating_sub(start);
    if len == 0 {
        return identity::NO_ENV;
    }
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return identity::NO_ENV;
    };
    // SAFETY: this CPU's scratch slot, used by this program alone (programs on one CPU
    // do not preempt each other).
    let s = unsafe { &mut *scratch };
    // The walk's state lives in the scratch, not on the stack: the loop's steps then
    // read plain map values, and the verifier has no pointer into another frame to
    // follow.
    s.start = start;
    s.len = len;
    s.found = identity::NO_ENV;
    match scan {
        Scan::First4K if len > ENV_SCAN_BYTES as u64 => return identity::UNRESOLVED,
        Scan::First4K => {
            chunk(0);
        }
        Scan::Whole => {
            let chunks = len.div_ceil(ENV_SCAN_BYTES as u64);
            if chunks > MAX_CHUNKS {
                return identity::UNRESOLVED;
            }
            // SAFETY: `step` is a BPF subprogram; it takes no context.
            unsafe { raw::bpf_loop(chunks as u32, step as *mut c_void, core::ptr::null_mut(), 0) };
        }
    }
    let Some(scratch) = SCRATCH.get_ptr(0) else {
        return identity::NO_ENV;
    };
    // SAFETY: as above.
    unsafe { (*scratch).found }
}

/// One `bpf_loop` step: chunk `index` of the block. 0 goes on, 1 stops.
#[inline(never)]
extern "C" fn step(index: u64, _ctx: *mut c_void) -> i64 {
    if chunk(index) { 0 } else { 1 }
}

/// Scans chunk `index` of the block the scratch names; `false` to stop the walk. A
/// later chunk's assignment wins over an earlier one; a chunk whose look-alikes
/// overflowed the candidate ring makes the answer unknown unless a later chunk assigns
/// again.
#[inline(always)]
fn chunk(index: u64) -> bool {
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's scratch slot, used by this program alone.
    let s = unsafe { &mut *scratch };
    let (start, len) = (s.start, s.len);
    let offset = index * ENV_SCAN_BYTES as u64;
    if offset >= len {
        return false;
    }
    // Whether the chunk's first byte starts an entry: the block's does; otherwise the
    // byte before it must be the previous entry's NUL.
    // SAFETY: the helper checks the user address and fails instead of faulting.
    let starts_entry =
        offset == 0 || unsafe { bpf_probe_read_user((start + offset - 1) as *const u8) } == Ok(0);
    let mut n = len - offset;
    if n > WINDOW_BYTES {
        n = WINDOW_BYTES;
    }
    if !copy_block(s, start + offset, n as usize) {
        s.found = identity::UNRESOLVED; // a page not present: the daemon reads /proc
        return false;
    }
    find_candidates(s, n as usize, starts_entry);
    if let Some(found) = last_assignment(s, n as usize) {
        s.found = found;
    }
    true
}

/// Copies the `n`-byte window at `start` into the scratch words; `false` if it could
/// not be read.
#[inline(always)]
fn copy_block(s: &mut EnvScratch, start: u64, n: usize) -> bool {
    if n > WINDOW_BYTES as usize {
        return false;
    }
    // SAFETY: at most WINDOW_BYTES into a buffer that large; the helper checks the
    // user address and fails instead of faulting.
    let copied = unsafe {
        raw::bpf_probe_read_user(
            s.words.as_mut_ptr() as *mut c_void,
            n as u32,
            start as *const c_void,
        )
    };
    // What an earlier, longer window left past `n` stays there: every read of a byte
    // checks `n` (see `byte`), which costs less than zeroing it.
    copied == 0
}

/// Pass 1: records where entries start with a `G` in the window's first 4 KiB (an
/// entry starting later belongs to the next chunk), eight bytes at a time.
#[inline(always)]
fn find_candidates(s: &mut EnvScratch, n: usize, starts_entry: bool) {
    // SAFETY: a field of our own scratch slot (volatile: see `record_candidates`).
    unsafe { core::ptr::write_volatile(&mut s.candidates, 0) };
    let word_count = n.div_ceil(8);
    // As if a NUL preceded byte 0 when it starts an entry.
    let mut previous_nuls: u64 = if starts_entry { 0x80 << 56 } else { 0 };
    for i in 0..ENV_SCAN_WORDS {
        if i >= word_count {
            break;
        }
        let word = s.words[i];
        let nuls = zero_bytes(word);
        let starts = (nuls << 8) | (previous_nuls >> 56);
        let candidates = starts & zero_bytes(word ^ 0x4747_4747_4747_4747);
        previous_nuls = nuls;
        if candidates != 0 {
            record_candidates(s, i, candidates);
        }
    }
}

/// Pass 2: the identity in the last candidate holding the variable; `None` if the
/// window assigns none.
#[inline(always)]
fn last_assignment(s: &EnvScratch, n: usize) -> Option<u64> {
    // SAFETY: a field of our own scratch slot (volatile: see `record_candidates`).
    let count = unsafe { core::ptr::read_volatile(&s.candidates) } as usize;
    for t in 0..ENV_CANDIDATES {
        if t >= count {
            return None;
        }
        let at = s.positions[(count - 1 - t) % ENV_CANDIDATES] as usize;
        if has_prefix(s, at, n) {
            return Some(hash_value(s, at + ENV_VAR_PREFIX.len(), n));
        }
    }
    // More `G` entries than the ring holds, none of the last ones the variable.
    Some(identity::UNRESOLVED)
}

/// Bit 7 of each byte of `word` that is zero (and, harmlessly, of a 0x01 byte just
/// above a zero one: every candidate is compared in full).
#[inline(always)]
fn zero_bytes(word: u64) -> u64 {
    word.wrapping_sub(0x0101_0101_0101_0101) & !word & 0x8080_8080_8080_8080
}

/// Records the byte positions of the candidate starts in word `i`. The count is read
/// and written through volatile accesses: kept in a register, it would differ between
/// the paths through the eight branches, and the verifier would walk all 256 of them
/// in every iteration.
#[inline(always)]
fn record_candidates(s: &mut EnvScratch, i: usize, candidates: u64) {
    for k in 0..8 {
        if candidates & (0x80 << (8 * k)) != 0 {
            // SAFETY: fields of our own scratch slot.
            unsafe {
                let count = core::ptr::read_volatile(&s.candidates);
                let slot = count as usize % ENV_CANDIDATES;
                core::ptr::write_volatile(&mut s.positions[slot], (i * 8 + k) as u32);
                core::ptr::write_volatile(&mut s.candidates, count.wrapping_add(1));
            }
        }
    }
}

#[inline(always)]
fn byte(s: &EnvScratch, at: usize, n: usize) -> u8 {
    let bytes = s.words.as_ptr() as *const u8;
    // Past the window's end reads as the NUL that ends the block.
    if at >= n || at >= TOTAL_WORDS * 8 {
        return 0;
    }
    // SAFETY: bounded by the buffer's size just above.
    unsafe { *bytes.add(at) }
}

#[inline(always)]
fn has_prefix(s: &EnvScratch, at: usize, n: usize) -> bool {
    let mut k = 0;
    while k < ENV_VAR_PREFIX.len() {
        if byte(s, at + k, n) != ENV_VAR_PREFIX[k] {
            return false;
        }
        k += 1;
    }
    true
}

/// `env_id_hash` of the NUL-terminated value at `at`, in a loop the verifier can
/// bound (the same steps); a value longer than `MAX_ENV_ID` is no environment's.
#[inline(always)]
fn hash_value(s: &EnvScratch, at: usize, n: usize) -> u64 {
    let mut hash = FNV_OFFSET;
    for j in 0..=MAX_ENV_ID {
        let b = byte(s, at + j, n);
        if b == 0 {
            return avoid_sentinels(hash);
        }
        hash = fnv_step(hash, b);
    }
    identity::NO_ENV
}
