//! SIGHUP: the configuration file read again, and what can change without touching the
//! kernel programs put in force at once: the rules, the intervals, how reports are
//! carried out, whether users are told on their terminals. What cannot (the tier, `--deny`, pins, the state directory, NVML) is
//! kept, and said to need a restart. The reading itself is the command line's (`cli`),
//! handed down as a [`Reloader`].

use std::time::Duration;

use crate::actions::ExecutorConfig;
use crate::cycle::Enforcer;
use crate::notify::NotifyMode;
use crate::rules::Rules;

use super::signals::notify;

/// What a reload can change in a running daemon.
#[derive(Debug)]
pub struct Reloadable {
    pub rules: Rules,
    pub interval: Duration,
    /// The event-driven mode's memory poll.
    pub memory_interval: Option<Duration>,
    pub execution: ExecutorConfig,
    /// `--notify`: whether users are told on their terminals.
    pub notify: NotifyMode,
}

/// Reads the configuration again: the new settings, and warnings about changes that
/// need a restart.
pub type ReloadFn = dyn FnMut() -> anyhow::Result<(Reloadable, Vec<String>)> + Send;

pub struct Reloader(pub Box<ReloadFn>);

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reloader")
    }
}

impl Reloader {
    /// Reads again; `None` (said why) when the file cannot be used, and the running
    /// settings stay.
    pub fn read(&mut self) -> Option<Reloadable> {
        match (self.0)() {
            Ok((reloadable, warnings)) => {
                for warning in warnings {
                    tracing::warn!("SIGHUP: {warning}");
                }
                Some(reloadable)
            }
            Err(e) => {
                tracing::error!("SIGHUP: {e:#}; the running settings stay");
                None
            }
        }
    }
}

/// The periods a reload set, for the caller's schedule (the rules and execution settings
/// are already in force on the enforcer).
pub struct NewPeriods {
    pub interval: Duration,
    pub memory_interval: Option<Duration>,
}

/// SIGHUP, in either daemon: `--config` read again (systemd told `RELOADING=1`
/// meanwhile) and its rules and execution settings put in force on `enforcer`; processes
/// already signalled keep their grace period. `None` when nothing changed: no file to
/// read, or one that cannot be used (said why; the running settings stay).
pub fn reload(reloader: Option<&mut Reloader>, enforcer: &mut Enforcer) -> Option<NewPeriods> {
    let Some(reloader) = reloader else {
        tracing::info!("SIGHUP: no --config file to read again; nothing changes");
        return None;
    };
    notify("RELOADING=1");
    let periods = reloader.read().map(|new| {
        enforcer.rules = new.rules;
        enforcer.executor.reconfigure(new.execution);
        if let Some(notifier) = enforcer.executor.notifier() {
            notifier.set_mode(new.notify);
        }
        NewPeriods {
            interval: new.interval,
            memory_interval: new.memory_interval,
        }
    });
    notify("READY=1");
    periods
}
