//! Kernel events, typed: a record with an unknown kind or hook is refused, not guessed.

use genv_ebpf_common::{
    AllocEvent, EXEC_UNRESOLVED, FORK_UNRESOLVED, OpenEvent, RawEvent, cuda_call, hook, kind,
    split_kernel_dev, verdict,
};

use super::subject::KernelSubject;

use crate::kernel::Tier;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelEvent {
    /// `unresolved`: the program could not read the environment block; the daemon must
    /// tell the kernel the process's identity.
    Exec {
        pid: u32,
        unresolved: bool,
        /// CLOCK_MONOTONIC nanoseconds of the exec.
        at_ns: u64,
    },
    /// `unresolved`: the child inherited its parent's unresolved identity; the daemon
    /// must tell the kernel the child's too.
    Fork {
        parent: u32,
        child: u32,
        unresolved: bool,
    },
    Exit {
        pid: u32,
    },
    Open(GpuOpen),
    /// An allocation past its environment's cap (`--memory-at-alloc`).
    Alloc(OverCap),
    /// A process started using CUDA (`cuInit`, or a context retained or created).
    CudaStart(CudaStart),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaStart {
    pub pid: u32,
    /// The process's real uid.
    pub uid: u32,
    pub call: CudaCall,
    /// CLOCK_MONOTONIC nanoseconds of the call.
    pub at_ns: u64,
}

/// An allocation that would take an environment past its `gpu_memory` on a GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverCap {
    pub pid: u32,
    /// The process's real uid.
    pub uid: u32,
    /// The environment's identity (`env_id_hash` of its id).
    pub env: u64,
    pub index: u32,
    /// Bytes the environment would use on the GPU with the allocation.
    pub would_use: u64,
    /// The allocation's size, as charged.
    pub size: u64,
    pub outcome: AllocOutcome,
    /// A refusal: the process's refusals the kernel did not report since its last one
    /// (it reports one a second per process).
    pub held_back: u64,
    pub at_ns: u64,
    /// The process, as the program read it in the call.
    pub subject: KernelSubject,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocOutcome {
    /// SIGKILL in the call: the driver never saw the allocation.
    Killed,
    /// `--memory-at-alloc report`: the allocation went on.
    Reported,
    /// SIGKILL could not be sent: the allocation went on.
    KillFailed,
    /// `--memory-at-alloc refuse`: the call returned `CUDA_ERROR_OUT_OF_MEMORY` without
    /// running; the process lives.
    Refused,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaCall {
    Init,
    PrimaryCtxRetain,
    CtxCreate,
}

/// A process opened (or, on the LSM, fmod_ret and fentry tiers, tried to open) a GPU node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuOpen {
    pub pid: u32,
    pub tid: u32,
    pub major: u32,
    pub minor: u32,
    pub index: u32,
    pub tier: Tier,
    /// The process's real uid.
    pub uid: u32,
    /// What the kernel side decided.
    pub verdict: Verdict,
    /// CLOCK_MONOTONIC nanoseconds of the open.
    pub at_ns: u64,
    /// The process as the program read it, for an open it refused or killed.
    pub subject: Option<KernelSubject>,
}

/// The kernel side's decision about a GPU open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A process of an environment it may claim, on a GPU attached to it.
    Attached,
    /// A process of an environment, on a GPU not attached to it (let through).
    NotAttached,
    /// Outside any environment, let through (no `--deny`).
    Outside,
    /// Outside any environment, run by an allow-listed executable.
    AllowedExe,
    /// Outside any environment: refused with EPERM in the kernel.
    Refused,
    /// Outside any environment: killed by the program before the open returned.
    Killed,
    /// Outside any environment, run by root: let through (no `--deny-root`).
    Root,
    /// The enforcer itself (exempt by process id).
    Exempt,
    /// Outside any environment: the program could not send SIGKILL; the open returned.
    KillFailed,
}

impl Verdict {
    fn from_raw(value: u32) -> Option<Self> {
        Some(match value {
            verdict::ATTACHED => Verdict::Attached,
            verdict::NOT_ATTACHED => Verdict::NotAttached,
            verdict::OUTSIDE => Verdict::Outside,
            verdict::ALLOWED_EXE => Verdict::AllowedExe,
            verdict::REFUSED => Verdict::Refused,
            verdict::KILLED => Verdict::Killed,
            verdict::ROOT => Verdict::Root,
            verdict::EXEMPT => Verdict::Exempt,
            verdict::KILL_FAILED => Verdict::KillFailed,
            _ => return None,
        })
    }

    /// For the `[EVENT]` line.
    pub fn describe(self) -> &'static str {
        match self {
            Verdict::Attached => "in its environment, attached",
            Verdict::NotAttached => "in its environment, not attached",
            Verdict::Outside => "outside any environment",
            Verdict::AllowedExe => "outside any environment, allow-listed executable",
            Verdict::Refused => "outside any environment, refused",
            Verdict::Killed => "outside any environment, killed",
            Verdict::Root => "outside any environment, root (not denied without --deny-root)",
            Verdict::Exempt => "the enforcer itself",
            Verdict::KillFailed => "outside any environment, the kill FAILED",
        }
    }
}

