//! A program loaded and attached, as the loader, the lifecycle and libcuda probes, and
//! the pins all hold it: what each of them needs of the others, and nothing more.

use aya::Ebpf;
use aya::programs::fentry::FEntryLinkId;
use aya::programs::lsm::LsmLinkId;
use aya::programs::raw_trace_point::RawTracePointLinkId;
use aya::programs::trace_point::TracePointLinkId;

use super::error::LoadError;
use super::fmod_ret;

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
    Lsm(LsmLinkId),
    FEntry(FEntryLinkId),
    /// The fmod_ret program's, which aya does not hold.
    FmodRet(fmod_ret::Link),
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
