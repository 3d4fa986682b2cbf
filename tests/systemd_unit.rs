//! The unit under a real systemd, as PID 1: `cargo xtask vm-test --systemd` boots the
//! VM with systemd as its init and runs this suite there (`cargo xtask test` does, after
//! the tier suites). Its test is ignored elsewhere: it installs genv-enforcer into `/`,
//! starts and kills the machine's service, and needs systemd to be the machine's init.
//!
//! What it shows: the `.deb` (`cargo xtask dist`, installed with `apt install ./…deb`, as
//! docs/install.md says) leaves the unit disabled; enabled by the admin, it stays enabled
//! over an upgrade to a newer package (the `dist` suite runs the postinst's other cases
//! on the host). systemd starts the unit (`Type=notify`: `systemctl start` returns once the
//! daemon is ready); a `kill -9` of the daemon is
//! followed by systemd's restart, and all along, an outsider's attempts to open a GPU,
//! one after the other, are refused by the programs the killed daemon pinned (with
//! `deny` and `keep-pinned`), including every attempt between the kill and the new
//! daemon's readiness, and through a `systemctl reload` that puts an edited
//! configuration in force in the same process with the same pins; a stop leaves them
//! deciding; `dpkg -r` stops the service and removes the pins, after which the attempts
//! reach the device again; `dpkg --purge` leaves none of the paths the package owned,
//! nor its configuration, enablement or runtime directory.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use genv_enforcer_tests::events::{make_gpu_node, requested_tier, test_node_flags, tier_refuses};
use genv_enforcer_tests::pins::generations;
use genv_enforcer_tests::{Node, artefact, device_record, env_record, wait_for_or};
use serde_json::json;

const UNIT: &str = "genv-enforcer";
const DROP_IN: &str = "/etc/systemd/system/genv-enforcer.service.d/test-node.conf";
const CONFIG: &str = "/etc/genv-enforcer/config.toml";
const PINS: &str = "/sys/fs/bpf/genv-enforcer";
/// The link `systemctl enable` makes (the unit's `WantedBy=multi-user.target`).
const WANTS: &str = "/etc/systemd/system/multi-user.target.wants/genv-enforcer.service";
const ALICE: u32 = 64_101;
const OUTSIDER: u32 = 64_103;

fn command(program: &str, args: &[&str]) -> String {
    let output = Command::new(program).args(args).output().unwrap();
    let said = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{program} {args:?}: {said}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    said
}

fn systemctl(args: &[&str]) -> String {
    command("systemctl", args)
}

/// The unit's properties systemd reports.
fn show() -> HashMap<String, String> {
    let props = "MainPID,ActiveState,SubState,NRestarts,ActiveEnterTimestampMonotonic";
    systemctl(&["show", "-p", props, UNIT])
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// `genv-enforcer status`'s file, where the unit's RuntimeDirectory puts it.
fn status() -> serde_json::Value {
    let text = std::fs::read_to_string("/run/genv-enforcer/status.json").unwrap();
    serde_json::from_str(&text).unwrap()
}

/// What the unit's daemons logged (stdout and stderr, through journald).
fn journal() -> String {
    command("journalctl", &["-u", UNIT, "-o", "cat", "--no-pager"])
}

fn monotonic_us() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    assert_eq!(
        // SAFETY: `now` is a live `timespec` for the call to write.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) },
        0
    );
    now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000
}

fn dpkg(args: &[&str]) -> String {
    command("dpkg", args)
}

/// The `.deb` `cargo xtask vm-test --systemd` built (`cargo xtask dist`) before booting.
fn deb() -> String {
    let deb = std::env::var("GENV_TEST_DEB")
        .expect("GENV_TEST_DEB names the .deb (cargo xtask vm-test --systemd sets it)");
    assert!(Path::new(&deb).is_file(), "{deb} is missing");
    deb
}

