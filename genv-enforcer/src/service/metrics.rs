//! `--metrics-addr`: a Prometheus endpoint (`GET /metrics`, the text format, through the
//! `prometheus-client` crate). Off by default.
//!
//! What it counts: kernel events by kind; decisions by rule and action (those of the
//! rules, and those the kernel made at the open or the allocation); the time from a GPU
//! open to the action on it; lost events and the resynchronisations they caused; the
//! full cycle's duration; the tier in use and `--deny`, each beside what was asked for;
//! when the daemon's loop last published (its heartbeat) and ran a full cycle; NVML's
//! failures. Counters that the status file already keeps are carried over from it as
//! it is published (every second at most, every [`super::status::HEARTBEAT`] at
//! least); the timings are observed where they are measured. The alerting rules in
//! `deploy/prometheus` read these names: keep them.
//!
//! The endpoint ([`endpoint`]) answers one request per connection and serves nothing but
//! `/metrics`; idle or slow clients cannot keep a scrape out. Bind it to an address only
//! the scraper reaches all the same.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::status::{Counts, Status};
use crate::kernel::TierChoice;

mod endpoint;
mod state;
mod text_format;

use state::StateGauges;

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    events: Family<Labels, Counter>,
    decisions: Family<Labels, Counter>,
    reaction: Histogram,
    cycle: Histogram,
    lost: Counter,
    skipped: Family<Labels, Counter>,
    resyncs: Counter,
    /// The tier and `--deny`, in force and asked for; the heartbeat.
    state: StateGauges,
    nvml_errors: Counter,
    /// What was carried over from the status last time.
    seen: Mutex<(Counts, u64)>,
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let mut registry = Registry::with_prefix("genv_enforcer");
        let metrics = Self {
            events: Family::default(),
            decisions: Family::default(),
            // 50 µs to about 1.6 s.
            reaction: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            // 100 µs to about 3.3 s.
            cycle: Histogram::new(exponential_buckets(0.000_1, 2.0, 16)),
            lost: Counter::default(),
            skipped: Family::default(),
            resyncs: Counter::default(),
            state: StateGauges::default(),
            nvml_errors: Counter::default(),
            seen: Mutex::new((Counts::default(), 0)),
            registry: Registry::default(),
        };
        metrics.register(&mut registry);
        Arc::new(Self {
            registry,
            ..metrics
        })
    }

    /// Names and explains each metric in `registry`.
    fn register(&self, registry: &mut Registry) {
        registry.register("events", "Kernel events seen, by kind", self.events.clone());
        registry.register(
            "decisions",
            "Actions decided, by rule and action (at_open and at_alloc: in the kernel)",
            self.decisions.clone(),
        );
        registry.register(
            "reaction_seconds",
            "From a GPU open to the action on its process",
            self.reaction.clone(),
        );
        registry.register("cycle_seconds", "Full cycles' duration", self.cycle.clone());
        registry.register(
            "lost_events",
            "Events the ring buffer had no room for",
            self.lost.clone(),
        );
        registry.register(
            "skipped_runs",
            "Runs of the kernel programs the kernel skipped (its recursion guard), by \
             programs: open (a GPU open undecided) or lifecycle (exec, fork, exit)",
            self.skipped.clone(),
        );
        registry.register(
            "resyncs",
            "Full cycles run to resynchronise after lost events or skipped runs",
            self.resyncs.clone(),
        );
        self.state.register(registry);
        registry.register(
            "nvml_errors",
            "NVML loads and queries that failed",
            self.nvml_errors.clone(),
        );
    }

    /// What was asked for: `--bpf-tier` and `--deny`.
    pub fn configured(&self, tier: TierChoice, deny: bool) {
        self.state.configured(tier, deny);
    }

    /// Carries over what the status counted since the last call, and what it says is in
    /// force.
    pub fn follow(&self, status: &Status, nvml_errors: u64) {
        self.state.follow(status);
        let counts = &status.counts;
        let mut seen = self.seen.lock().expect("not poisoned");
        let (last, last_nvml) = &*seen;
        let add =
            |family: &Family<Labels, Counter>, pairs: &[(&str, &str)], now: u64, before: u64| {
                let delta = now.saturating_sub(before);
                if delta > 0 {
                    family.get_or_create(&labels(pairs)).inc_by(delta);
                }
            };
        for (kind, now, before) in [
            ("exec", counts.exec_events, last.exec_events),
            ("fork", counts.fork_events, last.fork_events),
            ("exit", counts.exit_events, last.exit_events),
            ("open", counts.open_events, last.open_events),
            ("cuda_start", counts.cuda_starts, last.cuda_starts),
        ] {
            add(&self.events, &[("kind", kind)], now, before);
        }
        let at_open = [
            ("refuse_at_open", counts.refused, last.refused),
            ("kill_at_open", counts.killed, last.killed),
        ];
        for (action, now, before) in at_open {
            add(
                &self.decisions,
                &[("rule", "non-env-processes"), ("action", action)],
                now,
                before,
            );
        }
        for (action, now, before) in at_alloc(counts, last) {
            add(
                &self.decisions,
                &[("rule", "env-memory"), ("action", action)],
                now,
                before,
            );
        }
        self.follow_losses(counts, last);
        self.nvml_errors
            .inc_by(nvml_errors.saturating_sub(*last_nvml));
        *seen = (counts.clone(), nvml_errors);
    }

    /// The events lost and the runs the kernel skipped since the last call.
    fn follow_losses(&self, counts: &Counts, last: &Counts) {
        self.lost
            .inc_by(counts.lost_events.saturating_sub(last.lost_events));
        for (programs, now, before) in [
            ("open", counts.skipped_open_runs, last.skipped_open_runs),
            (
                "lifecycle",
                counts.skipped_lifecycle_runs,
                last.skipped_lifecycle_runs,
            ),
        ] {
            let delta = now.saturating_sub(before);
            if delta > 0 {
                (self
                    .skipped
                    .get_or_create(&labels(&[("programs", programs)])))
                .inc_by(delta);
            }
        }
    }

    /// The rules' decisions of one check.
    pub fn decided(&self, decisions: &[(&str, &str)]) {
        for (rule, action) in decisions {
            self.decisions
                .get_or_create(&labels(&[("rule", rule), ("action", action)]))
                .inc();
        }
    }

    pub fn reacted(&self, after: Duration) {
        self.reaction.observe(after.as_secs_f64());
    }

    pub fn cycled(&self, took: Duration) {
        self.cycle.observe(took.as_secs_f64());
    }

    pub fn resynced(&self) {
        self.resyncs.inc();
    }

    fn text(&self) -> String {
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("a String takes any text");
        text
    }
}

