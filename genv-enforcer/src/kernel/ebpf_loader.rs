//! An aya `EbpfLoader` that has not parsed the kernel's BTF.
//!
//! `EbpfLoader::new()` parses `/sys/kernel/btf/vmlinux` into aya-obj's types, about
//! 20 MiB of memory (for vmlinux's 5 MiB) held until the loader is dropped, and there is
//! no other way to make one. The daemon needs none of it: that BTF serves CO-RE
//! relocations, which the object has none of (a unit test holds it to that), and the
//! trampoline tiers' targets, which the daemon's own reader finds (`trampoline`). So the
//! loader is made on a short-lived thread that may open no file: a seccomp filter of
//! that thread alone (no capability needed, only `no_new_privs`, which is per thread
//! too) answers `EACCES` to the open system calls. aya's read of the BTF fails, and aya
//! goes on without it, as it does on a kernel without BTF. Nothing else runs on that
//! thread, and the rest of the process is untouched.
//!
//! Where that cannot be done (an architecture not listed here, no seccomp), the loader
//! is made as usual and its parse dropped at once: the same programs load, with the
//! higher peak.

use aya::EbpfLoader;

/// A loader without the kernel's BTF (`btf(None)`: no CO-RE relocation is attempted).
pub(super) fn without_kernel_btf() -> EbpfLoader<'static> {
    let made = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("genv-loader".into())
            .spawn_scoped(scope, loader_that_opens_nothing)
            .map_err(|e| e.to_string())?
            .join()
            .map_err(|_| "the thread panicked".to_owned())?
    });
    let mut loader = made.unwrap_or_else(|why| {
        tracing::debug!("Loading with aya's own parse of the kernel's BTF: {why}");
        EbpfLoader::new()
    });
    loader.btf(None);
    loader
}

/// On its own thread: the loader made where no file can be opened.
fn loader_that_opens_nothing() -> Result<EbpfLoader<'static>, String> {
    forbid_opens()?;
    if std::fs::File::open(super::btf::VMLINUX).is_ok() {
        return Err(format!("{} can still be opened", super::btf::VMLINUX));
    }
    Ok(EbpfLoader::new())
}

/// The architecture's seccomp id (`AUDIT_ARCH_*`) and its open system calls.
#[cfg(target_arch = "x86_64")]
const ARCH: (u32, [libc::c_long; 3]) = (
    0xc000_003e,
    [libc::SYS_open, libc::SYS_openat, libc::SYS_openat2],
);
#[cfg(target_arch = "aarch64")]
const ARCH: (u32, [libc::c_long; 3]) = (
    0xc000_00b7,
    [libc::SYS_openat, libc::SYS_openat2, libc::SYS_openat],
);

/// Makes every open of the calling thread fail with `EACCES`, for the thread's life.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn forbid_opens() -> Result<(), String> {
    // Classic BPF over `struct seccomp_data`: `nr` at offset 0, `arch` at 4.
    const LOAD_WORD: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JUMP_IF_EQUAL: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RETURN: u16 = 0x06; // BPF_RET | BPF_K
    let op = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let (arch, [a, b, c]) = ARCH;
    let mut filter = [
        op(LOAD_WORD, 0, 0, 4),
        op(JUMP_IF_EQUAL, 1, 0, arch), // another ABI's call: allowed
        op(RETURN, 0, 0, libc::SECCOMP_RET_ALLOW),
        op(LOAD_WORD, 0, 0, 0),
        op(JUMP_IF_EQUAL, 3, 0, a as u32),
        op(JUMP_IF_EQUAL, 2, 0, b as u32),
        op(JUMP_IF_EQUAL, 1, 0, c as u32),
        op(RETURN, 0, 0, libc::SECCOMP_RET_ALLOW),
        op(RETURN, 0, 0, libc::SECCOMP_RET_ERRNO | libc::EACCES as u32),
    ];
    let program = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    // SAFETY: prctl on the calling thread's own attributes; `program` points at
    // `filter`, alive across the call (the kernel copies it). Without
    // SECCOMP_FILTER_FLAG_TSYNC the filter is this thread's alone.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return Err(format!("no_new_privs: {}", std::io::Error::last_os_error()));
        }
        let mode = libc::SECCOMP_MODE_FILTER as libc::c_ulong;
        if libc::prctl(libc::PR_SET_SECCOMP, mode, &program as *const _, 0, 0) != 0 {
            return Err(format!("seccomp: {}", std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn forbid_opens() -> Result<(), String> {
    Err("no seccomp filter for this architecture".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the kernel's BTF, aya applies no CO-RE relocation: the object must have
    /// none (its programs read through the offsets the loader hands them instead).
    #[test]
    fn the_object_needs_no_kernel_btf() {
        let object = aya_obj::Object::parse(super::super::object::OBJECT).unwrap();
        assert!(!object.has_btf_relocations());
    }

    /// On its thread, aya can read no BTF and parses none; the calling thread, and so
    /// the process, opens files as before.
    #[test]
    fn aya_parses_nothing_and_the_process_still_opens_files() {
        let opens = || std::fs::File::open("/proc/self/status").is_ok();
        assert!(opens());
        let loader = std::thread::spawn(loader_that_opens_nothing)
            .join()
            .unwrap();
        let loader = loader.unwrap_or_else(|e| panic!("{e}"));
        let described = format!("{loader:?}");
        assert!(described.contains("btf: None"), "{described:.200}");
        assert!(opens());
        drop(without_kernel_btf());
        assert!(opens());
    }
}
