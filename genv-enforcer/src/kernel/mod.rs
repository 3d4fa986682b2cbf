//! The kernel side's userspace half: the embedded programs ([`object`]), the struct and
//! tracepoint offsets they need from the running kernel ([`btf`], [`tracefs`],
//! [`offsets`]), the tiers ([`tier`]), the loader that picks one ([`loader`]; the
//! fmod_ret tier's program, which aya cannot load, is loaded by `fmod_ret`), the
//! handles of the maps the programs decide from ([`policy_maps`]) and the pins that keep
//! them ([`pins`]); `--memory-at-alloc`'s libcuda uprobes and accounting maps
//! ([`cuda`]). What those maps should hold is [`crate::prevention`]'s business; the
//! events the programs emit are read by [`crate::intake`].

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
