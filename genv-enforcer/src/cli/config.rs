//! Parsed flags ([`super::args`]) become one validated configuration: every check that
//! involves more than one flag is made here, so that a combination that makes no sense
//! never reaches the daemon. Nothing here touches the system.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use super::args::{EnforceArgs, ExecutionArgs};
use super::shared_args::RuleArgs;
use crate::actions::ExecutorConfig;
use crate::alloc::MemoryAtAlloc;
use crate::backends::devmap::NodeOverride;
use crate::daemon::Settings;
use crate::kernel::TierChoice;
use crate::kernel::policy_maps::DenyPolicy;
use crate::notify::NotifyMode;
use crate::rules::{DeviceLimit, Rules};
use crate::snapshot::EnvPolicy;
use crate::sync::KernelSettings;

/// How `enforce` runs.
#[derive(Debug)]
pub enum Mode {
    /// `--interval 0`: one cycle, then exit.
    Once,
    /// genv's loop: a full cycle every interval.
    Polling(Duration),
    /// `--event-driven`.
    EventDriven(Settings),
}

#[derive(Debug)]
pub struct EnforceConfig {
    pub rules: Rules,
    pub policy: EnvPolicy,
    pub execution: ExecutorConfig,
    pub state_dir: PathBuf,
    pub nvml_lib: OsString,
    /// `--gpu-node`: device nodes to treat as GPUs, for the kernel programs and for the
    /// `/proc` scan alike.
    pub gpu_nodes: Vec<NodeOverride>,
    pub mode: Mode,
    /// `--notify`: whether users are told on their terminals.
    pub notify: NotifyMode,
    /// Flags that are accepted but do nothing here, said once at start.
    pub warnings: Vec<String>,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} needs --event-driven")]
    NeedsEventDriven(&'static str),
    #[error(
        "--event-driven needs a daemon: give --interval a value above 0 (the full cycle's period)"
    )]
    EventDrivenOnce,
    #[error("--deny is --non-env-processes enforced in the kernel: it needs --non-env-processes")]
    DenyWithoutNonEnv,
    #[error("{0} acts through the kernel programs, and --bpf-tier none loads none")]
    NeedsPrograms(&'static str),
    #[error("--deny-root widens --deny: it needs --deny")]
    DenyRootWithoutDeny,
    #[error("--memory-at-alloc holds the memory rule at the allocation: it needs --env-memory")]
    MemoryAtAllocWithoutEnvMemory,
    #[error(
        "--cuda-lib names libraries for --memory-at-alloc's probes: it needs --memory-at-alloc report or kill"
    )]
    CudaLibWithoutMemoryAtAlloc,
}

impl EnforceConfig {
    pub fn from_args(args: EnforceArgs) -> Result<Self, ConfigError> {
        let rules = args.rules.rules();
        let warnings: Vec<String> = args.rules.warning().into_iter().collect();
        let mode = mode(&args, &rules)?;
        Ok(Self {
            policy: EnvPolicy {
                trust_unknown_env_ids: args.allow_unknown_env,
                trust_foreign_env_ids: args.allow_foreign_env,
                orphans: args.orphans,
            },
            execution: executor_config(&args.execution),
            state_dir: args.sources.genv_tmpdir.clone(),
            nvml_lib: args.sources.nvml_lib.clone(),
            gpu_nodes: args.events.gpu_node.clone(),
            notify: args.notify,
            rules,
            mode,
            warnings,
        })
    }
}

impl RuleArgs {
    /// The rules `genv enforce` would run with these flags.
    pub fn rules(&self) -> Rules {
        Rules {
            non_env_processes: self.non_env_processes && !self.no_non_env_processes,
            env_devices: !self.no_env_devices,
            env_memory: !self.no_env_memory,
            max_devices_per_user: self.max_devices_per_user.map(|default| DeviceLimit {
                default,
                per_user: self.max_devices_for_user.iter().cloned().collect(),
            }),
        }
    }

    /// A flag accepted that does nothing, said once at start.
    pub fn warning(&self) -> Option<String> {
        (self.max_devices_per_user.is_none() && !self.max_devices_for_user.is_empty()).then(|| {
            "--max-devices-for-user has no effect without --max-devices-per-user (as in genv)"
                .to_owned()
        })
    }
}

pub fn executor_config(args: &ExecutionArgs) -> ExecutorConfig {
    ExecutorConfig {
        dry_run: args.dry_run,
        // genv: `int(os.environ.get("GENV_TERMINATE_PROCESSES", "1")) == 0` disables it.
        signals: std::env::var("GENV_TERMINATE_PROCESSES")
            .map_or(true, |v| v.trim().parse::<i64>() != Ok(0)),
        kill_after: (args.kill_after > 0.0).then(|| Duration::from_secs_f64(args.kill_after)),
    }
}

