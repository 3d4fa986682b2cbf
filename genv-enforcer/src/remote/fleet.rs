//! One remote cycle, as genv's `remote enforce` runs it: a snapshot from every host at
//! once, the rules over all of them together, then each host's report executed on that
//! host alone, its lines reprinted with the `[host] ` prefix. What a host answers is
//! parsed and checked before anything is decided from it; a host that fails, times out
//! or answers nonsense is reported and left out of the cycle, never acted on.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::hosts::Host;
use super::metrics::FleetMetrics;
use super::plain_hosts::{self, PlainHosts};
use super::ssh::{HostAnswer, Ssh, SshError};
use super::validate;
use crate::genv_lines;
use crate::report::{Report, reasons};
use crate::rules::{self, Rules, Survey};
use crate::snapshot::{Snapshot, WireError};

pub struct Fleet {
    pub hosts: Vec<Host>,
    pub ssh: Ssh,
    pub rules: Rules,
    /// `--remote-command`, in words (`sudo genv-enforcer`).
    pub remote: Vec<String>,
    pub errors: ErrorPolicy,
    /// How long one host may take to answer one command.
    pub host_timeout: Duration,
    /// `--max-parallel`: how many snapshots are asked for at once.
    pub parallel: Arc<Semaphore>,
    /// And how many reports are executed at once: apart, so that hosts slow to answer
    /// snapshots never hold up acting on the others.
    pub executing: Arc<Semaphore>,
    /// `--verbose`: each cycle's duration on stderr.
    pub verbose: bool,
    /// `--host-option`: flags after every `usage snapshot` and `usage watch` (where
    /// genv's state and NVML are on the host).
    pub host_options: Vec<String>,
    /// `--watch-option`: flags after `usage watch` alone.
    pub watch_options: Vec<String>,
    /// `--metrics-addr`: what is served there.
    pub metrics: Option<Arc<FleetMetrics>>,
    /// The hosts that refused a report with reasons: sent genv's alone.
    pub plain: PlainHosts,
}

/// The most a stream's heartbeat is asked to wait: a few seconds.
const HEARTBEAT_MAX: Duration = Duration::from_secs(5);

/// genv's `-e` and `-q`: what an SSH error does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorPolicy {
    /// Printed; the host is left out of the cycle (genv's default).
    Report,
    /// `-e`: the run ends with the error.
    Exit,
    /// `-q`: not printed.
    Quiet,
}

#[derive(Debug, thiserror::Error)]
pub enum HostFailure {
    #[error("{0}")]
    Ssh(#[from] SshError),
    /// The command ran and failed: its exit status and stderr.
    #[error("{0}")]
    Command(String),
    #[error("malformed snapshot: {0}")]
    Malformed(WireError),
    #[error("inconsistent snapshot: {0}")]
    Inconsistent(String),
}

impl HostFailure {
    /// A failure to run the command, which `-e` and `-q` are about; an answer that
    /// cannot be used is always reported.
    fn is_ssh(&self) -> bool {
        matches!(self, Self::Ssh(_) | Self::Command(_))
    }
}

/// Reads one host's snapshot: parsed as genv's, then checked for consistency.
pub fn read_snapshot(text: &[u8]) -> Result<Snapshot, HostFailure> {
    let text = std::str::from_utf8(text).map_err(|e| {
        HostFailure::Malformed(WireError::Shape(crate::state::model::ShapeError {
            path: String::new(),
            message: format!("not UTF-8: {e}"),
        }))
    })?;
    let snapshot = Snapshot::from_genv_json(text).map_err(HostFailure::Malformed)?;
    match validate::inconsistency(&snapshot) {
        Some(why) => Err(HostFailure::Inconsistent(why)),
        None => Ok(snapshot),
    }
}

impl Fleet {
    /// The remote command with these words after it.
    pub fn words(&self, sub: &[&str]) -> Vec<String> {
        let mut words = self.remote.clone();
        words.extend(sub.iter().map(|w| (*w).to_owned()));
        words
    }

    /// `usage snapshot`, as given to each host.
    pub fn snapshot_words(&self) -> Vec<String> {
        let mut words = self.words(&["usage", "snapshot"]);
        words.extend(self.host_options.iter().cloned());
        words
    }

    /// `usage watch`, with its heartbeat and the admin's options for it.
    pub fn watch_words(&self) -> Vec<String> {
        let beat = format!("{}", self.heartbeat().as_secs_f64());
        let mut words = self.words(&["usage", "watch", "--heartbeat", &beat]);
        words.extend(self.host_options.iter().cloned());
        words.extend(self.watch_options.iter().cloned());
        words
    }

