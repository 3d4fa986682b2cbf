//! The handles of `--memory-at-alloc`'s accounting maps (see `genv_ebpf_common::alloc`),
//! which the daemon keeps in step with genv and NVML: caps, baselines, exits, device
//! numbering. What they should hold is [`crate::alloc::caps`]'s.

use std::collections::{HashMap, HashSet};

use aya::Ebpf;
use aya::maps::{Array, HashMap as BpfHashMap, MapData, MapError};
use genv_ebpf_common::alloc::{
    ALLOC_BASE_MAP, ALLOC_DELTA_MAP, Baseline, CUDA_GPUS_MAP, Charge, Delta, ENV_MEMORY_MAP,
    EnvGpu, Ordinals, PROC_CAP_MAP, PROC_CHARGE_MAP, PROC_ORDINALS_MAP, ProcGpu,
};

use super::error::{LoadError, map_error, take_map};
use super::policy_maps::remove_if_there;

/// The accounting deltas of every environment and GPU, read just before NVML was asked
/// and just after it answered.
#[derive(Clone, Copy)]
pub struct DeltasAround<'a> {
    pub before: &'a HashMap<EnvGpu, Delta>,
    pub after: &'a HashMap<EnvGpu, Delta>,
}

/// Polls in a row an account may keep its baseline for an allocation or free in flight;
/// the next one takes NVML's figure anyway (with the delta read after it answered), so
/// that memory only NVML sees (contexts, exited processes' overhead) is not left
/// stale for ever by a process that never stops allocating.
const KEPT_POLLS: u32 = 3;

/// Accounts that kept their baseline, and for how many polls in a row.
type KeptPolls = HashMap<EnvGpu, u32>;

/// The accounting maps (see `genv_ebpf_common::alloc`).
pub struct AllocMaps {
    caps: BpfHashMap<MapData, u64, u64>,
    delta: BpfHashMap<MapData, EnvGpu, Delta>,
    base: BpfHashMap<MapData, EnvGpu, Baseline>,
    charges: BpfHashMap<MapData, ProcGpu, Charge>,
    ordinals: BpfHashMap<MapData, u32, Ordinals>,
    started_caps: BpfHashMap<MapData, u32, u64>,
    gpus: Array<MapData, u32>,
    /// Accounts that kept their baseline at the last polls.
    kept: KeptPolls,
}

impl AllocMaps {
    pub(super) fn take(ebpf: &mut Ebpf) -> Result<Self, LoadError> {
        Ok(Self {
            caps: take_map(ebpf, ENV_MEMORY_MAP)?,
            delta: take_map(ebpf, ALLOC_DELTA_MAP)?,
            base: take_map(ebpf, ALLOC_BASE_MAP)?,
            charges: take_map(ebpf, PROC_CHARGE_MAP)?,
            ordinals: take_map(ebpf, PROC_ORDINALS_MAP)?,
            started_caps: take_map(ebpf, PROC_CAP_MAP)?,
            gpus: take_map(ebpf, CUDA_GPUS_MAP)?,
            kept: HashMap::new(),
        })
    }

    /// Makes the caps exactly `wanted` (environment identity → bytes), and drops the
    /// accounts of environments that no longer have one.
    pub fn sync_caps(&mut self, wanted: HashMap<u64, u64>) -> Result<(), LoadError> {
        let ended = |key: &EnvGpu| !wanted.contains_key(&key.env);
        let stale: Vec<EnvGpu> = self
            .delta
            .keys()
            .filter_map(Result::ok)
            .filter(ended)
            .collect();
        super::policy_maps::sync_map(&mut self.caps, wanted).map_err(map_error(ENV_MEMORY_MAP))?;
        for key in stale {
            remove_if_there(&mut self.delta, &key).map_err(map_error(ALLOC_DELTA_MAP))?;
            remove_if_there(&mut self.base, &key).map_err(map_error(ALLOC_BASE_MAP))?;
        }
        Ok(())
    }

    /// The node's GPU count: device numbers at or past it are charged nowhere.
    pub fn set_gpus(&mut self, gpus: u32) -> Result<(), LoadError> {
        self.gpus.set(0, gpus, 0).map_err(map_error(CUDA_GPUS_MAP))
    }

    /// Every environment's delta now: read before NVML is asked and after it answers
    /// (see [`Self::set_baselines`]).
    pub fn deltas(&self) -> HashMap<EnvGpu, Delta> {
        self.delta
            .iter()
            .filter_map(Result::ok)
            .collect::<HashMap<_, _>>()
    }

