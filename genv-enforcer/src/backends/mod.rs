//! Where facts come from: NVML for GPU contexts and memory, `/proc` for processes.
//! (The kernel-side BPF tiers join these with the event-driven issue.)

pub mod nvml;
pub mod procfs;