/// `apt install ./…deb`, as docs/install.md says: apt-get, unattended and offline, with
/// a configuration of its own in `dir` (`APT_CONFIG`). The dependencies are installed,
/// so no package list is read; nor is the host's `apt.conf.d`, whose hooks are the
/// host's, not the package's (PackageKit's has D-Bus start PackageKit and polkit, which
/// under TCG cost more than the install).
fn apt_install(deb: &str, dir: &Path) {
    // man-db's trigger re-indexes every manual page on the machine once a package ships
    // some (this one does): about 100 s of TCG per install. Its switch is this file; the
    // package's pages are checked by the dist suite, with man itself.
    match std::fs::remove_file("/var/lib/man-db/auto-update") {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            panic!("turning man-db's trigger off in the guest: {e}")
        }
        _ => {}
    }
    // dpkg's fsync of every file it unpacks is what a guest under TCG on 9p pays most
    // for, and a throwaway guest needs none of it (`--force-unsafe-io`).
    let config = dir.join("apt.conf");
    std::fs::write(
        &config,
        "Dir::Etc::Parts \"/dev/null\";\n\
         Dir::Etc::SourceList \"/dev/null\";\n\
         Dir::Etc::SourceParts \"/dev/null\";\n\
         Dir::Cache::pkgcache \"\";\n\
         Dir::Cache::srcpkgcache \"\";\n\
         DPkg::Options { \"--force-unsafe-io\"; };\n",
    )
    .unwrap();
    let output = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .arg(deb)
        .env("APT_CONFIG", &config)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "apt-get install {deb}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `systemctl is-enabled`'s answer (it exits 1 for `disabled`).
fn is_enabled() -> String {
    let output = Command::new("systemctl")
        .args(["is-enabled", UNIT])
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

fn assert_disabled(when: &str) {
    assert!(
        Path::new(WANTS).symlink_metadata().is_err(),
        "{when}: {WANTS} is there"
    );
    assert_eq!(is_enabled(), "disabled", "{when}");
}

/// `deb` at a newer version (`<version>+rebuilt1`), in `dir`: what an upgrade installs.
/// gzip -1, not xz: quicker under TCG.
fn rebuilt(deb: &str, dir: &Path) -> String {
    let tree = dir.join("rebuilt");
    let tree_arg = tree.to_str().unwrap();
    command("dpkg-deb", &["-R", deb, tree_arg]);
    let control = tree.join("DEBIAN/control");
    let text = std::fs::read_to_string(&control).unwrap();
    let version = (text.lines().find_map(|l| l.strip_prefix("Version: "))).unwrap();
    let text = text.replacen(
        &format!("\nVersion: {version}\n"),
        &format!("\nVersion: {version}+rebuilt1\n"),
        1,
    );
    std::fs::write(&control, text).unwrap();
    let to = dir.join(format!("genv-enforcer_{version}+rebuilt1_amd64.deb"));
    let to_arg = to.to_str().unwrap();
    command(
        "dpkg-deb",
        &[
            "--root-owner-group",
            "-Zgzip",
            "-z1",
            "-b",
            tree_arg,
            to_arg,
        ],
    );
    std::fs::remove_dir_all(&tree).unwrap();
    to_arg.to_owned()
}

/// Installed as a node installs it: the unit is left disabled (the configuration comes
/// first); enabled as an admin would, it stays enabled over an upgrade to a newer
/// package. What each step took is said: under TCG, every package operation runs
/// systemd's `daemon-reload` and deb-systemd-helper (Perl), seconds each.
fn installed_disabled_then_kept_enabled(deb: &str, dir: &Path) {
    let mut took = vec![];
    let mut step = |what: &'static str, started: Instant| {
        took.push(format!("{what} {} ms", started.elapsed().as_millis()));
        Instant::now()
    };
    let at = Instant::now();
    apt_install(deb, dir);
    assert_disabled("after the first install");
    let at = step("apt install", at);
    systemctl(&["enable", UNIT]);
    assert_eq!(is_enabled(), "enabled");
    let at = step("enable", at);
    let newer = rebuilt(deb, dir);
    let at = step("a newer package", at);
    apt_install(&newer, dir);
    assert_eq!(
        is_enabled(),
        "enabled",
        "after an upgrade, the unit the admin enabled"
    );
    assert!(
        Path::new(WANTS).is_symlink(),
        "after an upgrade: no {WANTS}"
    );
    step("its apt install", at);
    let status = dpkg(&["-s", "genv-enforcer"]);
    assert!(status.contains("+rebuilt1\n"), "not upgraded: {status}");
    eprintln!("[systemd] installed, then upgraded: {}", took.join(", "));
}

/// Every path the `.deb` holds (`dpkg-deb -c`), and whether it was there before.
fn deb_paths(deb: &str) -> Vec<(String, bool)> {
    let listing = command("dpkg-deb", &["-c", deb]);
    (listing.lines())
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(|p| {
            let p = p.trim_start_matches('.').trim_end_matches('/');
            let p = if p.is_empty() { "/" } else { p };
            (p.to_owned(), Path::new(p).symlink_metadata().is_ok())
        })
        .collect()
}

