//! The records the programs write into the ring buffer: [`RawEvent`] for every event,
//! and, for the decisions a user is told of, [`OpenEvent`] and [`AllocEvent`], which
//! carry the process as the program read it ([`Subject`]).

/// One event, as the programs write it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawEvent {
    /// One of [`crate::kind`].
    pub kind: u32,
    /// Thread-group id (the process's pid, as userspace sees it).
    pub pid: u32,
    /// The thread that acted.
    pub tid: u32,
    /// Kind-specific: the child's pid for `FORK`, the node's `dev_t` for `OPEN`,
    /// [`crate::EXEC_UNRESOLVED`] for an `EXEC` whose identity the daemon must read.
    pub arg: u32,
    /// The GPU index for `OPEN`; [`crate::FORK_UNRESOLVED`] for a `FORK` whose child inherited
    /// an unresolved identity.
    pub index: u32,
    /// One of [`crate::hook`] for `OPEN`.
    pub hook: u32,
    /// The real uid of the process, for `OPEN`.
    pub uid: u32,
    /// One of [`crate::verdict`] for `OPEN`.
    pub verdict: u32,
    /// `bpf_ktime_get_ns()` when the event happened (CLOCK_MONOTONIC); 0 for `EXEC`,
    /// `FORK` and `EXIT`, whose time the daemon does not use.
    pub ktime_ns: u64,
}

/// The process a kernel decision (a refusal, a kill) was about, as its user is told of
/// it: read in the kernel at the decision, since the daemon may find the process gone
/// (killed, reaped) by the time it reads the event.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Subject {
    /// Its controlling terminal, a kernel `dev_t` ([`crate::kernel_dev`]); 0 for none.
    pub tty: u32,
    pub _pad: u32,
    /// Its `comm`, NUL-padded.
    pub comm: [u8; 16],
}

/// An `OPEN` event the program refused or killed (verdicts [`crate::verdict::REFUSED`],
/// [`crate::verdict::KILLED`], [`crate::verdict::KILL_FAILED`]): the common record and its
/// [`Subject`]. Every other open stays [`RawEvent`]'s size.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenEvent {
    pub head: RawEvent,
    pub subject: Subject,
}

/// An `ALLOC` event: the common record and what only it carries, written as a record
/// of its own size so that every other event (a GPU open, an exec) stays
/// [`RawEvent`]'s size in the ring buffer. A refusal's `head.arg` is the process's
/// refusals not reported since its last (see [`crate::alloc::REFUSAL_PACE_NS`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocEvent {
    pub head: RawEvent,
    /// The environment's [`crate::env_id_hash`].
    pub env: u64,
    /// Bytes the environment would use on the GPU with the allocation.
    pub would_use: u64,
    /// The allocation's size, as charged (at most [`crate::alloc::MAX_CHARGE`]).
    pub size: u64,
    pub subject: Subject,
}
