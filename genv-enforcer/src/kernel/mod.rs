//! The kernel programs' userspace half, the first stage of the event side: the embedded
//! programs (`object`), the struct and tracepoint offsets they need from the running
//! kernel ([`btf`], [`tracefs`], [`offsets`]), the tiers ([`tier`]), the loader
//! ([`loader`]) with the lifecycle programs ([`lifecycle`]) and the open tiers'
//! (`open_tiers`; the fmod_ret tier's program, which aya cannot load, is loaded by
//! `fmod_ret`), what each attached program is (`attached`), the handles of the maps the
//! programs decide from ([`policy_maps`]) and the pins that keep them ([`pins`]);
//! `--memory-at-alloc`'s libcuda uprobes ([`cuda`]) and accounting maps
//! ([`alloc_maps`]); the snapshot's view of processes through the identities the
//! kernel recorded ([`inspector`]).
//!
//! The events the programs emit are read by [`crate::intake`]; what their maps should
//! hold is decided by [`crate::sync`] and [`crate::alloc`].

pub mod alloc_maps;
mod attached;
pub mod btf;
pub mod cuda;
mod elf_symbols;
pub mod error;
mod fmod_ret;
pub mod inspector;
pub mod lifecycle;
pub mod loader;
mod object;
pub mod offsets;
mod open_tiers;
pub mod pins;
pub mod policy_maps;
pub mod tier;
pub mod tracefs;

pub use error::LoadError;
pub use loader::{EventMaps, KernelPrograms, LoadOptions, ProgramStats};
pub use tier::{Tier, TierChoice};
