//! genv-enforcer as a node's service: `cargo xtask install` lays down the binary, the
//! `genv` front and the systemd unit; the front sends `genv enforce` to genv-enforcer
//! and every other `genv` command to the real genv 1.4.3; the daemon runs with exactly
//! the capabilities the unit gives it (`setpriv`, its bounding set), on the tracepoint
//! tier here.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::events::{self, EventDaemon};
use genv_enforcer_tests::metrics::{free_local_addr, scrape_within};
use genv_enforcer_tests::pins::Pins;
use genv_enforcer_tests::{Daemon, Genv, Node, artefact, wait_for_or};

fn xtask(args: &[&str], root: &Path) {
    let status = genv_enforcer_tests::xtask()
        .args(args)
        .arg("--root")
        .arg(root)
        .status()
        .unwrap();
    assert!(status.success(), "xtask {args:?} failed");
}

fn install(node: &Node) -> PathBuf {
    let root = node.dir.join("root");
    let binary = artefact("genv-enforcer");
    // The front runs the binary where this install put it (by default it names the
    // node's /usr/local/bin/genv-enforcer, whatever --root is).
    let installed = root.join("usr/local/bin/genv-enforcer");
    xtask(
        &[
            "install",
            "--binary",
            binary.to_str().unwrap(),
            "--enforcer-path",
            installed.to_str().unwrap(),
        ],
        &root,
    );
    root
}

/// The unit's `CapabilityBoundingSet`, as `setpriv --bounding-set` takes it.
fn unit_capabilities(root: &Path) -> String {
    let unit =
        std::fs::read_to_string(root.join("etc/systemd/system/genv-enforcer.service")).unwrap();
    let caps = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit names its capabilities");
    let caps: Vec<String> = caps
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    format!("-all,{}", caps.join(","))
}

/// A script that runs `program` with the bounding set `bounding` (`setpriv`'s form) and
/// nothing inheritable: root with those capabilities alone.
fn with_capabilities(node: &Node, bounding: &str, program: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = node.dir.join("with-capabilities");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nexec setpriv --bounding-set={bounding} --inh-caps=-all {} \"$@\"\n",
            program.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// PATH with the installed front first, then the installed binary, then genv's own.
fn front_path(root: &Path) -> String {
    format!(
        "{}:{}:{}",
        root.join("usr/local/lib/genv-enforcer/front").display(),
        root.join("usr/local/bin").display(),
        Genv::get().path()
    )
}

fn bash(node: &Node, path: &str, script: &str) -> (bool, String, String) {
    let out = Command::new("bash")
        .args([
            "-c",
            &format!("set -e; eval \"$(genv shell --init)\"; {script}"),
        ])
        .env("PATH", path)
        .env("GENV_TMPDIR", &node.state)
        .env("GENV_FAKE_NVML_CONFIG", node.config_path())
        .env("GENV_ENFORCER_NVML_LIB", artefact("libnvidia_ml_fake.so"))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn genv_enforce_event_driven_runs_through_the_front_beside_genvs_own_commands() {
    let mut node = Node::new(2);
    let root = install(&node);
    let path = front_path(&root);
    // The daemon as the unit starts it: `genv enforce …` through the front, with the
    // unit's capabilities and no others.
    node.enforcer_binary = Some(with_capabilities(
        &node,
        &unit_capabilities(&root),
        &root.join("usr/local/lib/genv-enforcer/front/genv"),
    ));
    node.enforcer_env.push(("PATH".into(), path.clone()));
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes"]) else {
        return;
    };
    let status = std::fs::read_to_string(daemon.run_dir.join("status.json")).unwrap();
    assert!(status.contains("\"pid\""), "{status}");

    // genv's own commands, through the front, in one shell: genv answers them.
    let (ok, stdout, stderr) = bash(
        &node,
        &path,
        "genv activate --id e1 --no-prompt; genv attach --index 0; genv devices",
    );
    assert!(ok, "{stderr}");
    let attached = stdout
        .lines()
        .find(|l| l.starts_with("0 "))
        .unwrap_or_default();
    assert!(attached.contains("e1"), "genv devices: {stdout}");

    // `genv usage` goes to genv-enforcer only when asked (GENV_FRONT_USAGE=1): only
    // genv-enforcer's takes --nvml-lib.
    let fake = artefact("libnvidia_ml_fake.so");
    let usage = |asked: &str| {
        let script = format!(
            "GENV_FRONT_USAGE={asked} genv usage snapshot --type devices --nvml-lib {}",
            fake.display()
        );
        bash(&node, &path, &script)
    };
    let (ok, stdout, stderr) = usage("1");
    assert!(ok && stdout.contains("\"devices\""), "{stdout}{stderr}");
    let (ok, _, stderr) = usage("0");
    assert!(
        !ok && stderr.contains("unrecognized arguments"),
        "genv's own: {stderr}"
    );

    // An outside process opening a GPU: the daemon, started as `genv enforce`, acts.
    let gpu = events::make_gpu_node(&node.dir.join("gpu0"));
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", gpu.to_str().unwrap()], None);
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGTERM));
    drop(daemon);

    // `genv enforce --interval 0` is genv-enforcer's one-shot cycle (Python genv would
    // refuse --kill-after).
    let rogue = node.spawn(None, &[(1, 100)]);
    let (ok, stdout, stderr) = bash(
        &node,
        &path,
        "genv enforce --interval 0 --non-env-processes --kill-after 5",
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains(&format!(
            "Process {rogue} is not running in a GPU environment"
        )),
        "{stdout}"
    );
    assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGTERM));
}

