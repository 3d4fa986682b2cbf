//! From the command line to a running enforcer: parsed flags ([`args`]) become one
//! validated configuration ([`config`]), then the objects that do the work.

pub mod args;
mod ascii_stderr;
pub mod config;
pub mod config_file;
mod doctor;
pub mod logging;
pub mod man;
mod remote;
pub mod remote_args;
mod session_end;
pub mod shared_args;
mod why;

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;

use crate::actions::Executor;
use crate::cycle::{Enforcer, LockPolicy, execute_report};
use crate::daemon;
use crate::report::Report;
use crate::snapshot::{EnvPolicy, SnapshotBuilder};
use crate::state::StateDir;
use args::{Cli, Command, EnforceArgs, UsageCommand};
use config::{EnforceConfig, Mode, executor_config};

/// Run as root, this binary must be one only root could have put there: otherwise the
/// user who can replace it chooses what root runs next time.
fn refuse_an_untrusted_binary_as_root() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        return Ok(());
    }
    let exe = std::fs::read_link("/proc/self/exe").context("reading /proc/self/exe")?;
    crate::backends::trust::check_root_binary(&exe).map_err(|e| {
        anyhow::anyhow!(
            "not running as root from {}: {e}. Install it where only root can write, for \
             instance `sudo install -o root -g root -m 0755 {} /usr/local/sbin/genv-enforcer` \
             (or the .deb, the RPM, or the tarball as docs/install.md says), and run that; \
             --allow-untrusted-binary runs it anyway",
            exe.display(),
            exe.display()
        )
    })
}

/// The command line as given (before `--config`'s flags were put in), for SIGHUP.
static ARGV: std::sync::OnceLock<Vec<std::ffi::OsString>> = std::sync::OnceLock::new();

/// Parses the command line and runs it; the only place exit codes are decided.
pub fn main() -> ExitCode {
    let argv = remote_args::genv_spellings(std::env::args_os());
    let expanded = match config_file::expand(&argv) {
        Ok(expanded) => expanded,
        Err(e) => {
            eprintln!("genv-enforcer: --config {e}");
            return ExitCode::FAILURE;
        }
    };
    let _ = ARGV.set(argv);
    match run(Cli::parse_from(expanded)) {
        Ok(code) => code,
        Err(e) => {
            // An error may carry a host's stderr, or a name a user wrote.
            crate::genv_lines::eprint(&format!("genv-enforcer: {e:#}"));
            ExitCode::FAILURE
        }
    }
}

pub fn run(cli: Cli) -> Result<ExitCode> {
    logging::init(cli.log_format);
    if !cli.allow_untrusted_binary {
        refuse_an_untrusted_binary_as_root()?;
    }
    match cli.command {
        Command::Enforce(args) => enforce(args),
        Command::Status { run_dir, max_age } => crate::service::status::show(&run_dir, max_age),
        Command::Why {
            pid,
            me,
            limit,
            json,
            run_dir,
        } => why::why(pid, me, limit, json, &run_dir),
        Command::Remote(args) => remote::run(args),
        Command::Usage(UsageCommand::Watch {
            poll_interval,
            heartbeat,
            bpf_tier,
            gpu_node,
            sources,
        }) => {
            session_end::end_with_reader();
            usage_watch(poll_interval, heartbeat, bpf_tier, gpu_node, &sources)
        }
        Command::Unpin { pin_dir } => unpin(&pin_dir),
        Command::Doctor { json, enforce } => Ok(doctor::run(enforce, json)),
        Command::ManualPages { dir } => man::write(&dir),
        Command::Usage(UsageCommand::Snapshot { part, sources, .. }) => {
            session_end::end_with_reader();
            usage_snapshot(part, &sources)
        }
        Command::Usage(UsageCommand::Execute {
            execution,
            with_reasons,
            run_dir,
        }) => {
            session_end::end_with_reader();
            usage_execute(&execution, with_reasons.then_some(run_dir.as_path()))
        }
    }
}

/// `usage snapshot`, which remote enforcement runs as root on every host each cycle.
/// genv's lock is waited for as long as [`LockPolicy::COMMAND_WAIT`], then the state is
/// read without it: a user holding it (or putting a link or FIFO there) would otherwise
/// leave the host out of every cycle. Each environment's user is the owner the kernel
/// confirms, as this host names it (see `snapshot::owner_names`).
fn usage_snapshot(
    part: Option<crate::snapshot::SnapshotJson>,
    sources: &args::SourceArgs,
) -> Result<ExitCode> {
    let mut builder = snapshot_builder(
        &sources.genv_tmpdir,
        sources.nvml_lib.clone(),
        EnvPolicy::default(),
        Vec::new(),
    );
    // A process whose environment block does not answer is judged once it has not for
    // a grace period: kept across runs in root's run directory (see
    // `snapshot::unreadable`).
    let record = builder.remember_unreadable(Path::new(args::DEFAULT_RUN_DIR));
    builder.read_ahead(None);
    let lock = LockPolicy::bounded(LockPolicy::COMMAND_WAIT)
        .take(builder.state())
        .context("taking genv's global lock")?;
    let (mut snapshot, mut warnings) = builder.take();
    drop(lock);
    if let Some(record) = record {
        if let Err(e) = builder.save_unreadable(&record) {
            tracing::warn!("Cannot write {}: {e}", record.path().display());
        }
    }
    warnings.extend(crate::snapshot::name_confirmed_owners(
        &mut snapshot,
        crate::backends::users::name_for_snapshot,
    ));
    for warning in warnings {
        tracing::warn!("{}", warning.0);
    }
    println!(
        "{}",
        snapshot
            .to_genv_json(part)
            .context("taking a usage snapshot")?
    );
    Ok(ExitCode::SUCCESS)
}

