//! genv's remote enforcement (`genv remote -H h1,h2 enforce`), over the system's
//! OpenSSH client: one process enforces a fleet, running `genv-enforcer usage snapshot`
//! and `usage execute` (or Python genv's, which speak the same JSON) on each host, with
//! the rules run across all hosts at once, so that `--max-devices-per-user` counts a
//! user's devices on every host together.
//!
//! - [`hosts`]: which hosts, as `-H` and `--hostfile` name them;
//! - [`ssh`]: the client, multiplexed, with deadlines and bounded answers;
//! - [`fleet`]: genv's cycle (snapshot all, judge together, execute each);
//! - [`stream`] and [`engine`]: `--event-driven`, a `usage watch` stream per host and
//!   the rules run whenever one changes;
//! - [`validate`]: what makes a parsed snapshot one that cannot be acted on;
//! - [`metrics`]: `--metrics-addr`, each host up or down, heard from when, acted on;
//! - [`plain_hosts`]: which hosts take a report with the reasons for their users.

mod engine;
pub mod fleet;
pub mod hosts;
pub mod metrics;
pub mod plain_hosts;
pub mod ssh;
mod stream;
pub mod usage_watch;
mod validate;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;

use crate::service::StopSignals;
pub use fleet::{ErrorPolicy, Fleet};

/// How `remote enforce` runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RemoteMode {
    /// `--interval 0`: one cycle.
    Once,
    /// genv's loop: a cycle every interval.
    Polling(Duration),
    /// `--event-driven`: streams, with hosts that cannot stream polled every interval.
    EventDriven(Duration),
}

/// Runs remote enforcement until it is done, stopped (SIGINT, SIGTERM) or, with `-e`,
/// an SSH error; then closes the multiplexed connections.
pub async fn run(fleet: Fleet, mode: RemoteMode) -> Result<ExitCode> {
    let fleet = Arc::new(fleet);
    let mut stop = StopSignals::install()?;
    let work = async {
        match mode {
            RemoteMode::Once => fleet.cycle().await,
            RemoteMode::Polling(every) => loop {
                fleet.cycle().await?;
                tokio::time::sleep(every).await;
            },
            RemoteMode::EventDriven(every) => engine::run(Arc::clone(&fleet), every).await,
        }
    };
    let result = tokio::select! {
        result = work => result,
        _ = stop.recv() => Ok(()),
    };
    fleet.ssh.close(&fleet.hosts).await;
    result.map(|()| ExitCode::SUCCESS)
}
