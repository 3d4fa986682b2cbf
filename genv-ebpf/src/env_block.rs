//! Reading `GENV_ENVIRONMENT_ID` out of the current task's environment block at exec,
//! as genv reads `/proc/<pid>/environ`: the last assignment wins, look-alike names do
//! not count, and a block too large to scan here is left to the daemon.

use aya_ebpf::cty::c_void;
use aya_ebpf::helpers::bpf_get_current_task;
use aya_ebpf::helpers::generated as raw;
use genv_ebpf_common::{
    ENV_VAR_PREFIX, FNV_OFFSET, MAX_ENV_ID, Offsets, avoid_sentinels, fnv_step, identity,
};

use crate::kernel::read;
use crate::maps::{
    ENV_CANDIDATES, ENV_SCAN_BYTES, ENV_SCAN_PAD_WORDS, ENV_SCAN_WORDS, EnvScratch, SCRATCH,
};

/// The identity in the current task's environment block: the last
/// `GENV_ENVIRONMENT_ID=` entry wins, as in genv (a Python dict built from it).
///
/// The block is copied in one read and scanned eight bytes at a time: entry starts are
/// the bytes after a NUL, and only starts holding a `G` are compared with the prefix.
/// (One `bpf_probe_read_user_str` per entry instead cost ~100 ns an entry.)
#[inline(always)]
pub(crate) fn environment_identity(o: &Offsets) -> u64 {
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
    if len > ENV_SCAN_BYTES as u64 {
        return identity::UNRESOLVED; // the daemon reads /proc/<pid>/environ
    }
    let Some(scratch) = SCRATCH.get_ptr_mut(0) else {
        return identity::NO_ENV;
    };
    // SAFETY: this CPU's scratch slot, used by this program alone.
    let s = unsafe { &mut *scratch };
    let n = len as usize;
    if !copy_block(s, start, n) {
        return identity::UNRESOLVED; // a page not present: the daemon reads /proc
    }
    find_candidates(s, n);
    last_assignment(s)
}

/// Copies the `n`-byte block at `start` into the scratch words, and zeroes what an
/// earlier, longer block left past it. `false` if the block could not be read.
#[inline(always)]
fn copy_block(s: &mut EnvScratch, start: u64, n: usize) -> bool {
    // SAFETY: at most ENV_SCAN_BYTES into a buffer that large; the helper checks the
    // user address and fails instead of faulting.
    let copied = unsafe {
        raw::bpf_probe_read_user(
            s.words.as_mut_ptr() as *mut c_void,
            n as u32,
            start as *const c_void,
        )
    };
    if copied != 0 {
        return false;
    }
    // Nothing of an earlier block may survive past this one.
    let full = n / 8;
    let rem = n % 8;
    if full < ENV_SCAN_WORDS + ENV_SCAN_PAD_WORDS {
        if rem != 0 {
            s.words[full] &= (1u64 << (rem * 8)) - 1;
        } else {
            s.words[full] = 0;
        }
    }
    for j in 1..ENV_SCAN_PAD_WORDS {
        if full + j < ENV_SCAN_WORDS + ENV_SCAN_PAD_WORDS {
            s.words[full + j] = 0;
        }
    }
    true
}

/// Pass 1: records where entries start with a `G`, eight bytes at a time.
#[inline(always)]
fn find_candidates(s: &mut EnvScratch, n: usize) {
    // SAFETY: a field of our own scratch slot (volatile: see `record_candidates`).
    unsafe { core::ptr::write_volatile(&mut s.candidates, 0) };
    let word_count = n.div_ceil(8);
    // Byte 0 starts an entry: as if a NUL preceded it.
    let mut previous_nuls: u64 = 0x80 << 56;
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

/// Pass 2: the identity in the last candidate holding the variable.
#[inline(always)]
fn last_assignment(s: &EnvScratch) -> u64 {
    // SAFETY: a field of our own scratch slot (volatile: see `record_candidates`).
    let count = unsafe { core::ptr::read_volatile(&s.candidates) } as usize;
    for t in 0..ENV_CANDIDATES {
        if t >= count {
            return identity::NO_ENV;
        }
        let at = s.positions[(count - 1 - t) % ENV_CANDIDATES] as usize;
        if has_prefix(s, at) {
            return hash_value(s, at + ENV_VAR_PREFIX.len());
        }
    }
    // More `G` entries than the ring holds, none of the last ones the variable.
    identity::UNRESOLVED
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
fn byte(s: &EnvScratch, at: usize) -> u8 {
    let bytes = s.words.as_ptr() as *const u8;
    if at >= (ENV_SCAN_WORDS + ENV_SCAN_PAD_WORDS) * 8 {
        return 0;
    }
    // SAFETY: bounded by the buffer's size just above.
    unsafe { *bytes.add(at) }
}

#[inline(always)]
fn has_prefix(s: &EnvScratch, at: usize) -> bool {
    let mut k = 0;
    while k < ENV_VAR_PREFIX.len() {
        if byte(s, at + k) != ENV_VAR_PREFIX[k] {
            return false;
        }
        k += 1;
    }
    true
}

/// `env_id_hash` of the NUL-terminated value at `at`, in a loop the verifier can
/// bound (the same steps); a value longer than `MAX_ENV_ID` is no environment's.
#[inline(always)]
fn hash_value(s: &EnvScratch, at: usize) -> u64 {
    let mut hash = FNV_OFFSET;
    for j in 0..=MAX_ENV_ID {
        let b = byte(s, at + j);
        if b == 0 {
            return avoid_sentinels(hash);
        }
        hash = fnv_step(hash, b);
    }
    identity::NO_ENV
}