    /// How often a quiet stream says it is alive: well within --host-timeout.
    pub fn heartbeat(&self) -> Duration {
        (self.host_timeout / 2).clamp(Duration::from_millis(100), HEARTBEAT_MAX)
    }

    /// How long a stream may stay silent before its host counts as hung: --host-timeout
    /// past the heartbeat it owes.
    pub fn silence_limit(&self) -> Duration {
        self.host_timeout + self.heartbeat()
    }

    /// `usage snapshot` on one host; what it said on stderr is reprinted with its
    /// prefix, as genv does.
    pub async fn snapshot(&self, host: usize) -> Result<Snapshot, HostFailure> {
        let _permit = self.parallel.acquire().await.expect("never closed");
        self.snapshot_now(host).await
    }

    /// [`Self::snapshot`] after an execute there: counted with the executes, so that it
    /// never queues behind snapshots of hosts slow to answer.
    pub async fn check(&self, host: usize) -> Result<Snapshot, HostFailure> {
        let _permit = self.executing.acquire().await.expect("never closed");
        self.snapshot_now(host).await
    }

    async fn snapshot_now(&self, host: usize) -> Result<Snapshot, HostFailure> {
        let words = self.snapshot_words();
        let answer = self
            .ssh
            .run(&self.hosts[host], &words, None, self.host_timeout)
            .await?;
        if !answer.status.success() {
            return Err(HostFailure::Command(answer.stderr));
        }
        for line in answer.stderr.lines() {
            genv_lines::eprint(&format!("[{}] {line}", self.hosts[host].name));
        }
        let snapshot = read_snapshot(&answer.stdout)?;
        self.answered(host);
        Ok(snapshot)
    }

    /// A snapshot of the host was read, for the metrics.
    pub fn answered(&self, host: usize) {
        if let Some(metrics) = &self.metrics {
            metrics.answered(host);
        }
    }

    /// Something came from the host, for the metrics.
    pub fn heard(&self, host: usize) {
        if let Some(metrics) = &self.metrics {
            metrics.heard(host);
        }
    }

    /// Snapshots of these hosts, taken concurrently, in host order.
    pub async fn snapshots(
        self: &Arc<Self>,
        hosts: impl IntoIterator<Item = usize>,
    ) -> Vec<(usize, Result<Snapshot, HostFailure>)> {
        let mut tasks = JoinSet::new();
        for host in hosts {
            let fleet = Arc::clone(self);
            tasks.spawn(async move { (host, fleet.snapshot(host).await) });
        }
        let mut taken: Vec<_> = tasks.join_all().await;
        taken.sort_by_key(|(host, _)| *host);
        taken
    }

    /// Says that a host failed, as `-e` and `-q` ask (genv's line for SSH errors).
    pub fn failed(&self, host: usize, failure: &HostFailure) -> Result<()> {
        if let Some(metrics) = &self.metrics {
            metrics.failed(host);
        }
        let name = &self.hosts[host].name;
        if failure.is_ssh() {
            let line = format!("Failed running SSH command on {name} ({failure})");
            match self.errors {
                ErrorPolicy::Exit => bail!(line),
                ErrorPolicy::Quiet => {}
                ErrorPolicy::Report => genv_lines::eprint(&line),
            }
        } else {
            tracing::error!(
                "[{name}] Refusing its answer ({failure}); nothing is decided or done on {name} until it answers well"
            );
        }
        Ok(())
    }

    /// The rules over these hosts' snapshots together: prints their lines and returns
    /// each host's report (empty ones left out).
    pub fn judge(&self, taken: &[(usize, &Snapshot)]) -> Vec<(usize, Report)> {
        self.judge_where(taken, |_, _| true)
    }

