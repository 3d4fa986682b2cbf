//! What a process's claim makes of it: the kernel's exec-time record read among the
//! active environments, an orphan of an environment genv dropped, and the environment
//! it counts as being in.

use std::io;

use super::super::Warning;
use super::super::orphans::{DroppedEnvs, Orphan};
use super::{EnvPolicy, Usage};
use crate::state::Env;

/// An orphan: a process of its own environment (its uid, or root) that genv dropped,
/// on GPUs that environment had attached. Anywhere else it is no orphan, and the rules
/// judge it as the claim of an environment not active.
pub(super) fn orphan_of(
    dropped: &DroppedEnvs,
    eid: &str,
    gpus: &[Usage],
    uid: &mut dyn FnMut() -> io::Result<u32>,
) -> Option<Orphan> {
    let env = dropped.dropped(eid)?;
    if !gpus.iter().all(|u| env.attached.contains(&u.index)) {
        return None;
    }
    let uid = uid().ok()?;
    (uid == env.uid || uid == 0).then(|| Orphan {
        pid: 0,
        uid,
        eid: eid.to_owned(),
    })
}

/// What the kernel's exec-time record says of a process's environment.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum KernelClaim {
    /// No `GENV_ENVIRONMENT_ID` at its exec: outside any environment.
    Outside,
    /// This active environment.
    In(String),
    /// Nothing to go by: the kernel could not resolve it, or it names an environment
    /// not active now, whose id only `/proc` can spell.
    AskProc,
}

/// The claim the kernel's exec-time record (`identity`) makes, among `envs`.
pub(super) fn claim_of_identity(identity: u64, envs: Option<&[Env]>) -> KernelClaim {
    use genv_ebpf_common::{MAX_ENV_ID, env_id_hash, identity as kernel};
    match identity {
        kernel::UNRESOLVED => KernelClaim::AskProc,
        kernel::NO_ENV => KernelClaim::Outside,
        hash => envs
            .into_iter()
            .flatten()
            .find(|e| {
                !e.key_lost && e.eid.len() <= MAX_ENV_ID && env_id_hash(e.eid.as_bytes()) == hash
            })
            .map_or(KernelClaim::AskProc, |e| KernelClaim::In(e.eid.clone())),
    }
}

/// The environment a process counts as being in: `Some(None)` outside any,
/// `Some(Some(eid))` in `eid`, `None` when it cannot be told.
pub(super) fn resolve_env(
    pid: u32,
    claimed: Option<String>,
    envs: Option<&[Env]>,
    uid: &mut dyn FnMut() -> io::Result<u32>,
    policy: EnvPolicy,
    warnings: &mut Vec<Warning>,
) -> Option<Option<String>> {
    let Some(eid) = claimed else {
        return Some(None);
    };
    if policy.trust_unknown_env_ids && policy.trust_foreign_env_ids {
        return Some(Some(eid));
    }
    let Some(envs) = envs else {
        warnings.push(warning!(
            "cannot check environment {eid} of process {pid} without envs.json: leaving it alone"
        ));
        return None;
    };
    let Some(env) = envs.iter().find(|e| e.eid == eid) else {
        if policy.trust_unknown_env_ids {
            return Some(Some(eid));
        }
        warnings.push(warning!(
            "process {pid} claims environment {eid}, which is not active: it counts as outside any environment"
        ));
        return Some(None);
    };
    if policy.trust_foreign_env_ids {
        return Some(Some(eid));
    }
    match uid() {
        Ok(uid) if uid == env.uid || uid == 0 => Some(Some(eid)),
        Ok(uid) => {
            warnings.push(warning!(
                "process {pid} of uid {uid} claims environment {eid} of uid {}: it counts as outside any environment",
                env.uid
            ));
            Some(None)
        }
        Err(e) => {
            warnings.push(warning!(
                "cannot read the uid of process {pid} ({e}): leaving it alone"
            ));
            None
        }
    }
}
