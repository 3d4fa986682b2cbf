//! The long-running enforcer, in its two forms:
//! - [`polling`]: genv's loop, a full cycle every `--interval`;
//! - [`event_driven`]: kernel events, state-file changes and an NVML memory poll trigger
//!   narrow checks as they happen, with the full cycle kept as a safety net.
//!
//! And [`usage_watch`], which watches the same way and only prints snapshots.

pub mod event_driven;
mod instance;
mod kernel_inspector;
mod kernel_side;
mod memory_at_alloc;
pub mod metrics;
pub mod polling;
pub mod reload;
mod schedule;
mod settings;
mod state_watch;
pub mod status;
pub mod usage_watch;
mod watchlist;

use anyhow::{Context, Result};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// SIGTERM and SIGINT, installed before anything slow so that neither is lost.
pub(crate) struct StopSignals {
    term: Signal,
    int: Signal,
}

impl StopSignals {
    pub(crate) fn install() -> Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    pub(crate) async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}
