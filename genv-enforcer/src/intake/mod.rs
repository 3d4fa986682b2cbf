//! Event intake: the kernel programs' ring buffer read asynchronously ([`ring`]), its
//! records checked and turned into typed events ([`event`]); and, with `--bpf-log`, their
//! account of each decision ([`decision_log`]).

pub mod decision_log;
mod event;
mod ring;
mod subject;

#[cfg(test)]
mod fuzz_tests;

pub use event::{
    AllocOutcome, BadRecord, CudaCall, CudaStart, GpuOpen, KernelEvent, OverCap, UnknownEvent,
    Verdict,
};
pub use ring::EventIntake;
pub use subject::KernelSubject;