/// After `dpkg --purge`: none of the paths the package owned that were not there
/// before it (`/usr/lib/genv-enforcer`, ...) is left; nor anything its scripts or the
/// unit made.
fn assert_purged(paths: &[(String, bool)]) {
    let mut left: Vec<String> = (paths.iter())
        .filter(|(path, before)| !before && Path::new(path).symlink_metadata().is_ok())
        .map(|(path, _)| path.clone())
        .collect();
    for path in [
        "/etc/genv-enforcer",
        "/run/genv-enforcer",
        PINS,
        "/etc/systemd/system/genv-enforcer.service",
        WANTS,
        "/var/lib/systemd/deb-systemd-helper-enabled/genv-enforcer.service.dsh-also",
        "/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/genv-enforcer.service",
        "/var/lib/systemd/deb-systemd-helper-masked/genv-enforcer.service",
    ] {
        if Path::new(path).symlink_metadata().is_ok() {
            left.push(path.to_owned());
        }
    }
    assert!(left.is_empty(), "dpkg --purge left {left:#?}");
    let status = Command::new("dpkg")
        .args(["-s", "genv-enforcer"])
        .output()
        .unwrap();
    assert!(!status.status.success(), "dpkg still knows genv-enforcer");
}

/// The node's configuration as an admin would write it: the flags in the config file,
/// where genv's state and NVML are in a drop-in.
fn configure(node: &Node) {
    let [gpu0, gpu1] = test_node_flags();
    std::fs::write(
        CONFIG,
        format!(
            "event-driven = true\nnon-env-processes = true\ndeny = true\nkeep-pinned = true\n\
             verbose = true\nbpf-tier = \"{}\"\ngpu-node = [\"{gpu0}\", \"{gpu1}\"]\n",
            requested_tier()
        ),
    )
    .unwrap();
    // The guest's /etc is the host's under an overlay: no drop-in of the host's applies.
    let drop_ins = Path::new(DROP_IN).parent().unwrap();
    let _ = std::fs::remove_dir_all(drop_ins);
    std::fs::create_dir_all(drop_ins).unwrap();
    std::fs::write(
        DROP_IN,
        format!(
            "[Service]\nEnvironment=GENV_TMPDIR={} GENV_FAKE_NVML_CONFIG={} GENV_ENFORCER_NVML_LIB={}\n",
            node.state.display(),
            node.config_path().display(),
            artefact("libnvidia_ml_fake.so").display()
        ),
    )
    .unwrap();
    systemctl(&["daemon-reload"]);
}

/// An outsider opening `gpu` over and over until told to stop; every attempt it made.
struct Attempts {
    stop: PathBuf,
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Every attempt reported so far, in order: none is dropped unchecked.
    seen: Vec<Attempt>,
}

/// One attempt: when it started and ended (CLOCK_MONOTONIC, µs), and what became of it.
struct Attempt {
    start: u64,
    end: u64,
    outcome: String,
}

impl Attempts {
    fn start(dir: &Path, gpu: &Path) -> Self {
        static NTH: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let nth = NTH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let stop = dir.join(format!("stop-attempts-{nth}"));
        let mut command = Command::new(artefact("gpu-process"));
        std::os::unix::process::CommandExt::uid(&mut command, OUTSIDER);
        let mut child = command
            .arg("--attempts-until")
            .arg(&stop)
            .arg(gpu)
            .env_remove("GENV_ENVIRONMENT_ID")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Self {
            stop,
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits until `count` attempts that started from now on have ended.
    fn wait_for(&mut self, count: usize) {
        let since = monotonic_us();
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.seen.iter().filter(|a| a.start >= since).count() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = (self.lines.recv_timeout(left))
                .unwrap_or_else(|_| panic!("{count} attempts did not end within 60 s"));
            self.seen.push(parse(&line));
        }
    }

    /// Stops the loop; every attempt it made.
    fn finish(mut self) -> Vec<Attempt> {
        std::fs::write(&self.stop, "").unwrap();
        assert!(self.child.wait().unwrap().success());
        let rest = self.lines.iter().filter(|l| l.starts_with("attempt "));
        self.seen.extend(rest.map(|l| parse(&l)));
        self.seen
    }
}

fn parse(line: &str) -> Attempt {
    let words: Vec<&str> = line.split(' ').collect();
    let ["attempt", start, end, outcome] = words[..] else {
        panic!("unexpected line from the attempt loop: {line:?}");
    };
    Attempt {
        start: start.parse().unwrap(),
        end: end.parse().unwrap(),
        outcome: outcome.to_owned(),
    }
}

/// An open that got through to the device: a descriptor, or the driver's ENXIO (no
/// driver behind a test node).
fn reached(attempt: &Attempt) -> bool {
    matches!(attempt.outcome.as_str(), "ok" | "enxio")
}

/// What the kernel makes of an outsider's open on this tier: EPERM where it refuses
/// (LSM, fmod_ret), a SIGKILL inside the call elsewhere.
fn refusal() -> &'static str {
    if tier_refuses(&requested_tier()) {
        "eperm"
    } else {
        "killed"
    }
}

