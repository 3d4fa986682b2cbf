//! What `--memory-at-alloc`'s libcuda probes report: a process starting CUDA (its
//! device numbering and started cap read for the accounting; one outside any
//! environment that made a context judged at once), and an allocation past its
//! environment's cap (said, counted, told to its user).

use super::refusals::Paced;
use super::{Around, Wanted, told};
use crate::genv_lines;
use crate::intake::{AllocOutcome, CudaCall, CudaStart, OverCap};

/// A process started CUDA. At its first CUDA call seen its device numbering, and the
/// cap it was started with, are read for the probes' accounting. Once it has made a
/// context (the call succeeded: `cuInit` alone is only a probe, as
/// `torch.cuda.is_available()` is), it is computing, which is what the non-env rule
/// waits for NVML to show (on a real GPU some 230 ms after the open, mostly CUDA's own
/// start-up): a process the kernel knows to be outside any environment (no
/// `GENV_ENVIRONMENT_ID` at its exec; not one still being resolved) is to be judged
/// now, as a GPU process on the GPU it opened (or GPU 0).
pub fn start(start: &CudaStart, around: &mut Around<'_>) -> Option<Wanted> {
    around.counts.cuda_starts += 1;
    // At its first CUDA call seen, whichever (the probes of a copy found at the open
    // in its `cuInit` see its contexts first).
    if let Some(alloc) = around.alloc.as_deref_mut() {
        alloc.cuda_started(start.pid, around.devices);
    }
    if start.call == CudaCall::Init {
        return None;
    }
    if !around.non_env_rule || !around.mirror.definitely_outside(start.pid) {
        return None;
    }
    Some(Wanted::Judge {
        pid: start.pid,
        at_ns: start.at_ns,
    })
}

/// The kernel found an allocation past its environment's cap. A refused one is
/// counted always, and said where `said` allows (see [`super::refusals`]: a program that
/// lives on often tries again at once), with the refusals held back since.
pub fn over_cap(over: &OverCap, said: Paced, around: &mut Around<'_>) -> Option<Wanted> {
    let counts = &mut *around.counts;
    match over.outcome {
        AllocOutcome::Killed => counts.killed_at_alloc += 1,
        AllocOutcome::Reported => counts.reported_at_alloc += 1,
        // Counted by the kernel, every one (`Mirror::report`).
        AllocOutcome::Refused => {}
        AllocOutcome::KillFailed => {}
    }
    let held_back = match said {
        Paced::HeldBack => return None,
        Paced::Now { held_back } => held_back,
    };
    let alloc = around.alloc.as_deref();
    if let Some(alloc) = alloc {
        let since = match held_back {
            0 => String::new(),
            n => format!(" ({n} more refused since the last line)"),
        };
        genv_lines::print(&format!("{}{since}", alloc.line(over)));
    }
    told::alloc(around.notifier, alloc.and_then(|a| a.held_to(over)), over);
    (over.outcome == AllocOutcome::Killed).then_some(Wanted::Settle(over.pid))
}