#[derive(Clone, Copy, Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "unknown kernel event (kind {kind}, hook {hook}, verdict {verdict}): the daemon and its \
     programs disagree"
)]
pub struct UnknownEvent {
    pub kind: u32,
    pub hook: u32,
    pub verdict: u32,
}

/// A ring buffer record the daemon cannot take as an event.
#[derive(Clone, Copy, Debug, thiserror::Error, PartialEq, Eq)]
pub enum BadRecord {
    /// Not one [`RawEvent`] (nor one [`OpenEvent`] or [`AllocEvent`]): the programs
    /// write exactly one per record.
    #[error(
        "kernel record of {0} bytes, expected {raw}, {open} or {alloc}: the daemon and its programs disagree",
        raw = size_of::<RawEvent>(),
        open = size_of::<OpenEvent>(),
        alloc = size_of::<AllocEvent>()
    )]
    Size(usize),
    #[error(transparent)]
    Unknown(#[from] UnknownEvent),
}

impl KernelEvent {
    /// Decodes one ring buffer record, whatever its bytes: any length, any alignment.
    pub fn from_record(bytes: &[u8]) -> Result<Self, BadRecord> {
        if bytes.len() == size_of::<AllocEvent>() {
            // SAFETY: exactly one AllocEvent's bytes; every bit pattern is valid (plain
            // integers, no padding); read unaligned, as the ring promises no alignment.
            let alloc: AllocEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
            return Ok(Self::try_from(alloc)?);
        }
        if bytes.len() == size_of::<OpenEvent>() {
            // SAFETY: exactly one OpenEvent's bytes; every bit pattern is valid (plain
            // integers, no padding); read unaligned, as the ring promises no alignment.
            let open: OpenEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
            return Ok(Self::try_from(open)?);
        }
        if bytes.len() != size_of::<RawEvent>() {
            return Err(BadRecord::Size(bytes.len()));
        }
        // SAFETY: exactly one RawEvent's bytes, and every bit pattern is a valid RawEvent
        // (plain integers, no padding); read unaligned since the ring gives no alignment
        // promise for our type.
        let raw: RawEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        Ok(Self::try_from(raw)?)
    }
}

/// An open the program refused or killed: the only opens written as an [`OpenEvent`],
/// with the process as the program read it.
impl TryFrom<OpenEvent> for KernelEvent {
    type Error = UnknownEvent;

    fn try_from(open: OpenEvent) -> Result<Self, UnknownEvent> {
        let raw = open.head;
        let decided = [verdict::REFUSED, verdict::KILLED, verdict::KILL_FAILED];
        if raw.kind != kind::OPEN || !decided.contains(&raw.verdict) {
            return Err(UnknownEvent {
                kind: raw.kind,
                hook: raw.hook,
                verdict: raw.verdict,
            });
        }
        match KernelEvent::try_from(raw)? {
            KernelEvent::Open(gpu_open) => Ok(KernelEvent::Open(GpuOpen {
                subject: Some(open.subject.into()),
                ..gpu_open
            })),
            other => Ok(other),
        }
    }
}

/// An allocation past a cap: the only event written as an [`AllocEvent`].
impl TryFrom<AllocEvent> for KernelEvent {
    type Error = UnknownEvent;

    fn try_from(alloc: AllocEvent) -> Result<Self, UnknownEvent> {
        let raw = alloc.head;
        let unknown = UnknownEvent {
            kind: raw.kind,
            hook: raw.hook,
            verdict: raw.verdict,
        };
        if (raw.kind, raw.hook) != (kind::ALLOC, hook::UPROBE) {
            return Err(unknown);
        }
        Ok(KernelEvent::Alloc(OverCap {
            pid: raw.pid,
            uid: raw.uid,
            env: alloc.env,
            index: raw.index,
            would_use: alloc.would_use,
            size: alloc.size,
            held_back: u64::from(raw.arg),
            outcome: match raw.verdict {
                verdict::ALLOC_KILLED => AllocOutcome::Killed,
                verdict::ALLOC_REPORTED => AllocOutcome::Reported,
                verdict::ALLOC_KILL_FAILED => AllocOutcome::KillFailed,
                verdict::ALLOC_REFUSED => AllocOutcome::Refused,
                _ => return Err(unknown),
            },
            at_ns: raw.ktime_ns,
            subject: alloc.subject.into(),
        }))
    }
}

impl TryFrom<RawEvent> for KernelEvent {
    type Error = UnknownEvent;

