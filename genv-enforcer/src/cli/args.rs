//! The command line, as clap parses it: `genv enforce`'s flags, one for one, plus the
//! enforcer's own. Each flag's own value is checked here; how flags combine is checked
//! in one place, [`super::config`]. Nothing here touches the system.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::alloc::MemoryAtAlloc;
use crate::backends::devmap::NodeOverride;
use crate::backends::nvml::DEFAULT_LIBRARY;
use crate::kernel::TierChoice;
use crate::notify::NotifyMode;
use crate::snapshot::{OrphanPolicy, SnapshotJson};

use super::shared_args::{MAX_SECONDS, RuleArgs, non_negative_seconds, positive_seconds};

#[derive(Debug, Parser)]
#[command(
    name = "genv-enforcer",
    version,
    about = "Enforces genv's GPU-usage policy; a drop-in for `genv enforce`"
)]
pub struct Cli {
    /// How diagnostics are written to stderr: text, or one JSON object a line.
    #[arg(long, global = true, value_enum, default_value_t = super::logging::LogFormat::Text)]
    pub log_format: super::logging::LogFormat,

    /// Run as root even from a binary that another user could replace (a directory
    /// above it, or the file itself, owned or writable by someone other than root).
    /// Without it, root refuses to run such a binary and says how to install it.
    #[arg(
        long,
        global = true,
        env = "GENV_ENFORCER_ALLOW_UNTRUSTED_BINARY",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub allow_untrusted_binary: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Enforce GPU usage (genv enforce).
    Enforce(EnforceArgs),
    /// Take a usage snapshot or execute a report (genv usage), wire-compatible with genv.
    #[command(subcommand)]
    Usage(UsageCommand),
    /// Enforce on many hosts over SSH (genv remote ... enforce).
    Remote(super::remote_args::RemoteArgs),
    /// Show what a running event-driven enforcer is doing (tier, programs, counters).
    Status {
        /// The running enforcer's runtime directory.
        #[arg(long, value_name = "DIR", env = "GENV_ENFORCER_RUN_DIR", default_value = DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
        /// Exit 4 when the status was last written longer ago than this: the daemon's
        /// loop is stuck (it rewrites the file every 10 s at least). For a liveness
        /// probe; 20 at least.
        #[arg(long, value_name = "SECONDS", value_parser = status_max_age)]
        max_age: Option<u64>,
    },
    /// What the enforcer did to your processes, and why: the running daemon's recent
    /// decisions about them (root: about everyone's), with the line each was told.
    Why {
        /// Only decisions about this process.
        pid: Option<u32>,
        /// Only your own processes (for root, who otherwise sees everyone's).
        #[arg(long)]
        me: bool,
        /// The newest this many decisions.
        #[arg(long, value_name = "N", default_value_t = 20)]
        limit: usize,
        /// Print the decisions as one JSON array.
        #[arg(long)]
        json: bool,
        /// The running enforcer's runtime directory (its socket is `why.sock` there).
        #[arg(long, value_name = "DIR", env = "GENV_ENFORCER_RUN_DIR", default_value = DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
    },
    /// What this node allows and what the configuration (enforce's flags, --config)
    /// would get here, without a daemon and changing nothing; exit 5 when it cannot run
    /// as asked.
    Doctor {
        /// Print the report as one JSON object (the same items and verdict).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        enforce: EnforceArgs,
    },
    /// Remove the programs and maps an enforcer left pinned (--keep-pinned): the kernel
    /// stops deciding about GPU opens until an enforcer runs again.
    Unpin {
        /// Where they are pinned.
        #[arg(long, value_name = "DIR", env = "GENV_ENFORCER_PIN_DIR", default_value = crate::kernel::pins::DEFAULT_ROOT)]
        pin_dir: PathBuf,
    },
    /// Write the manual pages (roff, one file a page) into DIR: `cargo xtask dist` and
    /// `install` run the binary they ship so, and the pages say what it parses. Hidden:
    /// a packaging step, not a user's command.
    #[command(hide = true)]
    ManualPages {
        /// Where to write them (created if missing).
        dir: PathBuf,
    },
}

/// Where the event-driven daemon keeps its instance lock and status file.
pub const DEFAULT_RUN_DIR: &str = "/run/genv-enforcer";

