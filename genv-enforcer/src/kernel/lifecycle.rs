//! The lifecycle programs (exec, fork, exit), which every tier needs: they keep each
//! process's environment identity in the kernel, and the map that holds it.

use aya::Ebpf;
use aya::programs::{RawTracePoint, TracePoint};

use super::attached::{Attached, LinkId, program_mut};
use super::error::{LoadError, program_error};

/// How much of an environment block the exec hook reads itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvScan {
    /// The whole block, in `bpf_loop` steps.
    Whole,
    /// Up to 4 KiB (no `bpf_loop`, or `GENV_ENFORCER_ENV_SCAN=4k`); the daemon reads
    /// larger blocks from `/proc`.
    First4K,
}

/// Forces the 4 KiB exec hook, as on a kernel without `bpf_loop` (to check that
/// fallback where every kernel has it).
pub const ENV_SCAN_VARIABLE: &str = "GENV_ENFORCER_ENV_SCAN";

/// exec, fork and exit: needed on every tier. The exec hook that reads whole
/// environment blocks needs `bpf_loop` (5.17); without it, the 4 KiB one.
pub(super) fn attach(ebpf: &mut Ebpf, ids: &mut Vec<Attached>) -> Result<EnvScan, LoadError> {
    let forced = std::env::var(ENV_SCAN_VARIABLE).is_ok_and(|v| v == "4k");
    let whole = match forced {
        true => Err(format!("{ENV_SCAN_VARIABLE}=4k")),
        false => attach_tracepoint(ebpf, ids, "proc_exec", "sched", "sched_process_exec")
            .map_err(|e| e.to_string()),
    };
    let env_scan = match whole {
        Ok(()) => EnvScan::Whole,
        Err(why) => {
            tracing::warn!(
                "The exec hook reads environment blocks up to 4 KiB only ({why}); the daemon reads larger ones from /proc"
            );
            attach_tracepoint(ebpf, ids, "proc_exec_4k", "sched", "sched_process_exec")?;
            EnvScan::First4K
        }
    };
    attach_tracepoint(ebpf, ids, "proc_exit", "sched", "sched_process_exit")?;
    let error = program_error("proc_fork");
    let raw: &mut RawTracePoint = program_mut(ebpf, "proc_fork")?.try_into().map_err(&error)?;
    raw.load().map_err(&error)?;
    let link = LinkId::RawTracePoint(raw.attach("sched_process_fork").map_err(&error)?);
    ids.push(Attached {
        name: "proc_fork",
        id: raw.info().map_err(&error)?.id(),
        link: Some(link),
    });
    Ok(env_scan)
}

fn attach_tracepoint(
    ebpf: &mut Ebpf,
    ids: &mut Vec<Attached>,
    program: &'static str,
    category: &str,
    name: &str,
) -> Result<(), LoadError> {
    let error = program_error(program);
    let tp: &mut TracePoint = program_mut(ebpf, program)?.try_into().map_err(&error)?;
    tp.load().map_err(&error)?;
    let link = LinkId::TracePoint(tp.attach(category, name).map_err(&error)?);
    ids.push(Attached {
        name: program,
        id: tp.info().map_err(&error)?.id(),
        link: Some(link),
    });
    Ok(())
}

/// Sets `PROC_ENV`'s capacity instead (at least 16): to see what happens when it is
/// full (the tests), or to bound the kernel memory it may take.
pub const PROCESS_CAPACITY_VARIABLE: &str = "GENV_ENFORCER_PROCESS_CAPACITY";

/// `PROC_ENV`'s capacity: every process the machine can have at once, which is bounded
/// by both the pid space and the number of tasks (`kernel.threads-max`, derived from the
/// memory). Preallocated (before 6.1), at most 2^18 (about 13 MiB of kernel memory).
pub(super) fn process_capacity(lazy: bool) -> u32 {
    if let Some(set) = std::env::var(PROCESS_CAPACITY_VARIABLE)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        return set.max(16);
    }
    let read = |name: &str| -> Option<u32> {
        std::fs::read_to_string(format!("/proc/sys/kernel/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let bound = match (read("pid_max"), read("threads-max")) {
        (Some(pids), Some(tasks)) => pids.min(tasks),
        (Some(one), None) | (None, Some(one)) => one,
        (None, None) => genv_ebpf_common::MAX_PROCESSES,
    };
    bound.clamp(1024, if lazy { 1 << 22 } else { 1 << 18 })
}
