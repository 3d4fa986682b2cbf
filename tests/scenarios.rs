//! genv's reference scenarios (shared/genv-compat.md), with real processes on a simulated
//! node. Each runs the real genv 1.4.3 first, with signalling off, then genv-enforcer on
//! the same processes and state: both must print the same lines in the same order, the
//! processes genv names must die and every other must survive.

use genv_enforcer_tests::DEATH;
use genv_enforcer_tests::{Genv, Node, device_record, env_record};
use serde_json::json;

/// Runs both enforcers with `flags`, checks they agree with each other and with
/// `expected`, and that exactly the named processes died.
fn agree(node: &mut Node, flags: &[&str], expected: &[String], all: &[u32]) {
    let genv = Genv::get().enforce_dry(node, flags);
    let ours = node.enforce_once(flags);
    assert!(ours.success, "genv-enforcer failed: {}", ours.stderr);
    assert_eq!(genv.stdout, expected, "genv's own output");
    assert_eq!(
        ours.stdout, genv.stdout,
        "genv-enforcer must print genv's lines; stderr: {}",
        ours.stderr
    );
    let terminated = ours.terminated();
    for pid in all {
        if terminated.contains(pid) {
            assert_eq!(
                node.wait_exit(*pid, DEATH),
                Some(libc::SIGTERM),
                "{pid} must die of SIGTERM"
            );
        } else {
            assert!(node.alive(*pid), "{pid} must survive");
        }
    }
}

#[test]
fn non_env_processes() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", 0, "root", None, shell)]),
        json!([device_record(0, &["env-a"]), device_record(1, &[])]),
    );
    let member = node.spawn(Some("env-a"), &[(0, 100)]);
    let rogue = node.spawn(None, &[(1, 100)]);
    let expected = [
        format!("Process {rogue} is not running in a GPU environment"),
        format!("Terminating process {rogue} from environment N/A that is running on GPU(s) 1"),
    ];
    agree(
        &mut node,
        &["--non-env-processes"],
        &expected,
        &[member, rogue],
    );
}

#[test]
fn env_devices() {
    let mut node = Node::new(3);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-a", 0, "root", None, shell)]),
        json!([
            device_record(0, &["env-a"]),
            device_record(1, &[]),
            device_record(2, &[])
        ]),
    );
    let good = node.spawn(Some("env-a"), &[(0, 100)]);
    let bad = node.spawn(Some("env-a"), &[(0, 100), (1, 100), (2, 100)]);
    let expected = [
        format!("Process {bad} from environment env-a is using non-attached GPU(s) 1,2"),
        format!("Terminating process {bad} from environment env-a that is running on GPU(s) 0,1,2"),
    ];
    agree(&mut node, &[], &expected, &[good, bad]);
}

/// What bash's `printf %s` makes of one word of a line: `$'…'` quoting undone.
fn bash_reads(word: &str) -> String {
    if !word.starts_with("$'") {
        return word.to_owned();
    }
    let output = std::process::Command::new("bash")
        .args(["-c", &format!("printf %s {word}")])
        .output()
        .unwrap();
    assert!(output.status.success(), "bash read {word:?}");
    String::from_utf8(output.stdout).unwrap()
}

/// An environment id that retitles the terminal (OSC … BEL), clears it and homes the
/// cursor, as any user can write into `envs.json`: genv prints it raw; genv-enforcer
/// prints genv's lines with that word in `$'…'` quoting, which bash reads back into
/// genv's bytes exactly, and nothing else of the lines differs.
#[test]
fn an_environment_id_a_terminal_would_act_on_is_escaped_and_reads_back_as_genvs() {
    let mut node = Node::new(2);
    let shell = node.shell();
    let eid = "\u{1b}]0;pwned\u{7}\u{1b}[2J\u{1b}[H";
    node.write_state(
        json!([env_record(eid, 0, "root", None, shell)]),
        json!([device_record(0, &[eid]), device_record(1, &[])]),
    );
    let bad = node.spawn(Some(eid), &[(0, 100), (1, 100)]);
    let genv = Genv::get().enforce_dry(&node, &[]);
    assert_eq!(
        genv.stdout,
        [
            format!("Process {bad} from environment {eid} is using non-attached GPU(s) 1"),
            format!(
                "Terminating process {bad} from environment {eid} that is running on GPU(s) 0,1"
            ),
        ],
        "genv's own output"
    );
    let ours = node.enforce_once(&[]);
    assert!(ours.success, "{}", ours.stderr);
    assert_eq!(ours.terminated(), [bad], "{}", ours.stderr);
    let escaped = "$'\\e]0;pwned\\a\\e[2J\\e[H'";
    let expected: Vec<String> = genv
        .stdout
        .iter()
        .map(|l| l.replace(eid, escaped))
        .collect();
    assert_eq!(ours.stdout, expected, "stderr: {}", ours.stderr);
    for (line, theirs) in ours.stdout.iter().zip(&genv.stdout) {
        assert!(line.bytes().all(|b| (0x20..0x7f).contains(&b)), "{line:?}");
        let read: Vec<String> = line.split(' ').map(bash_reads).collect();
        assert_eq!(&read.join(" "), theirs);
    }
    // Nor does the log carry it raw.
    assert!(!ours.stderr.contains('\u{1b}'), "{:?}", ours.stderr);
    assert_eq!(node.wait_exit(bad, DEATH), Some(libc::SIGTERM));
}

