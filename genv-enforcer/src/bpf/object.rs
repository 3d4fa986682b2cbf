//! The compiled kernel programs, embedded at build time (see `build.rs`).

/// The `genv-ebpf` ELF object, aligned as aya requires.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/genv-ebpf"));