fn mode(args: &EnforceArgs, rules: &Rules) -> Result<Mode, ConfigError> {
    let events = &args.events;
    if !events.event_driven {
        if let Some(flag) = event_only_flag(args) {
            return Err(ConfigError::NeedsEventDriven(flag));
        }
        return Ok(if args.interval == 0.0 {
            Mode::Once
        } else {
            Mode::Polling(Duration::from_secs_f64(args.interval))
        });
    }
    if args.interval == 0.0 {
        return Err(ConfigError::EventDrivenOnce);
    }
    if events.deny && !rules.non_env_processes {
        return Err(ConfigError::DenyWithoutNonEnv);
    }
    if events.deny_root && !events.deny {
        return Err(ConfigError::DenyRootWithoutDeny);
    }
    let memory_at_alloc = events.memory_at_alloc != MemoryAtAlloc::Off;
    if memory_at_alloc && !rules.env_memory {
        return Err(ConfigError::MemoryAtAllocWithoutEnvMemory);
    }
    if !events.cuda_lib.is_empty() && !memory_at_alloc {
        return Err(ConfigError::CudaLibWithoutMemoryAtAlloc);
    }
    let tier = events.bpf_tier.unwrap_or(TierChoice::Auto);
    if tier == TierChoice::None {
        for (given, flag) in [
            (events.deny, "--deny"),
            (events.keep_pinned, "--keep-pinned"),
            (events.bpf_log, "--bpf-log"),
            (memory_at_alloc, "--memory-at-alloc"),
        ] {
            if given {
                return Err(ConfigError::NeedsPrograms(flag));
            }
        }
    }
    Ok(Mode::EventDriven(settings(args, tier)))
}

/// The event-driven mode's settings, from flags checked together already.
fn settings(args: &EnforceArgs, tier: TierChoice) -> Settings {
    let events = &args.events;
    Settings {
        interval: Duration::from_secs_f64(args.interval),
        memory_interval: Duration::from_secs_f64(events.memory_interval.unwrap_or(1.0)),
        run_dir: events.run_dir.clone(),
        kernel: KernelSettings {
            tier,
            ring_bytes: events.ring_buffer_bytes,
            verbose: events.verbose,
            deny: DenyPolicy {
                deny: events.deny,
                root: events.deny_root,
            },
            allow_exes: events.allow_exe.clone(),
            keep_pinned: events.keep_pinned,
            pin_dir: events.pin_dir.clone(),
            bpf_log: events.bpf_log,
            memory_at_alloc: events.memory_at_alloc,
            cuda_libs: events.cuda_lib.clone(),
        },
        reload: None,
        metrics_addr: events.metrics_addr,
    }
}

