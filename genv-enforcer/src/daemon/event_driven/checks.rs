//! The checks the event-driven daemon runs: the full cycle, the narrow check of
//! processes that just opened a GPU, the memory poll; and what each counts.

use std::collections::HashSet;
use std::time::Instant;

use super::{Daemon, SETTLE, monotonic_ns};
use crate::cycle::{CycleSummary, Scope};
use crate::kernel::alloc_maps::DeltasAround;
use crate::sync::KernelSide;

impl Daemon {
    pub(super) fn full_cycle(&mut self) {
        let started = Instant::now();
        let mut summary = self.enforcer.cycle();
        let took = started.elapsed();
        if let Some(metrics) = &self.metrics {
            metrics.cycled(took);
        }
        self.status.last_cycle = Some(crate::service::status::LastCycle {
            at: super::unix_now(),
            took_ms: took.as_secs_f64() * 1e3,
            gpu_processes: summary.processes,
            findings: summary.findings,
            terminated: summary.terminated.len(),
            detached: summary.detached,
        });
        self.status.counts.full_cycles += 1;
        // Unknown (a state file unreadable) counts as capped: the poll then runs.
        self.memory_capped = summary
            .state
            .as_ref()
            .is_none_or(|(envs, _)| envs.iter().any(|env| env.config.gpu_memory.is_some()));
        self.count(&summary);
        if let Some(kernel) = self.kernel.as_mut() {
            kernel.follow_cycle(
                &self.settings.kernel,
                &mut self.status,
                (
                    self.enforcer.builder.device_map(),
                    self.enforcer.builder.devices(),
                ),
                &mut summary,
            );
        }
        self.status.orphans = std::mem::take(&mut summary.orphans);
    }

    pub(super) fn opened_check(&mut self, pids: &HashSet<u32>) {
        let settled = self.settled(Instant::now());
        let summary = self.enforcer.check(Scope::Opened(pids), &settled);
        self.status.counts.open_checks += 1;
        for pid in &summary.gpu_pids {
            self.watchlist.computing(*pid);
        }
        self.count(&summary);
        let now_ns = monotonic_ns();
        for pid in &summary.terminated {
            if let Some(open) = self.watchlist.first_open(*pid) {
                let after = now_ns.saturating_sub(open.at_ns);
                if let Some(metrics) = &self.metrics {
                    metrics.reacted(std::time::Duration::from_nanos(after));
                }
                let ms = after as f64 / 1e6;
                tracing::info!(
                    "Acted on process {pid} {ms:.2} ms after its open of GPU {} [{}]",
                    open.index,
                    open.tier
                );
            }
            self.settled.insert(*pid, Instant::now());
        }
    }

    /// The memory rule between full cycles. Skipped while no environment has a memory
    /// cap and the state directory is watched (a new cap is a state change, which runs a
    /// full cycle at once): on a node without caps the poll would read NVML every second
    /// for nothing.
    pub(super) fn memory_check(&mut self) {
        if !self.enforcer.rules.env_memory {
            return;
        }
        let watched = self.state_watch.as_ref().is_some_and(|w| !w.is_lost());
        if !self.memory_capped && watched {
            return;
        }
        let settled = self.settled(Instant::now());
        // Read before NVML is asked and after it answers: an account that moved in
        // between keeps its baseline (NVML may or may not have seen the change).
        let before = self.kernel.as_mut().and_then(KernelSide::alloc_deltas);
        let summary = self.enforcer.check(Scope::Memory, &settled);
        let after = self.kernel.as_mut().and_then(KernelSide::alloc_deltas);
        if let (Some(kernel), Some(before), Some(after), Some(processes)) =
            (self.kernel.as_mut(), &before, &after, &summary.measured)
        {
            let usage = crate::alloc::caps::measured(processes);
            let listed = summary.gpu_pids.iter().copied().collect();
            kernel.rebase(DeltasAround { before, after }, &usage, &listed);
        }
        self.status.counts.memory_checks += 1;
        self.count(&summary);
        let now = Instant::now();
        for pid in summary.terminated {
            self.settled.insert(pid, now);
        }
    }

    pub(super) fn settled(&mut self, now: Instant) -> HashSet<u32> {
        self.settled
            .retain(|_, at| now.duration_since(*at) < SETTLE);
        self.settled.keys().copied().collect()
    }

    pub(super) fn count(&mut self, summary: &CycleSummary) {
        self.status.counts.terminated += summary.terminated.len() as u64;
        self.status.counts.detached += summary.detached as u64;
        if let Some(metrics) = &self.metrics {
            metrics.decided(&summary.decisions);
        }
    }
}
