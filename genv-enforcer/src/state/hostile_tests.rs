//! What another user can put in `$GENV_TMPDIR` (0777, no sticky bit, as genv makes it):
//! symbolic links to root's files, FIFOs, hard links, endless or huge files. None of it
//! may make the root enforcer write, truncate, chmod, hang or exhaust memory.
//!
//! The files a hostile user would point at live in a root-only directory beside the
//! state directory; every test checks they are byte for byte (and mode for mode) as
//! they were. The state files' own tests are in `hostile_file_tests`.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::json;

use super::StateDir;

/// Longer than any of these operations takes; shorter than a hung test suite.
pub(super) const PROMPTLY: Duration = Duration::from_secs(5);
/// A uid that is not ours, for files "another user" owns.
pub(super) const NOBODY: u32 = 65534;

/// A state directory as genv makes it, and a root-only directory for targets.
pub(super) struct Scratch {
    pub base: PathBuf,
    pub state: PathBuf,
    pub private: PathBuf,
}

impl Scratch {
    pub fn new() -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let base = std::env::temp_dir().join(format!(
            "genv-state-hostile-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let state = base.join("genv");
        let private = base.join("private");
        fs::create_dir_all(&state).unwrap();
        fs::set_permissions(&state, fs::Permissions::from_mode(0o777)).unwrap();
        fs::create_dir_all(&private).unwrap();
        fs::set_permissions(&private, fs::Permissions::from_mode(0o700)).unwrap();
        Self {
            base,
            state,
            private,
        }
    }

    pub fn dir(&self) -> StateDir {
        StateDir::new(&self.state)
    }

    pub fn in_state(&self, name: &str) -> PathBuf {
        self.state.join(name)
    }

    /// A root-owned file with `text` and `mode`, the kind a symlink would aim at.
    pub fn target(&self, name: &str, text: &str, mode: u32) -> PathBuf {
        let path = self.private.join(name);
        fs::write(&path, text).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    /// `envs.json` with one environment whose activating shell (this process) is alive,
    /// attached to device 0, so that a detach has something to remove.
    pub fn live_env(&self) -> String {
        let eid = "victim-env";
        let envs = json!({"envs": [{"eid": eid, "uid": 0, "creation": "22/11/2026 02:28:47",
            "username": "root", "config": {"name": null, "gpu_memory": null, "gpus": 1},
            "pids": [std::process::id()], "kernel_ids": []}]});
        fs::write(self.in_state("envs.json"), envs.to_string()).unwrap();
        eid.to_owned()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.base);
    }
}

pub(super) fn devices_text(eid: &str) -> String {
    json!({"devices": [{"index": 0, "total_memory": "16384mi",
        "attachments": [{"eid": eid, "gpu_memory": null, "time": "22/11/2026 02:28:47"}]}]})
    .to_string()
}

/// Content and permission bits, to compare before and after.
pub(super) fn snapshot(path: &Path) -> (Vec<u8>, u32, u32) {
    let meta = fs::symlink_metadata(path).unwrap();
    (fs::read(path).unwrap(), meta.mode() & 0o7777, meta.uid())
}

/// Runs `f` on a thread; fails the test (instead of hanging the suite) if it does not
/// return promptly. A thread stuck in a FIFO open is left behind; the process ends it.
pub(super) fn promptly<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(PROMPTLY)
        .unwrap_or_else(|_| panic!("{what} did not return within {PROMPTLY:?}"))
}

pub(super) fn mkfifo(path: &Path) {
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        path,
        rustix::fs::Mode::from_raw_mode(0o666),
    )
    .unwrap();
}

pub(super) fn assert_names(message: &str, name: &str, what: &str) {
    assert!(
        message.contains(name),
        "error does not name {name}: {message}"
    );
    assert!(
        message.contains(what),
        "error does not say {what:?}: {message}"
    );
}

#[test]
fn lock_never_follows_a_symlinked_genv_lock() {
    let scratch = Scratch::new();
    let target = scratch.target("ld.so.preload", "/lib/root-only.so\n", 0o644);
    let before = snapshot(&target);
    symlink(&target, scratch.in_state("genv.lock")).unwrap();

    let error = scratch.dir().lock().unwrap_err().to_string();

    assert_names(&error, "genv.lock", "symbolic link");
    assert_eq!(snapshot(&target), before, "the link's target was changed");
}

#[test]
fn lock_never_creates_the_target_of_a_dangling_symlink() {
    let scratch = Scratch::new();
    let target = scratch.private.join("created-by-root");
    symlink(&target, scratch.in_state("genv.lock")).unwrap();

    assert!(scratch.dir().lock().is_err());

    assert!(
        !target.exists(),
        "the enforcer created {}",
        target.display()
    );
}

#[test]
fn a_symlinked_state_directory_is_refused() {
    let scratch = Scratch::new();
    let linked = scratch.base.join("linked-genv");
    symlink(&scratch.private, &linked).unwrap();
    fs::write(
        scratch.private.join("envs.json"),
        json!({"envs": []}).to_string(),
    )
    .unwrap();
    let dir = StateDir::new(&linked);

    let error = dir.lock().unwrap_err().to_string();
    assert_names(&error, "linked-genv", "symbolic link");
    assert!(!scratch.private.join("genv.lock").exists());

    let error = dir.load_envs().unwrap_err().to_string();
    assert_names(&error, "linked-genv", "symbolic link");
}

#[test]
fn lock_keeps_an_existing_lock_files_content() {
    let scratch = Scratch::new();
    fs::write(scratch.in_state("genv.lock"), "written by someone\n").unwrap();

    drop(scratch.dir().lock().unwrap());

    assert_eq!(
        fs::read_to_string(scratch.in_state("genv.lock")).unwrap(),
        "written by someone\n"
    );
}

#[test]
fn lock_gives_genvs_mode_to_a_file_it_creates() {
    let scratch = Scratch::new();

    drop(scratch.dir().lock().unwrap());

    let meta = fs::metadata(scratch.in_state("genv.lock")).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o666);
}

#[test]
fn lock_leaves_the_mode_of_an_existing_file_alone() {
    let scratch = Scratch::new();
    let ours = scratch.target("ours", "", 0o600);
    fs::rename(&ours, scratch.in_state("genv.lock")).unwrap();

    drop(scratch.dir().lock().unwrap());

    assert_eq!(
        snapshot(&scratch.in_state("genv.lock")).1,
        0o600,
        "chmod of a lock file this call did not create"
    );
}

#[test]
fn lock_leaves_another_users_file_as_it_is() {
    let scratch = Scratch::new();
    let path = scratch.in_state("genv.lock");
    fs::write(&path, "theirs\n").unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&path, Some(NOBODY), Some(NOBODY)).unwrap();
    let before = snapshot(&path);

    drop(scratch.dir().lock().unwrap());

    assert_eq!(snapshot(&path), before);
}

#[test]
fn a_fifo_genv_lock_is_refused_promptly() {
    let scratch = Scratch::new();
    mkfifo(&scratch.in_state("genv.lock"));
    let dir = scratch.dir();

    let result = promptly("taking a FIFO lock", move || {
        dir.lock().map(drop).map_err(|e| e.to_string())
    });

    assert_names(&result.unwrap_err(), "genv.lock", "FIFO");
}