fn assert_refused(attempts: &[Attempt], when: &str) {
    let refusal = refusal();
    let other: Vec<(u64, &str)> = (attempts.iter())
        .filter(|a| a.outcome != refusal)
        .map(|a| (a.start, a.outcome.as_str()))
        .collect();
    assert!(
        !attempts.is_empty() && other.is_empty(),
        "{when}: {} of {} attempts were not refused ({refusal}), the first ones (start µs, \
         outcome): {:?}",
        other.len(),
        attempts.len(),
        &other[..other.len().min(10)]
    );
}

#[test]
#[ignore = "needs systemd as the machine's init: cargo xtask vm-test --systemd runs it"]
fn the_unit_restarts_a_killed_daemon_and_its_pinned_programs_guard_the_gap() {
    let init = std::fs::read_to_string("/proc/1/comm").unwrap_or_default();
    assert!(
        init.trim() == "systemd" && Path::new("/run/systemd/system").is_dir(),
        "this machine's init is {init:?}, not systemd: run it with cargo xtask vm-test --systemd"
    );
    let (mut node, gpu) = alices_node();
    let paths = deb_paths(&deb());
    assert!(
        paths.iter().any(|(p, _)| p == "/usr/bin/genv-enforcer"),
        "{paths:?}"
    );
    installed_disabled_then_kept_enabled(&deb(), &node.dir);
    configure(&node);

    // Type=notify: `systemctl start` returns once the daemon said READY.
    systemctl(&["start", UNIT]);
    let first = show();
    assert_eq!(first["ActiveState"], "active", "{first:?}");
    let first_pid: i32 = first["MainPID"].parse().unwrap();
    assert!(first_pid > 1, "{first:?}");
    assert_eq!(status()["pid"], first_pid, "{}", status());
    let pinned = generations(Path::new(PINS));
    assert_eq!(pinned.len(), 1, "{pinned:?}");

    // An environment's process is let through (ENXIO: no driver behind a test node).
    let open = ["--wait-stdin", "--open", gpu.to_str().unwrap()];
    let worker = node.spawn_with(Some("alice-env"), &[], &open, Some(ALICE));
    let said = node.attempt(worker);
    assert!(
        said.iter().any(|l| l.starts_with("returned ENXIO")),
        "alice-env's open: {said:?}"
    );

    // The outsider keeps trying; the daemon is killed under it, restarted, reloaded.
    let mut attempts = Attempts::start(&node.dir, &gpu);
    attempts.wait_for(3);
    let (second, killed_at) = killed_and_restarted(&first, first_pid);
    let ready_at: u64 = second["ActiveEnterTimestampMonotonic"].parse().unwrap();
    attempts.wait_for(3);
    reloaded_in_place(&second);
    attempts.wait_for(3);
    let all = attempts.finish();
    assert_refused(
        &all,
        "before the kill, through the restart and the reload, after",
    );
    say_the_gap(&all, killed_at, ready_at);
    took_over(&second["MainPID"], &pinned);

    // Stopped: the pins go on deciding.
    systemctl(&["stop", UNIT]);
    let mut attempts = Attempts::start(&node.dir, &gpu);
    attempts.wait_for(3);
    assert_refused(&attempts.finish(), "the service stopped");
    removed_then_purged(&node, &gpu, &paths);
}

