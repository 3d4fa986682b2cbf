//! SIGHUP's reading of `--config`: the command line as first given, with the file's flags
//! read again, parsed and validated exactly as at start; what changed that needs a
//! restart is named.

use std::ffi::OsString;

use clap::Parser;

use super::args::{Cli, Command, EnforceArgs};
use super::config::{EnforceConfig, Mode};
use super::config_file;
use crate::service::reload::{Reloadable, Reloader};

/// What only a restart changes (the kernel side, the sources, the identity policy),
/// each under its flag, its value as text: enough to say which ones a file changed.
fn restart_only(args: &EnforceArgs) -> Vec<(&'static str, String)> {
    use std::fmt::Debug;
    fn text(value: &dyn Debug) -> String {
        format!("{value:?}")
    }
    /// An optional flag's value, or that it was not given.
    fn given<T: Debug>(value: &Option<T>) -> String {
        value
            .as_ref()
            .map_or_else(|| "not given".to_owned(), |v| text(v))
    }
    let (e, s) = (&args.events, &args.sources);
    vec![
        ("--event-driven", text(&e.event_driven)),
        ("--bpf-tier", given(&e.bpf_tier)),
        ("--gpu-node", text(&e.gpu_node)),
        ("--run-dir", text(&e.run_dir)),
        ("--deny", text(&e.deny)),
        ("--deny-root", text(&e.deny_root)),
        ("--allow-exe", text(&e.allow_exe)),
        ("--keep-pinned", text(&e.keep_pinned)),
        ("--pin-dir", text(&e.pin_dir)),
        ("--bpf-log", text(&e.bpf_log)),
        ("--memory-at-alloc", text(&e.memory_at_alloc)),
        ("--cuda-lib", text(&e.cuda_lib)),
        ("--ring-buffer-bytes", given(&e.ring_buffer_bytes)),
        ("--metrics-addr", given(&e.metrics_addr)),
        ("--verbose", text(&e.verbose)),
        ("--nvml-lib", text(&s.nvml_lib)),
        ("--genv-tmpdir", text(&s.genv_tmpdir)),
        ("--allow-unknown-env", text(&args.allow_unknown_env)),
        ("--allow-foreign-env", text(&args.allow_foreign_env)),
        ("--orphans", text(&args.orphans)),
    ]
}

/// The flags whose values differ between `before` and `after`, with both values.
fn changed(before: &[(&'static str, String)], after: &[(&'static str, String)]) -> Vec<String> {
    before
        .iter()
        .zip(after)
        .filter(|((_, old), (_, new))| old != new)
        .map(|((flag, old), (_, new))| format!("{flag}: {old} -> {new}"))
        .collect()
}

pub fn reloader(argv: Vec<OsString>, started: &EnforceArgs) -> Reloader {
    let started = restart_only(started);
    Reloader(Box::new(move || {
        let expanded = config_file::expand(&argv)?;
        let Command::Enforce(args) = Cli::try_parse_from(expanded)?.command else {
            anyhow::bail!("not an enforce command line");
        };
        // Half a change could undo what the other half relied on (`deny` dropped with
        // `non-env-processes` off, the kernel still denying): all or nothing.
        let changed = changed(&started, &restart_only(&args));
        if !changed.is_empty() {
            anyhow::bail!(
                "the file changes settings only a restart changes ({}): restart the daemon to apply it",
                changed.join("; ")
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
