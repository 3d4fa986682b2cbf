//! Prevention (`--deny`): the kernel decides at the open whether a process may have a
//! GPU node. This stage keeps what it decides from true: each process's environment
//! identity ([`identity`]), genv's active environments ([`mirror`]) and the executables
//! allowed outside environments ([`allowlist`]), all written into the maps that
//! [`crate::bpf::policy_maps`] holds; it reports what the kernel decided
//! ([`decisions`]); and it finishes what a kill in the kernel could not, for processes
//! sharing the killed opener's descriptors ([`holders`]). With `--memory-at-alloc`, it
//! keeps the libcuda probes' accounting true too ([`alloc`]).

pub mod alloc;
pub mod allowlist;
pub mod decisions;
pub mod holders;
pub mod identity;
pub mod mirror;
pub mod started_cap;

pub use decisions::{decision_line, guarantee};
pub use identity::{identity_of, resolve_identity, resync_identities, seed_identities};
pub use mirror::sync_environments;
