//! The event-driven daemon. Triggers, and what each runs:
//! - a GPU open reported by the kernel → the process is watched, and checked (non-env and
//!   env-devices rules, memory for its environment) at once and at growing intervals
//!   while its window lasts ([`super::watchlist`]);
//! - a write to `envs.json` or `devices.json` → a full cycle at once;
//! - every `--memory-interval` → the memory rule;
//! - every `--interval`, and whenever the kernel lost events → a full cycle;
//! - exec and exit events keep the process table current;
//! - with `--deny`, the kernel refuses or kills at the open itself; its decisions arrive
//!   as open events and are reported ([`super::prevention`]).

use std::collections::{HashMap, HashSet};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};

use super::StopSignals;
use super::instance::Instance;
use super::prevention;
use super::state_watch::StateWatch;
use super::status::Status;
use super::watchlist::Watchlist;
use crate::backends::devmap::{DeviceMap, NodeOverride};
use crate::backends::procfs;
use crate::bpf::{KernelPrograms, LoadOptions, TierChoice, pins};
use crate::cycle::{CycleSummary, Enforcer, Scope};
use crate::intake::{EventIntake, KernelEvent, UnknownEvent, Verdict};
use crate::state::{Device, Env};

pub struct Settings {
    pub interval: Duration,
    pub memory_interval: Duration,
    pub tier: TierChoice,
    pub ring_bytes: Option<u32>,
    pub gpu_nodes: Vec<NodeOverride>,
    pub run_dir: std::path::PathBuf,
    pub verbose: bool,
    /// `--deny`: refuse (LSM) or kill in the syscall (other tiers) outside processes.
    pub deny: bool,
    /// `--allow-exe`, beyond the defaults.
    pub allow_exes: Vec<std::path::PathBuf>,
    /// `--keep-pinned`: pin under a generation of `pin_dir`.
    pub keep_pinned: bool,
    /// Where pins go, and where an earlier run's are looked for.
    pub pin_dir: std::path::PathBuf,
}

/// How long a process terminated by a narrow check is left out of the next ones.
const SETTLE: Duration = Duration::from_secs(2);
/// How often the daemon wakes at least, to read lifecycle events (which do not wake it).
const DRAIN_EVERY: Duration = Duration::from_millis(100);
/// How often the status file is rewritten at most.
const STATUS_EVERY: Duration = Duration::from_secs(1);