#[test]
fn install_is_idempotent_and_uninstall_leaves_nothing_of_ours() {
    let node = Node::new(1);
    let root = install(&node);
    let listing = |root: &Path| {
        let out = Command::new("find")
            .arg(root)
            .arg("-type")
            .arg("f")
            .output()
            .unwrap();
        let mut files: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        files.sort();
        files
    };
    let first = listing(&root);
    // A copy of the front earlier on PATH is skipped, as the front itself is: the real
    // genv answers, with no exec loop.
    let copy = node.dir.join("copy");
    std::fs::create_dir_all(&copy).unwrap();
    std::fs::copy(
        root.join("usr/local/lib/genv-enforcer/front/genv"),
        copy.join("genv"),
    )
    .unwrap();
    let out = Command::new("timeout")
        .args(["20", "genv", "--help"])
        .env("PATH", format!("{}:{}", copy.display(), front_path(&root)))
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("usage: genv"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // systemd reads the unit (its binary where this install put it).
    let unit = std::fs::read_to_string(root.join("etc/systemd/system/genv-enforcer.service"))
        .unwrap()
        .replace(
            "/usr/local/bin/genv-enforcer",
            &root
                .join("usr/local/bin/genv-enforcer")
                .display()
                .to_string(),
        );
    let check = node.dir.join("genv-enforcer.service");
    std::fs::write(&check, unit).unwrap();
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&check)
        .output()
        .expect("systemd-analyze (systemd) is installed");
    assert!(
        verify.status.success() && verify.stderr.is_empty(),
        "systemd-analyze verify: {}",
        String::from_utf8_lossy(&verify.stderr)
    );
    install(&node);
    assert_eq!(
        listing(&root),
        first,
        "a second install lays down the same files"
    );
    let link = root.join("usr/local/sbin/genv");
    assert_eq!(
        std::fs::read_link(&link).unwrap(),
        Path::new("/usr/local/lib/genv-enforcer/front/genv")
    );
    xtask(&["uninstall"], &root);
    assert!(
        listing(&root).is_empty(),
        "left behind: {:?}",
        listing(&root)
    );
    assert!(link.symlink_metadata().is_err());

    // The admin's configuration survives an install and an uninstall.
    let config = root.join("etc/genv-enforcer/config.toml");
    install(&node);
    std::fs::write(&config, "interval = 3\n").unwrap();
    install(&node);
    assert_eq!(std::fs::read_to_string(&config).unwrap(), "interval = 3\n");
    xtask(&["uninstall"], &root);
    assert_eq!(std::fs::read_to_string(&config).unwrap(), "interval = 3\n");
    std::fs::remove_file(&config).unwrap();

    // Someone else's /usr/local/sbin/genv is neither replaced nor removed.
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    std::fs::write(&link, "#!/bin/sh\n").unwrap();
    install(&node);
    xtask(&["uninstall"], &root);
    assert_eq!(std::fs::read_to_string(&link).unwrap(), "#!/bin/sh\n");
}

