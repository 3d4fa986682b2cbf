//! SIGHUP's reading of `--config`: the command line as first given, with the file's flags
//! read again, parsed and validated exactly as at start; what changed that needs a
//! restart is named.

use std::ffi::OsString;

use clap::Parser;

use super::args::{Cli, Command, EnforceArgs};
use super::config::{EnforceConfig, Mode};
use super::config_file;
use crate::daemon::reload::{Reloadable, Reloader};

/// What only a restart changes: the kernel side, the sources, the identity policy.
fn fixed(args: &EnforceArgs) -> String {
    let e = &args.events;
    format!(
        "{:?}",
        (
            (
                e.event_driven,
                e.bpf_tier,
                &e.gpu_node,
                &e.run_dir,
                e.deny,
                e.deny_root
            ),
            (
                &e.allow_exe,
                e.keep_pinned,
                &e.pin_dir,
                e.bpf_log,
                e.memory_at_alloc
            ),
            (
                &e.cuda_lib,
                e.ring_buffer_bytes,
                &args.sources.nvml_lib,
                e.metrics_addr,
                e.verbose
            ),
            (
                &args.sources.genv_tmpdir,
                args.allow_unknown_env,
                args.allow_foreign_env
            ),
            args.orphans,
        )
    )
}

pub fn reloader(argv: Vec<OsString>, started: &EnforceArgs) -> Reloader {
    let started = fixed(started);
    Reloader(Box::new(move || {
        let expanded = config_file::expand(&argv)?;
        let Command::Enforce(args) = Cli::try_parse_from(expanded)?.command else {
            anyhow::bail!("not an enforce command line");
        };
        // Half a change could undo what the other half relied on (`deny` dropped with
        // `non-env-processes` off, the kernel still denying): all or nothing.
        if fixed(&args) != started {
            anyhow::bail!(
                "the file changes settings only a restart changes (the tier, deny, pins, sources, identity policy, verbose, metrics-addr): restart the daemon to apply it"
            );
        }
        let config = EnforceConfig::from_args(args)?;
        let (interval, memory_interval) = match config.mode {
            Mode::EventDriven(settings) => (settings.interval, Some(settings.memory_interval)),
            Mode::Polling(interval) => (interval, None),
            Mode::Once => anyhow::bail!("interval = 0 would end the daemon; give it a period"),
        };
        let reloadable = Reloadable {
            rules: config.rules,
            interval,
            memory_interval,
            execution: config.execution,
        };
        // What the rules say of themselves, as at start (said as SIGHUP's).
        Ok((reloadable, config.warnings))
    }))
}
