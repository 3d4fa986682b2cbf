//! One full enforcement cycle, as genv runs it: snapshot under the global lock, all
//! rules, then one execution phase under the lock again.

use crate::actions::Executor;
use crate::report::Report;
use crate::rules::{self, Rules, Survey};
use crate::snapshot::{Snapshot, SnapshotBuilder};

pub struct Enforcer {
    pub builder: SnapshotBuilder,
    pub rules: Rules,
    pub executor: Executor,
}

/// What a cycle saw and did, for callers that count (tests, benchmarks, status).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CycleSummary {
    pub processes: usize,
    pub findings: usize,
    pub terminated: usize,
    pub detached: usize,
}

impl Enforcer {
    /// Takes a snapshot under genv's global lock and prints its warnings.
    pub fn snapshot(&mut self) -> std::io::Result<Snapshot> {
        let lock = self.builder.state().lock()?;
        let (snapshot, warnings) = self.builder.take();
        drop(lock);
        for warning in warnings {
            eprintln!("{warning}");
        }
        Ok(snapshot)
    }

    /// Runs one cycle. Nothing here ends the daemon: a lock that cannot be taken is
    /// reported and the cycle skipped.
    pub fn cycle(&mut self) -> CycleSummary {
        let snapshot = match self.snapshot() {
            Ok(snapshot) => snapshot,
            Err(e) => {
                eprintln!(
                    "[ERROR] Cannot take genv's lock in {}: {e}; skipping this cycle",
                    self.builder.state().root().display()
                );
                return CycleSummary::default();
            }
        };
        let surveys = [Survey {
            hostname: None,
            snapshot: &snapshot,
        }];
        let findings = rules::check(&surveys, &self.rules);
        for finding in &findings {
            println!("{}", finding.line(&[None]));
        }
        let report = Report::build(&surveys, &findings).remove(0);
        let summary = CycleSummary {
            processes: snapshot.processes.len(),
            findings: findings.len(),
            terminated: report.terminate.len(),
            detached: report.detach.iter().map(|d| d.envs.len()).sum(),
        };
        if !report.is_empty() {
            self.execute(&report);
        }
        summary
    }

    /// Carries out a report under genv's global lock.
    pub fn execute(&mut self, report: &Report) {
        let state = self.builder.state().clone();
        match state.lock() {
            Ok(_lock) => self.executor.execute(report, &state),
            Err(e) => eprintln!(
                "[ERROR] Cannot take genv's lock in {}: {e}; nothing was executed",
                state.root().display()
            ),
        }
    }
}