#[derive(Debug, Subcommand)]
pub enum UsageCommand {
    /// Print a snapshot of GPU usage as JSON.
    Snapshot {
        /// Output format.
        #[arg(long, value_parser = ["json"], default_value = "json")]
        format: String,
        /// Print only this part of the snapshot.
        #[arg(long = "type", value_enum)]
        part: Option<SnapshotJson>,
        #[command(flatten)]
        sources: SourceArgs,
    },
    /// Print the snapshot as one line of JSON at start and again whenever it changes
    /// (genv's state files, a GPU open or exit, or the poll); what `remote enforce
    /// --event-driven` streams from each host.
    Watch {
        /// Seconds between polls, which catch what no event announces (memory use).
        #[arg(long, value_name = "SECONDS", default_value_t = 1.0, value_parser = positive_seconds)]
        poll_interval: f64,
        /// Print `{}` (an empty JSON object, never a snapshot) when nothing else was
        /// printed for this many seconds: the reader tells a stream that is alive and
        /// quiet from one stuck (NVML hanging on a failed GPU). Off unless asked for,
        /// so that a reader that does not know it never sees one.
        #[arg(long, value_name = "SECONDS", value_parser = positive_seconds)]
        heartbeat: Option<f64>,
        /// Which kernel programs report GPU opens and exits: the best the kernel
        /// accepts (auto), or none (the poll alone).
        #[arg(long, value_enum, value_name = "TIER", default_value_t = TierChoice::Auto)]
        bpf_tier: TierChoice,
        /// Treat device node MAJOR:MINOR as GPU INDEX (repeatable), as `enforce` does.
        #[arg(long, value_name = "MAJOR:MINOR=INDEX", action = clap::ArgAction::Append)]
        gpu_node: Vec<NodeOverride>,
        #[command(flatten)]
        sources: SourceArgs,
    },
    /// Execute the report passed as JSON on stdin.
    Execute {
        #[command(flatten)]
        execution: ExecutionArgs,
        /// The report carries why each process goes (`reasons`, from genv-enforcer's
        /// `remote enforce`): each process's user is told on their terminal, and the
        /// decision is kept for `genv-enforcer why` (by the daemon running here, else in
        /// `<run-dir>/told/<uid>.json`).
        #[arg(long)]
        with_reasons: bool,
        /// The daemon's runtime directory here, where the decisions are kept.
        #[arg(long, value_name = "DIR", env = "GENV_ENFORCER_RUN_DIR", default_value = DEFAULT_RUN_DIR)]
        run_dir: PathBuf,
    },
}

#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub struct EnforceArgs {
    /// Read flags from this TOML file, one key per long flag (`non-env-processes =
    /// true`, `interval = 10`); flags on the command line win. SIGHUP reads it again.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Seconds between enforcement cycles; 0 runs one cycle and exits.
    #[arg(long, default_value_t = 10.0, value_parser = non_negative_seconds, allow_hyphen_values = true)]
    pub interval: f64,

    #[command(flatten)]
    pub rules: RuleArgs,

    /// genv's behaviour: a process whose GENV_ENVIRONMENT_ID names no active environment
    /// still counts as inside one.
    #[arg(long)]
    pub allow_unknown_env: bool,

    /// genv's behaviour: a process may claim another user's environment.
    #[arg(long)]
    pub allow_foreign_env: bool,

    /// Processes of an environment genv dropped when its shells exited (a `nohup` job):
    /// `leave` them running on the GPUs it had, reported (as genv leaves them), or
    /// `terminate` them as outside any environment.
    #[arg(long, value_enum, default_value_t = OrphanPolicy::Leave)]
    pub orphans: OrphanPolicy,

    /// Where the users whose processes are stopped or refused are told why and how to
    /// fix it: on the process's own terminal (`tty`), or only in the log and in what
    /// `genv-enforcer why` shows (`none`).
    #[arg(long, value_enum, value_name = "WHERE", default_value_t = NotifyMode::Tty)]
    pub notify: NotifyMode,

    #[command(flatten)]
    pub execution: ExecutionArgs,

    #[command(flatten)]
    pub sources: SourceArgs,

    #[command(flatten)]
    pub events: EventArgs,
}

/// The event-driven mode: kernel programs report GPU opens and process lifecycle.
#[derive(Debug, Args)]
pub struct EventArgs {
    /// React to GPU opens and state-file changes as they happen (eBPF), with the full
    /// cycle every --interval as a safety net.
    #[arg(long)]
    pub event_driven: bool,

    /// Which kernel tier watches GPU opens: the best the kernel accepts (auto), a forced
    /// one (an error if the kernel refuses it), or none (the full cycle alone)
    /// [default: auto].
    #[arg(long, value_enum, value_name = "TIER")]
    pub bpf_tier: Option<TierChoice>,