/// The first flag given that only the event-driven mode reads.
fn event_only_flag(args: &EnforceArgs) -> Option<&'static str> {
    let e = &args.events;
    [
        (e.bpf_tier.is_some(), "--bpf-tier"),
        (e.memory_interval.is_some(), "--memory-interval"),
        (e.verbose, "--verbose"),
        (e.deny, "--deny"),
        (e.deny_root, "--deny-root"),
        (!e.allow_exe.is_empty(), "--allow-exe"),
        (e.keep_pinned, "--keep-pinned"),
        (e.ring_buffer_bytes.is_some(), "--ring-buffer-bytes"),
        (e.bpf_log, "--bpf-log"),
        (e.memory_at_alloc != MemoryAtAlloc::Off, "--memory-at-alloc"),
        (!e.cuda_lib.is_empty(), "--cuda-lib"),
        (e.metrics_addr.is_some(), "--metrics-addr"),
    ]
    .into_iter()
    .find_map(|(given, flag)| given.then_some(flag))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::args::{Cli, Command};

    fn config(args: &[&str]) -> Result<EnforceConfig, ConfigError> {
        let cli =
            Cli::try_parse_from(["genv-enforcer", "enforce"].iter().chain(args)).expect("parses");
        match cli.command {
            Command::Enforce(args) => EnforceConfig::from_args(args),
            _ => unreachable!(),
        }
    }

    #[test]
    fn event_driven_flags_need_event_driven_and_say_so() {
        for (args, flag) in [
            (&["--bpf-tier", "lsm"][..], "--bpf-tier"),
            (&["--memory-interval", "2"], "--memory-interval"),
            (&["-v"], "--verbose"),
            (&["--non-env-processes", "--deny"], "--deny"),
            (&["--allow-exe", "/bin/true"], "--allow-exe"),
            (&["--keep-pinned"], "--keep-pinned"),
        ] {
            let error = config(args).unwrap_err();
            assert_eq!(error, ConfigError::NeedsEventDriven(flag));
            assert!(error.to_string().contains("--event-driven"), "{error}");
        }
    }

    #[test]
    fn memory_at_alloc_needs_the_memory_rule_and_programs() {
        let error = config(&["--memory-at-alloc", "kill"]).unwrap_err();
        assert_eq!(error, ConfigError::NeedsEventDriven("--memory-at-alloc"));
        let error = config(&[
            "--event-driven",
            "--memory-at-alloc",
            "kill",
            "--no-env-memory",
        ])
        .unwrap_err();
        assert_eq!(error, ConfigError::MemoryAtAllocWithoutEnvMemory);
        let error = config(&["--event-driven", "--cuda-lib", "/x/libcuda.so.1"]).unwrap_err();
        assert_eq!(error, ConfigError::CudaLibWithoutMemoryAtAlloc);
        let error = config(&[
            "--event-driven",
            "--bpf-tier",
            "none",
            "--memory-at-alloc",
            "report",
        ])
        .unwrap_err();
        assert_eq!(error, ConfigError::NeedsPrograms("--memory-at-alloc"));
        let ok = config(&["--event-driven", "--memory-at-alloc", "kill"]).unwrap();
        assert!(matches!(
            ok.mode,
            Mode::EventDriven(Settings {
                kernel: KernelSettings {
                    memory_at_alloc: MemoryAtAlloc::Kill,
                    ..
                },
                ..
            })
        ));
    }

    #[test]
    fn deny_is_the_non_env_rule_in_the_kernel_and_needs_it() {
        let error = config(&["--event-driven", "--deny"]).unwrap_err();
        assert!(error.to_string().contains("--non-env-processes"), "{error}");
        // The last of the flag and its no-form wins, for --deny too.
        let error = config(&[
            "--event-driven",
            "--non-env-processes",
            "--no-non-env-processes",
            "--deny",
        ])
        .unwrap_err();
        assert_eq!(error, ConfigError::DenyWithoutNonEnv);
        let error = config(&["--event-driven", "--non-env-processes", "--deny-root"]).unwrap_err();
        assert_eq!(error, ConfigError::DenyRootWithoutDeny);
        let ok = config(&[
            "--event-driven",
            "--non-env-processes",
            "--deny",
            "--keep-pinned",
        ])
        .unwrap();
        assert!(matches!(
            ok.mode,
            Mode::EventDriven(Settings {
                kernel: KernelSettings {
                    deny: DenyPolicy { deny: true, .. },
                    keep_pinned: true,
                    ..
                },
                ..
            })
        ));
    }

    #[test]
    fn no_programs_means_no_kernel_decisions_and_no_daemon_means_no_events() {
        let error = config(&[
            "--event-driven",
            "--bpf-tier",
            "none",
            "--non-env-processes",
            "--deny",
        ])
        .unwrap_err();
        assert_eq!(error, ConfigError::NeedsPrograms("--deny"));
        let error = config(&["--event-driven", "--bpf-tier", "none", "--keep-pinned"]).unwrap_err();
        assert_eq!(error, ConfigError::NeedsPrograms("--keep-pinned"));
        let error = config(&["--event-driven", "--interval", "0"]).unwrap_err();
        assert_eq!(error, ConfigError::EventDrivenOnce);
    }

    #[test]
    fn modes_and_defaults() {
        assert!(matches!(
            config(&["--interval", "0"]).unwrap().mode,
            Mode::Once
        ));
        assert!(matches!(
            config(&["--interval", "2.5"]).unwrap().mode,
            Mode::Polling(d) if d == Duration::from_millis(2500)
        ));
        let Mode::EventDriven(settings) = config(&["--event-driven"]).unwrap().mode else {
            panic!("event-driven");
        };
        assert_eq!(settings.kernel.tier, TierChoice::Auto);
        assert_eq!(settings.memory_interval, Duration::from_secs(1));
        assert_eq!(settings.interval, Duration::from_secs(10));
        let lonely = config(&["--max-devices-for-user", "alice=1"]).unwrap();
        assert_eq!(lonely.warnings.len(), 1);
    }

    /// Users are told on their terminals unless the admin says otherwise, in every mode.
    #[test]
    fn notify_is_tty_unless_switched_off() {
        assert_eq!(config(&[]).unwrap().notify, NotifyMode::Tty);
        assert_eq!(
            config(&["--interval", "0", "--notify", "none"])
                .unwrap()
                .notify,
            NotifyMode::None
        );
        assert_eq!(
            config(&["--event-driven", "--notify", "none", "--notify", "tty"])
                .unwrap()
                .notify,
            NotifyMode::Tty
        );
        let cli = Cli::try_parse_from(["genv-enforcer", "enforce", "--notify", "wall"]);
        assert!(cli.unwrap_err().to_string().contains("--notify"));
    }
}
