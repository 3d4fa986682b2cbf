//! Whether this kernel lets the allocation probes refuse a call (`--memory-at-alloc
//! refuse`): their refusing forms store to their registers, which only kernels with
//! "bpf: Allow uprobe program to change context registers" load. The kernel's own
//! answer at load decides, not its version: a backport, or a distribution's build
//! without it, answers for itself.

use aya::Ebpf;
use aya::programs::ProgramError;

use super::probe_mut;

/// Each allocation entry program, and its refusing form (`genv-ebpf/src/cuda/refuse.rs`).
pub(super) const REFUSING: [(&str, &str); 3] = [
    ("cu_mem_alloc", "cu_mem_alloc_refusing"),
    ("cu_mem_alloc_pitch", "cu_mem_alloc_pitch_refusing"),
    ("cu_mem_create", "cu_mem_create_refusing"),
];

/// What became of `refuse`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefusalAtAlloc {
    /// Not asked for (`report`, `kill`).
    NotAsked,
    /// The refusing programs loaded: a call past the cap returns out-of-memory.
    Loaded,
    /// The kernel refused them at load, in its verifier's words: a call past the cap
    /// kills its process instead.
    Refused(String),
}

/// The refusing form of the entry program `name`, where it has one.
pub(super) fn refusing_form(name: &str) -> Option<&'static str> {
    REFUSING
        .iter()
        .find(|(plain, _)| *plain == name)
        .map(|(_, refusing)| *refusing)
}

/// Loads the refusing programs, all or none: the first the kernel refuses ends it (the
/// others would be refused for the same store), and those loaded before it are
/// unloaded again.
pub(super) fn load(ebpf: &mut Ebpf) -> RefusalAtAlloc {
    for (at, (_, name)) in REFUSING.iter().enumerate() {
        let refused = match probe_mut(ebpf, name) {
            Ok(probe) => match probe.load() {
                Ok(()) => continue,
                Err(e) => verifier_says(&e),
            },
            Err(e) => e.to_string(),
        };
        for (_, loaded) in &REFUSING[..at] {
            if let Ok(probe) = probe_mut(ebpf, loaded) {
                let _ = probe.unload();
            }
        }
        return RefusalAtAlloc::Refused(refused);
    }
    RefusalAtAlloc::Loaded
}

/// The verifier's reason, in one line: its complaint about the store where it made one
/// (`invalid bpf_context access off=128 size=8` on 6.1 to 6.18), else its last line,
/// with the syscall's error.
fn verifier_says(e: &ProgramError) -> String {
    let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = e
    else {
        return e.to_string();
    };
    let log = verifier_log.to_string();
    let lines: Vec<&str> = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("processed "))
        .collect();
    let line = lines
        .iter()
        .find(|l| l.contains("bpf_context"))
        .or(lines.last())
        .copied()
        .unwrap_or("no verifier output");
    format!("{line} ({io_error})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_allocation_entry_program_has_a_refusing_form() {
        for (plain, refusing) in REFUSING {
            assert_eq!(refusing_form(plain), Some(refusing));
            assert!(super::super::PROBES.iter().any(|(name, _)| *name == plain));
        }
        assert_eq!(refusing_form("cu_mem_free"), None);
    }
}
