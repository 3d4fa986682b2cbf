//! Reading `GENV_ENVIRONMENT_ID` out of the current task's environment block at exec,
//! as genv reads `/proc/<pid>/environ`: the last assignment wins, look-alike names do
//! not count. The block is read whole, a window at a time, in `bpf_loop` steps (5.17
//! and later); without `bpf_loop` only blocks up to 4 KiB are read and larger ones are
//! left to the daemon.
//!
//! Each window is copied in one read and its odd aligned words are looked up in a filter
//! (`genv_ebpf_common::env_scan`: every assignment shows a key in an odd word); only the
//! rare word that is part of the variable's name is compared further. The words are
//! scanned in `bpf_loop` steps of `GROUP_WORDS`, which the verifier checks once, not
//! once per word.

use aya_ebpf::cty::c_void;
use aya_ebpf::helpers::bpf_get_current_task;
use aya_ebpf::helpers::generated as raw;
use genv_ebpf_common::env_scan::{
    CHUNK_BYTES, GROUP_WORDS, MAX_CHUNKS, MAX_GROUPS, PATTERN, TAIL_WORD, WINDOW_BYTES,
    WINDOW_WORDS, anchor_of_key, filter, is_anchored_assignment, key_of, pattern_start,
    scan_groups, scans_tail,
};
use genv_ebpf_common::{FNV_OFFSET, MAX_ENV_ID, Offsets, avoid_sentinels, fnv_step, identity};

use crate::kernel::read;
use crate::maps::{EnvScratch, SCRATCH};

/// How much of the block the exec hook reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scan {
    /// All of it, one window per `bpf_loop` step.
    Whole,
    /// Blocks up to 4 KiB; larger ones are unresolved (kernels without `bpf_loop`).
    First4K,
}

const FIRST_4K: u64 = 4096;
/// Groups of a window holding a 4 KiB block, for the scan without `bpf_loop`.
const FIRST_4K_GROUPS: usize = scan_groups(FIRST_4K as usize + 8);

/// The identity in the current task's environment block: the last
/// `GENV_ENVIRONMENT_ID=` entry wins, as in genv (a Python dict built from it).
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
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return identity::NO_ENV;
    };
    // SAFETY: this CPU's scratch slot, used by this program alone (programs on one CPU
    // do not preempt each other); written through the raw pointer only.
    unsafe {
        (*s).start = start;
        (*s).len = len;
        (*s).found = identity::NO_ENV;
    }
    match scan {
        Scan::First4K if len > FIRST_4K => return identity::UNRESOLVED,
        Scan::First4K => {
            if open_window(0) {
                for g in 0..FIRST_4K_GROUPS {
                    scan_group(g);
                }
                close_window();
            }
        }
        Scan::Whole => {
            let chunks = len.div_ceil(CHUNK_BYTES as u64);
            if chunks > MAX_CHUNKS as u64 {
                return identity::UNRESOLVED;
            }
            // SAFETY: `step` is a BPF subprogram; it takes no context.
            unsafe { raw::bpf_loop(chunks as u32, step as *mut c_void, core::ptr::null_mut(), 0) };
        }
    }
    let Some(s) = SCRATCH.get_ptr(0) else {
        return identity::NO_ENV;
    };
    // SAFETY: as above; volatile: the loop's steps wrote it.
    unsafe { core::ptr::read_volatile(&(*s).found) }
}

/// One `bpf_loop` step: the `index`th chunk of the block from its end. The last
/// assignment wins, so the walk goes backwards and stops at the first chunk holding
/// one; a block without one is read whole. 0 goes on, 1 stops.
#[inline(never)]
extern "C" fn step(index: u64, _ctx: *mut c_void) -> i64 {
    let Some(s) = SCRATCH.get_ptr(0) else {
        return 1;
    };
    // SAFETY: this CPU's scratch slot.
    let chunks = unsafe { (*s).len }.div_ceil(CHUNK_BYTES as u64);
    if index >= chunks || !open_window(chunks - 1 - index) {
        return 1;
    }
    // SAFETY: as above; volatile: `open_window` wrote it.
    let valid = unsafe { core::ptr::read_volatile(&(*s).valid) } as usize;
    let groups = scan_groups(valid);
    // SAFETY: `group_step` is a BPF subprogram; it takes no context.
    unsafe {
        raw::bpf_loop(
            groups as u32,
            group_step as *mut c_void,
            core::ptr::null_mut(),
            0,
        )
    };
    if scans_tail(valid) {
        scan_word(TAIL_WORD);
    }
    if close_window() { 1 } else { 0 }
}

/// One `bpf_loop` step of a window's scan: group `index`. Always goes on.
#[inline(never)]
extern "C" fn group_step(index: u64, _ctx: *mut c_void) -> i64 {
    scan_group(index as usize);
    0
}

/// Copies chunk `index` of the block, with the 8 bytes before it, into the window;
/// `false` past the block's end, or if the block could not be read (a page not present:
/// the identity is then unresolved, and the daemon reads `/proc`).
#[inline(always)]
fn open_window(index: u64) -> bool {
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's scratch slot; every copy stays within `words`, and the helper
    // checks the user address and fails instead of faulting.
    unsafe {
        let (start, len) = ((*s).start, (*s).len);
        let offset = index * CHUNK_BYTES as u64;
        if offset >= len {
            return false;
        }
        let rest = len - offset;
        let words = (*s).words.as_mut_ptr();
        let (copied, valid) = if offset == 0 {
            // As if a NUL preceded the block: its first entry starts one.
            *words = 0;
            let n = rest.min(WINDOW_BYTES as u64 - 8);
            let copied = raw::bpf_probe_read_user(
                words.add(1) as *mut c_void,
                n as u32,
                start as *const c_void,
            );
            (copied, n + 8)
        } else {
            let n = (rest + 8).min(WINDOW_BYTES as u64);
            let copied = raw::bpf_probe_read_user(
                words as *mut c_void,
                n as u32,
                (start + offset - 8) as *const c_void,
            );
            (copied, n)
        };
        if copied != 0 {
            (*s).found = identity::UNRESOLVED;
            return false;
        }
        // What an earlier, longer window left past `valid` stays there: every match and
        // every byte of a value is checked against `valid`, which costs less than
        // zeroing it.
        (*s).valid = valid;
        (*s).value = 0;
    }
    true
}

