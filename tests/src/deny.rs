//! `--deny`'s tests' node, and what they check of an open: two environments on two
//! GPUs (alice's and bob's), a daemon denying at the open, an attempt by a helper
//! process, and the outcomes a tier may give (refused, or killed inside the syscall).

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::events::{EventDaemon, holders_of, make_gpu_node, make_gpu_node_for, tier_refuses};
use crate::{DEATH, Node, device_record, env_record};

pub const ALICE: u32 = 64_101;
pub const BOB: u32 = 64_102;
/// A user with no environment. (Root outside environments is let through unless
/// --deny-root: see `each_tier_root_is_left_to_the_userspace_rules_unless_deny_root`.)
pub const OUTSIDER: u32 = 64_103;

/// A node with two GPUs, test nodes for both (reachable by every uid), and two
/// environments: `alice-env` (uid ALICE) on GPU 0 and `bob-env` (uid BOB) on GPU 1.
pub fn node() -> (Node, [PathBuf; 2]) {
    let mut node = Node::new(2);
    set_mode(&node.dir, 0o755);
    let gpus = [
        make_gpu_node(&node.dir.join("nvidia0")),
        make_gpu_node_for(&node.dir.join("nvidia1"), 1),
    ];
    let (alice_shell, bob_shell) = (node.shell(), node.shell());
    node.write_state(
        json!([
            env_record("alice-env", ALICE, "alice", None, alice_shell),
            env_record("bob-env", BOB, "bob", None, bob_shell),
        ]),
        json!([
            device_record(0, &["alice-env"]),
            device_record(1, &["bob-env"])
        ]),
    );
    (node, gpus)
}

pub fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
}

pub fn deny(node: &Node, extra: &[&str]) -> Option<EventDaemon> {
    let mut args = vec!["--non-env-processes", "--deny"];
    args.extend_from_slice(extra);
    let daemon = EventDaemon::start(node, &args)?;
    daemon.expect("GPU opens outside any environment are ");
    Some(daemon)
}

/// Starts a helper that waits, then lets it open; what it printed.
pub fn attempt(
    node: &mut Node,
    eid: Option<&str>,
    uid: Option<u32>,
    args: &[&str],
) -> (u32, Vec<String>) {
    let mut all = vec!["--wait-stdin"];
    all.extend_from_slice(args);
    let pid = node.spawn_with(eid, &[], &all, uid);
    (pid, node.attempt(pid))
}

/// The kernel prevented every open `pid` made: EPERM on the refusing tiers (and the
/// process lives on), killed inside the syscall elsewhere (no open ever returned to it).
pub fn assert_prevented(
    node: &mut Node,
    daemon: &EventDaemon,
    pid: u32,
    lines: &[String],
    how: &str,
) {
    // Not opens of the node for use: an O_PATH descriptor (which cannot reach the
    // driver; the /proc/self/fd way in starts with one) and the directory of openat.
    let lines: Vec<String> = lines
        .iter()
        .filter(|l| !l.starts_with("returned ok O_PATH") && !l.starts_with("returned ok open dir"))
        .cloned()
        .collect();
    if tier_refuses(&daemon.tier) {
        assert!(
            !lines.is_empty() && lines.iter().all(|l| !l.starts_with("returned ok")),
            "{how}: an open succeeded: {lines:?}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("returned EPERM")),
            "{how}: {lines:?}"
        );
        daemon.expect(&format!("Refused process {pid} of user "));
        assert!(node.alive(pid), "{how}: a refused process is left running");
    } else {
        assert!(
            lines.iter().all(|l| !l.starts_with("returned")),
            "{how}: an open returned to the process: {lines:?}"
        );
        assert_eq!(node.wait_exit(pid, DEATH), Some(libc::SIGKILL), "{how}");
        daemon.expect(&format!("Killed process {pid} of user "));
    }
}

/// No process outside both environments of [`node`] holds either test GPU node: an
/// environment counts only with the uid that owns it (or root's), as the kernel judges.
pub fn assert_no_outsider_holds(gpus: &[PathBuf], how: &str) {
    for gpu in gpus {
        let outsiders: Vec<_> = holders_of(gpu)
            .into_iter()
            .filter(|h| match h.eid.as_deref() {
                Some("alice-env") => h.uid != ALICE && h.uid != 0,
                Some("bob-env") => h.uid != BOB && h.uid != 0,
                _ => true,
            })
            .collect();
        assert!(
            outsiders.is_empty(),
            "{how}: {} is held outside any environment by {outsiders:?}",
            gpu.display()
        );
    }
}

/// Every open returned to the process, none refused, and it still runs.
pub fn assert_untouched(node: &mut Node, pid: u32, lines: &[String], opens: usize, how: &str) {
    let returned: Vec<&String> = lines.iter().filter(|l| l.starts_with("returned")).collect();
    assert_eq!(returned.len(), opens, "{how}: {lines:?}");
    assert!(
        returned.iter().all(|l| !l.starts_with("returned EPERM")),
        "{how}: refused: {lines:?}"
    );
    assert_eq!(lines.last().map(String::as_str), Some("opened"), "{how}");
    assert!(node.alive(pid), "{how}: killed");
}
