//! The daemon as a service: what it publishes about itself ([`status`], [`metrics`]),
//! the one instance per run directory ([`instance`]), the signals it answers and
//! systemd's notifications ([`signals`]), and SIGHUP's reading of its settings again
//! ([`reload`]).

pub mod instance;
pub mod metrics;
pub mod reload;
pub mod signals;
pub mod status;

pub use signals::StopSignals;
