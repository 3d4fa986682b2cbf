//! genv-enforcer's kernel programs.
//!
//! - [`lifecycle`]: exec, fork (processes, not threads) and exit (the whole thread
//!   group), so that the daemon's process table follows the system without `/proc` scans,
//!   and each process's environment identity, read at exec by [`env_block`];
//! - [`open`]: opens of watched GPU device nodes, recognised by the inode's device
//!   number, never by path, in four tiers: BPF LSM `file_open`, fmod_ret and fentry
//!   on `security_file_open`, and the `open*` syscall exit tracepoints;
//! - [`cuda`]: libcuda's memory and context calls, on uprobes (`--memory-at-alloc`):
//!   each allocation charged to its environment and GPU, and checked against its cap
//!   before the driver sees it;
//! - [`maps`]: what they share with the daemon.
//!
//! The kernel's struct layout is not compiled in: the daemon reads member offsets from
//! the running kernel's BTF and writes them into the `OFFSETS` global before loading.

#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// The atomic add of `cuda`'s accounting (the target has no atomic integer methods).
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

#[cfg(target_arch = "bpf")]
mod cuda;
#[cfg(target_arch = "bpf")]
mod env_block;
#[cfg(target_arch = "bpf")]
mod fd_file;
#[cfg(target_arch = "bpf")]
mod kernel;
#[cfg(target_arch = "bpf")]
mod lifecycle;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod open;
#[cfg(target_arch = "bpf")]
mod open_exit;
#[cfg(target_arch = "bpf")]
mod told;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any path that could reach here; nothing can panic at run time.
    loop {}
}

#[cfg(not(target_arch = "bpf"))]
fn main() {}
