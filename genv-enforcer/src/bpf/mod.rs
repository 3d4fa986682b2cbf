//! The kernel side's userspace half: the embedded programs ([`object`]), the struct and
//! tracepoint offsets they need from the running kernel ([`btf`], [`tracefs`],
//! [`offsets`]), the tiers ([`tier`]) and the loader that picks one ([`loader`]).
//! Events come out through [`crate::intake`].

pub mod btf;
pub mod loader;
mod object;
pub mod offsets;
pub mod tier;
pub mod tracefs;

pub use loader::{KernelPrograms, LoadError, LoadOptions, ProgramStats};
pub use tier::{Tier, TierChoice};
