//! genv's loop: a full cycle every `interval`, escalating to SIGKILL on time in between.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::StopSignals;
use crate::cycle::Enforcer;

pub async fn run(mut enforcer: Enforcer, interval: Duration) -> Result<ExitCode> {
    let mut stop = StopSignals::install()?;
    let mut next_cycle = Instant::now();
    loop {
        let now = Instant::now();
        if now >= next_cycle {
            enforcer.cycle();
            next_cycle = now + interval;
        }
        enforcer.executor.escalate(Instant::now());
        let wake = enforcer
            .executor
            .next_deadline()
            .map_or(next_cycle, |deadline| deadline.min(next_cycle));
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = stop.recv() => break,
        }
    }
    Ok(ExitCode::SUCCESS)
}