/// What systemd would hear from the node's daemons (`NOTIFY_SOCKET`, as `Type=notify`
/// gives it).
struct Systemd(std::os::unix::net::UnixDatagram);

impl Systemd {
    fn listen(node: &mut Node) -> Self {
        let path = node.dir.join("notify");
        let socket = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        node.enforcer_env
            .push(("NOTIFY_SOCKET".into(), path.display().to_string()));
        Self(socket)
    }

    /// The next notification (60 s at most).
    fn heard(&self) -> String {
        let mut buf = [0u8; 256];
        let n = self.0.recv(&mut buf).expect("a notification within 60 s");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
}

/// genv's loop (no `--event-driven`, as on a kernel without BPF) reloads as the
/// event-driven daemon does: SIGHUP reads `--config` again, systemd hears RELOADING then
/// READY around it, and the next cycle, at once, is under the new rules.
#[test]
fn sighup_reloads_genvs_loop_too() {
    let mut node = Node::new(1);
    let config = node.dir.join("config.toml");
    std::fs::write(&config, "non-env-processes = false\ninterval = 3600\n").unwrap();
    let systemd = Systemd::listen(&mut node);
    let daemon = Daemon::start(&node, &["--config", config.to_str().unwrap()]);
    assert_eq!(systemd.heard(), "READY=1");
    let outsider = node.spawn(None, &[(0, 100)]);

    std::fs::write(&config, "non-env-processes = true\ninterval = 3600\n").unwrap();
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(daemon.pid() as i32, libc::SIGHUP) };
    assert_eq!(systemd.heard(), "RELOADING=1");
    assert_eq!(systemd.heard(), "READY=1");
    // The hour-long interval starts again from the reload: this cycle is the reload's.
    // (Its line is on stdout, the reload's on stderr: either may come first.)
    let terminated = format!("Process {outsider} is not running in a GPU environment");
    let mut wanted = vec!["SIGHUP: settings read again and in force", &terminated];
    while let Some(needle) = wanted.pop() {
        let seen = daemon.expect_line(needle, Duration::from_secs(20));
        wanted.retain(|w| !seen.iter().any(|line| line.contains(w)));
    }
    assert_eq!(node.wait_exit(outsider, DEATH), Some(libc::SIGTERM));
}

/// The unit's daemon reads `--config`; SIGHUP reads it again and puts the new rules in
/// force at once, with the kernel programs left attached; systemd hears READY, and
/// RELOADING then READY around the reload (`NOTIFY_SOCKET`, as `Type=notify` gives it).
#[test]
fn sighup_reads_the_config_file_again_with_the_programs_attached() {
    let mut node = Node::new(1);
    let config = node.dir.join("config.toml");
    std::fs::write(&config, "non-env-processes = false\nkill-after = 5\n").unwrap();
    let systemd = Systemd::listen(&mut node);
    let Some(daemon) = EventDaemon::start(&node, &["--config", config.to_str().unwrap()]) else {
        return;
    };
    assert_eq!(systemd.heard(), "READY=1");
    let programs = |status: serde_json::Value| -> Vec<u64> {
        status["programs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["id"].as_u64().unwrap())
            .collect()
    };
    let before = programs(daemon.status());
    assert!(!before.is_empty());

    // No rule for outsiders yet: one opens a GPU and is left alone.
    let gpu = events::make_gpu_node(&node.dir.join("gpu0"));
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", gpu.to_str().unwrap()], None);
    daemon.expect(&format!("[EVENT] Process {rogue} "));
    // Its open is checked at once (it is listed on GPU 0: a check with the rule on ends
    // it), in the loop's turn after the one that printed the line: a status published
    // after the line counts that check, and any termination it made.
    let status = daemon.barrier();
    assert!(
        status["counts"]["open_checks"].as_u64().unwrap() > 0,
        "{status}"
    );
    assert_eq!(
        status["counts"]["terminated"], 0,
        "terminated with --non-env-processes off"
    );
    assert!(node.alive(rogue), "terminated with --non-env-processes off");

    std::fs::write(&config, "non-env-processes = true\nkill-after = 5\n").unwrap();
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(daemon.daemon.pid() as i32, libc::SIGHUP) };
    assert_eq!(systemd.heard(), "RELOADING=1");
    assert_eq!(systemd.heard(), "READY=1");
    daemon.expect("[INFO] SIGHUP: settings read again and in force");
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGTERM));
    assert_eq!(
        programs(daemon.status()),
        before,
        "the programs were reloaded"
    );

    // A file that changes what only a restart changes is refused whole: dropping the
    // rule while asking for --deny would leave the kernel denying with the rule off.
    std::fs::write(
        &config,
        "non-env-processes = false\nkill-after = 5\ndeny = true\n",
    )
    .unwrap();
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(daemon.daemon.pid() as i32, libc::SIGHUP) };
    daemon.expect(
        "[ERROR] SIGHUP: the file changes settings only a restart changes (--deny: false -> true)",
    );
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", gpu.to_str().unwrap()], None);
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));

    // A file that does not parse leaves the running settings.
    std::fs::write(&config, "non-env-processes = maybe\n").unwrap();
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(daemon.daemon.pid() as i32, libc::SIGHUP) };
    daemon.expect_count("[ERROR] SIGHUP:", 2);
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", gpu.to_str().unwrap()], None);
    daemon.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
}

