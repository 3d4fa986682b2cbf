//! Mounts over the state directory and its files. Any user can put a FUSE file system
//! there (`fusermount` mounts on a directory or a file the user can write); its server
//! may forge every read, or never answer, and a thread waiting on it wakes for SIGKILL
//! alone. Nothing mounted on a state file may be opened, read or locked; a FUSE file
//! system at the state directory neither; an administrator's tmpfs there is fine.
//!
//! Each test runs on a thread of its own that `unshare(CLONE_NEWNS)`s: that thread
//! alone gets a private copy of the mount table (the rest of the test process, and the
//! machine, never see its mounts), as do the threads it starts. The FUSE server is a
//! `/dev/fuse` descriptor that nobody reads: every request waits until it is closed.

use std::ffi::CString;
use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use rustix::fs::{Mode, OFlags};
use rustix::mount::{self, MountFlags, MountPropagationFlags, UnmountFlags};
use serde_json::json;

use super::hostile_tests::{PROMPTLY, Scratch, assert_names, devices_text, snapshot};
use super::{LockErrorKind, MountKind, Refusal, StateDir, StateErrorKind};

/// Runs `f` on a thread in a mount namespace of its own, with no propagation to or from
/// the machine's. Needs root, like the other hostile tests.
fn in_private_mounts<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let thread = std::thread::spawn(move || {
        // A multi-threaded process may unshare a mount namespace for one thread: the
        // kernel gives that thread its own copy of the filesystem context too.
        // SAFETY: unshare(2) takes no pointer; it gives this thread its own mount
        // namespace.
        let unshared = unsafe { libc::unshare(libc::CLONE_NEWNS) };
        assert_eq!(
            unshared,
            0,
            "unshare(CLONE_NEWNS) (needs root): {}",
            std::io::Error::last_os_error()
        );
        let flags = MountPropagationFlags::PRIVATE | MountPropagationFlags::REC;
        mount::mount_change("/", flags).expect("making the copied mounts private");
        f()
    });
    thread
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// A mount made by a test, undone when dropped.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = mount::unmount(&self.0, UnmountFlags::DETACH);
    }
}

/// `mount --bind source target`.
fn bind(source: &Path, target: &Path) -> Mounted {
    mount::mount_bind(source, target).expect("bind mount");
    Mounted(target.to_owned())
}

/// A tmpfs at `target`, mode 0777, as an administrator might put under genv's state.
fn tmpfs(target: &Path) -> Mounted {
    let data = CString::new("mode=777").unwrap();
    mount::mount("tmpfs", target, "tmpfs", MountFlags::empty(), &*data).expect("tmpfs");
    Mounted(target.to_owned())
}

/// A FUSE file system over `target` whose server never answers. `allow_other` is what
/// an administrator's `user_allow_other` lets a user ask for; without it, root is
/// refused (EACCES) instead of kept waiting.
struct SilentFuse {
    server: Option<OwnedFd>,
    _mounted: Mounted,
}

impl SilentFuse {
    fn mount(target: &Path, allow_other: bool) -> Self {
        let server = rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
            .expect("opening /dev/fuse");
        let root_mode = match target.is_dir() {
            true => 0o040000,
            false => 0o100000,
        };
        let mut options = format!(
            "fd={},rootmode={root_mode:o},user_id=65534,group_id=65534,default_permissions,subtype=silent",
            server.as_raw_fd()
        );
        if allow_other {
            options.push_str(",allow_other");
        }
        let data = CString::new(options).unwrap();
        let flags = MountFlags::NOSUID | MountFlags::NODEV;
        mount::mount("silent", target, "fuse", flags, &*data).expect("mounting FUSE");
        Self {
            server: Some(server),
            _mounted: Mounted(target.to_owned()),
        }
    }

    /// Closes the server's end: the kernel aborts the connection, and every request
    /// still waiting fails.
    fn abort(&mut self) {
        self.server = None;
    }
}

/// Runs `f` on another thread (in the same mount namespace); if it does not return
/// promptly, it is waiting on the FUSE server: the connection is aborted (freeing the
/// thread) and the test fails.
fn promptly<T: Send + 'static>(
    fuse: &mut SilentFuse,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(PROMPTLY) {
        Ok(value) => value,
        Err(_) => {
            fuse.abort();
            let _ = worker.join();
            panic!("{what} was still waiting on the FUSE server after {PROMPTLY:?}");
        }
    }
}

