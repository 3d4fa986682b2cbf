//! Carrying out a report: terminations first, then detaches, as genv's `execute` does,
//! with genv's output lines.

pub mod kill;

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use rustix::process::Signal;

pub use kill::{Outcome, Protected};

use crate::report::Report;
use crate::snapshot::join_indices;
use crate::state::StateDir;

/// How the executor acts.
#[derive(Clone, Debug)]
pub struct ExecutorConfig {
    /// Print what would be done, do nothing.
    pub dry_run: bool,
    /// `GENV_TERMINATE_PROCESSES=0` turns signalling off (genv's switch).
    pub signals: bool,
    /// SIGKILL a process still alive this long after SIGTERM; `None` never.
    pub kill_after: Option<Duration>,
}

/// A process sent SIGTERM and watched until it exits or its grace period ends.
struct Pending {
    pidfd: OwnedFd,
    pid: u32,
    eid: Option<String>,
    deadline: Instant,
}

pub struct Executor {
    config: ExecutorConfig,
    protected: Protected,
    pending: Vec<Pending>,
}

impl Executor {
    pub fn new(config: ExecutorConfig) -> Self {
        Self {
            config,
            protected: Protected::for_this_process(),
            pending: Vec::new(),
        }
    }

    fn prefix(&self) -> &'static str {
        if self.config.dry_run {
            "[DRY-RUN] "
        } else {
            ""
        }
    }

    /// Carries out `report`. The caller holds genv's global lock (detaches write
    /// `devices.json`).
    pub fn execute(&mut self, report: &Report, state: &StateDir) {
        for process in &report.terminate {
            self.terminate(
                process.pid,
                process.start_time,
                process.eid.as_deref(),
                &join_indices(process.indices()),
            );
        }
        for detach in &report.detach {
            for env in &detach.envs {
                println!(
                    "{}Detaching environment {} of user {} from device {}",
                    self.prefix(),
                    env.eid,
                    env.username.as_deref().unwrap_or("N/A"),
                    detach.index
                );
                if self.config.dry_run {
                    continue;
                }
                if let Err(e) = state.detach(&env.eid, detach.index) {
                    tracing::error!(
                        "Cannot detach environment {} from device {}: {e}",
                        env.eid,
                        detach.index
                    );
                }
            }
        }
    }

    fn terminate(&mut self, pid: u32, start_time: Option<u64>, eid: Option<&str>, indices: &str) {
        if let Some(reason) = self.protected.reason(pid) {
            tracing::warn!("Not terminating process {pid}: {reason}");
            return;
        }
        println!(
            "{}Terminating process {pid} from environment {} that is running on GPU(s) {indices}",
            self.prefix(),
            eid.unwrap_or("N/A")
        );
        if self.config.dry_run || !self.config.signals {
            return;
        }
        let sent = kill::open(pid, start_time, &self.protected)
            .and_then(|pidfd| kill::send(&pidfd, Signal::TERM).map(|()| pidfd));
        match sent {
            Ok(pidfd) => {
                if let Some(grace) = self.config.kill_after {
                    self.pending.retain(|p| p.pid != pid);
                    self.pending.push(Pending {
                        pidfd,
                        pid,
                        eid: eid.map(str::to_owned),
                        deadline: Instant::now() + grace,
                    });
                }
            }
            Err(Outcome::Refused(reason)) => {
                tracing::warn!("Not terminating process {pid}: {reason}")
            }
            Err(Outcome::PermissionDenied) => {
                tracing::error!("Not enough permissions to terminate process {pid}")
            }
            Err(_) => tracing::debug!("Process {pid} already terminated"),
        }
    }

    /// Sends SIGKILL to processes whose grace period ended; forgets those that exited.
    pub fn escalate(&mut self, now: Instant) {
        let grace = self.config.kill_after.unwrap_or_default().as_secs_f64();
        self.pending.retain(|p| {
            if kill::has_exited(&p.pidfd) {
                return false;
            }
            if now < p.deadline {
                return true;
            }
            println!(
                "Killing process {} from environment {} that is still running {grace}s after SIGTERM",
                p.pid,
                p.eid.as_deref().unwrap_or("N/A")
            );
            if let Err(Outcome::PermissionDenied) = kill::send(&p.pidfd, Signal::KILL) {
                tracing::error!("Not enough permissions to kill process {}", p.pid);
            }
            false
        });
    }

    /// When the next escalation is due, if any process is being watched.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.pending.iter().map(|p| p.deadline).min()
    }

    /// New settings (SIGHUP); processes already signalled keep their grace period.
    pub fn reconfigure(&mut self, config: ExecutorConfig) {
        self.config = config;
    }

    /// For a one-shot run: waits until every terminated process exited or was killed.
    pub fn finish(&mut self) {
        while let Some(deadline) = self.next_deadline() {
            let now = Instant::now();
            self.escalate(now);
            if self.pending.is_empty() {
                break;
            }
            std::thread::sleep(
                deadline
                    .saturating_duration_since(now)
                    .min(Duration::from_millis(20)),
            );
        }
    }
}

#[cfg(test)]
mod tests;
