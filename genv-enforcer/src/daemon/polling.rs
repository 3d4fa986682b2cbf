//! genv's loop: a full cycle every `interval`, escalating to SIGKILL on time in between;
//! SIGHUP reads `--config` again.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::cycle::Enforcer;
use crate::service::reload::{Reloader, reload};
use crate::service::signals::{Hangup, StopSignals, notify};

pub async fn run(
    mut enforcer: Enforcer,
    mut interval: Duration,
    mut reload_from: Option<Reloader>,
) -> Result<ExitCode> {
    let mut stop = StopSignals::install()?;
    let mut hangup = Hangup::install()?;
    let mut next_cycle = Instant::now();
    let mut ready = false;
    loop {
        let now = Instant::now();
        if now >= next_cycle {
            enforcer.cycle();
            next_cycle = now + interval;
        }
        if !std::mem::replace(&mut ready, true) {
            notify("READY=1");
        }
        enforcer.executor.escalate(Instant::now());
        let wake = enforcer
            .executor
            .next_deadline()
            .map_or(next_cycle, |deadline| deadline.min(next_cycle));
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = stop.recv() => break,
            _ = hangup.recv() => {
                if let Some(new) = reload(reload_from.as_mut(), &mut enforcer) {
                    interval = new.interval;
                    next_cycle = Instant::now();
                    tracing::info!("SIGHUP: settings read again and in force");
                }
            }
        }
    }
    if let Some(notifier) = enforcer.executor.notifier() {
        notifier.flush();
    }
    Ok(ExitCode::SUCCESS)
}