    /// Seconds between NVML memory polls (fractions allowed) [default: 1].
    #[arg(long, value_name = "SECONDS", value_parser = positive_seconds)]
    pub memory_interval: Option<f64>,

    /// Treat device node MAJOR:MINOR as GPU INDEX (repeatable), in addition to what
    /// /proc/devices and NVML's minor numbers say: for the kernel programs and for the
    /// /proc scan that stands in for NVML.
    #[arg(long, value_name = "MAJOR:MINOR=INDEX", action = clap::ArgAction::Append)]
    pub gpu_node: Vec<NodeOverride>,

    /// Runtime directory: the single-instance lock and the status file.
    #[arg(long, value_name = "DIR", env = "GENV_ENFORCER_RUN_DIR", default_value = DEFAULT_RUN_DIR)]
    pub run_dir: PathBuf,

    /// Print each GPU open the kernel reports, and how long each reaction took.
    #[arg(long, short)]
    pub verbose: bool,

    /// Decide in the kernel, at the open: a GPU node opened by a process outside any
    /// environment is refused with EPERM (lsm and fmod_ret tiers) or the process is
    /// killed before the open returns (fentry and tracepoint tiers). It is
    /// --non-env-processes, enforced before the process gets the GPU; processes inside
    /// environments are never refused.
    #[arg(long)]
    pub deny: bool,

    /// With --deny, deny root's processes outside environments too. Off by default: the
    /// container runtime's hooks, MPS, Xorg, nvidia-persistenced and DCGM run as root,
    /// and root can unload the programs anyway; root's compute processes outside
    /// environments are still terminated by --non-env-processes, as in genv.
    #[arg(long)]
    pub deny_root: bool,

    /// An executable that may open GPU nodes outside any environment (repeatable), by
    /// device and inode; beyond the enforcer itself and nvidia-smi,
    /// nvidia-persistenced, nv-hostengine, dcgmi and dcgm-exporter where they exist.
    #[arg(long, value_name = "PATH", action = clap::ArgAction::Append)]
    pub allow_exe: Vec<PathBuf>,

    /// Pin the kernel programs and maps in bpffs, so that they keep deciding (with the
    /// last environments mirrored) while the daemon is stopped, restarts or is
    /// upgraded: fail-closed. Without it, stopping the daemon detaches them: fail-open.
    /// `genv-enforcer unpin` removes them.
    #[arg(long)]
    pub keep_pinned: bool,

    /// Where --keep-pinned pins (a directory in bpffs), and where a starting daemon
    /// looks for a previous run's pins to take over from.
    #[arg(long, value_name = "DIR", env = "GENV_ENFORCER_PIN_DIR", default_value = crate::kernel::pins::DEFAULT_ROOT)]
    pub pin_dir: PathBuf,

    /// Print why the kernel programs decided what they did about each GPU open, as
    /// `[BPF] …` lines on stderr: the identity found, the environment it names and its
    /// owner, the verdict. Off, the logging code is not even loaded (the verifier drops
    /// it), so it costs nothing.
    #[arg(long)]
    pub bpf_log: bool,

    /// Hold environments' gpu_memory at the allocation: uprobes on libcuda's
    /// allocation calls charge each to its environment and GPU, and one that would take
    /// the environment past its cap is reported (`report`), its process killed in the
    /// call, before the driver hands anything out (`kill`), or made to return
    /// CUDA_ERROR_OUT_OF_MEMORY without running, the process living on (`refuse`; on
    /// kernels that let a uprobe program set registers, else as `kill`, said at start).
    /// The memory rule still acts after the fact, as the safety net.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = MemoryAtAlloc::Off)]
    pub memory_at_alloc: MemoryAtAlloc,

    /// A libcuda to probe for --memory-at-alloc (repeatable), beyond ldconfig's
    /// libcuda.so.1 and the one beside the NVML library.
    #[arg(long, value_name = "PATH", action = clap::ArgAction::Append)]
    pub cuda_lib: Vec<PathBuf>,

    /// Serve Prometheus metrics at this address (`GET /metrics`), e.g. 127.0.0.1:9469
    /// [default: off].
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_addr: Option<std::net::SocketAddr>,

    /// Ring buffer size in bytes (a power of two, at least 4096).
    #[arg(long, value_name = "BYTES", value_parser = ring_bytes, hide = true)]
    pub ring_buffer_bytes: Option<u32>,
}

