//! What a reaction may use beyond its own state: the stages it asks (the mirror, for an
//! identity the exec hook could not read; `alloc`, which keeps the probes' maps), what
//! the last full cycle learned of the devices, the users' notifier, and the counters.
//! Each is borrowed for the one event: the reactions own none of them.

use crate::alloc::AllocSide;
use crate::backends::nvml::GpuInfo;
use crate::notify::Notifier;
use crate::service::status::Counts;
use crate::sync::Mirror;

pub struct Around<'a> {
    pub mirror: &'a mut Mirror,
    /// `--memory-at-alloc`.
    pub alloc: Option<&'a mut AllocSide>,
    /// NVML's devices, as the last full cycle listed them.
    pub devices: &'a [GpuInfo],
    pub notifier: Option<&'a Notifier>,
    pub counts: &'a mut Counts,
    /// Whether genv's non-env rule is in force (a CUDA start outside any environment is
    /// judged at once only then).
    pub non_env_rule: bool,
}