pub async fn run(enforcer: Enforcer, settings: Settings) -> Result<ExitCode> {
    let mut stop = StopSignals::install()?;
    let instance = Instance::claim(&settings.run_dir)?;
    let mut status = Status {
        pid: std::process::id(),
        started: unix_now(),
        interval_s: settings.interval.as_secs_f64(),
        memory_interval_s: settings.memory_interval.as_secs_f64(),
        ..Status::default()
    };

    let pin_generation = match settings.keep_pinned {
        true => Some(
            pins::prepare_generation(&settings.pin_dir).with_context(|| {
                format!("--keep-pinned: preparing {}", settings.pin_dir.display())
            })?,
        ),
        false => None,
    };
    let (mut kernel, mut intake) = load(&settings, pin_generation.clone(), &mut status)?;
    if let Some(kernel) = kernel.as_mut() {
        let allowed = prevention::install_allow_list(kernel.policy_mut(), &settings.allow_exes)?;
        let seeded = prevention::seed_identities(kernel.policy_mut());
        eprintln!(
            "[INFO] Environment identities of {seeded} running processes recorded in the kernel; allowed outside environments: {allowed}"
        );
    }
    instance.publish(&status);

    let mut daemon = Daemon {
        enforcer,
        settings,
        status,
        watchlist: Watchlist::default(),
        settled: HashMap::new(),
        device_map: None,
        armed: false,
        pin_generation,
    };
    let mut state_watch = None;
    let mut next_full = Instant::now();
    let mut next_memory = Instant::now() + daemon.settings.memory_interval;
    let mut next_status = Instant::now();
    let mut events = Vec::new();
    let mut unknown = Vec::new();
    let mut said_unknown = false;

    loop {
        let mut now = Instant::now();
        if now >= next_full {
            // Watch first: a state change during the cycle then triggers another one,
            // where watching after it would miss a change made while it ran.
            if state_watch.as_ref().is_none_or(StateWatch::is_lost) {
                state_watch = watch_state(&daemon.enforcer);
            }
            daemon.full_cycle(kernel.as_mut());
            now = Instant::now();
            next_full = now + daemon.settings.interval;
            next_memory = now + daemon.settings.memory_interval;
        }
        if let Some(pids) = daemon.watchlist.due(now) {
            daemon.opened_check(&pids);
        }
        if now >= next_memory {
            daemon.memory_check();
            next_memory = Instant::now() + daemon.settings.memory_interval;
        }
        daemon.enforcer.executor.escalate(Instant::now());
        if Instant::now() >= next_status {
            daemon.status.updated = unix_now();
            if let Some(kernel) = &kernel {
                daemon.status.programs = kernel.stats();
                let decided = kernel.policy().decisions();
                daemon.status.counts.refused_in_kernel = decided.refused;
                daemon.status.counts.killed_in_kernel = decided.killed;
            }
            instance.publish(&daemon.status);
            next_status = Instant::now() + STATUS_EVERY;
        }

        let wake = [
            Some(next_full),
            Some(next_memory),
            Some(next_status),
            daemon.watchlist.next_wake(),
            daemon.enforcer.executor.next_deadline(),
            intake.as_ref().map(|_| Instant::now() + DRAIN_EVERY),
        ]
        .into_iter()
        .flatten()
        .min()
        .expect("at least the full cycle is scheduled");
        tokio::select! {
            biased;
            () = stop.recv() => break,
            read = next_batch(intake.as_mut(), &mut events, &mut unknown) => {
                if let Err(e) = read {
                    eprintln!("[WARNING] Cannot read kernel events: {e}; running a full cycle");
                    next_full = Instant::now();
                }
            }
            changed = state_changed(state_watch.as_mut()) => match changed {
                Ok(true) => {
                    daemon.status.counts.state_changes += 1;
                    next_full = Instant::now();
                }
                Ok(false) => {}
                Err(e) => {
                    eprintln!("[WARNING] Watching genv's state directory failed ({e}); state changes wait for the full cycle");
                    state_watch = None;
                }
            },
            () = tokio::time::sleep_until(wake.into()) => {}
        }

        let now = Instant::now();
        if let Some(intake) = intake.as_mut() {
            intake.drain_now(&mut events, &mut unknown);
        }
        for event in events.drain(..) {
            daemon.on_event(event, now, kernel.as_mut());
        }
        if !unknown.is_empty() {
            if !said_unknown {
                eprintln!("[WARNING] {}; treating it as a lost event", unknown[0]);
                said_unknown = true;
            }
            unknown.clear();
            next_full = now;
        }
        if let Some(intake) = intake.as_mut() {
            let lost = intake.newly_lost();
            if lost > 0 {
                daemon.status.counts.lost_events += lost;
                eprintln!(
                    "[WARNING] The kernel lost {lost} events (its ring buffer was full); running a full cycle to resynchronise"
                );
                next_full = now;
            }
        }
    }

    // Programs and maps go with `kernel` and `intake`; the status file with `instance`.
    drop(intake);
    drop(kernel.take());
    drop(instance);
    Ok(ExitCode::SUCCESS)
}

