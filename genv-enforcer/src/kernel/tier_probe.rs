//! What `genv-enforcer doctor` asks the kernel: each open tier's programs, and
//! `--memory-at-alloc`'s probes, loaded for real as the daemon loads them (the same
//! object, offsets, map sizes and targets), so that the verifier and the kernel's
//! permission checks give the daemon's answer; then unloaded at once.
//!
//! Nothing is attached and nothing pinned: an attached open program would decide about
//! the node's GPU opens with empty policy maps, and `doctor` changes nothing. Loading
//! is where the kernel answers for the trampoline tiers (a tracing or LSM program names
//! its target at `BPF_PROG_LOAD`, and that is where a kernel that forbids them says
//! `EPERM`); what attaching would add is read instead: whether the BPF LSM is active
//! (an LSM program loads where it is not, and then never runs) and whether the
//! `syscalls` tracepoints exist in tracefs.

use std::path::Path;

use aya::Ebpf;
use aya::programs::TracePoint;

use super::attached::program_mut;
use super::cuda::{self, AllocProbes, RefusalAtAlloc};
use super::error::{LoadError, chain};
use super::loader::{LoadOptions, with_object};
use super::open_tiers::{EXIT_TRACEPOINTS, active_lsms};
use super::relocation;
use super::tier::Tier;
use super::tracefs;
use super::trampoline::{self, Targets};

/// The kernel's answers, best tier first.
#[derive(Debug)]
pub struct KernelAnswers {
    /// Each tier and what loading it showed: what was done, or the kernel's refusal.
    pub tiers: Vec<(Tier, Result<String, String>)>,
    /// `/sys/kernel/security/lsm`, where it could be read.
    pub lsms: Option<String>,
    /// `--memory-at-alloc`'s probes, where the options ask for them: loaded (and
    /// whether their refusing forms were), or why not.
    pub memory_at_alloc: Option<Result<RefusalAtAlloc, String>>,
    /// Whether tracefs has `uprobe_events` (the kernel's uprobes, which the probes
    /// are attached through).
    pub uprobe_events: bool,
}

/// Loads and unloads every tier's programs, and the libcuda probes where `options` asks
/// for them (each costs verifying time: a dozen programs), as `options` sizes the
/// object (its `choice` and `pin_dir` are not used: every tier is asked, nothing is
/// pinned). An error is one the daemon would meet before any tier (BTF, tracefs, the
/// object): every tier is refused for it.
pub fn ask(options: &LoadOptions) -> Result<KernelAnswers, LoadError> {
    let lsms = active_lsms();
    let tracefs_root = tracefs::ensure_mounted()?;
    with_object(options, |mut ebpf, object, _| {
        let mut trampolines = load_trampolines(&ebpf, object).into_iter();
        // In BEST_FIRST's order, as `load_trampolines` returns them.
        let mut next = || trampolines.next().unwrap_or(Err("not loaded".to_owned()));
        let tiers = Tier::BEST_FIRST
            .iter()
            .map(|&tier| {
                let answer = match tier {
                    Tier::Lsm => lsm(next(), lsms.as_deref()),
                    Tier::FmodRet | Tier::Fentry => next(),
                    Tier::Tracepoint => load_tracepoints(&mut ebpf, &tracefs_root),
                };
                (tier, answer)
            })
            .collect();
        let memory_at_alloc =
            (options.memory_at_alloc != AllocProbes::Off).then(|| memory_at_alloc(&mut ebpf));
        // Dropping `ebpf` here unloads the probes and frees every map it made.
        Ok(KernelAnswers {
            tiers,
            lsms: lsms.clone(),
            memory_at_alloc,
            uprobe_events: tracefs_root.join("uprobe_events").exists(),
        })
    })
}

/// The LSM tier: its program loaded (`loaded`), and the BPF LSM active to run it.
fn lsm(loaded: Result<String, String>, lsms: Option<&str>) -> Result<String, String> {
    let active = match lsms {
        Some(list) if super::open_tiers::bpf_lsm_active(list) => Ok(()),
        Some(list) => Err(format!(
            "the BPF LSM is not active (active LSMs: {})",
            list.trim()
        )),
        None => Err("/sys/kernel/security/lsm cannot be read".to_owned()),
    };
    match (loaded, active) {
        (Ok(done), Ok(())) => Ok(format!("{done}; bpf is in the active LSMs")),
        (Ok(done), Err(why)) => Err(format!("{done}, but {why}: it would never run")),
        (Err(refused), Ok(())) => Err(refused),
        (Err(refused), Err(why)) => Err(format!("{refused}; and {why}")),
    }
}

/// The trampoline tiers' programs (lsm, fmod_ret, fentry, in that order), relocated
/// once and each loaded against its target, then unloaded.
fn load_trampolines(
    ebpf: &Ebpf,
    (bytes, targets): (&[u8], &Targets),
) -> Vec<Result<String, String>> {
    let hooks = [trampoline::LSM, trampoline::FMOD_RET, trampoline::FENTRY];
    let programs = match relocation::relocated(ebpf, bytes, &hooks.map(|h| h.program)) {
        Ok(programs) => programs,
        Err(e) => return hooks.map(|_| Err(e.to_string())).into(),
    };
    hooks
        .into_iter()
        .zip(programs)
        .map(|(hook, (instructions, license))| {
            let target = targets.id(&hook).map_err(|e| e.to_string())?;
            let program = trampoline::load(&instructions, &license, hook, target)
                .map_err(|e| one_line(&e.to_string()))?;
            drop(program);
            Ok(format!(
                "{} loaded and verified on {}, then unloaded (not attached)",
                hook.program, hook.target
            ))
        })
        .collect()
}

/// The tracepoint tier's programs loaded and unloaded, and the tracepoint it cannot do
/// without (`sys_exit_openat`) present.
fn load_tracepoints(ebpf: &mut Ebpf, tracefs_root: &Path) -> Result<String, String> {
    for (program, _) in EXIT_TRACEPOINTS {
        let tp: &mut TracePoint = program_mut(ebpf, program)
            .map_err(|e| e.to_string())?
            .try_into()
            .map_err(|e| chain(&e))?;
        tp.load().map_err(|e| one_line(&chain(&e)))?;
        tp.unload().map_err(|e| chain(&e))?;
    }
    let (_, required) = EXIT_TRACEPOINTS[0];
    let event = tracefs_root.join("events/syscalls").join(required);
    if !event.is_dir() {
        return Err(format!(
            "the programs load, but there is no tracepoint {}",
            event.display()
        ));
    }
    Ok(format!(
        "{} programs loaded and verified, then unloaded (not attached); \
         syscalls/{required} exists",
        EXIT_TRACEPOINTS.len()
    ))
}

/// The libcuda probes loaded as `--memory-at-alloc refuse` loads them (their refusing
/// forms where the kernel takes them, else the plain ones), not attached to any
/// library.
fn memory_at_alloc(ebpf: &mut Ebpf) -> Result<RefusalAtAlloc, String> {
    let mut programs = Vec::new();
    match cuda::load_if(AllocProbes::Refusing, ebpf, &mut programs) {
        Ok(Some(kernel)) => Ok(kernel.refusal),
        Ok(None) => Err("not loaded".to_owned()),
        Err(e) => Err(one_line(&e.to_string())),
    }
}

/// A verifier's log joined into one line, for a report with one line per item.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ")
}
