//! The long-running enforcer, in its two forms:
//! - [`polling`]: genv's loop, a full cycle every `--interval`;
//! - [`event_driven`]: kernel events, state-file changes and an NVML memory poll trigger
//!   narrow checks as they happen, with the full cycle kept as a safety net.
//!
//! Here are the loops, their timers ([`schedule`]), their start ([`start`]) and their
//! triggers: genv's state directory watched ([`state_watch`]); kernel events, which the
//! [`crate::react`] stage turns into what is to be done; GPU openers watched for a
//! while ([`watchlist`]). The kernel programs' maps are
//! kept by [`crate::sync`] and [`crate::alloc`], and the daemon's status, metrics and
//! signals are [`crate::service`]'s.

mod checks;
pub mod event_driven;
pub mod polling;
mod schedule;
mod settings;
mod settled;
mod skip_watch;
mod start;
pub mod state_watch;
mod watchlist;

pub use settings::Settings;
