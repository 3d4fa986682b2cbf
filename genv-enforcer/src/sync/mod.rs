//! The mirror: the maps the kernel programs decide from (watched nodes, process
//! identities, genv's environments, the allow-list, `--deny`) kept in step with genv's
//! state and `/proc`, by their one owner, [`mirror::Mirror`]. Its writers, each pure
//! where it can be: [`environments`] (genv's environments), [`identity`] (each
//! process's claim), [`allowlist`] (the tools let through outside environments).

pub mod allowlist;
pub mod environments;
pub mod identity;
pub mod mirror;
mod settings;

pub use mirror::Mirror;
pub use settings::KernelSettings;
