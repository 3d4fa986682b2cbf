//! Property tests of the ring buffer records' decoding (how they run, and how to run
//! them longer: `state::test_support::arbitrary`): any bytes, of any length and alignment, decode
//! without a panic; only exactly one `RawEvent` (or one `AllocEvent`) of a known kind,
//! hook and verdict is an event, and it is the event the programs meant.

use genv_ebpf_common::{
    AllocEvent, OpenEvent, RawEvent, Subject, hook, kind, split_kernel_dev, verdict,
};
use proptest::collection::vec;
use proptest::prelude::*;

use super::{BadRecord, KernelEvent, UnknownEvent};
use crate::state::test_support::arbitrary::check;

const SIZE: usize = size_of::<RawEvent>();
const ALLOC_SIZE: usize = size_of::<AllocEvent>();
const OPEN_SIZE: usize = size_of::<OpenEvent>();
/// The sizes a record may have.
const SIZES: [usize; 3] = [SIZE, OPEN_SIZE, ALLOC_SIZE];

/// The record's bytes as the programs write them: the fields in declaration order,
/// native-endian (the programs are built for the host's endianness).
fn record(raw: &RawEvent) -> Vec<u8> {
    let fields = [
        raw.kind,
        raw.pid,
        raw.tid,
        raw.arg,
        raw.index,
        raw.hook,
        raw.uid,
        raw.verdict,
    ];
    let mut bytes: Vec<u8> = fields.iter().flat_map(|f| f.to_ne_bytes()).collect();
    bytes.extend(raw.ktime_ns.to_ne_bytes());
    bytes
}

/// A `Subject`'s bytes, as the programs append it.
fn subject_bytes(subject: &Subject) -> Vec<u8> {
    let mut bytes = subject.tty.to_ne_bytes().to_vec();
    bytes.extend(subject._pad.to_ne_bytes());
    bytes.extend(subject.comm);
    bytes
}

/// An `AllocEvent`'s bytes: the common record, then its own fields.
fn alloc_record(alloc: &AllocEvent) -> Vec<u8> {
    let mut bytes = record(&alloc.head);
    bytes.extend(alloc.env.to_ne_bytes());
    bytes.extend(alloc.would_use.to_ne_bytes());
    bytes.extend(alloc.size.to_ne_bytes());
    bytes.extend(subject_bytes(&alloc.subject));
    bytes
}

fn subject() -> impl Strategy<Value = Subject> {
    (any::<u32>(), any::<[u8; 16]>()).prop_map(|(tty, comm)| Subject { tty, _pad: 0, comm })
}

/// A field that is sometimes one of the values the programs write, sometimes anything.
fn field(known: &'static [u32]) -> impl Strategy<Value = u32> {
    prop_oneof![3 => proptest::sample::select(known), 1 => any::<u32>()]
}

fn raw_event() -> impl Strategy<Value = RawEvent> {
    let kinds = &[
        kind::EXEC,
        kind::FORK,
        kind::EXIT,
        kind::OPEN,
        kind::ALLOC,
        kind::CUDA,
    ];
    let hooks = &[
        hook::LSM,
        hook::FMOD_RET,
        hook::FENTRY,
        hook::TRACEPOINT,
        hook::UPROBE,
    ];
    let verdicts = &[
        verdict::ATTACHED,
        verdict::NOT_ATTACHED,
        verdict::OUTSIDE,
        verdict::ALLOWED_EXE,
        verdict::REFUSED,
        verdict::KILLED,
        verdict::ROOT,
        verdict::EXEMPT,
        verdict::KILL_FAILED,
        verdict::ALLOC_KILLED,
        verdict::ALLOC_REPORTED,
        verdict::ALLOC_KILL_FAILED,
    ];
    let ids = (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>());
    let decided = (field(kinds), field(hooks), field(verdicts), any::<u32>());
    (ids, decided, any::<u64>()).prop_map(
        |((pid, tid, arg, index), (kind, hook, verdict, uid), ktime_ns)| RawEvent {
            kind,
            pid,
            tid,
            arg,
            index,
            hook,
            uid,
            verdict,
            ktime_ns,
        },
    )
}

