//! genv's state directory is 0777 without the sticky bit, so any user can replace the
//! names in it. The root enforcer must never write, truncate or chmod what a planted
//! symbolic link points at, and must say which file it refused.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use genv_enforcer_tests::mounts::{self, SilentFuse};
use genv_enforcer_tests::{Daemon, Node, device_record, env_record, wait_until};
use serde_json::json;

/// The unprivileged user who plants the links.
const NOBODY: u32 = 65534;

/// genv's modes: the directory writable by every user, as genv creates it.
fn share(node: &Node) {
    std::fs::set_permissions(&node.state, std::fs::Permissions::from_mode(0o777)).unwrap();
}

/// A root-owned file in a root-only directory: what a hostile link would aim at
/// (`/etc/ld.so.preload`, `/etc/shadow`, ...).
fn root_only_file(node: &Node, text: &str) -> PathBuf {
    let dir = node.dir.join("root-only");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let file = dir.join("precious");
    std::fs::write(&file, text).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    file
}

/// Content, permission bits and owner.
fn snapshot(path: &Path) -> (String, u32, u32) {
    let meta = std::fs::metadata(path).unwrap();
    (
        std::fs::read_to_string(path).unwrap(),
        meta.mode() & 0o7777,
        meta.uid(),
    )
}

/// `ln -sfn TARGET STATE/NAME`, run as nobody: needs nothing but the directory's 0777.
fn plant_link_as_nobody(node: &Node, name: &str, target: &Path) {
    let mut command = Command::new("ln");
    std::os::unix::process::CommandExt::uid(&mut command, NOBODY);
    let status = command
        .arg("-sfn")
        .arg(target)
        .arg(node.state.join(name))
        .status()
        .unwrap();
    assert!(status.success(), "nobody could not plant {name}");
    let meta = std::fs::symlink_metadata(node.state.join(name)).unwrap();
    assert!(meta.file_type().is_symlink() && meta.uid() == NOBODY);
}

#[test]
fn a_genv_lock_symlinked_by_another_user_is_refused_and_its_target_untouched() {
    let mut node = Node::new(1);
    share(&node);
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let rogue = node.spawn(None, &[(0, 100)]);
    let target = root_only_file(&node, "/usr/lib/root-only.so\n");
    let before = snapshot(&target);
    plant_link_as_nobody(&node, "genv.lock", &target);

    let run = node.enforce_once(&["--non-env-processes"]);

    assert_eq!(snapshot(&target), before, "the link's target was changed");
    let lock = node.state.join("genv.lock");
    assert!(
        run.stderr
            .contains(&format!("{}: is a symbolic link", lock.display())),
        "the error must name genv.lock and say why: {}",
        run.stderr
    );
    assert!(
        run.stdout.is_empty(),
        "nothing may be enforced: {:?}",
        run.stdout
    );
    assert!(node.alive(rogue));
}

/// Generous: these machines are shared and noisy.
const PROMPTLY: Duration = Duration::from_secs(30);

/// The same link under a daemon: refused as a lock, as above, but enforcement goes on
/// from the state read without it, as when a user holds the lock (terminations go ahead,
/// detaches wait). Anyone can replace genv.lock; that must not switch the daemon off.
#[test]
fn a_daemon_enforces_on_when_genv_lock_is_refused() {
    let mut node = Node::new(1);
    share(&node);
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let target = root_only_file(&node, "");
    let before = snapshot(&target);
    plant_link_as_nobody(&node, "genv.lock", &target);

    let mut daemon = Daemon::start(&node, &["--interval", "0.2", "--non-env-processes"]);

    // Marker: a cycle terminated an outsider.
    let seen = node.mark_cycle(&daemon);
    let lock = node.state.join("genv.lock");
    let said = format!(
        "Cannot take genv's lock: {}: is a symbolic link",
        lock.display()
    );
    // Said once, on stderr, whose lines may arrive after stdout's.
    if !seen.iter().any(|l| l.contains(&said)) {
        daemon.expect_line(&said, PROMPTLY);
    }
    assert_eq!(snapshot(&target), before, "the link's target was changed");
    assert!(daemon.stop(PROMPTLY).is_some_and(|s| s.success()));
}