fn envs_text() -> String {
    json!({"envs": []}).to_string()
}

fn mounted_file(refusal: &Refusal) -> &MountKind {
    match refusal {
        Refusal::MountedFile(kind) => kind,
        other => panic!("not refused as a mount: {other:?}"),
    }
}

#[test]
fn a_file_bind_mounted_over_envs_json_is_not_read() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        fs::write(scratch.in_state("envs.json"), envs_text()).unwrap();
        let forged = scratch.target("forged", "{\"envs\": [forged]}", 0o644);
        let _mounted = bind(&forged, &scratch.in_state("envs.json"));

        let error = scratch.dir().load_envs().unwrap_err();

        let message = error.to_string();
        assert_names(&message, "envs.json", "is a mount point of a ");
        assert_names(&message, "envs.json", "a state file is never a mount");
        let StateErrorKind::ReadRefused(refusal) = &error.kind else {
            panic!("{error}");
        };
        assert!(!mounted_file(refusal).fuse, "{message}");
    });
}

#[test]
fn devices_json_bind_mounted_is_neither_read_nor_rewritten() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        let eid = scratch.live_env();
        fs::write(scratch.in_state("devices.json"), devices_text(&eid)).unwrap();
        let target = scratch.target("precious", &devices_text(&eid), 0o600);
        let before = snapshot(&target);
        let _mounted = bind(&target, &scratch.in_state("devices.json"));

        let error = scratch.dir().detach(&eid, 0).unwrap_err().to_string();

        assert_names(&error, "devices.json", "is a mount point");
        assert_eq!(snapshot(&target), before, "the mounted file was rewritten");
    });
}

#[test]
fn a_genv_lock_with_a_file_mounted_on_it_is_not_locked() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        fs::write(scratch.in_state("genv.lock"), "").unwrap();
        let target = scratch.target("root-only", "", 0o600);
        let _mounted = bind(&target, &scratch.in_state("genv.lock"));

        let error = scratch.dir().lock().unwrap_err();

        assert_names(&error.to_string(), "genv.lock", "is a mount point");
        assert!(
            matches!(error.kind, LockErrorKind::Refused(Refusal::MountedFile(_))),
            "{error}"
        );
        let locks = fs::read_to_string("/proc/locks").unwrap();
        let id = format!(":{} ", fs::metadata(&target).map(|m| m.ino()).unwrap());
        assert!(!locks.contains(&id), "the mounted file was locked: {locks}");
    });
}

/// An administrator may put the state directory on a tmpfs of its own: it is used as
/// any directory, and a file mounted inside it is still refused.
#[test]
fn an_administrators_tmpfs_at_the_state_directory_is_used() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        let _tmpfs = tmpfs(&scratch.state);
        let eid = scratch.live_env();
        fs::write(scratch.in_state("devices.json"), devices_text(&eid)).unwrap();
        let dir = scratch.dir();

        assert_eq!(dir.load_envs().unwrap().len(), 1);
        drop(dir.lock().unwrap());
        dir.detach(&eid, 0).unwrap();
        let text = fs::read_to_string(scratch.in_state("devices.json")).unwrap();
        assert!(text.contains("\"attachments\": []"), "{text}");
        assert!(dir.open_checked().unwrap().is_some());

        let forged = scratch.target("forged", &envs_text(), 0o644);
        let _mounted = bind(&forged, &scratch.in_state("envs.json"));
        let error = dir.load_envs().unwrap_err().to_string();
        assert_names(&error, "envs.json", "is a mount point");
    });
}

/// The worst case: `user_allow_other`, and a server that never answers. Before, the
/// open of envs.json waited for ever (and SIGTERM could not end the wait).
#[test]
fn a_silent_fuse_envs_json_is_refused_promptly_and_named() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        fs::write(scratch.in_state("envs.json"), envs_text()).unwrap();
        let mut fuse = SilentFuse::mount(&scratch.in_state("envs.json"), true);
        let dir = scratch.dir();

        let error = promptly(&mut fuse, "reading envs.json", move || {
            dir.load_envs().unwrap_err()
        });

        let message = error.to_string();
        assert_names(&message, "envs.json", "a FUSE file system (fuse.silent)");
        assert_names(&message, "envs.json", "could stall or forge every read");
        let StateErrorKind::ReadRefused(refusal) = &error.kind else {
            panic!("{error}");
        };
        let kind = mounted_file(refusal);
        assert!(kind.fuse && kind.fstype.as_deref() == Some("fuse.silent"));
    });
}