#[test]
fn any_bytes_decode_without_a_panic_and_only_one_record_is_an_event() {
    let length = prop_oneof![
        0..=2 * ALLOC_SIZE,
        Just(SIZE),
        Just(SIZE),
        Just(OPEN_SIZE),
        Just(ALLOC_SIZE)
    ];
    let bytes = length.prop_flat_map(|n| vec(any::<u8>(), n));
    check(bytes, |bytes| {
        match KernelEvent::from_record(&bytes) {
            Err(BadRecord::Size(n)) => prop_assert!(n == bytes.len() && !SIZES.contains(&n)),
            Err(BadRecord::Unknown(_)) | Ok(_) => prop_assert!(SIZES.contains(&bytes.len())),
        }
        Ok(())
    });
}

/// A record the programs wrote, at any offset in the ring's memory, decodes to the
/// event it describes: every field where the programs put it.
#[test]
fn a_record_decodes_to_the_event_it_describes_at_any_alignment() {
    check((raw_event(), 0..8usize), |(raw, offset)| {
        let mut memory = vec![0xa5; offset];
        memory.extend(record(&raw));
        let decoded = KernelEvent::from_record(&memory[offset..]);
        prop_assert_eq!(decoded, KernelEvent::try_from(raw).map_err(BadRecord::from));
        let unknown = UnknownEvent {
            kind: raw.kind,
            hook: raw.hook,
            verdict: raw.verdict,
        };
        let expected = match raw.kind {
            kind::EXEC => KernelEvent::Exec {
                pid: raw.pid,
                unresolved: raw.arg == genv_ebpf_common::EXEC_UNRESOLVED,
                at_ns: raw.ktime_ns,
            },
            kind::FORK => KernelEvent::Fork {
                parent: raw.pid,
                child: raw.arg,
                unresolved: raw.index == genv_ebpf_common::FORK_UNRESOLVED,
            },
            kind::EXIT => KernelEvent::Exit { pid: raw.pid },
            kind::OPEN => return open_as_described(&raw, decoded, unknown),
            // An allocation past a cap comes only as an `AllocEvent` (below).
            kind::ALLOC | kind::CUDA => return cuda_start_as_described(&raw, decoded, unknown),
            _ => {
                prop_assert_eq!(decoded, Err(BadRecord::Unknown(unknown)));
                return Ok(());
            }
        };
        prop_assert_eq!(decoded, Ok(expected));
        Ok(())
    });
}

/// An open record decodes to the open it describes, or (an unknown hook or verdict) to
/// no event.
fn open_as_described(
    raw: &RawEvent,
    decoded: Result<KernelEvent, BadRecord>,
    unknown: UnknownEvent,
) -> Result<(), TestCaseError> {
    match decoded {
        Ok(KernelEvent::Open(open)) => {
            let (major, minor) = split_kernel_dev(raw.arg);
            prop_assert_eq!((open.pid, open.tid, open.uid), (raw.pid, raw.tid, raw.uid));
            prop_assert_eq!((open.major, open.minor), (major, minor));
            prop_assert_eq!((open.index, open.at_ns), (raw.index, raw.ktime_ns));
            Ok(())
        }
        Ok(other) => Err(TestCaseError::fail(format!("{other:?}"))),
        Err(e) => {
            prop_assert_eq!(e, BadRecord::Unknown(unknown));
            Ok(())
        }
    }
}

/// A CUDA record (from the uprobes) decodes to the CUDA start it describes; anything
/// else of that kind is no event.
fn cuda_start_as_described(
    raw: &RawEvent,
    decoded: Result<KernelEvent, BadRecord>,
    unknown: UnknownEvent,
) -> Result<(), TestCaseError> {
    match decoded {
        Ok(KernelEvent::CudaStart(start)) => {
            prop_assert_eq!((raw.kind, raw.hook), (kind::CUDA, hook::UPROBE));
            prop_assert_eq!(
                (start.pid, start.uid, start.at_ns),
                (raw.pid, raw.uid, raw.ktime_ns)
            );
            Ok(())
        }
        Ok(other) => Err(TestCaseError::fail(format!("{other:?}"))),
        Err(e) => {
            prop_assert_eq!(e, BadRecord::Unknown(unknown));
            Ok(())
        }
    }
}

