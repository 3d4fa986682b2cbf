//! Diagnostics go through `tracing` to stderr; genv's lines stay on stdout, as genv's
//! (escaped only where a user-written field holds what a terminal would act on: see
//! [`crate::genv_lines`]).
//!
//! `--log-format text` (the default) prints each event as the enforcer always has:
//! `[INFO] …`, `[WARNING] …`, `[ERROR] …`, `[DEBUG] …`, and `[EVENT] …` / `[BPF] …` for
//! what `--verbose` and `--bpf-log` report, `[DECISION] …` for what was done to a
//! process and why (its fields after the line: `rule=… action=… pid=… uid=… user=…`). `--log-format json` prints one JSON object a
//! line (timestamp, level, target, fields.message) for log shippers, ASCII only (see
//! [`super::ascii_stderr`]).

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the subscriber for the whole process (once).
pub fn init(format: LogFormat) {
    let builder = tracing_subscriber::fmt().with_max_level(Level::DEBUG);
    let _ = match format {
        LogFormat::Text => (builder.with_writer(std::io::stderr))
            .event_format(Text)
            .try_init(),
        // Its strings escape C0 only: the rest past ASCII is escaped on the way out.
        LogFormat::Json => (builder.with_writer(|| super::ascii_stderr::AsciiStderr))
            .json()
            .with_current_span(false)
            .try_init(),
    };
}

/// The enforcer's own line format.
struct Text;

impl<S, N> FormatEvent<S, N> for Text
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let metadata = event.metadata();
        let tag = match (metadata.target(), *metadata.level()) {
            ("event", _) => "EVENT",
            ("bpf", _) => "BPF",
            ("decision", _) => "DECISION",
            (_, Level::ERROR) => "ERROR",
            (_, Level::WARN) => "WARNING",
            (_, Level::INFO) => "INFO",
            (_, Level::DEBUG) => "DEBUG",
            (_, Level::TRACE) => "TRACE",
        };
        // Fields carry names users wrote (environment ids, user names): escaped as
        // genv's lines are, so a log read on a terminal cannot drive it.
        let mut line = format!("[{tag}] ");
        ctx.field_format()
            .format_fields(Writer::new(&mut line), event)?;
        writeln!(writer, "{}", crate::genv_lines::escaped(&line))
    }
}