    /// [`Self::judge`], keeping only the reports `keep` accepts, and printing only the
    /// lines of findings that act on those hosts.
    pub fn judge_where(
        &self,
        taken: &[(usize, &Snapshot)],
        keep: impl Fn(usize, &Report) -> bool,
    ) -> Vec<(usize, Report)> {
        let surveys: Vec<Survey<'_>> = taken
            .iter()
            .map(|(host, snapshot)| Survey {
                hostname: Some(self.hosts[*host].name.as_str()),
                snapshot,
            })
            .collect();
        let findings = rules::check(&surveys, &self.rules);
        let reports: Vec<(usize, Report)> = Report::build(&surveys, &findings)
            .into_iter()
            .enumerate()
            .filter(|(survey, report)| !report.is_empty() && keep(taken[*survey].0, report))
            .collect();
        let acting = |survey: usize| reports.iter().any(|(s, _)| *s == survey);
        let names: Vec<Option<&str>> = surveys.iter().map(|s| s.hostname).collect();
        for finding in &findings {
            let acts = finding.host.is_some_and(acting)
                || finding.actions.iter().any(|a| acting(a.host()));
            if acts {
                genv_lines::print(&finding.line(&names));
            }
        }
        reports
            .into_iter()
            .map(|(survey, report)| (taken[survey].0, report))
            .collect()
    }

    /// `usage execute` on one host with its own report: with the reasons for its users
    /// (`--with-reasons`), unless the host refused them before or refuses them now.
    pub async fn execute_one(&self, host: usize, report: &Report) -> Result<HostAnswer, SshError> {
        let _permit = self.executing.acquire().await.expect("never closed");
        let mut answer = None;
        let now = std::time::Instant::now();
        if !self.plain.is_plain(host, now) {
            let words = self.words(&["usage", "execute", plain_hosts::FLAG]);
            match self
                .run_execute(host, &words, &reasons::to_json(report))
                .await
            {
                Ok(refused) if plain_hosts::refused_flag(&refused) => self.plain.mark(host, now),
                other => answer = Some(other),
            }
        }
        let answer = match answer {
            Some(answer) => answer,
            None => {
                let words = self.words(&["usage", "execute"]);
                self.run_execute(host, &words, &report.to_genv_json()).await
            }
        };
        if let (Some(metrics), Ok(done)) = (&self.metrics, &answer) {
            if done.status.success() {
                metrics.acted(host, report);
            }
        }
        answer
    }

    async fn run_execute(
        &self,
        host: usize,
        words: &[String],
        input: &str,
    ) -> Result<HostAnswer, SshError> {
        self.ssh
            .run(
                &self.hosts[host],
                words,
                Some(input.as_bytes()),
                self.host_timeout,
            )
            .await
    }

    /// Reprints what an execute said, with the host's prefix; `Ok(true)` if it ran.
    pub fn executed(&self, host: usize, answer: Result<HostAnswer, SshError>) -> Result<bool> {
        let name = &self.hosts[host].name;
        match answer {
            Ok(answer) if answer.status.success() => {
                for line in String::from_utf8_lossy(&answer.stdout).lines() {
                    genv_lines::print(&format!("[{name}] {line}"));
                }
                for line in answer.stderr.lines() {
                    genv_lines::eprint(&format!("[{name}] {line}"));
                }
                Ok(true)
            }
            Ok(answer) => self
                .failed(host, &HostFailure::Command(answer.stderr))
                .map(|()| false),
            Err(e) => self.failed(host, &HostFailure::Ssh(e)).map(|()| false),
        }
    }

    /// Each host's report executed there, concurrently; their output reprinted in host
    /// order.
    pub async fn execute(self: &Arc<Self>, reports: Vec<(usize, Report)>) -> Result<()> {
        let mut tasks = JoinSet::new();
        for (host, report) in reports {
            let fleet = Arc::clone(self);
            tasks.spawn(async move { (host, fleet.execute_one(host, &report).await) });
        }
        let mut done: Vec<_> = tasks.join_all().await;
        done.sort_by_key(|(host, _)| *host);
        for (host, answer) in done {
            self.executed(host, answer)?;
        }
        Ok(())
    }

    /// One polling cycle over every host.
    pub async fn cycle(self: &Arc<Self>) -> Result<()> {
        let started = std::time::Instant::now();
        let mut taken = Vec::new();
        for (host, snapshot) in self.snapshots(0..self.hosts.len()).await {
            match snapshot {
                Ok(snapshot) => taken.push((host, snapshot)),
                Err(failure) => self.failed(host, &failure)?,
            }
        }
        let views: Vec<(usize, &Snapshot)> = taken.iter().map(|(h, s)| (*h, s)).collect();
        let reports = self.judge(&views);
        let acted = reports.len();
        if !reports.is_empty() {
            self.execute(reports).await?;
        }
        if self.verbose {
            tracing::info!(
                "Cycle over {} hosts: {} answered, {acted} acted on, in {:.1} ms",
                self.hosts.len(),
                taken.len(),
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        Ok(())
    }
}
