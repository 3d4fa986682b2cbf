//! `--deny` and the identity the kernel decides on: seeding it, mirroring genv's state
//! into the kernel's maps, saying which guarantee the kernel gives, and reporting what
//! it decided in genv's style.

use std::path::PathBuf;

use crate::backends::procfs;
use crate::bpf::policy_maps::PolicyMaps;
use crate::bpf::{Tier, allowlist, mirror};
use crate::intake::{GpuOpen, Verdict};
use crate::state::{Device, Env};

/// Records, for every process that exists now, the identity its environment block
/// gives; the exec and fork hooks keep it current from here on (they were attached
/// first, and an entry they wrote wins over this). How many were seeded.
pub fn seed_identities(maps: &mut PolicyMaps) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut seeded = 0;
    for pid in dir
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
    {
        // Gone, or a kernel thread (empty block): nothing to record.
        let Ok(id) = procfs::environment_id(pid) else {
            continue;
        };
        if maps
            .seed_identity(pid, mirror::identity_of(id.as_deref()))
            .is_ok()
        {
            seeded += 1;
        }
    }
    seeded
}

/// The identity of a process whose environment block the exec hook could not read in
/// full, from `/proc/<pid>/environ`.
pub fn resolve_identity(maps: &mut PolicyMaps, pid: u32, verbose: bool) {
    if let Ok(id) = procfs::environment_id(pid) {
        if verbose {
            eprintln!(
                "[EVENT] Process {pid}'s environment block is too large for the kernel to read; its environment was read from /proc"
            );
        }
        if let Err(e) = maps.set_identity(pid, mirror::identity_of(id.as_deref())) {
            eprintln!("[WARNING] Cannot record process {pid}'s environment in the kernel: {e}");
        }
    }
}

/// Mirrors the active environments, as the full cycle just read them, into the kernel.
/// When a state file could not be read (`None`; the cycle said why), the kernel keeps
/// what it had: a malformed file never turns environments' processes into outsiders.
/// `true` if the mirror is current.
pub fn sync_environments(maps: &mut PolicyMaps, state: Option<(Vec<Env>, Vec<Device>)>) -> bool {
    let Some((envs, devices)) = state else {
        eprintln!("[WARNING] The kernel keeps its previous list of environments");
        return false;
    };
    let (entries, skipped) = mirror::env_entries(&envs, &devices);
    for eid in skipped {
        eprintln!(
            "[WARNING] Environment id {eid:?} is longer than {} bytes: the kernel cannot \
             match it, and its processes count as outside any environment",
            genv_ebpf_common::MAX_ENV_ID
        );
    }
    match maps.sync_envs(&entries) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("[ERROR] Cannot update the kernel's environments: {e}");
            false
        }
    }
}

/// Loads the allow-list into the kernel; what is allowed, for the start-up line.
pub fn install_allow_list(maps: &mut PolicyMaps, given: &[PathBuf]) -> anyhow::Result<String> {
    let list = allowlist::build(given).map_err(anyhow::Error::msg)?;
    for warning in &list.warnings {
        eprintln!("[WARNING] {warning}");
    }
    maps.allow_exes(&list.keys)?;
    Ok(list.described.join(", "))
}

/// What the kernel guarantees about GPU opens by processes outside any environment.
pub fn guarantee(tier: Option<Tier>, deny: bool) -> String {
    match (tier, deny) {
        (Some(Tier::Lsm), true) => {
            "refused in the kernel: the open fails with EPERM (--deny, lsm tier)".into()
        }
        (Some(tier), true) => format!(
            "killed in the syscall: SIGKILL from the {tier} program, before open() returns \
             (--deny; the kernel has no BPF LSM for refusing)"
        ),
        (Some(_), false) => {
            "reacted to in userspace, milliseconds after the open (no --deny)".into()
        }
        (None, _) => "reacted to in userspace by the full cycle (no kernel programs)".into(),
    }
}

/// genv-style line for an in-kernel decision (stdout, like genv's own lines).
pub fn decision_line(open: &GpuOpen) -> Option<String> {
    let user = user_name(open.uid);
    let pid = open.pid;
    let index = open.index;
    match open.verdict {
        Verdict::Refused => Some(format!(
            "Refused process {pid} of user {user} access to GPU {index}: it is not running in a GPU environment"
        )),
        Verdict::Killed => Some(format!(
            "Killed process {pid} of user {user} when it opened GPU {index}: it is not running in a GPU environment"
        )),
        _ => None,
    }
}

/// The user's name, or the uid where it has none.
fn user_name(uid: u32) -> String {
    let mut buf = vec![0u8; 4096];
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes into our buffers only.
    let rc = unsafe {
        libc::getpwuid_r(
            uid,
            &mut pwd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return uid.to_string();
    }
    // SAFETY: on success pw_name points into `buf`, NUL-terminated.
    unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_are_reported_with_pid_user_and_gpu() {
        let open = GpuOpen {
            pid: 42,
            tid: 43,
            major: 195,
            minor: 1,
            index: 1,
            tier: Tier::Lsm,
            uid: 0,
            verdict: Verdict::Refused,
            at_ns: 0,
        };
        assert_eq!(
            decision_line(&open).unwrap(),
            "Refused process 42 of user root access to GPU 1: it is not running in a GPU environment"
        );
        let killed = GpuOpen {
            verdict: Verdict::Killed,
            uid: 4_000_000,
            ..open
        };
        assert_eq!(
            decision_line(&killed).unwrap(),
            "Killed process 42 of user 4000000 when it opened GPU 1: it is not running in a GPU environment"
        );
        let seen = GpuOpen {
            verdict: Verdict::Outside,
            ..open
        };
        assert_eq!(decision_line(&seen), None);
    }

    #[test]
    fn the_guarantee_names_what_the_kernel_does() {
        assert!(guarantee(Some(Tier::Lsm), true).starts_with("refused in the kernel"));
        assert!(guarantee(Some(Tier::Fentry), true).starts_with("killed in the syscall"));
        assert!(guarantee(Some(Tier::Tracepoint), true).contains("tracepoint program"));
        assert!(guarantee(Some(Tier::Lsm), false).starts_with("reacted to in userspace"));
        assert!(guarantee(None, true).contains("full cycle"));
    }
}