/// `--metrics-addr`: `curl` after a scenario shows what it caused.
#[test]
fn the_metrics_endpoint_counts_what_a_scenario_caused() {
    let mut node = Node::new(1);
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let Some(daemon) = EventDaemon::start(&node, &["--non-env-processes", "--metrics-addr", &addr])
    else {
        return;
    };
    let gpu = events::make_gpu_node(&node.dir.join("gpu0"));
    for _ in 0..2 {
        let rogue = node.spawn_with(None, &[(0, 100)], &["--open", gpu.to_str().unwrap()], None);
        daemon.expect(&format!(
            "Process {rogue} is not running in a GPU environment"
        ));
        assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGTERM));
    }
    let scrape = || {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "5", &format!("http://{addr}/metrics")])
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let wanted = [
        "genv_enforcer_decisions_total{rule=\"non-env-processes\",action=\"terminate\"} 2",
        "genv_enforcer_reaction_seconds_count 2",
        &format!(
            "genv_enforcer_tier_info{{tier=\"{}\",configured=\"{}\"}} 1",
            daemon.tier,
            events::requested_tier()
        ),
    ];
    // The counters the status keeps are carried over as it is published (every second).
    let last = std::cell::RefCell::new(String::new());
    let text = wait_for_or(
        format_args!("metrics with {wanted:?} and 2 opens"),
        Duration::from_secs(30),
        || {
            let text = scrape();
            let opens = text
                .lines()
                .find_map(|l| l.strip_prefix("genv_enforcer_events_total{kind=\"open\"} "))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            let done = wanted.iter().all(|w| text.contains(w)) && opens >= 2;
            *last.borrow_mut() = text.clone();
            done.then_some(text)
        },
        || last.take(),
    );
    assert!(text.contains("genv_enforcer_cycle_seconds_count"), "{text}");
    assert!(text.contains("genv_enforcer_lost_events_total 0"), "{text}");
    // `genv-enforcer status`: the tier, the programs, what is watched, NVML as found,
    // the last cycle.
    let out = Command::new(artefact("genv-enforcer"))
        .arg("status")
        .arg("--run-dir")
        .arg(&daemon.run_dir)
        .output()
        .unwrap();
    let status = String::from_utf8_lossy(&out.stdout).into_owned();
    for line in [
        format!("tier: {}", daemon.tier),
        "program ".to_owned(),
        format!(
            "watching: {} (envs.json, devices.json)",
            node.state.display()
        ),
        format!("nvml: {}", artefact("libnvidia_ml_fake.so").display()),
        "last full cycle: ".to_owned(),
        "allowed outside environments: ".to_owned(),
    ] {
        assert!(status.contains(&line), "{line:?} not in:\n{status}");
    }
    let other = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("http://{addr}/"),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&other.stdout), "404");
}

