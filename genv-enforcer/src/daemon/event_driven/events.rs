//! What each kernel event does in the daemon: exec, fork and exit keep the process
//! table and the identities current; a GPU open is said, counted and watched (or, after
//! a kill in the kernel, its GPU swept of other holders); the libcuda probes'
//! allocations past a cap and CUDA starts (`--memory-at-alloc`) are said, and a CUDA
//! start outside any environment judged at once.

use std::collections::HashSet;
use std::time::Instant;

use super::{Batch, DRAIN_EVERY, DRAIN_IDLE, Daemon, monotonic_ns};
use crate::cycle::Scope;
use crate::daemon::schedule::Schedule;
use crate::intake::{
    AllocOutcome, CudaCall, CudaStart, EventIntake, GpuOpen, KernelEvent, OverCap, Verdict,
};
use crate::sync::KernelSide;

impl Daemon {
    /// Handles what the intake holds: every event, then any undecodable record or loss,
    /// either of which means the daemon's view may be stale, so a full cycle resyncs it.
    pub(super) fn take_in(
        &mut self,
        intake: &mut EventIntake,
        batch: &mut Batch,
        schedule: &mut Schedule,
    ) {
        let now = Instant::now();
        intake.drain_now(&mut batch.events, &mut batch.unknown);
        self.drain_every = if batch.events.is_empty() {
            (self.drain_every * 2).min(DRAIN_IDLE)
        } else {
            DRAIN_EVERY
        };
        for event in batch.events.drain(..) {
            self.on_event(event, now);
        }
        // Exits waiting for their processes to be gone: looked at again soon.
        if self.kernel.as_mut().is_some_and(KernelSide::settle_exits) {
            self.drain_every = DRAIN_EVERY;
        }
        if let Some(kernel) = self.kernel.as_mut() {
            kernel.run_due_looks(self.enforcer.builder.devices());
        }
        self.sweep_holders();
        if let Some(first) = batch.unknown.first() {
            if self.undecodable.first(()) {
                tracing::warn!("{first}; treating it as a lost event");
            }
            batch.unknown.clear();
            schedule.full_now(now);
        }
        let lost = intake.newly_lost();
        if lost > 0 {
            self.status.counts.lost_events += lost;
            if let Some(metrics) = &self.metrics {
                metrics.resynced();
            }
            tracing::warn!(
                "The kernel lost {lost} events (its ring buffer was full); running a full cycle to resynchronise"
            );
            schedule.full_now(now);
        }
    }

    fn on_event(&mut self, event: KernelEvent, now: Instant) {
        match event {
            KernelEvent::Exec { pid, unresolved } => self.on_exec(pid, unresolved),
            KernelEvent::Fork {
                child, unresolved, ..
            } => {
                self.status.counts.fork_events += 1;
                if let Some(kernel) = self.kernel.as_mut() {
                    if unresolved {
                        kernel.resolve_identity(child, self.settings.kernel.verbose);
                    }
                    kernel.place_probes(child, self.enforcer.builder.devices());
                }
            }
            KernelEvent::Exit { pid } => {
                self.status.counts.exit_events += 1;
                if let Some(kernel) = self.kernel.as_mut() {
                    kernel.exiting(pid);
                }
                self.enforcer.builder.forget(pid);
                self.watchlist.remove(pid);
                self.settled.remove(&pid);
            }
            KernelEvent::CudaStart(start) => self.on_cuda_start(start, now),
            KernelEvent::Alloc(over) => self.on_over_cap(&over, now),
            KernelEvent::Open(open) => self.on_open(open, now),
        }
    }

    fn on_exec(&mut self, pid: u32, unresolved: bool) {
        self.status.counts.exec_events += 1;
        self.enforcer.builder.forget(pid);
        let Some(kernel) = self.kernel.as_mut() else {
            return;
        };
        // A new image: the old one's GPU memory went with its address space.
        kernel.execed(pid);
        if unresolved {
            kernel.resolve_identity(pid, self.settings.kernel.verbose);
        }
        kernel.place_probes(pid, self.enforcer.builder.devices());
    }

