//! Where facts about the node come from: NVML for GPUs and their processes, `/proc` for
//! processes (and for GPU use when NVML is missing), and the device map that says which
//! device node is which GPU.

pub mod devmap;
pub mod nvml;
pub mod procfs;