/// Without `allow_other` root is refused by the kernel; the refusal still says why.
#[test]
fn a_fuse_envs_json_root_may_not_enter_is_named_as_fuse() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        fs::write(scratch.in_state("envs.json"), envs_text()).unwrap();
        let mut fuse = SilentFuse::mount(&scratch.in_state("envs.json"), false);
        let dir = scratch.dir();

        let error = promptly(&mut fuse, "reading envs.json", move || {
            dir.load_envs().unwrap_err().to_string()
        });

        assert_names(&error, "envs.json", "a FUSE file system (fuse.silent)");
    });
}

#[test]
fn a_silent_fuse_devices_json_is_refused_promptly() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        let eid = scratch.live_env();
        fs::write(scratch.in_state("devices.json"), devices_text(&eid)).unwrap();
        let mut fuse = SilentFuse::mount(&scratch.in_state("devices.json"), true);
        let dir = scratch.dir();

        let (read, detach) = promptly(&mut fuse, "reading devices.json", move || {
            let read = dir.load_devices(&[]).unwrap_err().to_string();
            (read, dir.detach(&eid, 0).unwrap_err().to_string())
        });

        assert_names(&read, "devices.json", "a FUSE file system");
        assert_names(&detach, "devices.json", "a FUSE file system");
    });
}

/// genv.lock is `flock`ed: on a FUSE file, the lock is the server's to grant, or to
/// hold back for ever.
#[test]
fn a_silent_fuse_genv_lock_is_refused_promptly() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        fs::write(scratch.in_state("genv.lock"), "").unwrap();
        let mut fuse = SilentFuse::mount(&scratch.in_state("genv.lock"), true);
        let dir = scratch.dir();

        let errors = promptly(&mut fuse, "taking genv's lock", move || {
            let within = dir.lock_within(PROMPTLY / 10).unwrap_err();
            let now = dir.try_lock().unwrap_err();
            [within, now, dir.lock().unwrap_err()]
        });

        for error in errors {
            assert_names(&error.to_string(), "genv.lock", "a FUSE file system");
            assert!(matches!(error.kind, LockErrorKind::Refused(_)), "{error}");
        }
    });
}

/// `fusermount` mounts on the state directory itself: 0777 without the sticky bit.
#[test]
fn a_silent_fuse_state_directory_is_refused_promptly() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        fs::write(scratch.in_state("envs.json"), envs_text()).unwrap();
        let mut fuse = SilentFuse::mount(&scratch.state, true);
        let dir = scratch.dir();

        let errors = promptly(&mut fuse, "opening the state directory", move || {
            [
                dir.load_envs().unwrap_err().to_string(),
                dir.load_devices(&[]).unwrap_err().to_string(),
                dir.lock().unwrap_err().to_string(),
                dir.open_checked().unwrap_err().to_string(),
            ]
        });

        let state = scratch.state.display().to_string();
        for error in errors {
            assert!(
                error.starts_with(&format!("{state}: ")),
                "does not name the directory: {error}"
            );
            assert_names(&error, &state, "is a mount point of a FUSE file system");
        }
    });
}

/// Stacked on an administrator's tmpfs, a FUSE mount is what the path reaches, and is
/// refused.
#[test]
fn a_silent_fuse_stacked_on_a_tmpfs_state_directory_is_refused() {
    in_private_mounts(|| {
        let scratch = Scratch::new();
        let _tmpfs = tmpfs(&scratch.state);
        let mut fuse = SilentFuse::mount(&scratch.state, true);
        let dir = scratch.dir();

        let error = promptly(&mut fuse, "reading envs.json", move || {
            dir.load_envs().unwrap_err()
        });

        assert!(
            matches!(
                error.kind,
                StateErrorKind::ReadRefused(Refusal::FuseDirectory(_))
            ),
            "{error}"
        );
    });
}

/// The daemon's inotify watch is placed through [`StateDir::open_checked`]: the
/// directory as every read opens it.
#[test]
fn open_checked_is_the_directory_every_read_uses() {
    let scratch = Scratch::new();
    assert!(
        StateDir::new(scratch.base.join("never-made"))
            .open_checked()
            .unwrap()
            .is_none()
    );
    let fd = scratch.dir().open_checked().unwrap().unwrap();
    let link = fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    assert_eq!(link, scratch.state);
}