    /// A GPU open, with what the kernel decided about it: said (`--verbose`, and a
    /// genv-style line for a refusal or kill), counted, and what was let through watched.
    fn on_open(&mut self, open: GpuOpen, now: Instant) {
        self.status.counts.open_events += 1;
        if let Some(kernel) = self.kernel.as_mut() {
            kernel.opened(open.pid, open.uid, self.enforcer.builder.devices());
        }
        if self.settings.kernel.verbose {
            tracing::info!(
                target: "event", "Process {} (thread {}) {} GPU {} (node {}:{}) [{}; {}]",
                open.pid,
                open.tid,
                open.tier.open_verb(),
                open.index,
                open.major,
                open.minor,
                open.tier,
                open.verdict.describe()
            );
        }
        if let Some(line) = self.decision_lines.line(&open, now) {
            println!("{line}");
        }
        self.tell_open(&open);
        let counts = &mut self.status.counts;
        match open.verdict {
            Verdict::Refused => counts.refused += 1,
            Verdict::Killed => {
                counts.killed += 1;
                self.to_sweep.insert(open.index);
            }
            Verdict::KillFailed => {
                self.to_sweep.insert(open.index);
                tracing::error!(
                    "The kernel could not kill process {} when it opened GPU {}: the open returned; the daemon kills the holders now",
                    open.pid,
                    open.index
                );
                self.watchlist.add(open, now);
            }
            // Let through: watched, and checked against genv's rules.
            _ => self.watchlist.add(open, now),
        }
    }

    /// After the kernel killed openers: whoever still holds those GPUs outside any
    /// environment (a process sharing the opener's file table) is killed too. One sweep
    /// of `/proc` per batch of events, however many kills it held.
    fn sweep_holders(&mut self) {
        if self.to_sweep.is_empty() {
            return;
        }
        let gpus = std::mem::take(&mut self.to_sweep);
        let Some(kernel) = &self.kernel else {
            return;
        };
        for killed in kernel.sweep_holders(&self.settings.kernel, &gpus) {
            println!("{}", killed.line());
            self.tell_holder(&killed);
            self.status.counts.killed_holders += 1;
        }
    }

    /// The kernel found an allocation past its environment's cap.
    fn on_over_cap(&mut self, over: &OverCap, now: Instant) {
        let counts = &mut self.status.counts;
        match over.outcome {
            AllocOutcome::Killed => counts.killed_at_alloc += 1,
            AllocOutcome::Reported => counts.reported_at_alloc += 1,
            AllocOutcome::KillFailed => {}
        }
        if let Some(line) = self.kernel.as_ref().and_then(|k| k.alloc_line(over)) {
            println!("{line}");
        }
        self.tell_alloc(over);
        if over.outcome == AllocOutcome::Killed {
            self.settled.insert(over.pid, now);
        }
    }

    /// A process started CUDA. At its first CUDA call seen its device numbering, and the
    /// cap it was started with, are read for the probes' accounting. Once it has made a
    /// context (the call succeeded: `cuInit` alone is only a probe, as
    /// `torch.cuda.is_available()` is), it is computing, which is what the non-env rule
    /// waits for NVML to show (on a real GPU some 230 ms after the open, mostly CUDA's
    /// own start-up): a process the kernel knows to be outside any environment (no
    /// `GENV_ENVIRONMENT_ID` at its exec; not one still being resolved) is judged now,
    /// as a GPU process on the GPU it opened (or GPU 0).
    fn on_cuda_start(&mut self, start: CudaStart, now: Instant) {
        self.status.counts.cuda_starts += 1;
        let Some(kernel) = self.kernel.as_mut() else {
            return;
        };
        // At its first CUDA call seen, whichever (the probes of a copy found at the
        // open in its `cuInit` see its contexts first).
        kernel.cuda_started(start.pid, self.enforcer.builder.devices());
        if start.call == CudaCall::Init {
            return;
        }
        if !self.enforcer.rules.non_env_processes || !kernel.definitely_outside(start.pid) {
            return;
        }
        let index = self.watchlist.first_open(start.pid).map_or(0, |o| o.index);
        self.enforcer.builder.prove_computing(start.pid, index);
        let settled = self.settled(now);
        let summary = self
            .enforcer
            .check(Scope::Opened(&HashSet::from([start.pid])), &settled);
        self.count(&summary);
        if summary.terminated.contains(&start.pid) {
            let ms = monotonic_ns().saturating_sub(start.at_ns) as f64 / 1e6;
            tracing::info!(
                "Acted on process {} {ms:.2} ms after it started CUDA [uprobe]",
                start.pid
            );
            self.settled.insert(start.pid, Instant::now());
        }
    }
}
