//! Mounts over a node's state, as a user's `fusermount` makes them, seen by the enforcer
//! alone: the enforcer gets a mount namespace of its own ([`private_namespace`]), and
//! the test mounts into it ([`bind_in`], [`SilentFuse::mount_in`]), so that neither the
//! machine nor the other tests see the mounts, and they go away with the enforcer.
//!
//! The FUSE server, [`SilentFuse`], is a `/dev/fuse` descriptor that nobody reads: the
//! kernel never gets an answer to its first request (INIT), so every open, `stat` or
//! `flock` on the mount waits, and wakes for SIGKILL alone, until the descriptor is
//! closed (dropping it aborts the connection, freeing whoever waits).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;

/// What [`crate::Node::before_exec`] runs in the enforcer's process before it execs.
pub type BeforeExec = Arc<dyn Fn() -> io::Result<()> + Send + Sync>;

fn check(rc: libc::c_int) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_encoded_bytes()).unwrap()
}

/// `unshare(CLONE_NEWNS)` and no propagation to or from the machine's mounts; then,
/// with `fuse`, a [`SilentFuse`] mount already at its target when the enforcer starts.
/// Only system calls, on strings made here beforehand: it runs between fork and exec.
pub fn private_namespace(fuse: Option<(&SilentFuse, &Path)>) -> BeforeExec {
    let fuse = fuse.map(|(server, target)| (c_path(target), server.options(target)));
    Arc::new(move || {
        // SAFETY: unshare(2) takes no pointer; this runs in the forked child before it
        // execs.
        check(unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
        let flags = libc::MS_REC | libc::MS_PRIVATE;
        let none = c"none".as_ptr();
        // SAFETY: the strings are static and NUL-terminated; no data argument.
        check(unsafe { libc::mount(none, c"/".as_ptr(), none, flags, std::ptr::null()) })?;
        if let Some((target, options)) = &fuse {
            SilentFuse::mount_raw(target, options)?;
        }
        Ok(())
    })
}

/// Runs `f` in the mount namespace of process `pid`, on a thread of its own.
pub fn in_namespace_of<T: Send>(pid: u32, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        let thread = scope.spawn(|| {
            let ns = std::fs::File::open(format!("/proc/{pid}/ns/mnt")).unwrap();
            // Joining a mount namespace takes a filesystem context of this thread's own.
            // SAFETY: unshare(2) takes no pointer; it gives this thread its own
            // filesystem context.
            check(unsafe { libc::unshare(libc::CLONE_FS) }).expect("unshare(CLONE_FS)");
            // SAFETY: `ns` is an open descriptor of a mount namespace, alive across the
            // call.
            check(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) })
                .expect("joining the enforcer's mount namespace (needs root)");
            f()
        });
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// `mount --bind SOURCE TARGET` in the mount namespace of process `pid`.
pub fn bind_in(pid: u32, source: &Path, target: &Path) {
    let (source, target) = (c_path(source), c_path(target));
    in_namespace_of(pid, || {
        // SAFETY: the paths are NUL-terminated `CString`s alive across the call.
        let rc = unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        };
        check(rc).expect("bind mount");
    });
}

/// A FUSE server that never answers. Its mounts are of type `fuse.silent`, owned by
/// nobody (65534) as a user's `fusermount` would make them, with `allow_other` (what an
/// administrator's `user_allow_other` permits) so that root is kept waiting rather than
/// refused.
pub struct SilentFuse {
    server: OwnedFd,
}

impl Default for SilentFuse {
    fn default() -> Self {
        Self::new()
    }
}

impl SilentFuse {
    pub fn new() -> Self {
        let flags = rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC;
        let server = rustix::fs::open("/dev/fuse", flags, rustix::fs::Mode::empty())
            .expect("opening /dev/fuse");
        Self { server }
    }

    /// mount(2)'s data for a mount of this server over `target`, a file or a directory
    /// (FUSE's root must be of the same kind as what it covers).
    fn options(&self, target: &Path) -> CString {
        let root_mode = if target.is_dir() { 0o040000 } else { 0o100000 };
        CString::new(format!(
            "fd={},rootmode={root_mode:o},user_id=65534,group_id=65534,allow_other,default_permissions,subtype=silent",
            self.server.as_raw_fd()
        ))
        .unwrap()
    }

    fn mount_raw(target: &CString, options: &CString) -> io::Result<()> {
        let flags = libc::MS_NOSUID | libc::MS_NODEV;
        // SAFETY: the paths and options are NUL-terminated `CString`s alive across the
        // call.
        check(unsafe {
            libc::mount(
                c"silent".as_ptr(),
                target.as_ptr(),
                c"fuse".as_ptr(),
                flags,
                options.as_ptr().cast(),
            )
        })
    }

    /// Mounts it over `target` in the mount namespace of process `pid`.
    pub fn mount_in(&self, pid: u32, target: &Path) {
        let (target, options) = (c_path(target), self.options(target));
        in_namespace_of(pid, || Self::mount_raw(&target, &options)).expect("mounting FUSE");
    }
}