/// The attack on the endpoint: idle sockets, opened again and again, left
/// silent or with half a request. With more of them open than it serves at once, each
/// scrape still gets its 200 within 1 s, and the daemon closes the idle ones itself.
#[test]
fn a_scrape_is_answered_past_idle_connections() {
    use std::io::{Read, Write};
    let node = Node::new(1);
    let addr = free_local_addr();
    let Some(_daemon) =
        EventDaemon::start(&node, &["--non-env-processes", "--metrics-addr", &addr])
    else {
        return;
    };
    for round in 0..4 {
        let idle: Vec<std::net::TcpStream> = (0..80)
            .map(|i| {
                let mut stream = std::net::TcpStream::connect(&addr).unwrap();
                if i % 2 == 1 {
                    stream
                        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                        .unwrap();
                }
                stream
            })
            .collect();
        let answer = scrape_within(&addr, Duration::from_secs(1));
        assert!(
            answer.starts_with("HTTP/1.1 200 OK\r\n") && answer.contains("genv_enforcer_tier_info"),
            "round {round}, 80 idle connections open: {answer:?}"
        );
        // Not held: each idle connection is closed by the daemon (its end, or a reset
        // where half a request was left unread), well before this bound.
        for mut stream in idle {
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            match stream.read(&mut [0u8; 64]) {
                Ok(0) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
                other => panic!("round {round}: an idle connection was held: {other:?}"),
            }
        }
    }
}

/// The DaemonSet (and its namespace, ConfigMap and NetworkPolicy) against Kubernetes' own
/// schema, strict:
/// `kubernetes-validate` (PyPI, with the schemas of each release) in a venv of its own.
#[test]
fn the_kubernetes_manifest_is_valid_against_the_schema() {
    let venv = genv_enforcer_tests::target_dir().join("k8s-venv");
    let validate = venv.join("bin/kubernetes-validate");
    let lock =
        std::fs::File::create(genv_enforcer_tests::target_dir().join("k8s-venv.lock")).unwrap();
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
    if !validate.exists() {
        let ok = |c: &mut Command| assert!(c.status().unwrap().success(), "{c:?} failed");
        ok(Command::new("python3").args(["-m", "venv"]).arg(&venv));
        ok(Command::new(venv.join("bin/pip")).args([
            "install",
            "-q",
            "kubernetes-validate==1.37.0",
        ]));
    }
    let manifest = genv_enforcer_tests::workspace_root().join("deploy/kubernetes/daemonset.yaml");
    let out = Command::new(&validate)
        .args(["--strict", "--no-warn"])
        .arg(&manifest)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    for kind in ["namespace", "configmap", "daemonset", "networkpolicy"] {
        assert!(
            said.contains(&format!("passed for resource {kind}/genv-enforcer")),
            "{said}"
        );
    }
    // And a manifest that is not one fails: the check can fail.
    let broken = std::fs::read_to_string(&manifest)
        .unwrap()
        .replace("hostPID: true", "hostPID: yes-please");
    let bad = std::env::temp_dir().join(format!("genv-k8s-{}.yaml", std::process::id()));
    std::fs::write(&bad, broken).unwrap();
    let out = Command::new(&validate)
        .args(["--strict", "--no-warn"])
        .arg(&bad)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&bad);
    assert!(!out.status.success(), "a broken manifest passed");
}

fn daemonset() -> String {
    let manifest = genv_enforcer_tests::workspace_root().join("deploy/kubernetes/daemonset.yaml");
    std::fs::read_to_string(manifest).unwrap()
}

/// The container's added capabilities, as `setpriv --bounding-set` takes them.
fn daemonset_capabilities(manifest: &str) -> String {
    let listed = manifest
        .split("capabilities:")
        .nth(1)
        .and_then(|rest| rest.split("add:").nth(1))
        .expect("the DaemonSet adds capabilities");
    let caps: Vec<String> = listed
        .lines()
        .skip(1)
        .map_while(|l| l.trim().strip_prefix("- "))
        .map(|c| format!("+{}", c.to_lowercase()))
        .collect();
    format!("-all,{}", caps.join(","))
}

/// The ConfigMap's `config.toml`.
fn configmap_toml(manifest: &str) -> String {
    let block = manifest.split("config.toml: |\n").nth(1).unwrap();
    let block = block.split("\n---").next().unwrap();
    block
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l).to_owned() + "\n")
        .collect()
}

