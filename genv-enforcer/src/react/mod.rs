//! The reactions: what each kernel event leads to, decided by the event alone and what
//! this stage keeps (the decision lines said, the GPUs to sweep).
//! A reaction takes one event and gives back what it wants done ([`Wanted`]); the
//! daemon does it. A new reaction is a file here and an arm in [`Reactions::on`].
//!
//! - [`lifecycle`]: exec, fork, exit;
//! - [`open`]: a GPU open, to be watched or, decided in the kernel, said ([`lines`])
//!   and swept ([`holders`]);
//! - [`cuda`]: what `--memory-at-alloc`'s probes report, a process's refusals said at
//!   the pace [`refusals`] allows;
//! - [`told`]: the kernel's decisions told to their users.

mod around;
mod cuda;
pub mod holders;
mod lifecycle;
pub mod lines;
mod open;
mod refusals;
mod told;
mod wanted;

use std::time::Instant;

pub use around::Around;
pub use wanted::Wanted;

use crate::genv_lines;
use crate::intake::KernelEvent;
use open::Opens;

/// The stage's state, and how it reacts.
pub struct Reactions {
    opens: Opens,
    refusals: refusals::Refusals,
    /// `--verbose`: every event and identity resolved is said.
    verbose: bool,
    /// `--deny-root`: the sweep of a killed opener's GPUs takes root's holders too.
    deny_root: bool,
}

impl Reactions {
    pub fn new(verbose: bool, deny_root: bool) -> Self {
        Self {
            opens: Opens::default(),
            refusals: refusals::Refusals::default(),
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
            KernelEvent::Exec {
                pid,
                unresolved,
                at_ns,
            } => {
                self.refusals_gone(pid);
                Some(lifecycle::exec((pid, at_ns), unresolved, verbose, around))
            }
            KernelEvent::Fork {
                child, unresolved, ..
            } => {
                lifecycle::fork(child, unresolved, verbose, around);
                None
            }
            KernelEvent::Exit { pid } => {
                self.refusals_gone(pid);
                Some(lifecycle::exit(pid, around))
            }
            KernelEvent::CudaStart(start) => cuda::start(&start, around),
            KernelEvent::Alloc(over) => {
                let said = self.refusals.say(&over, now);
                cuda::over_cap(&over, said, around)
            }
            KernelEvent::Open(open) => self.opens.on_open(open, now, verbose, around),
        }
    }

    /// A process's image ended (exec or exit): the refusals held back since its last
    /// line, if any, are said now (its user saw the first; the log gets the count).
    fn refusals_gone(&mut self, pid: u32) {
        if let Some(held_back) = self.refusals.forget(pid) {
            genv_lines::print(&format!(
                "Process {pid} had {held_back} more allocations refused since its last line (--memory-at-alloc refuse)"
            ));
        }
    }

    /// `--deny`'s decision skipped by the kernel for some GPU open: every GPU node is
    /// swept of holders outside environments after the batch.
    pub fn undecided_open(&mut self) {
        self.opens.sweep_every_gpu();
    }

    /// After a batch of events: the GPUs whose openers the kernel killed are swept of
    /// other holders, once for the batch.
    pub fn after_batch(&mut self, around: &mut Around<'_>) {
        self.opens.sweep_holders(self.deny_root, around);
    }
}