#[test]
fn a_devices_json_symlinked_by_another_user_is_never_rewritten() {
    let mut node = Node::new(2);
    share(&node);
    let shell = node.shell();
    // Over the limit: a detach is due, and would rewrite devices.json.
    node.write_state(
        json!([env_record("env-a", 0, "root", None, shell)]),
        json!([device_record(0, &["env-a"]), device_record(1, &["env-a"])]),
    );
    let devices = node.read_file("devices.json");
    let target = root_only_file(&node, &devices);
    let before = snapshot(&target);
    std::fs::remove_file(node.state.join("devices.json")).unwrap();
    plant_link_as_nobody(&node, "devices.json", &target);

    let run = node.enforce_once(&["--max-devices-per-user", "1"]);

    assert_eq!(snapshot(&target), before, "the link's target was rewritten");
    let path = node.state.join("devices.json");
    assert!(
        run.stderr.contains(&format!(
            "{}: cannot read: is a symbolic link",
            path.display()
        )),
        "the error must name devices.json and say why: {}",
        run.stderr
    );
    assert!(
        !run.stdout.iter().any(|l| l.starts_with("Detaching")),
        "{:?}",
        run.stdout
    );
}

/// The sticky bit (1777) would stop users replacing each other's files, and genv 1.4.3
/// keeps working with it where `fs.protected_regular` is 0. Where it is 1 or 2 (Debian's
/// and most systemd distributions' default), the kernel refuses `O_CREAT` on another
/// user's file in a sticky world-writable directory, even to root, and genv opens every
/// state file with `O_CREAT`: a second user's genv, and root's `genv enforce`, fail with
/// EACCES on genv.lock. The enforcer never opens an existing file with `O_CREAT`, so it
/// works in such a directory with every file another user's; this pins that down.
#[test]
fn works_in_a_sticky_state_directory_with_another_users_files() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", NOBODY, "nobody", None, shell)]),
        json!([device_record(0, &["env-a"]), device_record(1, &["env-a"])]),
    );
    std::fs::write(node.state.join("genv.lock"), "").unwrap();
    for name in ["envs.json", "devices.json", "genv.lock"] {
        let path = node.state.join(name);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        std::os::unix::fs::chown(&path, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    std::fs::set_permissions(&node.state, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let devices = node.state.join("devices.json");
    let inode = std::fs::metadata(&devices).unwrap().ino();
    let lock_before = snapshot(&node.state.join("genv.lock"));

    let run = node.enforce_once(&["--max-devices-per-user", "1"]);

    assert!(run.success, "{}", run.stderr);
    assert_eq!(
        run.stdout.last().map(String::as_str),
        Some("Detaching environment env-a of user nobody from device 0"),
        "{:?} {}",
        run.stdout,
        run.stderr
    );
    assert_eq!(node.attached("env-a"), [1]);
    let meta = std::fs::metadata(&devices).unwrap();
    assert_eq!(
        (meta.ino(), meta.uid(), meta.mode() & 0o7777),
        (inode, NOBODY, 0o666),
        "devices.json is rewritten in place, keeping its owner and mode"
    );
    assert_eq!(snapshot(&node.state.join("genv.lock")), lock_before);
}

/// A node whose environment env-a has a process on its attached GPU 0, and a polling
/// daemon, in a mount namespace of its own, past a cycle that read the state.
fn daemon_with_a_member() -> (Node, u32, Daemon) {
    let mut node = Node::new(1);
    share(&node);
    node.before_exec = Some(mounts::private_namespace(None));
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", 0, "root", None, shell)]),
        json!([device_record(0, &["env-a"])]),
    );
    let member = node.spawn(Some("env-a"), &[(0, 100)]);
    let daemon = Daemon::start(&node, &["--interval", "0.2", "--non-env-processes"]);
    // Marker: a cycle that read the state terminated an outsider.
    node.mark_cycle(&daemon);
    (node, member, daemon)
}

/// What a user's FUSE server can serve under `user_allow_other`: an envs.json of its
/// own. A forged file bind-mounted over the real one, in the daemon's namespace alone,
/// stands for it. The daemon refuses the mount, says so, and enforces from its last
/// good parse: env-a stays active (before, the forged file was believed, and env-a
/// taken for dropped by genv).
#[test]
fn a_forged_envs_json_mounted_over_the_real_one_is_refused() {
    let (mut node, member, mut daemon) = daemon_with_a_member();
    // No environments: env-a would be gone.
    let forged = root_only_file(&node, &json!({"envs": []}).to_string());
    let envs = node.state.join("envs.json");

    mounts::bind_in(daemon.pid(), &forged, &envs);

    let mut seen = daemon.expect_line(
        &format!("{}: cannot read: is a mount point of a ", envs.display()),
        PROMPTLY,
    );
    seen.extend(daemon.expect_line(
        "a state file is never a mount; enforcing from its last good contents (1 active environments)",
        PROMPTLY,
    ));
    // Marker: a later cycle, which judged env-a's process again, terminated an outsider.
    seen.extend(node.mark_cycle(&daemon));
    assert!(
        !seen.iter().any(|l| l.contains("genv dropped")),
        "the forged file was believed: {seen:#?}"
    );
    assert!(node.alive(member), "{seen:#?}");
    assert!(daemon.stop(PROMPTLY).is_some_and(|s| s.success()));
}

/// The worst case: a FUSE server that never answers, mounted over envs.json. Before, the
/// daemon's one thread waited in `open` for ever: no enforcement, and SIGTERM not
/// handled. Now the mount is refused unopened, cycles go on from the last good parse,
/// and SIGTERM stops the daemon.
#[test]
fn a_silent_fuse_envs_json_neither_stalls_the_daemon_nor_stops_enforcement() {
    let (mut node, member, mut daemon) = daemon_with_a_member();
    let envs = node.state.join("envs.json");
    // Declared after the daemon, so dropped first: closing the server frees a daemon
    // stuck on the mount, which can then be stopped and reaped whatever the outcome.
    let fuse = SilentFuse::new();

    fuse.mount_in(daemon.pid(), &envs);

    daemon.expect_line(
        &format!(
            "{}: cannot read: is a mount point of a FUSE file system (fuse.silent)",
            envs.display()
        ),
        PROMPTLY,
    );
    let seen = node.mark_cycle(&daemon);
    assert!(node.alive(member), "{seen:#?}");
    assert_stops_on_sigterm(&mut daemon);
}

/// `fusermount` mounts on the state directory itself (0777, not sticky). Its files and
/// genv.lock are then all the server's: every one is refused, and the daemon enforces
/// on from its last good parse, without the lock, and stops on SIGTERM.
#[test]
fn a_silent_fuse_state_directory_neither_stalls_the_daemon_nor_stops_enforcement() {
    let (mut node, member, mut daemon) = daemon_with_a_member();
    let fuse = SilentFuse::new();

    fuse.mount_in(daemon.pid(), &node.state);

    let fuse_dir = format!(
        "{}: is a mount point of a FUSE file system (fuse.silent)",
        node.state.display()
    );
    daemon.expect_line(&format!("Cannot take genv's lock: {fuse_dir}"), PROMPTLY);
    let seen = node.mark_cycle(&daemon);
    assert!(node.alive(member), "{seen:#?}");
    assert_stops_on_sigterm(&mut daemon);
}

/// The event-driven daemon also watches the state directory (inotify). Watching a path
/// asks a FUSE server mounted there for permission, and a silent one never gives it:
/// the watch must go on the directory as the state reads open it, which refuses FUSE.
/// Started with a silent FUSE file system over its state directory, the daemon says it
/// cannot watch it, keeps its status file fresh, and stops on SIGTERM. (With its kernel
/// programs or without: the watch is the same.)
#[test]
fn an_event_driven_daemon_under_a_silent_fuse_state_directory_stays_responsive() {
    let mut node = Node::new(1);
    share(&node);
    node.write_state(json!([]), json!([device_record(0, &[])]));
    let fuse = SilentFuse::new();
    node.before_exec = Some(mounts::private_namespace(Some((&fuse, &node.state))));
    let run_dir = node.dir.join("run");
    let args = ["--event-driven", "--interval", "3600", "--run-dir"];
    let mut daemon = Daemon::start(&node, &[&args[..], &[run_dir.to_str().unwrap()]].concat());
    // Dropped before the daemon: closing the server frees a daemon stuck on the mount.
    let _fuse = fuse;

    daemon.expect_line(
        &format!(
            "Cannot watch {} (cannot read: is a mount point of a FUSE file system (fuse.silent)",
            node.state.display()
        ),
        PROMPTLY,
    );
    let updated = || {
        let text = std::fs::read_to_string(run_dir.join("status.json")).unwrap();
        let status: serde_json::Value = serde_json::from_str(&text).unwrap();
        status["updated"].as_u64().unwrap()
    };
    let first = updated();
    wait_until("status.json updated", PROMPTLY, || updated() > first);
    assert_stops_on_sigterm(&mut daemon);
}

/// SIGTERM still stops the daemon, promptly and cleanly.
fn assert_stops_on_sigterm(daemon: &mut Daemon) {
    let status = daemon.stop(PROMPTLY);
    assert!(
        status.is_some_and(|s| s.success()),
        "the daemon must stop on SIGTERM: {status:?}"
    );
}
