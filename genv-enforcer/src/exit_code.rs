//! The exit codes the subcommands give beyond success (0), an error (1) and a command
//! line clap refused (2), decided in this one place. `status` and `why` read them as an
//! LSB init script's `status` does.

/// The daemon is not running (no status file, or one whose process is gone; no `why`
/// socket answering).
pub const NOT_RUNNING: u8 = 3;
/// The daemon runs, but its status was not written for longer than `--max-age`.
pub const STUCK: u8 = 4;
/// `doctor`: the configuration cannot run here as asked (its verdict says which item
/// fails).
pub const NOT_READY: u8 = 5;
