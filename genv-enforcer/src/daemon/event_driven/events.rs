//! The daemon's reactions to the libcuda probes (`--memory-at-alloc`): what the kernel
//! decided about an allocation past a cap, and a process starting CUDA.

use std::collections::HashSet;
use std::time::Instant;

use super::{Daemon, monotonic_ns};
use crate::cycle::Scope;
use crate::intake::{AllocOutcome, CudaCall, CudaStart, OverCap};

impl Daemon {
    /// The kernel found an allocation past its environment's cap.
    pub(super) fn on_over_cap(&mut self, over: &OverCap, now: Instant) {
        let counts = &mut self.status.counts;
        match over.outcome {
            AllocOutcome::Killed => counts.killed_at_alloc += 1,
            AllocOutcome::Reported => counts.reported_at_alloc += 1,
            AllocOutcome::KillFailed => {}
        }
        if let Some(line) = self.kernel.as_ref().and_then(|k| k.alloc_line(over)) {
            println!("{line}");
        }
        if over.outcome == AllocOutcome::Killed {
            self.settled.insert(over.pid, now);
        }
    }

    /// A process started CUDA. At its first CUDA call seen its device numbering, and the
    /// cap it was started with, are read for the probes' accounting. Once it has made a context (the call succeeded: `cuInit` alone is
    /// only a probe, as `torch.cuda.is_available()` is), it is computing, which is what
    /// the non-env rule waits for NVML to show (on a real GPU some 230 ms after the
    /// open, mostly CUDA's own start-up): a process the kernel knows to be outside any
    /// environment (no `GENV_ENVIRONMENT_ID` at its exec; not one still being resolved)
    /// is judged now, as a GPU process on the GPU it opened (or GPU 0).
    pub(super) fn on_cuda_start(&mut self, start: CudaStart, now: Instant) {
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