#[test]
fn env_memory_is_greedy() {
    let mut node = Node::new(1);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-m", 0, "root", Some("1g"), shell)]),
        json!([device_record(0, &["env-m"])]),
    );
    let pids: Vec<u32> = (0..3)
        .map(|_| node.spawn(Some("env-m"), &[(0, 600)]))
        .collect();
    // 1800 MiB against 1g: 887m over. genv's order is its set order; both must agree on
    // which two die, so the expected lines are taken from the order genv printed.
    let genv = Genv::get().enforce_dry(&node, &[]);
    assert_eq!(
        genv.stdout[0],
        "Environment env-m is using 1887m on device 0 which is 887m over its capacity of 1g"
    );
    let victims = genv.terminated();
    assert_eq!(victims.len(), 2, "greedy: two of three cover the excess");
    let mut expected = vec![genv.stdout[0].clone()];
    expected.extend(victims.iter().map(|p| {
        format!("Terminating process {p} from environment env-m that is running on GPU(s) 0")
    }));
    agree(&mut node, &[], &expected, &pids);
}

#[test]
fn max_devices_per_user() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("env-u", 0, "alice", None, shell)]),
        json!([device_record(0, &["env-u"]), device_record(1, &["env-u"])]),
    );
    let on0 = node.spawn(Some("env-u"), &[(0, 100)]);
    let on1 = node.spawn(Some("env-u"), &[(1, 100)]);
    let expected = [
        "User alice is using 2 devices which is 1 more than the maximum allowed".to_owned(),
        format!("Terminating process {on0} from environment env-u that is running on GPU(s) 0"),
        "Detaching environment env-u of user alice from device 0".to_owned(),
    ];
    agree(
        &mut node,
        &["--max-devices-per-user", "1"],
        &expected,
        &[on0, on1],
    );
    assert_eq!(node.attached("env-u"), [1]);
}

#[test]
fn max_devices_for_user_overrides() {
    let mut node = Node::new(2);
    let (s1, s2) = (node.shell(), node.shell());
    node.write_state(
        json!([
            // Two users, as genv records them: each with a uid of their own (the
            // processes run as root, which may be in any environment).
            env_record("env-a", 64_301, "alice", None, s1),
            env_record("env-b", 64_302, "bob", None, s2)
        ]),
        json!([
            device_record(0, &["env-a", "env-b"]),
            device_record(1, &["env-a"])
        ]),
    );
    let a = node.spawn(Some("env-a"), &[(0, 100), (1, 100)]);
    let b = node.spawn(Some("env-b"), &[(0, 100)]);
    let expected = [
        "User bob is using 1 devices which is 1 more than the maximum allowed".to_owned(),
        format!("Terminating process {b} from environment env-b that is running on GPU(s) 0"),
        "Detaching environment env-b of user bob from device 0".to_owned(),
    ];
    agree(
        &mut node,
        &[
            "--max-devices-per-user",
            "2",
            "--max-devices-for-user",
            "bob=0",
        ],
        &expected,
        &[a, b],
    );
    assert_eq!(node.attached("env-b"), Vec::<u64>::new());
    assert_eq!(node.attached("env-a"), [0, 1]);
}

fn python_set_order(pids: &[u32]) -> Vec<u32> {
    let list = pids
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            &format!("print(','.join(str(p) for p in set([{list}])))"),
        ])
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .split(',')
        .map(|p| p.parse().unwrap())
        .collect()
}

#[test]
fn reference_run() {
    let mut node = Node::new(2);
    let shell = node.shell();
    node.write_state(
        json!([env_record("21364", 0, "root", Some("1g"), shell)]),
        json!([device_record(0, &["21364"]), device_record(1, &["21364"])]),
    );
    let heavy = node.spawn(Some("21364"), &[(0, 2000)]);
    let rogue = node.spawn(None, &[(1, 100)]);
    let mut terminating = [
        format!("Terminating process {heavy} from environment 21364 that is running on GPU(s) 0"),
        format!("Terminating process {rogue} from environment N/A that is running on GPU(s) 1"),
    ];
    // Terminations come in genv's snapshot order: CPython's set order of the pids, as
    // nvidia-smi lists them (GPU 0 first).
    if python_set_order(&[heavy, rogue])[0] != heavy {
        terminating.swap(0, 1);
    }
    let expected = [
        format!("Process {rogue} is not running in a GPU environment"),
        "Environment 21364 is using 2097m on device 0 which is 1097m over its capacity of 1g"
            .to_owned(),
        "User root is using 2 devices which is 1 more than the maximum allowed".to_owned(),
        terminating[0].clone(),
        terminating[1].clone(),
        "Detaching environment 21364 of user root from device 0".to_owned(),
    ];
    agree(
        &mut node,
        &["--non-env-processes", "--max-devices-per-user", "1"],
        &expected,
        &[heavy, rogue],
    );
    assert_eq!(node.attached("21364"), [1]);
}
