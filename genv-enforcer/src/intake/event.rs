//! Kernel events, typed: a record with an unknown kind or hook is refused, not guessed.

use genv_ebpf_common::{RawEvent, kind, split_kernel_dev};

use crate::bpf::Tier;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelEvent {
    Exec { pid: u32 },
    Fork { parent: u32, child: u32 },
    Exit { pid: u32 },
    Open(GpuOpen),
}

/// A process opened (or, on the LSM and fentry tiers, tried to open) a GPU node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuOpen {
    pub pid: u32,
    pub tid: u32,
    pub major: u32,
    pub minor: u32,
    pub index: u32,
    pub tier: Tier,
    /// CLOCK_MONOTONIC nanoseconds of the open.
    pub at_ns: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown kernel event (kind {kind}, hook {hook}): the daemon and its programs disagree")]
pub struct UnknownEvent {
    pub kind: u32,
    pub hook: u32,
}

impl TryFrom<RawEvent> for KernelEvent {
    type Error = UnknownEvent;

    fn try_from(raw: RawEvent) -> Result<Self, UnknownEvent> {
        let unknown = UnknownEvent {
            kind: raw.kind,
            hook: raw.hook,
        };
        Ok(match raw.kind {
            kind::EXEC => KernelEvent::Exec { pid: raw.pid },
            kind::FORK => KernelEvent::Fork {
                parent: raw.pid,
                child: raw.arg,
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
                    at_ns: raw.ktime_ns,
                })
            }
            _ => return Err(unknown),
        })
    }
}

#[cfg(test)]
mod tests {
    use genv_ebpf_common::{hook, kernel_dev};

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
            ktime_ns: 5,
        };
        let KernelEvent::Open(open) = KernelEvent::try_from(raw).unwrap() else {
            panic!("not an open");
        };
        assert_eq!((open.major, open.minor, open.index), (195, 3, 1));
        assert_eq!((open.pid, open.tid, open.tier), (10, 11, Tier::Tracepoint));
    }

    #[test]
    fn refuses_unknown_kinds_and_hooks() {
        let raw = RawEvent {
            kind: 99,
            ..RawEvent::default()
        };
        assert!(KernelEvent::try_from(raw).is_err());
        let raw = RawEvent {
            kind: kind::OPEN,
            hook: 42,
            ..RawEvent::default()
        };
        assert_eq!(
            KernelEvent::try_from(raw),
            Err(UnknownEvent { kind: 4, hook: 42 })
        );
    }
}
