//! A program loaded and attached, as the loader, the lifecycle and libcuda probes, and
//! the pins all hold it: what each of them needs of the others, and nothing more.

use aya::Ebpf;
use aya::programs::raw_trace_point::RawTracePointLinkId;
use aya::programs::trace_point::TracePointLinkId;

use super::error::LoadError;
use super::trampoline;

/// An attached program: its name in the object, kernel id, and link (taken from the
/// program when pinned).
pub(super) struct Attached {
    pub(super) name: &'static str,
    pub(super) id: u32,
    pub(super) link: Option<LinkId>,
}

pub(super) enum LinkId {
    TracePoint(TracePointLinkId),
    RawTracePoint(RawTracePointLinkId),
    /// A trampoline tier's program's (lsm, fmod_ret, fentry), which aya does not hold.
    Trampoline(trampoline::Link),
}

/// The program `program` of the object, for loading or attaching.
pub(super) fn program_mut<'a>(
    ebpf: &'a mut Ebpf,
    program: &'static str,
) -> Result<&'a mut aya::programs::Program, LoadError> {
    ebpf.program_mut(program).ok_or(LoadError::Program {
        program,
        message: "not in the object".into(),
    })
}
