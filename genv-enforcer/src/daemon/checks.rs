//! The checks the event-driven daemon runs, each over the enforcer's snapshot: the full
//! cycle, the narrow check of processes that just opened a GPU (watched for a while,
//! [`super::watchlist`]) or, outside any environment, made a CUDA context, the memory
//! poll; what each counts; and what a reaction wanted of them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::settled::Settled;
use super::watchlist::Watchlist;
use crate::alloc::AllocSide;
use crate::clock::{monotonic_ns, unix_now};
use crate::cycle::{CycleSummary, Enforcer, Scope};
use crate::kernel::alloc_maps::DeltasAround;
use crate::react::Wanted;
use crate::service::metrics::Metrics;
use crate::service::status::{LastCycle, Status};

pub struct Checks {
    pub enforcer: Enforcer,
    /// Processes a check terminated, or the kernel killed, a moment ago.
    settled: Settled,
    /// GPU openers, checked at once and at growing intervals while their window lasts.
    watchlist: Watchlist,
    /// Whether an environment had a memory cap at the last full cycle (or the state was
    /// unreadable).
    memory_capped: bool,
    /// `--metrics-addr`.
    metrics: Option<Arc<Metrics>>,
}

impl Checks {
    pub fn new(enforcer: Enforcer, metrics: Option<Arc<Metrics>>) -> Self {
        Self {
            enforcer,
            settled: Settled::default(),
            watchlist: Watchlist::default(),
            memory_capped: true,
            metrics,
        }
    }

    /// What a reaction wanted, done.
    pub fn act(&mut self, wanted: Wanted, now: Instant, status: &mut Status) {
        match wanted {
            Wanted::Watch(open) => self.watchlist.add(open, now),
            Wanted::Forget(pid) => self.enforcer.builder.forget(pid),
            Wanted::Gone(pid) => {
                self.enforcer.builder.forget(pid);
                self.watchlist.remove(pid);
                self.settled.remove(pid);
            }
            Wanted::Judge { pid, at_ns } => self.judge(pid, at_ns, status),
            Wanted::Settle(pid) => self.settled.insert(pid, now),
        }
    }

    /// The full cycle, recorded in `status`; its summary, for the stages that follow it.
    pub fn full_cycle(&mut self, status: &mut Status) -> CycleSummary {
        let started = Instant::now();
        let summary = self.enforcer.cycle();
        let took = started.elapsed();
        if let Some(metrics) = &self.metrics {
            metrics.cycled(took);
        }
        status.last_cycle = Some(LastCycle {
            at: unix_now(),
            took_ms: took.as_secs_f64() * 1e3,
            gpu_processes: summary.processes,
            findings: summary.findings,
            terminated: summary.terminated.len(),
            detached: summary.detached,
        });
        status.counts.full_cycles += 1;
        // Unknown (a state file unreadable) counts as capped: the poll then runs.
        self.memory_capped = summary
            .state
            .as_ref()
            .is_none_or(|(envs, _)| envs.iter().any(|env| env.config.gpu_memory.is_some()));
        self.count(&summary, status);
        for pid in &summary.terminated {
            self.acted_on_opener(*pid);
        }
        summary
    }

    /// When the next check of a watched opener is due.
    pub fn next_wake(&self) -> Option<Instant> {
        self.watchlist.next_wake()
    }

    /// The watched openers, checked if a check of them is due (one snapshot serves them
    /// all).
    pub fn opened_if_due(&mut self, status: &mut Status) {
        if let Some(pids) = self.watchlist.due(Instant::now()) {
            self.opened(&pids, status);
        }
    }

    /// The processes that just opened a GPU, checked; those seen computing end their
    /// watch with its window.
    fn opened(&mut self, pids: &HashSet<u32>, status: &mut Status) {
        let settled = self.settled.at(Instant::now());
        let summary = self.enforcer.check(Scope::Opened(pids), &settled);
        status.counts.open_checks += 1;
        for pid in &summary.gpu_pids {
            self.watchlist.computing(*pid);
        }
        self.count(&summary, status);
        for pid in &summary.terminated {
            self.acted_on_opener(*pid);
            self.settled.insert(*pid, Instant::now());
        }
    }

    /// A process acted on after its GPU open: how long after, said and measured,
    /// whichever check acted (its own, or a full cycle that came first: one that lost
    /// or skipped events asks for it at once).
    fn acted_on_opener(&self, pid: u32) {
        let Some(open) = self.watchlist.first_open(pid) else {
            return;
        };
        let after = monotonic_ns().saturating_sub(open.at_ns);
        if let Some(metrics) = &self.metrics {
            metrics.reacted(Duration::from_nanos(after));
        }
        let ms = after as f64 / 1e6;
        tracing::info!(
            "Acted on process {pid} {ms:.2} ms after its open of GPU {} [{}]",
            open.index,
            open.tier
        );
    }

    /// A process the kernel knows to be outside any environment made a CUDA context:
    /// judged now, as a GPU process on `gpu` (see `react::cuda`).
    fn judge(&mut self, pid: u32, at_ns: u64, status: &mut Status) {
        let gpu = self.watchlist.first_open(pid).map_or(0, |o| o.index);
        self.enforcer.builder.prove_computing(pid, gpu);
        let settled = self.settled.at(Instant::now());
        let summary = self
            .enforcer
            .check(Scope::Opened(&HashSet::from([pid])), &settled);
        self.count(&summary, status);
        if summary.terminated.contains(&pid) {
            let ms = monotonic_ns().saturating_sub(at_ns) as f64 / 1e6;
            tracing::info!("Acted on process {pid} {ms:.2} ms after it started CUDA [uprobe]");
            self.settled.insert(pid, Instant::now());
        }
    }

    /// The memory rule between full cycles. Skipped while no environment has a memory
    /// cap and the state directory is watched (a new cap is a state change, which runs a
    /// full cycle at once): on a node without caps the poll would read NVML every second
    /// for nothing.
    /// `watched`: whether genv's state directory is watched now.
    pub fn memory(&mut self, status: &mut Status, alloc: Option<&mut AllocSide>, watched: bool) {
        if !self.enforcer.rules.env_memory {
            return;
        }
        if !self.memory_capped && watched {
            return;
        }
        let settled = self.settled.at(Instant::now());
        // Read before NVML is asked and after it answers: an account that moved in
        // between keeps its baseline (NVML may or may not have seen the change).
        let before = alloc.as_deref().map(AllocSide::deltas);
        let summary = self.enforcer.check(Scope::Memory, &settled);
        if let (Some(alloc), Some(before), Some(processes)) = (alloc, &before, &summary.measured) {
            let after = alloc.deltas();
            let usage = crate::alloc::caps::measured(processes);
            let listed = summary.gpu_pids.iter().copied().collect();
            let around = DeltasAround {
                before,
                after: &after,
            };
            alloc.rebase(around, &usage, &listed);
        }
        status.counts.memory_checks += 1;
        self.count(&summary, status);
        let now = Instant::now();
        for pid in summary.terminated {
            self.settled.insert(pid, now);
        }
    }

    fn count(&mut self, summary: &CycleSummary, status: &mut Status) {
        status.counts.terminated += summary.terminated.len() as u64;
        status.counts.detached += summary.detached as u64;
        if let Some(metrics) = &self.metrics {
            metrics.decided(&summary.decisions);
        }
    }
}
