//! The kernel programs' userspace half, the first stage of the event side: the embedded
//! programs (`object`), the struct and tracepoint offsets they need from the running
//! kernel ([`btf`], [`tracefs`], [`offsets`]), the tiers and what each guarantees
//! ([`tier`]), the loader ([`loader`]) with the lifecycle programs ([`lifecycle`]) and
//! the open tiers' (`open_tiers`; the trampoline tiers' programs, which aya cannot load
//! without its own parse of the kernel's BTF, or at all for fmod_ret, are relocated by
//! `relocation` and loaded by `trampoline`), what each attached program is
//! (`attached`), the handles of the maps the programs decide from ([`policy_maps`])
//! and the pins that keep them ([`pins`]); `--memory-at-alloc`'s libcuda uprobes
//! ([`cuda`]) and accounting maps ([`alloc_maps`]); the snapshot's view of processes
//! through the identities the kernel recorded ([`inspector`]); the runs the kernel
//! skipped ([`skipped_runs`]); `doctor`'s load-and-unload of every tier ([`tier_probe`]).
//!
//! Loading hands each part to its one owner ([`Loaded`]): the events to
//! [`crate::intake`], the policy maps to the mirror ([`crate::sync`]), the allocation
//! maps and probes to [`crate::alloc`].

pub mod alloc_maps;
mod attached;
pub mod btf;
pub mod cuda;
mod ebpf_loader;
mod elf_symbols;
pub mod error;
pub mod inspector;
pub mod lifecycle;
pub mod loader;
mod object;
pub mod offsets;
mod open_tiers;
pub mod pins;
pub mod policy_maps;
mod relocation;
pub mod skipped_runs;
pub mod tier;
pub mod tier_probe;
pub mod tracefs;
mod trampoline;
mod verifier_log;

pub use error::LoadError;
pub use loader::{EventMaps, KernelPrograms, LoadOptions, Loaded, ProgramStats};
pub(crate) use open_tiers::bpf_lsm_active;
pub use skipped_runs::SkippedRuns;
pub use tier::{Tier, TierChoice};
