//! The `gpu_memory` a program was started with: the owner's own word on its cap, which
//! no other user can change. genv's shell and SDK set `GENV_GPU_MEMORY` from the
//! environment's configuration (after `genv activate` and `genv config`), and unset it
//! when there is none; genv's SDK reads it back as the environment's configuration.
//! `envs.json`, which any user can rewrite, may say otherwise since: at the allocation a
//! program is held to the larger of the two (the memory rule still follows the file at
//! its polls, as genv's does).

use crate::state::MemorySpec;

/// The variables read, from the program's environment block as it was at exec.
pub const GPU_MEMORY_VAR: &str = "GENV_GPU_MEMORY";
/// Set by `genv activate` in the shell it activates.
pub const SHELL_VAR: &str = "GENV_SHELL";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartedWith {
    /// This cap.
    Cap(MemorySpec),
    /// No cap: started from genv's activated shell while the environment had none.
    NoCap,
}

impl StartedWith {
    /// From `GENV_GPU_MEMORY` and `GENV_SHELL`; `None` when they say nothing (not
    /// started by genv, or an amount genv would not read).
    pub fn of(gpu_memory: Option<&str>, genv_shell: Option<&str>) -> Option<Self> {
        match (gpu_memory, genv_shell) {
            (Some(text), _) => MemorySpec::parse(text).ok().map(StartedWith::Cap),
            (None, Some(_)) => Some(StartedWith::NoCap),
            (None, None) => None,
        }
    }

    /// For the kernel's `PROC_CAP`: bytes, or no limit at all.
    pub fn kernel_bytes(&self) -> u64 {
        match self {
            StartedWith::Cap(spec) => spec.bytes(),
            StartedWith::NoCap => u64::MAX,
        }
    }

    /// Whether it allows more than `cap` (then it is what the program is held to).
    pub fn exceeds(&self, cap: &MemorySpec) -> bool {
        self.kernel_bytes() > cap.bytes()
    }
}

impl std::fmt::Display for StartedWith {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartedWith::Cap(spec) => spec.fmt(f),
            StartedWith::NoCap => f.write_str("no cap"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn genvs_variables_say_what_the_program_was_started_with() {
        let one_g = MemorySpec::parse("1g").unwrap();
        assert_eq!(
            StartedWith::of(Some("1g"), None),
            Some(StartedWith::Cap(one_g.clone()))
        );
        assert_eq!(
            StartedWith::of(Some("1g"), Some("1")),
            Some(StartedWith::Cap(one_g.clone()))
        );
        assert_eq!(StartedWith::of(None, Some("1")), Some(StartedWith::NoCap));
        assert_eq!(StartedWith::of(None, None), None);
        assert_eq!(
            StartedWith::of(Some("lots"), None),
            None,
            "genv would fail on it"
        );
        let small = MemorySpec::parse("100m").unwrap();
        assert!(StartedWith::Cap(one_g.clone()).exceeds(&small));
        assert!(!StartedWith::Cap(small).exceeds(&one_g));
        assert!(StartedWith::NoCap.exceeds(&one_g));
        assert_eq!(StartedWith::NoCap.kernel_bytes(), u64::MAX);
    }
}
