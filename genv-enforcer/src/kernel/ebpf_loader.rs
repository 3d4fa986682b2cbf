//! An aya `EbpfLoader` that has not parsed the kernel's BTF.
//!
//! `EbpfLoader::new()` parses `/sys/kernel/btf/vmlinux` into aya-obj's types, about
//! 20 MiB of memory (for vmlinux's 5 MiB) held until the loader is dropped, and there is
//! no other way to make one. The daemon needs none of it: that BTF serves CO-RE
//! relocations, which the object has none of (a unit test holds it to that), and the
//! trampoline tiers' targets, which the daemon's own reader finds (`trampoline`). So the
//! loader is made on a short-lived thread with a filesystem view of its own
//! (`unshare(CLONE_FS)`) rooted where no `sys/kernel/btf/vmlinux` exists: aya's read of
//! it fails, and aya goes on without it, as it does on a kernel without BTF. Nothing else
//! runs on that thread, and the rest of the process keeps its root.
//!
//! Where that cannot be done (no `CAP_SYS_CHROOT`), the loader is made as usual and its
//! parse dropped at once: the same programs load, with the higher peak.

use aya::EbpfLoader;

/// Where the thread is rooted: a directory every BTF kernel has, holding BTF blobs and
/// no `sys/`, so that aya's absolute path resolves to nothing under it.
const EMPTY_ROOT: &std::ffi::CStr = c"/sys/kernel/btf";

/// A loader without the kernel's BTF (`btf(None)`: no CO-RE relocation is attempted).
pub(super) fn without_kernel_btf() -> EbpfLoader<'static> {
    let made = std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("genv-loader".into())
            .spawn_scoped(scope, hidden_btf_loader)
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

/// On its own thread: the loader made where the kernel's BTF cannot be read.
fn hidden_btf_loader() -> Result<EbpfLoader<'static>, String> {
    // SAFETY: plain system calls on this thread's own state (its filesystem root, which
    // `CLONE_FS` first makes its own); the pointer is a NUL-terminated constant.
    unsafe {
        if libc::unshare(libc::CLONE_FS) != 0 {
            return Err(format!(
                "unshare(CLONE_FS): {}",
                std::io::Error::last_os_error()
            ));
        }
        if libc::chroot(EMPTY_ROOT.as_ptr()) != 0 {
            return Err(format!("chroot: {}", std::io::Error::last_os_error()));
        }
    }
    if std::path::Path::new(super::btf::VMLINUX).exists() {
        return Err(format!("{} is still visible", super::btf::VMLINUX));
    }
    Ok(EbpfLoader::new())
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

    /// On its thread, aya finds no BTF to parse; the calling thread, and so the process,
    /// keeps its root and still sees the kernel's BTF.
    #[test]
    fn aya_parses_nothing_and_the_process_keeps_its_root() {
        let visible = || std::path::Path::new(super::super::btf::VMLINUX).exists();
        let before = visible();
        let loader = std::thread::spawn(hidden_btf_loader).join().unwrap();
        let loader = loader.unwrap_or_else(|e| panic!("{e}"));
        let described = format!("{loader:?}");
        assert!(described.contains("btf: None"), "{described:.200}");
        assert_eq!(visible(), before);
        drop(without_kernel_btf());
        assert_eq!(visible(), before);
    }
}
