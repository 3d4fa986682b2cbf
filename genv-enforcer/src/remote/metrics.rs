//! `remote enforce --metrics-addr`: what a fleet's Prometheus needs to see a dead host,
//! per host: up or down, how long since it was last heard from (a stream's lag), its
//! failures, and the actions sent to it.

use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::report::Report;
use crate::service::metrics::Exposition;

type Labels = Vec<(String, String)>;

pub struct FleetMetrics {
    registry: Registry,
    hosts: Vec<String>,
    up: Family<Labels, Gauge>,
    last_heard: Family<Labels, Gauge<f64, AtomicU64>>,
    failures: Family<Labels, Counter>,
    actions: Family<Labels, Counter>,
    /// When each host was last heard from (a line, a heartbeat, an answer).
    heard: Mutex<Vec<Option<Instant>>>,
}

impl FleetMetrics {
    pub fn new(hosts: Vec<String>) -> Self {
        let mut registry = Registry::with_prefix("genv_enforcer_remote");
        let metrics = Self {
            registry: Registry::default(),
            heard: Mutex::new(vec![None; hosts.len()]),
            hosts,
            up: Family::default(),
            last_heard: Family::default(),
            failures: Family::default(),
            actions: Family::default(),
        };
        registry.register(
            "host_up",
            "1 while the host's last snapshot was read, 0 once it failed, was refused or went silent",
            metrics.up.clone(),
        );
        registry.register(
            "last_heard_seconds",
            "Seconds since the host last sent a line, a heartbeat or an answer",
            metrics.last_heard.clone(),
        );
        registry.register(
            "host_failures",
            "Commands or streams of the host that failed, timed out or were refused",
            metrics.failures.clone(),
        );
        registry.register(
            "actions",
            "Actions sent to the host and executed there, by action",
            metrics.actions.clone(),
        );
        // Every host is down until it answers, and has failed 0 times: an alert on the
        // failures' increase sees the first.
        for host in 0..metrics.hosts.len() {
            metrics.up.get_or_create(&metrics.host(host)).set(0);
            metrics
                .failures
                .get_or_create(&metrics.host(host))
                .inc_by(0);
        }
        Self {
            registry,
            ..metrics
        }
    }

    fn host(&self, host: usize) -> Labels {
        vec![("host".to_owned(), self.hosts[host].clone())]
    }

    /// Anything came from the host.
    pub fn heard(&self, host: usize) {
        self.heard.lock().unwrap_or_else(|e| e.into_inner())[host] = Some(Instant::now());
    }

    /// A snapshot of the host was read.
    pub fn answered(&self, host: usize) {
        self.heard(host);
        self.up.get_or_create(&self.host(host)).set(1);
    }

    pub fn failed(&self, host: usize) {
        self.up.get_or_create(&self.host(host)).set(0);
        self.failures.get_or_create(&self.host(host)).inc();
    }

    /// A report was executed on the host.
    pub fn acted(&self, host: usize, report: &Report) {
        let mut labels = self.host(host);
        labels.push(("action".to_owned(), String::new()));
        for (action, count) in [
            ("terminate", report.terminate.len()),
            ("detach", report.detach.len()),
        ] {
            labels[1].1 = action.to_owned();
            self.actions.get_or_create(&labels).inc_by(count as u64);
        }
    }
}

impl Exposition for FleetMetrics {
    fn text(&self) -> String {
        let heard = self.heard.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (host, at) in heard.iter().enumerate() {
            if let Some(at) = at {
                let gauge = self.last_heard.get_or_create(&self.host(host));
                gauge.set(at.elapsed().as_secs_f64());
            }
        }
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("a String takes any text");
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_down_until_it_answers_and_after_it_fails() {
        let metrics = FleetMetrics::new(vec!["gpu1".into(), "gpu2".into()]);
        let text = metrics.text();
        assert!(
            text.contains("genv_enforcer_remote_host_up{host=\"gpu1\"} 0"),
            "{text}"
        );
        assert!(!text.contains("last_heard_seconds{"), "{text}");
        assert!(
            text.contains("genv_enforcer_remote_host_failures_total{host=\"gpu1\"} 0"),
            "{text}"
        );
        metrics.answered(0);
        metrics.answered(1);
        metrics.failed(1);
        let text = metrics.text();
        assert!(
            text.contains("genv_enforcer_remote_host_up{host=\"gpu1\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("genv_enforcer_remote_host_up{host=\"gpu2\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("genv_enforcer_remote_host_failures_total{host=\"gpu2\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("genv_enforcer_remote_last_heard_seconds{host=\"gpu1\"} "),
            "{text}"
        );
    }
}