/// The `exec` command of the container's `probe` (`livenessProbe`, `startupProbe`): a
/// YAML flow sequence of quoted strings, which JSON reads.
fn probe_command(manifest: &str, probe: &str) -> Vec<String> {
    let after = manifest
        .split(&format!("{probe}:"))
        .nth(1)
        .unwrap_or_else(|| panic!("no {probe}"));
    let line = after
        .lines()
        .find_map(|l| l.trim().strip_prefix("command: "))
        .unwrap_or_else(|| panic!("{probe} runs no command"));
    serde_json::from_str(line).unwrap()
}

/// Runs a probe's command here: the built binary for the image's, on `run_dir`.
fn run_probe(command: &[String], run_dir: &Path) -> (Option<i32>, String) {
    assert_eq!(command[0], "/usr/local/bin/genv-enforcer", "{command:?}");
    let out = Command::new(artefact("genv-enforcer"))
        .args(&command[1..])
        .env("GENV_ENFORCER_RUN_DIR", run_dir)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// bpffs at /sys/fs/bpf, as systemd mounts it on a node and the DaemonSet mounts the
/// host's into the pod (a daemon without CAP_SYS_ADMIN cannot mount it itself). Left
/// mounted, as a daemon that mounts it leaves it; tracefs is already at
/// /sys/kernel/tracing here.
fn host_mounts_bpffs() {
    const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
    #[allow(clippy::unnecessary_cast)]
    let mounted =
        rustix::fs::statfs("/sys/fs/bpf").is_ok_and(|fs| fs.f_type as i64 == BPF_FS_MAGIC);
    if !mounted {
        let status = Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .status()
            .unwrap();
        assert!(status.success(), "mount -t bpf bpf /sys/fs/bpf: {status}");
    }
}

/// Continues a process the test stopped, however the test ends.
struct Stopped(u32);

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
        unsafe { libc::kill(self.0 as i32, libc::SIGCONT) };
    }
}

/// Waits (generously) until `probe` exits with `code`; returns what it said.
fn probe_until(code: i32, probe: impl Fn() -> (Option<i32>, String)) -> String {
    let last = std::cell::RefCell::new((None, String::new()));
    wait_for_or(
        format_args!("the probe's exit {code}"),
        Duration::from_secs(60),
        || {
            let (exit, said) = probe();
            let found = (exit == Some(code)).then(|| said.clone());
            *last.borrow_mut() = (exit, said);
            found
        },
        || format!("{:?}", last.take()),
    )
}

/// The DaemonSet's pod as near as this host gets: its ConfigMap's configuration (the
/// pins, the metrics port and NVML moved to the test's), its capabilities and no
/// others (no CAP_SYS_ADMIN), started twice as after a restart (the second takes over
/// the first's pins), and its probes, which pass while it runs, fail when it is gone,
/// and fail when it is stuck (SIGSTOP) until it goes on.
#[test]
fn the_daemonsets_pod_runs_with_its_capabilities_and_its_probes_see_it_stuck() {
    let manifest = daemonset();
    let bounding = daemonset_capabilities(&manifest);
    assert!(!bounding.contains("sys_admin"), "{bounding}");
    let mut node = Node::new(1);
    node.enforcer_binary = Some(with_capabilities(
        &node,
        &bounding,
        &artefact("genv-enforcer"),
    ));
    let config = node.dir.join("config.toml");
    std::fs::write(&config, configmap_toml(&manifest)).unwrap();
    host_mounts_bpffs();
    let pins = Pins(PathBuf::from(format!(
        "/sys/fs/bpf/genv-enforcer-daemonset-{}",
        std::process::id()
    )));
    let (addr, nvml) = (free_local_addr(), artefact("libnvidia_ml_fake.so"));
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--pin-dir",
        pins.0.to_str().unwrap(),
        "--metrics-addr",
        &addr,
        "--nvml-lib",
        nvml.to_str().unwrap(),
    ];
    let Some(mut first) = EventDaemon::start(&node, &args) else {
        return;
    };
    first.expect("pinned under");
    let gpu = events::make_gpu_node(&node.dir.join("gpu0"));
    let rogue = node.spawn_with(None, &[(0, 100)], &["--open", gpu.to_str().unwrap()], None);
    first.expect(&format!(
        "Process {rogue} is not running in a GPU environment"
    ));
    assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGTERM));
    let (startup, liveness) = (
        probe_command(&manifest, "startupProbe"),
        probe_command(&manifest, "livenessProbe"),
    );
    let run_dir = first.run_dir.clone();
    for probe in [&startup, &liveness] {
        let (code, said) = run_probe(probe, &run_dir);
        assert_eq!(code, Some(0), "{probe:?}: {said}");
    }
    assert!(first.daemon.stop(DEATH).unwrap().success());
    let (code, said) = run_probe(&liveness, &run_dir);
    assert_eq!(code, Some(3), "{said}");

    let second = EventDaemon::start(&node, &args).expect("it started the first time");
    second.expect("Took over from an earlier run's pinned programs");
    probe_until(0, || run_probe(&liveness, &run_dir));
    // Stuck: the status ages past --max-age (20 here, the least it takes; the pod's
    // is 60), and the probe says so.
    let _stopped = Stopped(second.daemon.pid());
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(second.daemon.pid() as i32, libc::SIGSTOP) };
    let stuck = || {
        run_probe(
            &[
                liveness[0].clone(),
                "status".into(),
                "--max-age".into(),
                "20".into(),
            ],
            &run_dir,
        )
    };
    let said = probe_until(4, stuck);
    assert!(
        said.contains(&format!("pid {} is stuck", second.daemon.pid())),
        "{said}"
    );
    // SAFETY: kill(2) takes no pointer; the daemon is this test's child.
    unsafe { libc::kill(second.daemon.pid() as i32, libc::SIGCONT) };
    probe_until(0, stuck);
}