/// Loads the kernel programs as `--bpf-tier` asks: a forced tier the kernel refuses is
/// an error; under `auto`, no tier at all leaves the full cycle alone, said loudly.
fn load(
    settings: &Settings,
    pin_dir: Option<std::path::PathBuf>,
    status: &mut Status,
) -> Result<(Option<KernelPrograms>, Option<EventIntake>)> {
    let every = settings.interval.as_secs_f64();
    if settings.tier == TierChoice::None {
        status.sees = format!("no BPF (--bpf-tier none): the full cycle alone, every {every}s");
        status.guarantee = prevention::guarantee(None, false);
        eprintln!(
            "[INFO] --bpf-tier none: no kernel programs; enforcing with the full cycle alone every {every}s"
        );
        return Ok((None, None));
    }
    let options = LoadOptions {
        choice: settings.tier,
        ring_bytes: settings.ring_bytes,
        pin_dir,
    };
    match KernelPrograms::load(&options) {
        Ok((kernel, intake)) => {
            for (tier, why) in kernel.refused() {
                eprintln!("[INFO] The kernel refused the {tier} tier: {why}");
                status.refused.push(format!("{tier}: {why}"));
            }
            eprintln!(
                "[INFO] Event-driven on the {} tier: it sees {}",
                kernel.tier(),
                kernel.tier().sees()
            );
            status.tier = Some(kernel.tier().to_string());
            status.sees = kernel.tier().sees().to_owned();
            status.programs = kernel.stats();
            Ok((Some(kernel), Some(intake)))
        }
        Err(e) if settings.tier != TierChoice::Auto => {
            bail!("--bpf-tier {}: {e}", settings.tier.name())
        }
        Err(e) => {
            eprintln!(
                "[WARNING] No BPF tier could be loaded ({e}); enforcing with the full cycle alone every {every}s, as genv does"
            );
            status.sees = format!("no BPF ({e}): the full cycle alone, every {every}s");
            status.guarantee = prevention::guarantee(None, settings.deny);
            if settings.deny {
                eprintln!(
                    "[WARNING] --deny cannot be kept without kernel programs: GPU opens outside any environment are {}",
                    status.guarantee
                );
            }
            Ok((None, None))
        }
    }
}

struct Daemon {
    enforcer: Enforcer,
    settings: Settings,
    status: Status,
    watchlist: Watchlist,
    /// Processes a narrow check terminated, and when.
    settled: HashMap<u32, Instant>,
    device_map: Option<DeviceMap>,
    /// The environments were mirrored into the kernel once and the policy (`--deny` or
    /// not) put in force and announced.
    armed: bool,
    /// This run's pin directory (`--keep-pinned`).
    pin_generation: Option<std::path::PathBuf>,
}