/// A node with two GPUs (a test node for the first, reachable by every uid) and
/// alice's environment on GPU 0; the node and that GPU's node.
fn alices_node() -> (Node, PathBuf) {
    let mut node = Node::new(2);
    std::fs::set_permissions(
        &node.dir,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let gpu = make_gpu_node(&node.dir.join("nvidia0"));
    let alice_shell = node.shell();
    node.write_state(
        json!([env_record("alice-env", ALICE, "alice", None, alice_shell)]),
        json!([device_record(0, &["alice-env"]), device_record(1, &[])]),
    );
    (node, gpu)
}

/// SIGKILL to the unit's daemon (`first`, pid `first_pid`); systemd restarts it once.
/// The restarted unit's properties, and when the kill was sent (CLOCK_MONOTONIC, µs).
fn killed_and_restarted(
    first: &HashMap<String, String>,
    first_pid: i32,
) -> (HashMap<String, String>, u64) {
    let killed_at = monotonic_us();
    // SAFETY: kill(2) takes no pointer; the pid is the unit's daemon, which this test
    // started.
    assert_eq!(unsafe { libc::kill(first_pid, libc::SIGKILL) }, 0);
    let second = wait_for_or(
        "systemd to restart the killed daemon",
        Duration::from_secs(180),
        || {
            let now = show();
            let restarted = now["MainPID"] != first["MainPID"]
                && now["MainPID"] != "0"
                && now["ActiveState"] == "active";
            restarted.then_some(now)
        },
        || format!("{:?}", show()),
    );
    let ready_at: u64 = second["ActiveEnterTimestampMonotonic"].parse().unwrap();
    assert_eq!(second["NRestarts"], "1", "{second:?}");
    assert!(ready_at > killed_at, "{second:?}");
    (second, killed_at)
}

/// `systemctl reload` (SIGHUP): the edited file in force, same process, same pins.
fn reloaded_in_place(running: &HashMap<String, String>) {
    let pinned_now = generations(Path::new(PINS));
    let mut config = std::fs::read_to_string(CONFIG).unwrap();
    config.push_str("interval = 7\n");
    std::fs::write(CONFIG, config).unwrap();
    systemctl(&["reload", UNIT]);
    wait_for_or(
        "the reload said in the journal",
        Duration::from_secs(60),
        || {
            journal()
                .contains("SIGHUP: settings read again and in force")
                .then_some(())
        },
        journal,
    );
    wait_for_or(
        "the status after the reload",
        Duration::from_secs(60),
        || (status()["interval_s"] == 7.0).then_some(()),
        || status().to_string(),
    );
    assert_eq!(show()["MainPID"], running["MainPID"]);
    assert_eq!(
        generations(Path::new(PINS)),
        pinned_now,
        "a reload re-pinned the programs"
    );
}

/// The attempts between the kill and the restarted daemon's READY, said (none reached
/// the GPU: `assert_refused` saw all of them); there must be some.
fn say_the_gap(all: &[Attempt], killed_at: u64, ready_at: u64) {
    let gap: Vec<&Attempt> = (all.iter())
        .filter(|a| a.start >= killed_at && a.end <= ready_at)
        .collect();
    eprintln!(
        "[systemd] kill -9 to the restarted daemon's READY: {} ms; {} attempts in that gap, \
         {} in all, none reached the GPU ({} tier: {})",
        (ready_at - killed_at) / 1000,
        gap.len(),
        all.len(),
        requested_tier(),
        gap.iter()
            .map(|a| a.outcome.as_str())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(
        !gap.is_empty(),
        "no attempt fell between the kill and the restart"
    );
}

/// The restarted daemon (`pid`) took over from the killed one's pins (`pinned`) and
/// pinned its own.
fn took_over(pid: &str, pinned: &[PathBuf]) {
    let said = command(
        "journalctl",
        &["-b", &format!("_PID={pid}"), "-o", "cat", "--no-pager"],
    );
    assert!(
        said.contains("Took over from an earlier run's pinned programs"),
        "the restarted daemon ({pid}) said: {said}"
    );
    let now = generations(Path::new(PINS));
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now, pinned, "the new daemon pins its own programs");
}

/// Removed: stopped, unpinned, the device reached again; purged: the edited
/// configuration too, and every trace of `paths`.
fn removed_then_purged(node: &Node, gpu: &Path, paths: &[(String, bool)]) {
    dpkg(&["-r", "genv-enforcer"]);
    assert!(!Path::new(PINS).exists(), "dpkg -r left {PINS}");
    assert!(!Path::new("/usr/bin/genv-enforcer").exists());
    assert_eq!(show()["ActiveState"], "inactive");
    let mut attempts = Attempts::start(&node.dir, gpu);
    attempts.wait_for(3);
    let after = attempts.finish();
    assert!(
        after.iter().all(reached),
        "nothing decides after dpkg -r, yet: {:?}",
        after.iter().map(|a| &a.outcome).collect::<Vec<_>>()
    );
    // The test's drop-in is the test's, not the package's.
    std::fs::remove_dir_all(Path::new(DROP_IN).parent().unwrap()).unwrap();
    assert!(
        Path::new(CONFIG).exists(),
        "dpkg -r removed the configuration"
    );
    dpkg(&["--purge", "genv-enforcer"]);
    systemctl(&["daemon-reload"]);
    assert_purged(paths);
    let enabled = Command::new("systemctl")
        .args(["is-enabled", UNIT])
        .output()
        .unwrap();
    assert!(!enabled.status.success(), "still enabled after the purge");
}
