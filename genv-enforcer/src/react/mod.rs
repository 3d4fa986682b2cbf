//! The reactions: what each kernel event leads to, decided by the event alone and what
//! this stage keeps (the GPU openers watched, the decision lines said, the GPUs to sweep).
//! A reaction takes one event and gives back what it wants done ([`Wanted`]); the
//! daemon does it. A new reaction is a file here and an arm in [`Reactions::on`].
//!
//! - [`lifecycle`]: exec, fork, exit;
//! - [`open`]: a GPU open, watched ([`watchlist`]) or, decided in the kernel, said
//!   ([`lines`]) and swept ([`holders`]);
//! - [`cuda`]: what `--memory-at-alloc`'s probes report;
//! - [`told`]: the kernel's decisions told to their users.

mod around;
mod cuda;
pub mod holders;
mod lifecycle;
pub mod lines;
mod open;
mod told;
mod wanted;
pub mod watchlist;

use std::collections::HashSet;
use std::time::Instant;

pub use around::Around;
pub use wanted::Wanted;

use crate::intake::{GpuOpen, KernelEvent};
use open::Opens;

/// The stage's state, and how it reacts.
pub struct Reactions {
    opens: Opens,
    /// `--verbose`: every event and identity resolved is said.
    verbose: bool,
    /// `--deny-root`: the sweep of a killed opener's GPUs takes root's holders too.
    deny_root: bool,
}

impl Reactions {
    pub fn new(verbose: bool, deny_root: bool) -> Self {
        Self {
            opens: Opens::default(),
            verbose,
            deny_root,
        }
    }

    /// One event: what it wants done, if anything.
    pub fn on(
        &mut self,
        event: KernelEvent,
        now: Instant,
        around: &mut Around<'_>,
    ) -> Option<Wanted> {
        let verbose = self.verbose;
        match event {
            KernelEvent::Exec { pid, unresolved } => {
                Some(lifecycle::exec(pid, unresolved, verbose, around))
            }
            KernelEvent::Fork {
                child, unresolved, ..
            } => {
                lifecycle::fork(child, unresolved, verbose, around);
                None
            }
            KernelEvent::Exit { pid } => {
                self.opens.watchlist.remove(pid);
                Some(lifecycle::exit(pid, around))
            }
            KernelEvent::CudaStart(start) => {
                let gpu = self.opens.watchlist.first_open(start.pid).map(|o| o.index);
                cuda::start(&start, gpu, around)
            }
            KernelEvent::Alloc(over) => cuda::over_cap(&over, around),
            KernelEvent::Open(open) => {
                self.opens.on_open(open, now, verbose, around);
                None
            }
        }
    }

    /// After a batch of events: the GPUs whose openers the kernel killed are swept of
    /// other holders, once for the batch.
    pub fn after_batch(&mut self, around: &mut Around<'_>) {
        self.opens.sweep_holders(self.deny_root, around);
    }

    /// The watched openers, if a check of them is due (see [`watchlist`]).
    pub fn due(&mut self, now: Instant) -> Option<HashSet<u32>> {
        self.opens.watchlist.due(now)
    }

    /// When the next check of a watched opener is due.
    pub fn next_wake(&self) -> Option<Instant> {
        self.opens.watchlist.next_wake()
    }

    /// A check saw `pid` with a compute context: its watch ends with its window.
    pub fn computing(&mut self, pid: u32) {
        self.opens.watchlist.computing(pid);
    }

    /// The open that started watching `pid`, for the reaction time.
    pub fn first_open(&self, pid: u32) -> Option<&GpuOpen> {
        self.opens.watchlist.first_open(pid)
    }
}