impl Daemon {
    fn on_event(&mut self, event: KernelEvent, now: Instant, kernel: Option<&mut KernelPrograms>) {
        let counts = &mut self.status.counts;
        match event {
            KernelEvent::Exec { pid, unresolved } => {
                counts.exec_events += 1;
                self.enforcer.builder.forget(pid);
                if let (true, Some(kernel)) = (unresolved, kernel) {
                    prevention::resolve_identity(kernel.policy_mut(), pid, self.settings.verbose);
                }
            }
            KernelEvent::Fork { .. } => counts.fork_events += 1,
            KernelEvent::Exit { pid } => {
                counts.exit_events += 1;
                self.enforcer.builder.forget(pid);
                self.watchlist.remove(pid);
                self.settled.remove(&pid);
            }
            KernelEvent::Open(open) => {
                counts.open_events += 1;
                if self.settings.verbose {
                    eprintln!(
                        "[EVENT] Process {} (thread {}) {} GPU {} (node {}:{}) [{}; {}]",
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
                if let Some(line) = prevention::decision_line(&open) {
                    println!("{line}");
                }
                match open.verdict {
                    Verdict::Refused => counts.refused += 1,
                    Verdict::Killed => counts.killed += 1,
                    // Let through: watched, and checked against genv's rules.
                    _ => self.watchlist.add(open, now),
                }
            }
        }
    }

    /// Mirrors genv's environments into the kernel, and arms `--deny` the first time
    /// that succeeds: before it, every environment's processes would count as outside.
    fn mirror_state(
        &mut self,
        kernel: &mut KernelPrograms,
        state: Option<(Vec<Env>, Vec<Device>)>,
    ) {
        let current = prevention::sync_environments(kernel.policy_mut(), state);
        if !current || self.armed {
            return;
        }
        if self.settings.deny {
            if let Err(e) = kernel.policy_mut().set_deny(true) {
                eprintln!("[ERROR] Cannot turn on --deny in the kernel: {e}");
                return;
            }
        }
        let guarantee = prevention::guarantee(Some(kernel.tier()), self.settings.deny);
        eprintln!("[INFO] GPU opens outside any environment are {guarantee}");
        self.status.guarantee = guarantee;
        self.armed = true;
        self.take_over_pins();
    }

    /// Our programs decide now: an earlier run's pinned programs can go. With
    /// `--keep-pinned`, ours stay after we exit.
    fn take_over_pins(&mut self) {
        let own = self.pin_generation.as_deref();
        for old in pins::other_generations(&self.settings.pin_dir, own) {
            match pins::remove_generation(&old) {
                Ok(removed) => eprintln!(
                    "[INFO] Took over from an earlier run's pinned programs: removed {} links and {} maps under {}",
                    removed.links,
                    removed.maps,
                    old.display()
                ),
                Err(e) => eprintln!("[WARNING] Cannot remove {}: {e}", old.display()),
            }
        }
        if let Some(own) = own {
            eprintln!(
                "[INFO] Programs and maps pinned under {}: they keep deciding after this daemon exits (genv-enforcer unpin removes them)",
                own.display()
            );
        }
    }

    fn full_cycle(&mut self, kernel: Option<&mut KernelPrograms>) {
        let mut summary = self.enforcer.cycle();
        self.status.counts.full_cycles += 1;
        self.count(&summary);
        if let Some(kernel) = kernel {
            self.refresh_device_map(kernel);
            self.mirror_state(kernel, summary.state.take());
        }
    }

    /// The device map follows NVML's device list, which the full cycle refreshes.
    fn refresh_device_map(&mut self, kernel: &mut KernelPrograms) {
        let proc_devices = std::fs::read_to_string("/proc/devices").ok();
        let map = DeviceMap::build(
            self.enforcer.builder.devices(),
            procfs::driver_minors_in_pci_order(),
            proc_devices.as_deref(),
            &self.settings.gpu_nodes,
        );
        if self.device_map.as_ref() == Some(&map) {
            return;
        }
        match kernel.watch_nodes(&map) {
            Ok(()) => {
                eprintln!("[INFO] Watching GPU nodes: {map}");
                self.status.gpu_nodes = map.to_string();
                self.device_map = Some(map);
            }
            Err(e) => eprintln!("[ERROR] Cannot update the watched GPU nodes: {e}"),
        }
    }

    fn opened_check(&mut self, pids: &HashSet<u32>) {
        let settled = self.settled(Instant::now());
        let summary = self.enforcer.check(Scope::Opened(pids), &settled);
        self.status.counts.open_checks += 1;
        self.count(&summary);
        let now_ns = monotonic_ns();
        for pid in &summary.terminated {
            if let Some(open) = self.watchlist.first_open(*pid) {
                let ms = now_ns.saturating_sub(open.at_ns) as f64 / 1e6;
                eprintln!(
                    "[INFO] Acted on process {pid} {ms:.2} ms after its open of GPU {} [{}]",
                    open.index, open.tier
                );
            }
            self.settled.insert(*pid, Instant::now());
        }
    }

    fn memory_check(&mut self) {
        if !self.enforcer.rules.env_memory {
            return;
        }
        let settled = self.settled(Instant::now());
        let summary = self.enforcer.check(Scope::Memory, &settled);
        self.status.counts.memory_checks += 1;
        self.count(&summary);
        let now = Instant::now();
        for pid in summary.terminated {
            self.settled.insert(pid, now);
        }
    }

    fn settled(&mut self, now: Instant) -> HashSet<u32> {
        self.settled
            .retain(|_, at| now.duration_since(*at) < SETTLE);
        self.settled.keys().copied().collect()
    }

    fn count(&mut self, summary: &CycleSummary) {
        self.status.counts.terminated += summary.terminated.len() as u64;
        self.status.counts.detached += summary.detached as u64;
    }
}

fn watch_state(enforcer: &Enforcer) -> Option<StateWatch> {
    let dir = enforcer.builder.state().root();
    match StateWatch::new(dir) {
        Ok(watch) => Some(watch),
        Err(e) => {
            eprintln!(
                "[WARNING] Cannot watch {} ({e}); state changes wait for the full cycle",
                dir.display()
            );
            None
        }
    }
}

async fn next_batch(
    intake: Option<&mut EventIntake>,
    events: &mut Vec<KernelEvent>,
    unknown: &mut Vec<UnknownEvent>,
) -> std::io::Result<()> {
    match intake {
        Some(intake) => intake.next_batch(events, unknown).await,
        None => std::future::pending().await,
    }
}

async fn state_changed(watch: Option<&mut StateWatch>) -> std::io::Result<bool> {
    match watch {
        Some(watch) => watch.changed().await,
        None => std::future::pending().await,
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// CLOCK_MONOTONIC, the clock of `bpf_ktime_get_ns`.
fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