/// Where the node keeps NVML outside the loader's path (`/usr/local/nvidia/lib64` on the
/// H100 node checked), the default name still finds it: here, in a mount namespace of
/// its own, the fake NVML is put there and nothing else names it.
#[test]
fn nvml_is_found_where_the_container_toolkit_puts_it() {
    let mut node = Node::new(2);
    let process = node.spawn(None, &[(1, 100)]);
    let fake = artefact("libnvidia_ml_fake.so");
    let script = format!(
        "mount -t tmpfs -o mode=755 tmpfs /usr/local && mkdir -p /usr/local/nvidia/lib64 && \
         cp {} /usr/local/nvidia/lib64/libnvidia-ml.so.1 && exec {} usage snapshot",
        fake.display(),
        artefact("genv-enforcer").display()
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .env("GENV_TMPDIR", &node.state)
        .env("GENV_FAKE_NVML_CONFIG", node.config_path())
        .env_remove("GENV_ENFORCER_NVML_LIB")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("cannot load NVML"), "{stderr}");
    let snapshot: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // The process and its memory are NVML's figures (the fake's, loaded from there).
    let processes = &snapshot["processes"]["processes"];
    assert_eq!(processes[0]["pid"], process, "{snapshot}");
    assert_eq!(processes[0]["used_gpu_memory"][0]["index"], 1, "{snapshot}");
    assert_eq!(
        processes[0]["used_gpu_memory"][0]["gpu_memory"], "100mi",
        "{snapshot}"
    );
}

/// `--log-format json`: diagnostics become one JSON object a line on stderr, for log
/// shippers; genv's lines on stdout are as ever.
#[test]
fn diagnostics_are_json_lines_with_log_format_json() {
    let mut node = Node::new(1);
    node.write_state(serde_json::json!([]), serde_json::json!([]));
    let rogue = node.spawn(None, &[(0, 100)]);
    let out = node
        .enforcer()
        .args([
            "--log-format",
            "json",
            "enforce",
            "--interval",
            "0",
            "--non-env-processes",
        ])
        .args(["--max-devices-for-user", "alice=2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().collect::<Vec<_>>(),
        [
            format!("Process {rogue} is not running in a GPU environment"),
            format!("Terminating process {rogue} from environment N/A that is running on GPU(s) 0"),
        ]
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let events: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect();
    assert!(
        events.iter().any(|e| e["level"] == "WARN"
            && e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("--max-devices-for-user has no effect"))),
        "{stderr}"
    );
    assert_eq!(node.wait_exit(rogue, DEATH), Some(libc::SIGTERM));
}
