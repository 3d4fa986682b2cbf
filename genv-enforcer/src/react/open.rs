//! A GPU open, with what the kernel decided about it: said (`--verbose`, and a
//! genv-style line for a refusal or kill), told to its user, counted; what was let
//! through is to be watched (checked against genv's rules by the daemon); after a kill
//! in the kernel, the GPU is swept of other holders ([`super::holders`]).

use std::collections::HashSet;
use std::time::Instant;

use super::lines::LineLimiter;
use super::{Around, Wanted, holders, told};
use crate::genv_lines;
use crate::intake::{GpuOpen, Verdict};

/// The open reaction's state.
#[derive(Default)]
pub struct Opens {
    lines: LineLimiter,
    /// GPUs the kernel killed an opener of since the last sweep for other holders.
    to_sweep: HashSet<u32>,
    /// The openers it killed meanwhile: told already, and dying, but maybe still
    /// holding the node when the sweep looks (they were killed, and told, twice).
    killed_openers: HashSet<u32>,
    /// Every GPU node is to be swept: the kernel skipped a run of an open program, so
    /// an open of any of them may have gone undecided.
    sweep_every: bool,
}

impl Opens {
    /// The open said, told and counted; what it wants done (its process watched, if it
    /// was let through).
    pub fn on_open(
        &mut self,
        open: GpuOpen,
        now: Instant,
        verbose: bool,
        around: &mut Around<'_>,
    ) -> Option<Wanted> {
        around.counts.open_events += 1;
        let notifier = around.notifier;
        let user = || notifier.map_or(open.uid, |n| n.owner(open.uid, Some(open.pid)));
        if let Some(alloc) = around.alloc.as_deref_mut() {
            // The examination budget is kept per user, not per uid; who that is, is
            // looked up once per process, not at every open.
            alloc.opened((open.pid, open.uid), user, around.devices);
        }
        if verbose {
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
        if let Some(line) = self.lines.line(&open, user, now) {
            genv_lines::print(&line);
        }
        told::open(around.notifier, &open);
        let counts = &mut *around.counts;
        match open.verdict {
            Verdict::Refused => {
                counts.refused += 1;
                None
            }
            Verdict::Killed => {
                counts.killed += 1;
                self.to_sweep.insert(open.index);
                self.killed_openers.insert(open.pid);
                None
            }
            Verdict::KillFailed => {
                self.to_sweep.insert(open.index);
                tracing::error!(
                    "The kernel could not kill process {} when it opened GPU {}: the open returned; the daemon kills the holders now",
                    open.pid,
                    open.index
                );
                Some(Wanted::Watch(open))
            }
            // Let through: watched, and checked against genv's rules.
            _ => Some(Wanted::Watch(open)),
        }
    }

    /// An open of any GPU may have gone undecided (the kernel skipped a run of an open
    /// program): the next sweep takes every GPU node's holders.
    pub fn sweep_every_gpu(&mut self) {
        self.sweep_every = true;
    }

    /// After the kernel killed openers: whoever still holds those GPUs outside any
    /// environment (a process sharing the opener's file table) is killed too. One sweep
    /// of `/proc` per batch of events, however many kills it held.
    pub fn sweep_holders(&mut self, deny_root: bool, around: &mut Around<'_>) {
        if self.to_sweep.is_empty() && !self.sweep_every {
            return;
        }
        let gpus = std::mem::take(&mut self.to_sweep);
        let every = std::mem::take(&mut self.sweep_every);
        let spared = std::mem::take(&mut self.killed_openers);
        let Some((policy, device_map)) = around.mirror.holders_view() else {
            return;
        };
        let which = (!every).then_some(&gpus);
        for killed in holders::sweep(policy, device_map, (which, &spared), deny_root) {
            genv_lines::print(&killed.line());
            told::holder(around.notifier, &killed);
            around.counts.killed_holders += 1;
        }
    }
}
