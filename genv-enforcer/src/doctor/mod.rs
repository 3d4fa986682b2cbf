//! `genv-enforcer doctor`: what this node allows and what a configuration would get
//! here, without a running daemon and changing nothing. Each item is found or not,
//! with why and the fix ([`checked_item`]): the kernel's BTF, LSMs, open tiers and libcuda
//! probes, loaded for real and unloaded at once ([`kernel_checks`]); NVML, libcuda and
//! the GPU nodes ([`gpu_checks`]); root, genv's state directory, the systemd unit and
//! pins ([`node_checks`]). The report ([`checkup`]) ends in a verdict: exit 0 when the
//! configuration can run as asked, [`crate::exit_code::NOT_READY`] otherwise.
//!
//! Its mounts (tracefs, securityfs where a minimal system lacks them, as the daemon
//! mounts them) are made in a mount namespace of its own ([`private_mounts`]).

mod checked_item;
mod checkup;
mod gpu_checks;
mod kernel_checks;
mod node_checks;
mod private_mounts;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use checked_item::{CheckedItem, ItemStatus};
pub use checkup::Checkup;

use crate::alloc::MemoryAtAlloc;
use crate::sync::KernelSettings;

/// The configuration, as `enforce` would read the same flags.
#[derive(Debug)]
pub struct Asked {
    /// What it asks for in a few words (`event-driven, --bpf-tier auto`), or why it is
    /// refused before anything runs (flags that do not go together).
    pub mode: Result<String, String>,
    /// `--event-driven`'s kernel settings; `None`: no kernel programs.
    pub events: Option<KernelSettings>,
    pub state_dir: PathBuf,
    pub nvml_lib: OsString,
    pub pin_dir: PathBuf,
}

/// Every check, in the order the report shows them.
pub fn checkup(asked: &Asked) -> Checkup {
    let mut items = vec![node_checks::root()];
    items.push(match &asked.mode {
        Ok(mode) => CheckedItem::ok("configuration", mode.clone()),
        Err(why) => CheckedItem::new("configuration", ItemStatus::Fail, why.clone())
            .with_fix("see docs/reference.md for how the flags combine"),
    });
    let outcome = match &asked.mode {
        Ok(_) => {
            let probe = private_mounts::enter();
            let (kernel, outcome) = kernel_checks::check(asked.events.as_ref(), probe);
            items.extend(kernel);
            outcome
        }
        // Flags `enforce` refuses load nothing there either: fixed first, they are
        // what the kernel is asked about.
        Err(_) => {
            items.push(CheckedItem::new(
                "kernel",
                ItemStatus::Absent,
                "not asked: programs are loaded for a configuration enforce accepts",
            ));
            kernel_checks::TierOutcome::default()
        }
    };
    let (nvml, beside_nvml) = gpu_checks::nvml(&asked.nvml_lib);
    items.push(nvml);
    let cuda_libs = asked.events.as_ref().map_or(&[][..], |s| &s.cuda_libs);
    let memory_at_alloc = asked
        .events
        .as_ref()
        .is_some_and(|s| s.memory_at_alloc != MemoryAtAlloc::Off);
    let libcuda = gpu_checks::libcuda(cuda_libs, beside_nvml.as_deref(), memory_at_alloc);
    items.push(libcuda);
    items.push(gpu_checks::device_nodes());
    items.push(node_checks::state_dir(&asked.state_dir));
    items.push(node_checks::systemd_unit());
    items.push(node_checks::pins(&asked.pin_dir));
    Checkup::new(items, outcome, asked.events.is_some())
}

/// Prints the checkup (text, or JSON with `json`); exit 0 when ready.
pub fn run(asked: &Asked, json: bool) -> ExitCode {
    let checkup = checkup(asked);
    match json {
        true => println!("{}", checkup.json()),
        false => print!("{}", checkup.text()),
    }
    match checkup.ready {
        true => ExitCode::SUCCESS,
        false => ExitCode::from(crate::exit_code::NOT_READY),
    }
}
