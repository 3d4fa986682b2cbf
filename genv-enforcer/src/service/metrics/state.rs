//! The gauges an alert compares: the tier in use beside the one asked for, `--deny` in
//! force beside `--deny` asked for, and when the daemon's loop last published its
//! status (its heartbeat) and ran a full cycle. A scrape that answers does not show a
//! daemon at work (the endpoint has a thread of its own): the heartbeat does.

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Labels, labels};
use crate::kernel::{Tier, TierChoice};
use crate::service::status::Status;

#[derive(Default)]
pub(super) struct StateGauges {
    tier_info: Family<Labels, Gauge>,
    tier_level: Gauge,
    tier_configured_level: Gauge,
    deny_configured: Gauge,
    deny_in_force: Gauge,
    heartbeat: Gauge,
    last_full_cycle: Gauge,
    full_cycle_interval: Gauge<f64, AtomicU64>,
    /// `--bpf-tier` as given, for the info's `configured` label.
    configured: Mutex<Option<&'static str>>,
}

impl StateGauges {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "tier_info",
            "1, labelled with the open tier in use (none: no kernel programs) and \
             --bpf-tier as configured",
            self.tier_info.clone(),
        );
        registry.register(
            "tier_level",
            "The open tier in use: 4 lsm, 3 fmod_ret, 2 fentry, 1 tracepoint, 0 none",
            self.tier_level.clone(),
        );
        registry.register(
            "tier_configured_level",
            "The least tier --bpf-tier accepts, as tier_level counts: a forced tier's own, \
             1 for auto, 0 for none",
            self.tier_configured_level.clone(),
        );
        registry.register(
            "deny_configured",
            "1 where --deny is configured",
            self.deny_configured.clone(),
        );
        registry.register(
            "deny_in_force",
            "1 once --deny is armed in the kernel's policy",
            self.deny_in_force.clone(),
        );
        self.register_times(registry);
    }

    fn register_times(&self, registry: &mut Registry) {
        registry.register(
            "heartbeat_timestamp_seconds",
            "When the daemon's loop last published its status (every 10 s at least), \
             seconds since the epoch",
            self.heartbeat.clone(),
        );
        registry.register(
            "last_full_cycle_timestamp_seconds",
            "When the last full cycle ran, seconds since the epoch (0 before the first)",
            self.last_full_cycle.clone(),
        );
        registry.register(
            "full_cycle_interval_seconds",
            "The full cycle's period (--interval)",
            self.full_cycle_interval.clone(),
        );
    }

    pub(super) fn configured(&self, tier: TierChoice, deny: bool) {
        self.tier_configured_level.set(tier.least_level());
        self.deny_configured.set(i64::from(deny));
        *self.configured.lock().unwrap_or_else(|e| e.into_inner()) = Some(tier.name());
    }

    pub(super) fn follow(&self, status: &Status) {
        let tier = status.tier.as_deref();
        let level = Tier::BEST_FIRST
            .iter()
            .find(|t| Some(t.name()) == tier)
            .map_or(0, |t| t.level());
        self.tier_level.set(level);
        let configured = *self.configured.lock().unwrap_or_else(|e| e.into_inner());
        let info = [
            ("tier", tier.unwrap_or("none")),
            ("configured", configured.unwrap_or("unknown")),
        ];
        // The tier is loaded once per run: one series, set once and kept.
        self.tier_info.get_or_create(&labels(&info)).set(1);
        self.deny_in_force.set(i64::from(status.deny_in_force));
        self.heartbeat.set(status.updated as i64);
        if let Some(cycle) = &status.last_cycle {
            self.last_full_cycle.set(cycle.at as i64);
        }
        self.full_cycle_interval.set(status.interval_s);
    }
}
