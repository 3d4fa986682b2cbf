//! The open tiers' programs, best first as `--bpf-tier` lists them: the BPF LSM hook,
//! fmod_ret on `security_file_open`, fentry on it, and the open syscalls' exit
//! tracepoints. Each is loaded and attached where the kernel allows it; the first that
//! is, is the tier in use.

use aya::Ebpf;
use aya::programs::{ProgramError, RawTracePoint, TracePoint};

use super::attached::{Attached, LinkId, program_mut};
use super::error::{LoadError, chain, program_error};
use super::tier::{Tier, TierChoice};
use super::trampoline::{self, Hook, Targets};

/// Attaches the first of `choice`'s candidate tiers the kernel accepts (`object`: the
/// bytes `ebpf` was loaded from, and the trampoline tiers' targets; `compat_opens`: see
/// `LoadOptions`); that tier, and why each better one was refused.
pub(super) fn attach_best(
    ebpf: &mut Ebpf,
    object: (&[u8], &Targets),
    (choice, compat_opens): (TierChoice, bool),
    programs: &mut Vec<Attached>,
) -> Result<(Tier, Vec<(Tier, String)>), LoadError> {
    let mut refused = Vec::new();
    for &tier in choice.candidates() {
        match attach_open_tier(ebpf, object, tier, programs, compat_opens) {
            Ok(()) => return Ok((tier, refused)),
            Err(reason) => refused.push((tier, reason)),
        }
    }
    let reasons = refused
        .iter()
        .map(|(tier, why)| format!("{tier}: {why}"))
        .collect::<Vec<_>>()
        .join("; ");
    Err(LoadError::NoTier(reasons))
}

/// 32-bit opens (`int 0x80`, 32-bit programs) fire no `sys_exit_open*` tracepoint:
/// `raw_syscalls:sys_exit` catches them, at the cost of a program run per syscall exit
/// of the whole machine (it returns at once for 64-bit ones), so it is attached only
/// where `--deny` must hold. Without it the tier still works, with that hole: the full
/// cycle finds a 32-bit opener's compute context.
fn attach_compat_opens(ebpf: &mut Ebpf, ids: &mut Vec<Attached>) {
    let attach = |ebpf: &mut Ebpf| -> Result<Attached, LoadError> {
        let error = program_error("open_exit_compat");
        let raw: &mut RawTracePoint = program_mut(ebpf, "open_exit_compat")?
            .try_into()
            .map_err(&error)?;
        raw.load().map_err(&error)?;
        let link = LinkId::RawTracePoint(raw.attach("sys_exit").map_err(&error)?);
        Ok(Attached {
            name: "open_exit_compat",
            id: raw.info().map_err(&error)?.id(),
            link: Some(link),
        })
    };
    match attach(ebpf) {
        Ok(attached) => {
            ids.push(attached);
            tracing::info!("32-bit opens are watched too (raw_syscalls:sys_exit, for --deny)");
        }
        Err(e) => tracing::warn!(
            "32-bit opens are not seen at the open ({e}): the full cycle finds their GPU contexts"
        ),
    }
}

/// The kernel's active LSMs, mounting securityfs first where nothing did (a minimal
/// system, a VM's init). A BPF LSM program loads and attaches even where the BPF LSM is
/// not active, and then never runs: this list is the only way to know.
pub(super) fn active_lsms() -> Option<String> {
    const SECURITYFS: &str = "/sys/kernel/security";
    let list = std::path::Path::new(SECURITYFS).join("lsm");
    if !list.exists() {
        let mounted = rustix::mount::mount(
            "securityfs",
            SECURITYFS,
            "securityfs",
            rustix::mount::MountFlags::empty(),
            None,
        );
        if let Err(e) = mounted {
            tracing::warn!("Cannot mount securityfs on {SECURITYFS}: {e}");
        }
    }
    std::fs::read_to_string(list).ok()
}

/// Whether `list` (the kernel's active LSMs, [`active_lsms`]) names the BPF LSM.
pub(crate) fn bpf_lsm_active(list: &str) -> bool {
    list.split(',').any(|lsm| lsm.trim() == "bpf")
}

/// Loads and attaches one open tier (`object`: as for [`attach_best`]); the reason it
/// was refused otherwise.
fn attach_open_tier(
    ebpf: &mut Ebpf,
    object: (&[u8], &Targets),
    tier: Tier,
    ids: &mut Vec<Attached>,
    compat_opens: bool,
) -> Result<(), String> {
    let hook = match tier {
        Tier::Lsm => {
            let active = active_lsms().ok_or(
                "cannot read /sys/kernel/security/lsm, so whether the BPF LSM runs is unknown",
            )?;
            if !bpf_lsm_active(&active) {
                return Err(format!(
                    "BPF LSM is not active (active LSMs: {}; boot with lsm=...,bpf)",
                    active.trim()
                ));
            }
            trampoline::LSM
        }
        Tier::FmodRet => trampoline::FMOD_RET,
        Tier::Fentry => trampoline::FENTRY,
        Tier::Tracepoint => return attach_exit_tracepoints(ebpf, ids, compat_opens),
    };
    attach_trampoline(ebpf, object, hook, ids)
}

/// A trampoline tier: its program loaded and attached outside aya (`trampoline`).
fn attach_trampoline(
    ebpf: &mut Ebpf,
    (bytes, targets): (&[u8], &Targets),
    hook: Hook,
    ids: &mut Vec<Attached>,
) -> Result<(), String> {
    let (id, link) =
        trampoline::load_and_attach(ebpf, bytes, hook, targets).map_err(|e| e.to_string())?;
    ids.push(Attached {
        name: hook.program,
        id,
        link: Some(LinkId::Trampoline(link)),
    });
    Ok(())
}

/// The tracepoint tier's programs, and the `syscalls` tracepoint each is attached to.
pub(super) const EXIT_TRACEPOINTS: [(&str, &str); 5] = [
    ("open_exit_at", "sys_exit_openat"),
    ("open_exit_at2", "sys_exit_openat2"),
    ("open_exit_open", "sys_exit_open"),
    ("open_exit_creat", "sys_exit_creat"),
    ("open_exit_by_handle", "sys_exit_open_by_handle_at"),
];

/// The tracepoint tier: the exits of every syscall that opens a file, and (for `--deny`)
/// 32-bit opens. `openat` is required; an architecture may lack the others.
fn attach_exit_tracepoints(
    ebpf: &mut Ebpf,
    ids: &mut Vec<Attached>,
    compat_opens: bool,
) -> Result<(), String> {
    let describe = |e: ProgramError| chain(&e);
    let mut attached = 0;
    let mut missing = Vec::new();
    for (program, name) in EXIT_TRACEPOINTS {
        let tp: &mut TracePoint = program_mut(ebpf, program)
            .map_err(|e| e.to_string())?
            .try_into()
            .map_err(describe)?;
        tp.load().map_err(describe)?;
        match tp.attach("syscalls", name) {
            Ok(link) => {
                attached += 1;
                ids.push(Attached {
                    name: program,
                    id: tp.info().map_err(describe)?.id(),
                    link: Some(LinkId::TracePoint(link)),
                });
            }
            // Some architectures have no open(2); openat is what matters.
            Err(e) if name != "sys_exit_openat" => missing.push(format!("{name}: {}", describe(e))),
            Err(e) => return Err(format!("{name}: {}", describe(e))),
        }
    }
    if attached == 0 {
        return Err(missing.join("; "));
    }
    if compat_opens {
        attach_compat_opens(ebpf, ids);
    }
    Ok(())
}
