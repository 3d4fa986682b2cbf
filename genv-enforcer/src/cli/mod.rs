//! From the command line to a running enforcer: parsed flags ([`args`]) become
//! validated settings, then the objects that do the work.

pub mod args;

use std::io::Read;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;

use crate::actions::{Executor, ExecutorConfig};
use crate::cycle::Enforcer;
use crate::daemon;
use crate::daemon::event_driven::Settings;
use crate::report::Report;
use crate::rules::{DeviceLimit, Rules};
use crate::snapshot::{EnvPolicy, SnapshotBuilder};
use crate::state::StateDir;
use args::{Cli, Command, EnforceArgs, ExecutionArgs, SourceArgs, UsageCommand};

/// Parses the command line and runs it; the only place exit codes are decided.
pub fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("genv-enforcer: {e:#}");
            ExitCode::FAILURE
        }
    }
}

pub fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Enforce(args) => enforce(args),
        Command::Status { run_dir } => daemon::status::show(&run_dir),
        Command::Unpin { pin_dir } => unpin(&pin_dir),
        Command::Usage(UsageCommand::Snapshot { part, sources, .. }) => {
            let mut builder = builder(&sources, EnvPolicy::default());
            let lock = builder
                .state()
                .lock()
                .context("taking genv's global lock")?;
            let (snapshot, warnings) = builder.take();
            drop(lock);
            for warning in warnings {
                eprintln!("{warning}");
            }
            println!(
                "{}",
                snapshot
                    .to_genv_json(part)
                    .context("taking a usage snapshot")?
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Usage(UsageCommand::Execute { execution }) => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("reading the report from stdin")?;
            let report = Report::from_genv_json(&text).context("the report on stdin")?;
            let state = StateDir::from_env();
            let mut executor = Executor::new(executor_config(&execution));
            {
                let _lock = state.lock().context("taking genv's global lock")?;
                executor.execute(&report, &state);
            }
            executor.finish();
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn builder(sources: &SourceArgs, policy: EnvPolicy) -> SnapshotBuilder {
    SnapshotBuilder::new(
        StateDir::new(&sources.genv_tmpdir),
        sources.nvml_lib.clone(),
        policy,
    )
}

fn executor_config(args: &ExecutionArgs) -> ExecutorConfig {
    ExecutorConfig {
        dry_run: args.dry_run,
        // genv: `int(os.environ.get("GENV_TERMINATE_PROCESSES", "1")) == 0` disables it.
        signals: std::env::var("GENV_TERMINATE_PROCESSES")
            .map_or(true, |v| v.trim().parse::<i64>() != Ok(0)),
        kill_after: (args.kill_after > 0.0).then(|| Duration::from_secs_f64(args.kill_after)),
    }
}

/// The rules `genv enforce` would run with these flags.
pub fn rules(args: &EnforceArgs) -> Rules {
    if args.max_devices_per_user.is_none() && !args.max_devices_for_user.is_empty() {
        eprintln!(
            "[WARNING] --max-devices-for-user has no effect without --max-devices-per-user (as in genv)"
        );
    }
    Rules {
        non_env_processes: args.non_env_processes && !args.no_non_env_processes,
        env_devices: !args.no_env_devices,
        env_memory: !args.no_env_memory,
        max_devices_per_user: args.max_devices_per_user.map(|default| DeviceLimit {
            default,
            per_user: args.max_devices_for_user.iter().cloned().collect(),
        }),
    }
}

fn enforce(args: EnforceArgs) -> Result<ExitCode> {
    raise_open_file_limit();
    let policy = EnvPolicy {
        trust_unknown_env_ids: args.allow_unknown_env,
        trust_foreign_env_ids: args.allow_foreign_env,
    };
    let mut enforcer = Enforcer {
        builder: builder(&args.sources, policy),
        rules: rules(&args),
        executor: Executor::new(executor_config(&args.execution)),
    };
    if args.interval == 0.0 && args.events.event_driven {
        bail!(
            "--event-driven needs a daemon: give --interval a value above 0 (the full cycle's period)"
        );
    }
    if args.interval == 0.0 {
        enforcer.cycle();
        enforcer.executor.finish();
        return Ok(ExitCode::SUCCESS);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .enable_io()
        .build()
        .context("starting the runtime")?;
    let interval = Duration::from_secs_f64(args.interval);
    if !args.events.event_driven {
        return runtime.block_on(daemon::polling::run(enforcer, interval));
    }
    if args.events.bpf_tier == crate::bpf::TierChoice::None {
        if args.events.deny {
            bail!("--deny is decided by the kernel programs, and --bpf-tier none loads none");
        }
        if args.events.keep_pinned {
            bail!("--keep-pinned pins the kernel programs, and --bpf-tier none loads none");
        }
    }
    let settings = Settings {
        interval,
        memory_interval: Duration::from_secs_f64(args.events.memory_interval),
        tier: args.events.bpf_tier,
        ring_bytes: args.events.ring_buffer_bytes,
        gpu_nodes: args.events.gpu_node,
        run_dir: args.events.run_dir,
        verbose: args.events.verbose,
        deny: args.events.deny,
        allow_exes: args.events.allow_exe,
        keep_pinned: args.events.keep_pinned,
        pin_dir: args.events.pin_dir,
    };
    runtime.block_on(daemon::event_driven::run(enforcer, settings))
}

fn unpin(root: &std::path::Path) -> Result<ExitCode> {
    let removed = crate::bpf::pins::unpin_all(root)
        .with_context(|| format!("removing the pins under {}", root.display()))?;
    if removed.links == 0 && removed.maps == 0 {
        println!("Nothing pinned under {}", root.display());
    } else {
        println!(
            "Removed {} pinned programs and {} maps under {}: the kernel no longer decides about GPU opens until an enforcer runs",
            removed.links,
            removed.maps,
            root.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The process table keeps one `/proc/<pid>/stat` descriptor per GPU process; the
/// usual soft limit of 1024 descriptors would be reached on a busy node. Raise it to the
/// hard limit (failure only costs speed: reads then go by path).
fn raise_open_file_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        let _ = setrlimit(Resource::Nofile, limit);
    }
}
