//! SIGHUP in the event-driven daemon: the rules, intervals and execution settings read
//! again and put in force, the kernel programs left attached (see [`super::super::reload`]).

use std::time::Instant;

use super::super::schedule::Schedule;
use super::Daemon;
use crate::service::reload::reload;

impl Daemon {
    pub(super) fn reload(&mut self, schedule: &mut Schedule) {
        let Some(new) = reload(self.settings.reload.as_mut(), &mut self.enforcer) else {
            return;
        };
        let memory = new.memory_interval.unwrap_or(self.settings.memory_interval);
        self.settings.interval = new.interval;
        self.settings.memory_interval = memory;
        self.status.interval_s = new.interval.as_secs_f64();
        self.status.memory_interval_s = memory.as_secs_f64();
        // A full cycle at once, under the new rules.
        schedule.set_periods(Instant::now(), new.interval, memory);
        tracing::info!(
            "SIGHUP: settings read again and in force ({:?}, every {:?}); the kernel programs stay attached",
            self.enforcer.rules,
            new.interval
        );
    }
}
