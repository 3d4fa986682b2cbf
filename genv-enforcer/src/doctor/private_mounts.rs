//! The daemon mounts tracefs and securityfs where a minimal system has not; `doctor`
//! must change nothing, so it first moves into a mount namespace of its own, whose
//! mounts nobody else sees and which ends with the process.

/// Enters a private mount namespace (every mount below `/` private, so that nothing
/// mounted here propagates back); why not, where it cannot (not root).
pub fn enter() -> Result<(), String> {
    // SAFETY: unshare(2) with CLONE_NEWNS alone changes only this thread's mount
    // namespace (the process has no other thread yet; threads made later inherit it).
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        let error = std::io::Error::last_os_error();
        return Err(format!(
            "cannot enter a mount namespace of its own: {error}"
        ));
    }
    use rustix::mount::{MountPropagationFlags, mount_change};
    mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(|e| format!("cannot make its mounts private: {e}"))
}
