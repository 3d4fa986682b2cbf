//! The allocation entry probes' refusing forms (`--memory-at-alloc refuse`): the same
//! bodies as the plain ones (`memory.rs`), with the stores to the registers of
//! [`super::refuse`] compiled in. Loaded only where the kernel accepts them.

use aya_ebpf::macros::uprobe;
use aya_ebpf::programs::ProbeContext;

use super::memory::{alloc_entry, create_entry, pitch_entry};

/// `cuMemAlloc_v2` and the calls with its arguments, refusing past the cap.
#[uprobe]
pub fn cu_mem_alloc_refusing(ctx: ProbeContext) -> u32 {
    alloc_entry::<true>(&ctx)
}

/// `cuMemAllocPitch_v2`, refusing past the cap.
#[uprobe]
pub fn cu_mem_alloc_pitch_refusing(ctx: ProbeContext) -> u32 {
    pitch_entry::<true>(&ctx)
}

/// `cuMemCreate`, refusing past the cap.
#[uprobe]
pub fn cu_mem_create_refusing(ctx: ProbeContext) -> u32 {
    create_entry::<true>(&ctx)
}
