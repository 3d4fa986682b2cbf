//! The event-driven mode's settings: what `cli::config` validated, as the daemon reads
//! it.

use std::path::PathBuf;
use std::time::Duration;

use crate::service::reload::Reloader;
use crate::sync::KernelSettings;

/// The event-driven mode's settings, validated (see `cli::config`).
#[derive(Debug)]
pub struct Settings {
    pub interval: Duration,
    pub memory_interval: Duration,
    pub run_dir: PathBuf,
    /// The kernel programs and their maps.
    pub kernel: KernelSettings,
    /// `--config`: read again on SIGHUP.
    pub reload: Option<Reloader>,
    /// `--metrics-addr`.
    pub metrics_addr: Option<std::net::SocketAddr>,
}