/// An `AllocEvent` the programs wrote, at any offset, decodes to the allocation it
/// describes; with another kind or hook in its head, it is no event.
#[test]
fn an_allocation_record_decodes_to_the_event_it_describes() {
    let alloc = (raw_event(), any::<[u64; 3]>(), subject()).prop_map(
        |(head, [env, would_use, size], subject)| AllocEvent {
            head,
            env,
            would_use,
            size,
            subject,
        },
    );
    check((alloc, 0..8usize), |(alloc, offset)| {
        let mut memory = vec![0xa5; offset];
        memory.extend(alloc_record(&alloc));
        let decoded = KernelEvent::from_record(&memory[offset..]);
        prop_assert_eq!(
            decoded,
            KernelEvent::try_from(alloc).map_err(BadRecord::from)
        );
        let head = alloc.head;
        match decoded {
            Ok(KernelEvent::Alloc(over)) => {
                prop_assert_eq!((head.kind, head.hook), (kind::ALLOC, hook::UPROBE));
                prop_assert_eq!(
                    (over.pid, over.env, over.index),
                    (head.pid, alloc.env, head.index)
                );
                prop_assert_eq!(
                    (over.would_use, over.size, over.at_ns),
                    (alloc.would_use, alloc.size, head.ktime_ns)
                );
                prop_assert_eq!(over.subject, alloc.subject.into());
            }
            Ok(other) => return Err(TestCaseError::fail(format!("{other:?}"))),
            Err(e) => prop_assert!(matches!(e, BadRecord::Unknown(_)), "{e:?}"),
        }
        Ok(())
    });
}

/// A record cut short or run long (the daemon and programs built apart) is refused,
/// whatever it holds.
#[test]
fn a_record_of_another_size_is_refused() {
    check((raw_event(), 0..2 * ALLOC_SIZE + 8), |(raw, length)| {
        let mut bytes = record(&raw);
        bytes.resize(length, 0);
        let decoded = KernelEvent::from_record(&bytes);
        if length == SIZE {
            prop_assert_eq!(decoded, KernelEvent::try_from(raw).map_err(BadRecord::from));
        } else if length == OPEN_SIZE {
            let padded = OpenEvent {
                head: raw,
                ..OpenEvent::default()
            };
            prop_assert_eq!(
                decoded,
                KernelEvent::try_from(padded).map_err(BadRecord::from)
            );
        } else if length == ALLOC_SIZE {
            let padded = AllocEvent {
                head: raw,
                ..AllocEvent::default()
            };
            prop_assert_eq!(
                decoded,
                KernelEvent::try_from(padded).map_err(BadRecord::from)
            );
        } else {
            prop_assert_eq!(decoded, Err(BadRecord::Size(length)));
            let message = decoded.unwrap_err().to_string();
            let expected = format!("{length} bytes, expected {SIZE}, {OPEN_SIZE} or {ALLOC_SIZE}");
            prop_assert!(message.contains(&expected), "{}", message);
        }
        Ok(())
    });
}

/// An `OpenEvent` the programs wrote (a refused or killed open, with the process as
/// the program read it), at any offset, decodes to that open and its subject; any
/// other kind or verdict in its head is no event.
#[test]
fn a_decided_open_record_decodes_with_its_subject() {
    let open = (raw_event(), subject()).prop_map(|(head, subject)| OpenEvent { head, subject });
    check((open, 0..8usize), |(open, offset)| {
        let mut memory = vec![0xa5; offset];
        memory.extend(record(&open.head));
        memory.extend(subject_bytes(&open.subject));
        let decoded = KernelEvent::from_record(&memory[offset..]);
        let head = open.head;
        let decided = [verdict::REFUSED, verdict::KILLED, verdict::KILL_FAILED];
        match decoded {
            Ok(KernelEvent::Open(gpu_open)) => {
                prop_assert_eq!(head.kind, kind::OPEN);
                prop_assert!(decided.contains(&head.verdict));
                prop_assert_eq!((gpu_open.pid, gpu_open.uid), (head.pid, head.uid));
                prop_assert_eq!(gpu_open.subject, Some(open.subject.into()));
            }
            Ok(other) => return Err(TestCaseError::fail(format!("{other:?}"))),
            Err(e) => {
                prop_assert!(matches!(e, BadRecord::Unknown(_)), "{e:?}");
                let known = head.kind == kind::OPEN && decided.contains(&head.verdict);
                let hook_known = [hook::LSM, hook::FMOD_RET, hook::FENTRY, hook::TRACEPOINT]
                    .contains(&head.hook);
                prop_assert!(!(known && hook_known), "{head:?}");
            }
        }
        Ok(())
    });
}