/// `usage execute`: a report read on stdin, carried out under genv's lock as the
/// daemons take it: past [`LockPolicy::COMMAND_WAIT`], terminations go ahead and
/// detaches are named and left for a later cycle. With `told_in` (`--with-reasons`),
/// each process's user is told why, and the decision kept there.
fn usage_execute(execution: &args::ExecutionArgs, told_in: Option<&Path>) -> Result<ExitCode> {
    let mut text = String::new();
    std::io::stdin()
        .read_to_string(&mut text)
        .context("reading the report from stdin")?;
    let mut report = Report::from_genv_json(&text).context("the report on stdin")?;
    let state = StateDir::from_env();
    let mut executor = Executor::new(executor_config(execution));
    let notifier = told_in.map(|run_dir| {
        let (reasons, warnings) = crate::report::reasons::from_json(&text);
        for warning in warnings {
            tracing::warn!("The report on stdin: {warning}");
        }
        report.why = reasons;
        std::sync::Arc::new(crate::notify::Notifier::relaying(run_dir))
    });
    if let Some(notifier) = &notifier {
        executor = executor.with_notifier(std::sync::Arc::clone(notifier));
    }
    let mut lock = LockPolicy::bounded(LockPolicy::COMMAND_WAIT);
    let executed = execute_report(&mut lock, &mut executor, &report, &state);
    executor.finish();
    if let Some(notifier) = &notifier {
        notifier.flush();
    }
    executed.context("taking genv's global lock")?;
    Ok(ExitCode::SUCCESS)
}

fn enforce(args: EnforceArgs) -> Result<ExitCode> {
    let mut reload = match (&args.config, ARGV.get()) {
        (Some(_), Some(argv)) => Some(config_file::reloader(argv.clone(), &args)),
        _ => None,
    };
    let mut config = EnforceConfig::from_args(args)?;
    if let Mode::EventDriven(settings) = &mut config.mode {
        settings.reload = reload.take();
    }
    for warning in &config.warnings {
        tracing::warn!("{warning}");
    }
    raise_open_file_limit();
    let notifier = std::sync::Arc::new(crate::notify::Notifier::new(config.notify));
    let mut enforcer = Enforcer {
        builder: snapshot_builder(
            &config.state_dir,
            config.nvml_lib,
            config.policy,
            config.gpu_nodes,
        ),
        rules: config.rules,
        executor: Executor::new(config.execution).with_notifier(std::sync::Arc::clone(&notifier)),
        lock: LockPolicy::blocking(),
    };
    match config.mode {
        Mode::Once => {
            enforcer.cycle();
            enforcer.executor.finish();
            notifier.flush();
            Ok(ExitCode::SUCCESS)
        }
        Mode::Polling(interval) => {
            enforcer.lock = LockPolicy::bounded(LockPolicy::DAEMON_WAIT);
            runtime()?.block_on(daemon::polling::run(enforcer, interval, reload))
        }
        Mode::EventDriven(settings) => {
            enforcer.lock = LockPolicy::bounded(LockPolicy::DAEMON_WAIT);
            runtime()?.block_on(daemon::event_driven::run(enforcer, settings))
        }
    }
}

/// How every command takes its snapshots: genv's state in `state_dir`, NVML loaded
/// from `nvml_lib`, `policy` for environment claims, `--gpu-node`'s overrides.
fn snapshot_builder(
    state_dir: &std::path::Path,
    nvml_lib: std::ffi::OsString,
    policy: EnvPolicy,
    gpu_nodes: Vec<crate::backends::devmap::NodeOverride>,
) -> SnapshotBuilder {
    SnapshotBuilder::new(StateDir::new(state_dir), nvml_lib, policy).with_gpu_nodes(gpu_nodes)
}

/// `usage watch`.
fn usage_watch(
    poll: f64,
    heartbeat: Option<f64>,
    tier: crate::kernel::TierChoice,
    gpu_nodes: Vec<crate::backends::devmap::NodeOverride>,
    sources: &args::SourceArgs,
) -> Result<ExitCode> {
    let builder = snapshot_builder(
        &sources.genv_tmpdir,
        sources.nvml_lib.clone(),
        EnvPolicy::default(),
        gpu_nodes,
    );
    let settings = crate::remote::usage_watch::WatchSettings {
        poll: std::time::Duration::from_secs_f64(poll),
        heartbeat: heartbeat.map(std::time::Duration::from_secs_f64),
        tier,
    };
    runtime()?.block_on(crate::remote::usage_watch::run(builder, settings))
}

/// The single-threaded runtime every long-running mode uses.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .enable_io()
        .build()
        .context("starting the runtime")
}

fn unpin(root: &std::path::Path) -> Result<ExitCode> {
    use crate::kernel::pins;
    let removed = pins::unpin_all(root)
        .with_context(|| format!("removing the pins under {}", root.display()))?;
    if removed.links == 0 && removed.maps == 0 {
        println!("Nothing pinned under {}", root.display());
        return Ok(ExitCode::SUCCESS);
    }
    // "Removed" must mean the kernel stopped deciding, not that it will soon.
    let held = pins::wait_detached(&removed.attached, pins::DETACH_WAIT);
    if !held.is_empty() {
        eprintln!(
            "Removed the pins under {}, but links {:?} are still attached after {} s: another process holds them (see `bpftool link show id N`), and their programs still decide about GPU opens",
            root.display(),
            held,
            pins::DETACH_WAIT.as_secs()
        );
        return Ok(ExitCode::FAILURE);
    }
    println!(
        "Removed {} pinned programs and {} maps under {}: the kernel no longer decides about GPU opens until an enforcer runs",
        removed.links,
        removed.maps,
        root.display()
    );
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