/// Scans the odd window words `g * GROUP_WORDS + 1, + 3, …` for keys of the pattern.
#[inline(always)]
fn scan_group(g: usize) {
    if g >= MAX_GROUPS {
        return;
    }
    let Some(s) = SCRATCH.get_ptr(0) else {
        return;
    };
    // The group's words are `group[1..=GROUP_WORDS]`: a constant offset in each load
    // (`1 + g * GROUP_WORDS` as one index, the compiler may compute with an OR, which the
    // verifier cannot bound).
    // SAFETY: `g * GROUP_WORDS + GROUP_WORDS` is within `words` for every
    // `g < MAX_GROUPS`.
    let group = unsafe { (*s).words.as_ptr().add(g * GROUP_WORDS) };
    // Unrolled: a handful of instructions a word, no loop counter.
    macro_rules! words {
        ($($j:literal)*) => {$(
            // SAFETY: as above.
            check(unsafe { *group.add($j) }, g * GROUP_WORDS + $j);
        )*};
    }
    words!(1 3 5 7 9 11 13 15 17 19 21 23 25 27 29 31 33 35 37 39 41 43 45 47 49 51 53 55 57 59 61 63
           65 67 69 71 73 75 77 79 81 83 85 87 89 91 93 95 97 99 101 103 105 107 109 111 113 115 117
           119 121 123 125 127);
    const _: () = assert!(GROUP_WORDS == 128);
}

/// Scans window word `k` alone (the tail word, past every group).
#[inline(always)]
fn scan_word(k: usize) {
    if k >= WINDOW_WORDS {
        return;
    }
    let Some(s) = SCRATCH.get_ptr(0) else {
        return;
    };
    // SAFETY: `k` is within `words`, checked just above.
    check(unsafe { *(*s).words.as_ptr().add(k) }, k);
}

/// Window word `k`, read as `word`: through the filter, and on to [`matched`] in the
/// rare case it shows a key.
#[inline(always)]
fn check(word: u64, k: usize) {
    let filtered = filter(word);
    if filtered != 0 {
        if let Some(t) = key_of(word, filtered) {
            matched(k, t);
        }
    }
}

/// Word `k` shows key `t`: records the assignment its anchor is part of, if it is one
/// and it starts in this window's chunk. Assignments are met in block order: the last
/// wins.
#[inline(never)]
fn matched(k: usize, t: usize) {
    let (anchor, shift) = anchor_of_key(k, t);
    // Words `anchor - 1 ..= anchor + 2`, through one bounded register: verifiers before
    // 6.10 do not carry a bound checked on `k + 2` over to `k`, and the compiler would
    // check one and index with the other (`black_box` keeps them one).
    let before = core::hint::black_box(anchor.wrapping_sub(1));
    if before >= WINDOW_WORDS - 3 {
        return;
    }
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: this CPU's scratch slot; `before + 3` is within `words`.
    unsafe {
        let around = (*s).words.as_ptr().add(before);
        let words = (*around, *around.add(1), *around.add(2), *around.add(3));
        if !is_anchored_assignment(words.0, words.1, words.2, words.3, shift) {
            return;
        }
        if let Some(q) = pattern_start(before + 1, shift, (*s).valid as usize) {
            core::ptr::write_volatile(&mut (*s).value, (q + PATTERN.len()) as u64);
        }
    }
}

/// The chunk's last assignment, if any, becomes the identity; whether there was one.
#[inline(always)]
fn close_window() -> bool {
    let Some(s) = SCRATCH.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: this CPU's scratch slot; volatile: the scan's steps wrote it.
    unsafe {
        let value = core::ptr::read_volatile(&(*s).value) as usize;
        if value != 0 {
            (*s).found = hash_value(&*s, value, (*s).valid as usize);
        }
        value != 0
    }
}

/// `env_id_hash` of the NUL-terminated value at `at`, in a loop the verifier can
/// bound (the same steps); a value longer than `MAX_ENV_ID` is no environment's, and
/// past the bytes read is the NUL that ends the block.
#[inline(always)]
fn hash_value(s: &EnvScratch, at: usize, valid: usize) -> u64 {
    // One bounded register for every byte (see `matched`).
    let at = core::hint::black_box(at);
    if at > WINDOW_BYTES - (MAX_ENV_ID + 1) {
        return identity::NO_ENV;
    }
    // SAFETY: `at + MAX_ENV_ID` is within the window, checked just above.
    let value = unsafe { (s.words.as_ptr() as *const u8).add(at) };
    let mut hash = FNV_OFFSET;
    for j in 0..=MAX_ENV_ID {
        // SAFETY: as above.
        let b = if at + j < valid {
            // SAFETY: as above.
            unsafe { *value.add(j) }
        } else {
            0
        };
        if b == 0 {
            return avoid_sentinels(hash);
        }
        hash = fnv_step(hash, b);
    }
    identity::NO_ENV
}
