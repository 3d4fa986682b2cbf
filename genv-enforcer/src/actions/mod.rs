//! Carrying out a report: terminations first, then detaches, as genv's `execute` does,
//! with genv's output lines.

pub mod kill;

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::process::Signal;

pub use kill::{Outcome, Protected};

use crate::genv_lines;
use crate::notify::{self, Facts, Notifier, Subject};
use crate::report::{Report, Why};
use crate::snapshot::{GpuProcess, join_indices};
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
    /// What its user was told at the SIGTERM, to tell them of the SIGKILL too.
    told: Option<Told>,
}

/// A terminated process as its user was told of it.
struct Told {
    subject: Subject,
    why: Why,
}

pub struct Executor {
    config: ExecutorConfig,
    protected: Protected,
    pending: Vec<Pending>,
    /// Where each termination is told to the user it is done to, and why.
    notifier: Option<Arc<Notifier>>,
}

impl Executor {
    pub fn new(config: ExecutorConfig) -> Self {
        Self {
            config,
            protected: Protected::for_this_process(),
            pending: Vec::new(),
            notifier: None,
        }
    }

    /// Tells each process's user what was done and why (for the processes a report
    /// says why of).
    pub fn with_notifier(mut self, notifier: Arc<Notifier>) -> Self {
        self.notifier = Some(notifier);
        self
    }

    /// Where the daemon tells of what the kernel decided, too.
    pub fn notifier(&self) -> Option<&Arc<Notifier>> {
        self.notifier.as_ref()
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
            self.terminate(process, report.why.get(&process.pid));
        }
        for detach in &report.detach {
            for env in &detach.envs {
                genv_lines::print(&format!(
                    "{}Detaching environment {} of user {} from device {}",
                    self.prefix(),
                    env.eid,
                    env.username.as_deref().unwrap_or("N/A"),
                    detach.index
                ));
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

    fn terminate(&mut self, process: &GpuProcess, why: Option<&Why>) {
        let (pid, start_time) = (process.pid, process.start_time);
        let eid = process.eid.as_deref();
        if let Some(reason) = self.protected.reason(pid) {
            tracing::warn!("Not terminating process {pid}: {reason}");
            return;
        }
        genv_lines::print(&format!(
            "{}Terminating process {pid} from environment {} that is running on GPU(s) {}",
            self.prefix(),
            eid.unwrap_or("N/A"),
            join_indices(process.indices())
        ));
        if self.config.dry_run || !self.config.signals {
            return;
        }
        let mut told = None;
        let sent = kill::open(pid, start_time, &self.protected).and_then(|pidfd| {
            // Who it is and where its terminal is, while it is still there to read.
            told = self.notifier.as_ref().zip(why).and_then(|(_, why)| {
                let subject = Subject::of_process(pid, start_time)?;
                Some(Told {
                    subject,
                    why: why.clone(),
                })
            });
            kill::send(&pidfd, Signal::TERM).map(|()| pidfd)
        });
        match sent {
            Ok(pidfd) => {
                if let Some(told) = &told {
                    let action = match told.why.detached {
                        true => notify::Done::Detached,
                        false => notify::Done::Terminated,
                    };
                    self.tell(pid, eid, told, action);
                }
                if let Some(grace) = self.config.kill_after {
                    self.pending.retain(|p| p.pid != pid);
                    self.pending.push(Pending {
                        pidfd,
                        pid,
                        eid: eid.map(str::to_owned),
                        deadline: Instant::now() + grace,
                        told,
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

    /// Tells process `pid`'s user what was done to it, and why.
    fn tell(&self, pid: u32, eid: Option<&str>, told: &Told, action: notify::Done) {
        let Some(notifier) = &self.notifier else {
            return;
        };
        let facts = Facts {
            pid,
            uid: told.subject.uid,
            comm: &told.subject.comm,
            env: eid.map(|eid| (eid, told.why.env_name.as_deref())),
            gpus: told.why.gpus.clone(),
            rule: told.why.rule.clone(),
            action,
        };
        notifier.decided(facts, told.subject.terminal);
    }

    /// Sends SIGKILL to processes whose grace period ended; forgets those that exited.
    pub fn escalate(&mut self, now: Instant) {
        let grace = self.config.kill_after.unwrap_or_default().as_secs_f64();
        let mut killed = Vec::new();
        self.pending.retain_mut(|p| {
            if kill::has_exited(&p.pidfd) {
                return false;
            }
            if now < p.deadline {
                return true;
            }
            genv_lines::print(&format!(
                "Killing process {} from environment {} that is still running {grace}s after SIGTERM",
                p.pid,
                p.eid.as_deref().unwrap_or("N/A")
            ));
            match kill::send(&p.pidfd, Signal::KILL) {
                Ok(()) => killed.extend(p.told.take().map(|told| (p.pid, p.eid.take(), told))),
                Err(Outcome::PermissionDenied) => {
                    tracing::error!("Not enough permissions to kill process {}", p.pid)
                }
                Err(_) => {}
            }
            false
        });
        for (pid, eid, told) in killed {
            self.tell(pid, eid.as_deref(), &told, notify::Done::Killed);
        }
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
mod notify_tests;
#[cfg(test)]
mod tests;
