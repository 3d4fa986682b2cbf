//! The kernel programs `usage watch` loads where it can: reporting only, their watched
//! nodes kept as the snapshot finds them, their events read.

use std::time::Duration;

use crate::backends::procfs;
use crate::intake::{EventIntake, KernelEvent};
use crate::kernel::cuda::AllocProbes;
use crate::kernel::policy_maps::PolicyMaps;
use crate::kernel::{KernelPrograms, LoadOptions, Loaded, TierChoice};

/// How often exit events are read (they do not wake the reader).
const DRAIN_EVERY: Duration = Duration::from_millis(100);

/// The programs `usage watch` loads: the watched nodes kept in their policy maps, and
/// their events read.
pub(super) struct WatchPrograms {
    /// Held for their life: dropped, the programs are detached.
    programs: KernelPrograms,
    pub(super) policy: PolicyMaps,
    pub(super) intake: EventIntake,
}

/// The kernel programs, reporting only (no `--deny`), where they load; otherwise the
/// poll alone, said once.
pub(super) fn load_programs(tier: TierChoice) -> Option<WatchPrograms> {
    if tier == TierChoice::None {
        return None;
    }
    if let Some(namespace) = procfs::nested_pid_namespace() {
        tracing::info!(
            "usage watch: in a pid namespace of its own ({namespace}), the kernel's pids are not this one's; polling"
        );
        return None;
    }
    let options = LoadOptions {
        choice: tier,
        ring_bytes: None,
        pin_dir: None,
        compat_opens: false,
        log_decisions: false,
        memory_at_alloc: AllocProbes::Off,
    };
    let loaded = KernelPrograms::load(&options)
        .map_err(|e| e.to_string())
        .and_then(|loaded| {
            let Loaded {
                programs,
                events,
                policy,
                ..
            } = loaded;
            let intake = EventIntake::new(events.ring, events.lost)
                .map_err(|e| format!("reading its events: {e}"))?;
            Ok(WatchPrograms {
                programs,
                policy,
                intake,
            })
        });
    match loaded {
        Ok(loaded) => {
            tracing::info!(
                "usage watch: kernel programs on the {} tier report GPU opens and exits",
                loaded.programs.tier().name()
            );
            Some(loaded)
        }
        Err(e) => {
            tracing::info!("usage watch: no kernel programs ({e}); polling");
            None
        }
    }
}

pub(super) async fn next_events(kernel: &mut Option<WatchPrograms>, events: &mut Vec<KernelEvent>) {
    match kernel {
        Some(WatchPrograms { intake, .. }) => {
            let mut unknown = Vec::new();
            let waited = tokio::time::timeout(DRAIN_EVERY, intake.next_batch(events, &mut unknown));
            if let Ok(Err(e)) = waited.await {
                tracing::warn!("Reading the kernel's events: {e}; polling");
                *kernel = None;
            }
        }
        None => std::future::pending().await,
    }
}
