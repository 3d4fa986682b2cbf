//! The kernel side's userspace half: the embedded programs ([`object`]), the struct and
//! tracepoint offsets they need from the running kernel ([`btf`], [`tracefs`],
//! [`offsets`]), the tiers ([`tier`]) and the loader that picks one ([`loader`]); the
//! maps the programs decide from ([`policy_maps`]), what they should hold ([`mirror`],
//! [`allowlist`]). Events come out through [`crate::intake`].

pub mod allowlist;
pub mod btf;
pub mod loader;
pub mod mirror;
mod object;
pub mod offsets;
pub mod pins;
pub mod policy_maps;
pub mod tier;
pub mod tracefs;

pub use loader::{KernelPrograms, LoadError, LoadOptions, ProgramStats};
pub use tier::{Tier, TierChoice};
