//! What the GPU processes claim, read before genv's lock is taken (their environment
//! blocks may not answer for a while: see `crate::backends::address_space`), and used by
//! the assembly under it.

use super::claims::{KernelClaim, claim_of_identity};
use super::{ProcessInspector, ProcessTable};
use crate::backends::procfs::{EnvironError, ProcStat};
use crate::state::Env;

/// A process's claim, read ahead of the lock, with the image it was read of.
pub(super) struct ReadAhead {
    pub(super) start_time: u64,
    pub(super) exec_fingerprint: [u64; 3],
    pub(super) claim: Result<Option<String>, EnvironError>,
}

/// Reads what the processes in `pids` not known yet claim, before genv's lock is taken,
/// and the start time of each.
pub(super) fn read_claims_ahead(
    table: &mut ProcessTable,
    pids: &[u32],
    inspector: &dyn ProcessInspector,
) {
    use genv_ebpf_common::identity;
    table.ahead.clear();
    table.ahead_started.clear();
    table.claims_read_ahead = true;
    // What exec'd or exited since the last assembly is forgotten first, so that its new
    // image is read ahead here rather than left out under the lock.
    table.apply_changes(inspector);
    for &pid in pids {
        if let Some(known) = table.known.get(&pid) {
            table.ahead_started.insert(pid, known.start_time);
            continue;
        }
        if table.ahead.contains_key(&pid) {
            continue;
        }
        let Ok(stat) = inspector.stat(pid) else {
            continue; // gone: the assembly leaves it out
        };
        table.ahead_started.insert(pid, stat.start_time);
        // Outside any environment at its exec, it is outside whatever the state says.
        // An identity that names an environment is read ahead all the same: the state
        // read under the lock may no longer list that environment (it was dropped),
        // and only the block spells the id of one that is not active.
        let needs_block = inspector.kernel_identity(pid) != Some(identity::NO_ENV);
        if stat.is_kernel_thread() || !needs_block {
            continue;
        }
        let claim = inspector.environment_id(pid);
        table.ahead.insert(
            pid,
            ReadAhead {
                start_time: stat.start_time,
                exec_fingerprint: stat.exec_fingerprint,
                claim,
            },
        );
    }
}

/// What process `pid` (its image as `stat` reads) claims: the kernel's exec-time record
/// where there is one, else its environment block, read ahead of genv's lock (or now,
/// where nothing was read ahead); `None` when it was not read ahead (it is new, or
/// exec'd, since): it is left out of this snapshot, and read ahead of the next.
pub(super) fn claim_of(
    table: &mut ProcessTable,
    pid: u32,
    stat: &ProcStat,
    inspector: &dyn ProcessInspector,
    envs: Option<&[Env]>,
) -> Option<Result<Option<String>, EnvironError>> {
    let recorded = inspector.kernel_identity(pid);
    Some(
        match recorded.map_or(KernelClaim::AskProc, |id| claim_of_identity(id, envs)) {
            KernelClaim::Outside => Ok(None),
            KernelClaim::In(eid) => Ok(Some(eid)),
            KernelClaim::AskProc => match table.ahead.remove(&pid) {
                Some(ahead)
                    if ahead.start_time == stat.start_time
                        && ahead.exec_fingerprint == stat.exec_fingerprint =>
                {
                    ahead.claim
                }
                _ if table.claims_read_ahead => return None,
                _ => inspector.environment_id(pid),
            },
        },
    )
}