    fn try_from(raw: RawEvent) -> Result<Self, UnknownEvent> {
        let unknown = UnknownEvent {
            kind: raw.kind,
            hook: raw.hook,
            verdict: raw.verdict,
        };
        Ok(match raw.kind {
            kind::EXEC => KernelEvent::Exec {
                pid: raw.pid,
                unresolved: raw.arg == EXEC_UNRESOLVED,
                at_ns: raw.ktime_ns,
            },
            kind::FORK => KernelEvent::Fork {
                parent: raw.pid,
                child: raw.arg,
                unresolved: raw.index == FORK_UNRESOLVED,
            },
            kind::EXIT => KernelEvent::Exit { pid: raw.pid },
            kind::OPEN => {
                let (major, minor) = split_kernel_dev(raw.arg);
                KernelEvent::Open(GpuOpen {
                    pid: raw.pid,
                    tid: raw.tid,
                    major,
                    minor,
                    index: raw.index,
                    tier: Tier::from_hook(raw.hook).ok_or(unknown)?,
                    uid: raw.uid,
                    verdict: Verdict::from_raw(raw.verdict).ok_or(unknown)?,
                    at_ns: raw.ktime_ns,
                    // An open of the common record's size: none read (an open the
                    // program let through, or a program from before it read one).
                    subject: None,
                })
            }
            kind::CUDA if raw.hook == hook::UPROBE => KernelEvent::CudaStart(CudaStart {
                pid: raw.pid,
                uid: raw.uid,
                call: match raw.arg {
                    cuda_call::INIT => CudaCall::Init,
                    cuda_call::PRIMARY_CTX_RETAIN => CudaCall::PrimaryCtxRetain,
                    cuda_call::CTX_CREATE => CudaCall::CtxCreate,
                    _ => return Err(unknown),
                },
                at_ns: raw.ktime_ns,
            }),
            _ => return Err(unknown),
        })
    }
}

#[cfg(test)]
mod tests {
    use genv_ebpf_common::{hook, kernel_dev, verdict};

    use super::*;

    #[test]
    fn decodes_an_open_with_its_device_number() {
        let raw = RawEvent {
            kind: kind::OPEN,
            pid: 10,
            tid: 11,
            arg: kernel_dev(195, 3),
            index: 1,
            hook: hook::TRACEPOINT,
            uid: 1000,
            verdict: verdict::KILLED,
            ktime_ns: 5,
        };
        let KernelEvent::Open(open) = KernelEvent::try_from(raw).unwrap() else {
            panic!("not an open");
        };
        assert_eq!((open.major, open.minor, open.index), (195, 3, 1));
        assert_eq!((open.pid, open.tid, open.tier), (10, 11, Tier::Tracepoint));
        assert_eq!((open.uid, open.verdict), (1000, Verdict::Killed));
    }

    #[test]
    fn refuses_unknown_kinds_hooks_and_verdicts() {
        let raw = RawEvent {
            kind: 99,
            ..RawEvent::default()
        };
        assert!(KernelEvent::try_from(raw).is_err());
        let raw = RawEvent {
            kind: kind::OPEN,
            hook: 42,
            verdict: verdict::OUTSIDE,
            ..RawEvent::default()
        };
        assert_eq!(
            KernelEvent::try_from(raw),
            Err(UnknownEvent {
                kind: 4,
                hook: 42,
                verdict: verdict::OUTSIDE
            })
        );
        let raw = RawEvent {
            kind: kind::OPEN,
            hook: hook::LSM,
            verdict: 77,
            ..RawEvent::default()
        };
        assert!(KernelEvent::try_from(raw).is_err());
    }

    /// Written for `fuzz_tests::a_record_of_another_size_is_refused`: a record shorter
    /// than a `RawEvent` was skipped without a word, and a longer one read as its first
    /// 40 bytes. Either means the daemon and its programs were built apart: the daemon
    /// now warns and resynchronises, as for an unknown kind.
    #[test]
    fn records_of_another_size_are_refused_not_skipped() {
        // The record as the programs write it: kind, then pid, native-endian.
        let mut bytes = [0u8; size_of::<RawEvent>()];
        bytes[..4].copy_from_slice(&kind::EXIT.to_ne_bytes());
        bytes[4..8].copy_from_slice(&7u32.to_ne_bytes());
        assert_eq!(
            KernelEvent::from_record(&bytes),
            Ok(KernelEvent::Exit { pid: 7 })
        );
        assert_eq!(
            KernelEvent::from_record(&bytes[..39]),
            Err(BadRecord::Size(39))
        );
        let mut long = bytes.to_vec();
        long.extend([0; 8]);
        assert_eq!(KernelEvent::from_record(&long), Err(BadRecord::Size(48)));
        assert_eq!(KernelEvent::from_record(&[]), Err(BadRecord::Size(0)));
        assert_eq!(
            BadRecord::Size(39).to_string(),
            "kernel record of 39 bytes, expected 40, 64 or 88: the daemon and its programs disagree"
        );
    }
}
