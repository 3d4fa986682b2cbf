//! Where facts about the node come from: NVML for GPUs and their processes, `/proc` for
//! processes (and for GPU use when NVML is missing) and the files they map, the device
//! map that says which device node is which GPU, and the passwd database for user names.

pub mod address_space;
pub mod devmap;
pub mod maps;
pub mod nvml;
pub mod proc_events;
pub mod procfs;
pub mod trust;
pub mod uid_owners;
pub mod users;
