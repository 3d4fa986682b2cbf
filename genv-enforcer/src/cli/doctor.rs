//! `genv-enforcer doctor`: `enforce`'s flags and `--config` file, read as `enforce`
//! reads them, handed to [`crate::doctor`] as what the configuration asks.

use std::process::ExitCode;

use super::args::EnforceArgs;
use super::config::{EnforceConfig, Mode};
use crate::doctor::{self, Asked};

/// Checks the node for the configuration `enforce` gives; `json`: the report as JSON.
pub fn run(enforce: EnforceArgs, json: bool) -> ExitCode {
    let state_dir = enforce.sources.genv_tmpdir.clone();
    let nvml_lib = enforce.sources.nvml_lib.clone();
    let pin_dir = enforce.events.pin_dir.clone();
    let config_file = enforce.config.clone();
    let (mode, events) = match EnforceConfig::from_args(enforce) {
        Ok(config) => match config.mode {
            Mode::Once => (Ok("one cycle (--interval 0)".to_owned()), None),
            Mode::Polling(every) => (Ok(format!("the full cycle every {every:?}")), None),
            Mode::EventDriven(settings) => {
                let kernel = settings.kernel;
                let mode = format!(
                    "event-driven, --bpf-tier {}, deny {}, memory-at-alloc {}",
                    kernel.tier.name(),
                    if kernel.deny.deny { "on" } else { "off" },
                    kernel.memory_at_alloc.name()
                );
                (Ok(mode), Some(kernel))
            }
        },
        Err(e) => (Err(e.to_string()), None),
    };
    let from = config_file.map_or(" (no --config)".to_owned(), |f| {
        format!(" (with {})", f.display())
    });
    let asked = Asked {
        mode: mode.map(|m| m + &from),
        events,
        state_dir,
        nvml_lib,
        pin_dir,
    };
    doctor::run(&asked, json)
}