/// How reports are carried out.
#[derive(Debug, Args)]
pub struct ExecutionArgs {
    /// SIGKILL a process still running this many seconds after SIGTERM; 0 never (genv).
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0, value_parser = non_negative_seconds, allow_hyphen_values = true)]
    pub kill_after: f64,

    /// Print what would be done without signalling or detaching anything.
    #[arg(long)]
    pub dry_run: bool,
}

/// Where facts come from.
#[derive(Debug, Args)]
pub struct SourceArgs {
    /// The NVML library to load.
    #[arg(long, value_name = "PATH", env = "GENV_ENFORCER_NVML_LIB", default_value = DEFAULT_LIBRARY)]
    pub nvml_lib: OsString,

    /// genv's state directory.
    #[arg(long, value_name = "DIR", env = "GENV_TMPDIR", default_value = crate::state::DEFAULT_DIR)]
    pub genv_tmpdir: PathBuf,
}

/// `status --max-age`: long enough that an idle daemon's status (rewritten every
/// [`HEARTBEAT`](crate::service::status::HEARTBEAT)) is never taken for a stuck one.
fn status_max_age(text: &str) -> Result<u64, String> {
    let least = 2 * crate::service::status::HEARTBEAT.as_secs();
    match text.parse::<u64>() {
        Ok(s) if (least..=MAX_SECONDS as u64).contains(&s) => Ok(s),
        _ => Err(format!(
            "{text:?} is not a whole number of seconds from {least} (the daemon rewrites its status every {} s when idle) up to {MAX_SECONDS}",
            least / 2
        )),
    }
}

fn ring_bytes(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(n) if n >= 4096 && n.is_power_of_two() => Ok(n),
        _ => Err(format!("{text:?} is not a power of two of at least 4096")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enforce(args: &[&str]) -> Result<EnforceArgs, clap::Error> {
        let cli = Cli::try_parse_from(["genv-enforcer", "enforce"].iter().chain(args))?;
        match cli.command {
            Command::Enforce(args) => Ok(args),
            _ => unreachable!(),
        }
    }

    #[test]
    fn accepts_genvs_command_line() {
        let args = enforce(&[
            "--interval",
            "0",
            "--non-env-processes",
            "--no-env-memory",
            "--max-devices-per-user",
            "1",
            "--max-devices-for-user",
            "alice=2",
            "bob=0",
        ])
        .unwrap();
        assert_eq!(args.interval, 0.0);
        assert!(args.rules.non_env_processes && args.rules.no_env_memory);
        assert_eq!(
            args.rules.max_devices_for_user,
            [("alice".into(), 2), ("bob".into(), 0)]
        );
    }

    #[test]
    fn the_last_of_a_flag_and_its_no_form_wins() {
        let args = enforce(&["--no-env-devices", "--env-devices"]).unwrap();
        assert!(args.rules.env_devices && !args.rules.no_env_devices);
    }

    #[test]
    fn bad_values_name_the_flag() {
        let err = enforce(&["--max-devices-for-user", "alice"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--max-devices-for-user") && err.contains("not a valid spec: alice"),
            "{err}"
        );
        let err = enforce(&["--interval", "-1"]).unwrap_err().to_string();
        assert!(err.contains("--interval"), "{err}");
        let err = enforce(&["--interval", "1e300"]).unwrap_err().to_string();
        assert!(err.contains("--interval"), "{err}");
        let err = enforce(&["--event-driven", "--gpu-node", "195:0"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--gpu-node") && err.contains("MAJOR:MINOR=INDEX"),
            "{err}"
        );
        let err = enforce(&["--event-driven", "--memory-interval", "0"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--memory-interval"), "{err}");
        let err = enforce(&["--max-devices-per-user", "-1"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--max-devices-per-user"), "{err}");
    }

    /// Shorter than twice the idle daemon's rewrite period, a liveness probe would
    /// restart a healthy daemon.
    #[test]
    fn status_max_age_is_twice_the_heartbeat_at_least() {
        let status = |age: &str| Cli::try_parse_from(["genv-enforcer", "status", "--max-age", age]);
        let err = status("19").unwrap_err().to_string();
        assert!(
            err.contains("--max-age") && err.contains("from 20"),
            "{err}"
        );
        let Command::Status { max_age, .. } = status("20").unwrap().command else {
            unreachable!()
        };
        assert_eq!(max_age, Some(20));
    }
}