/// What an endpoint serves: the text format, rendered at each scrape.
pub trait Exposition: Send + Sync + 'static {
    fn text(&self) -> String;
}

impl Exposition for Metrics {
    fn text(&self) -> String {
        Metrics::text(self)
    }
}

/// New metrics, served at `--metrics-addr` (an error naming it if it cannot be bound).
pub fn serve(addr: std::net::SocketAddr) -> anyhow::Result<Arc<Metrics>> {
    let metrics = Metrics::new();
    listen(addr, Arc::clone(&metrics) as Arc<dyn Exposition>)?;
    Ok(metrics)
}

/// Serves `metrics` at `addr` on the current runtime (the remote loop's own metrics, or
/// the daemon's).
pub fn listen(addr: std::net::SocketAddr, metrics: Arc<dyn Exposition>) -> anyhow::Result<()> {
    use anyhow::Context;
    let listener = std::net::TcpListener::bind(addr)
        .with_context(|| format!("--metrics-addr {addr}: cannot listen there"))?;
    endpoint::start(listener, metrics)?;
    tracing::info!("Metrics at http://{addr}/metrics");
    Ok(())
}

/// `--memory-at-alloc`'s decisions, by action: now and at the last call.
fn at_alloc(counts: &Counts, last: &Counts) -> [(&'static str, u64, u64); 3] {
    [
        (
            "kill_at_alloc",
            counts.killed_at_alloc,
            last.killed_at_alloc,
        ),
        (
            "report_at_alloc",
            counts.reported_at_alloc,
            last.reported_at_alloc,
        ),
        (
            "refuse_at_alloc",
            counts.refused_at_alloc,
            last.refused_at_alloc,
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_carry_over_once() {
        let metrics = Metrics::new();
        metrics.configured(TierChoice::Auto, true);
        let mut status = Status {
            tier: Some("tracepoint".into()),
            counts: Counts {
                open_events: 3,
                ..Counts::default()
            },
            ..Status::default()
        };
        metrics.follow(&status, 1);
        metrics.follow(&status, 1);
        status.counts.open_events = 5;
        metrics.follow(&status, 2);
        metrics.decided(&[("non-env-processes", "terminate")]);
        let text = metrics.text();
        for line in [
            "genv_enforcer_events_total{kind=\"open\"} 5",
            "genv_enforcer_nvml_errors_total 2",
            "genv_enforcer_decisions_total{rule=\"non-env-processes\",action=\"terminate\"} 1",
        ] {
            assert!(text.contains(line), "{line} not in {text}");
        }
    }

    /// What the alerts compare: the tier and `--deny` in force beside what was asked
    /// for, and the heartbeat.
    #[test]
    fn what_is_in_force_stands_beside_what_was_asked_for() {
        let metrics = Metrics::new();
        metrics.configured(TierChoice::FmodRet, true);
        let mut status = Status {
            tier: Some("fmod_ret".into()),
            updated: 1_700_000_000,
            interval_s: 3600.0,
            ..Status::default()
        };
        metrics.follow(&status, 0);
        let text = metrics.text();
        for line in [
            "genv_enforcer_tier_info{tier=\"fmod_ret\",configured=\"fmod_ret\"} 1",
            "genv_enforcer_tier_level 3",
            "genv_enforcer_tier_configured_level 3",
            "genv_enforcer_deny_configured 1",
            "genv_enforcer_deny_in_force 0",
            "genv_enforcer_heartbeat_timestamp_seconds 1700000000",
            "genv_enforcer_full_cycle_interval_seconds 3600.0",
        ] {
            assert!(text.contains(line), "{line} not in {text}");
        }
        assert!(
            text.contains("last_full_cycle_timestamp_seconds 0"),
            "{text}"
        );
        status.deny_in_force = true;
        status.last_cycle = Some(super::super::status::LastCycle {
            at: 1_700_000_005,
            ..Default::default()
        });
        metrics.follow(&status, 0);
        let text = metrics.text();
        assert!(text.contains("genv_enforcer_deny_in_force 1"), "{text}");
        assert!(
            text.contains("genv_enforcer_last_full_cycle_timestamp_seconds 1700000005"),
            "{text}"
        );
    }
}