    /// NVML's figures (`measured`; an environment and GPU absent there uses nothing)
    /// become the baselines, each paired with the delta read before NVML was asked.
    ///
    /// An account that moved while NVML was being asked (an allocation or free in
    /// flight: its [`Delta::moves`], which an allocation and a free of one size change
    /// too) keeps the baseline it had, up to [`KEPT_POLLS`] polls in a row: NVML's
    /// figure may or may not hold that change, so taking it with the delta read before
    /// would count an allocation twice (and kill a process with room left under its
    /// cap). The probes' own count since stands for it meanwhile.
    ///
    /// Charges of processes NVML no longer lists are dropped (its figure has let go of
    /// them already), so that their exit is not taken off twice; on an account that
    /// kept its baseline, which still holds them, they are taken off it now, as at an
    /// exit.
    pub fn set_baselines(
        &mut self,
        deltas: DeltasAround<'_>,
        measured: &HashMap<EnvGpu, u64>,
        listed: &HashSet<u32>,
    ) -> Result<(), LoadError> {
        let (mut wanted, kept) = self.plan_baselines(deltas, measured)?;
        // Off NVML's list: gone, or too new to be on it yet. On an account that took
        // NVML's figure the charges go (that figure has let go of them, or never held
        // them); on one that kept its baseline, which still holds them, a dead process's
        // come off it now, as at an exit, and a live one's stay for its exit.
        let gone: Vec<(ProcGpu, Charge)> = self
            .charges
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, _)| !listed.contains(&key.tgid))
            .filter(|(key, charge)| !kept.contains_key(&charge.account()) || dead(key.tgid))
            .collect();
        for (_, charge) in &gone {
            if kept.contains_key(&charge.account()) {
                let base = wanted.entry(charge.account()).or_default();
                base.delta_at = base.delta_at.saturating_add(charge.bytes);
            }
        }
        super::policy_maps::sync_map(&mut self.base, wanted).map_err(map_error(ALLOC_BASE_MAP))?;
        self.kept = kept;
        for (key, _) in gone {
            remove_if_there(&mut self.charges, &key).map_err(map_error(PROC_CHARGE_MAP))?;
        }
        Ok(())
    }

    /// Each account's new baseline, and the accounts that kept theirs (with how many
    /// polls in a row); an account that kept none yet has no entry.
    fn plan_baselines(
        &self,
        deltas: DeltasAround<'_>,
        measured: &HashMap<EnvGpu, u64>,
    ) -> Result<(HashMap<EnvGpu, Baseline>, KeptPolls), LoadError> {
        let keys: HashSet<EnvGpu> = deltas
            .before
            .keys()
            .chain(deltas.after.keys())
            .chain(measured.keys())
            .copied()
            .collect();
        let mut wanted = HashMap::new();
        let mut kept = HashMap::new();
        for key in keys {
            let (before, after) = (deltas.before.get(&key), deltas.after.get(&key));
            // Both fields: a read of the map is no atomic copy of them.
            let moved = before != after;
            let in_a_row = self.kept.get(&key).copied().unwrap_or(0);
            let paired = match (moved, in_a_row < KEPT_POLLS) {
                (false, _) => before,
                (true, true) => {
                    kept.insert(key, in_a_row + 1);
                    match self.base.get(&key, 0) {
                        Ok(base) => {
                            wanted.insert(key, base);
                        }
                        // No baseline yet: the probes' own count is all there is.
                        Err(MapError::KeyNotFound) => {}
                        Err(e) => return Err(map_error(ALLOC_BASE_MAP)(e)),
                    }
                    continue;
                }
                // Kept long enough: NVML's figure, with what moved counted as NVML saw it.
                (true, false) => after,
            };
            let base = Baseline {
                nvml_bytes: measured.get(&key).copied().unwrap_or(0),
                delta_at: paired.map_or(0, |d| d.bytes),
            };
            wanted.insert(key, base);
        }
        Ok((wanted, kept))
    }

    /// A process exited: the driver freed what it held, so its charges come off its
    /// environments (through the baseline, which only the daemon writes: the probes'
    /// atomic adds to the delta are never raced); its device numbering goes.
    pub fn process_exited(&mut self, pid: u32) {
        self.forget_numbering(pid);
        self.take_off_charges(pid);
    }

    /// The process's device numbering and started cap go (its image ended, and no
    /// later one was read).
    pub fn forget_numbering(&mut self, pid: u32) {
        let _ = remove_if_there(&mut self.ordinals, &pid);
        let _ = remove_if_there(&mut self.started_caps, &pid);
    }

    /// What the process held comes off its environments (its image ended: an exit, or
    /// an exec, whose new image keeps its numbering where the daemon read it since).
    pub fn take_off_charges(&mut self, pid: u32) {
        let held: Vec<ProcGpu> = self
            .charges
            .keys()
            .filter_map(Result::ok)
            .filter(|key| key.tgid == pid)
            .collect();
        for key in held {
            let Ok(charge) = self.charges.get(&key, 0) else {
                continue;
            };
            let _ = remove_if_there(&mut self.charges, &key);
            let env_gpu = charge.account();
            let mut base = self.base.get(&env_gpu, 0).unwrap_or_default();
            base.delta_at = base.delta_at.saturating_add(charge.bytes);
            if let Err(e) = self.base.insert(env_gpu, base, 0) {
                tracing::warn!("Cannot take process {pid}'s memory off its environment: {e}");
            }
        }
    }

    /// The process's CUDA device numbers (`None`: CUDA's own, unmapped).
    pub fn set_ordinals(&mut self, pid: u32, map: Option<Ordinals>) -> Result<(), LoadError> {
        match map {
            Some(map) => self.ordinals.insert(pid, map, 0),
            None => remove_if_there(&mut self.ordinals, &pid),
        }
        .map_err(map_error(PROC_ORDINALS_MAP))
    }

    /// Records the cap in bytes `pid` was started with (`None`: it holds to its
    /// environment's alone).
    pub fn set_started_cap(&mut self, pid: u32, bytes: Option<u64>) -> Result<(), LoadError> {
        match bytes {
            Some(bytes) => self.started_caps.insert(pid, bytes, 0),
            None => remove_if_there(&mut self.started_caps, &pid),
        }
        .map_err(map_error(PROC_CAP_MAP))
    }
}

/// Whether process `pid` is gone (or a zombie, whose GPU memory the driver has freed).
fn dead(pid: u32) -> bool {
    crate::backends::procfs::stat(pid).map_or(true, |stat| stat.is_zombie())
}
