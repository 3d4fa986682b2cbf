//! `cargo xtask bench remote`: remote enforcement over real OpenSSH against the test
//! suite's hosts (`tests/src/sshd.rs`): one cycle over 1, 4 and 16 hosts, with and
//! without multiplexing, against genv 1.4.3's own `remote enforce`, and the cross-host
//! reaction time of `usage watch` streams. A benchmark, not a test: it runs only when
//! asked (`--ignored`), on the release build, and writes its table.

use std::time::{Duration, Instant};

use genv_enforcer_tests::running::Running;
use genv_enforcer_tests::sshd::{Runs, SshFleet, USERS};
use genv_enforcer_tests::{device_record, env_record};
use serde_json::json;

/// Each host of a benchmark fleet: two GPUs, alice's environment attached to one, a
/// process on it; nothing to enforce, so a cycle is the snapshots and the rules.
fn typical_hosts(fleet: &mut SshFleet) {
    for host in &mut fleet.hosts {
        let shell = host.node.shell();
        host.node.write_state(
            json!([env_record("a", 0, "alice", None, shell)]),
            json!([device_record(0, &["a"]), device_record(1, &[])]),
        );
        host.node.spawn(Some("a"), &[(0, 100)]);
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn wall_ms(mut command: std::process::Command) -> f64 {
    let started = Instant::now();
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    started.elapsed().as_secs_f64() * 1e3
}

/// The median cycle of a long-running `remote -v enforce` (the first, which connects,
/// left out).
fn looped_cycle_ms(fleet: &SshFleet, extra: &[&str]) -> f64 {
    let mut args = vec!["-v"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["enforce", "--interval", "0.2"]);
    let mut child = fleet
        .remote(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut cycles = Vec::new();
    use std::io::BufRead;
    for line in std::io::BufReader::new(stderr)
        .lines()
        .map_while(Result::ok)
    {
        if let Some(ms) = line.strip_prefix("[INFO] Cycle over ").and_then(|l| {
            let ms = l.rsplit(" in ").next()?.strip_suffix(" ms")?;
            ms.parse::<f64>().ok()
        }) {
            cycles.push(ms);
        }
        if cycles.len() == 11 {
            break;
        }
    }
    // SAFETY: kill(2) takes no pointer; the child is this test's.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    median(cycles[1..].to_vec())
}

/// A user holds device 0 on the first host; she attaches one on the second, one over
/// `--max-devices-per-user 1`: how long until the first host's is detached. Each round
/// is another user's ([`USERS`] in turn): what the last round left (its user's device
/// on the second host still attached) is then no one's violation, whichever host's new
/// state the enforcer reads first, so the attach needs no wait before it.
fn reaction_ms(fleet: &mut SshFleet, round: usize, pace: Pace) -> f64 {
    if pace != Pace::Loop {
        std::thread::sleep(ROUND_GAP);
    }
    let user = USERS[round % USERS.len()];
    let (a1, a2) = (format!("a1-{round}"), format!("a2-{round}"));
    let (shell0, uid0) = (fleet.hosts[0].shell_of(user), fleet.hosts[0].uid(user));
    let (shell1, uid1) = (fleet.hosts[1].shell_of(user), fleet.hosts[1].uid(user));
    let envs0 = json!([env_record(&a1, uid0, user, None, shell0)]);
    let envs1 = json!([env_record(&a2, uid1, user, None, shell1)]);
    fleet.hosts[1].node.write_state(
        envs1.clone(),
        json!([device_record(0, &[]), device_record(1, &[])]),
    );
    fleet.hosts[0].node.write_state(
        envs0,
        json!([device_record(0, &[&a1]), device_record(1, &[])]),
    );
    assert_eq!(
        fleet.hosts[0].node.attached(&a1),
        [0],
        "detached before the attach"
    );
    if pace == Pace::Settled {
        std::thread::sleep(Duration::from_millis(1500));
    }
    let attached = Instant::now();
    fleet.hosts[1].node.write_state(
        envs1,
        json!([device_record(0, &[&a2]), device_record(1, &[])]),
    );
    while fleet.hosts[0].node.try_attached(&a1) != Some(Vec::new()) {
        assert!(
            attached.elapsed() < Duration::from_secs(30),
            "never detached"
        );
        // Fine: this wait is what is measured.
        std::thread::sleep(Duration::from_millis(1));
    }
    attached.elapsed().as_secs_f64() * 1e3
}

fn cycle_row(hosts: usize) -> String {
    let mut ours = SshFleet::start(&vec![Runs::Enforcer; hosts], 2);
    typical_hosts(&mut ours);
    let once = median(
        (0..3)
            .map(|_| wall_ms(ours.remote(&["enforce", "--interval", "0"])))
            .collect(),
    );
    let multiplexed = looped_cycle_ms(&ours, &[]);
    let plain = looped_cycle_ms(&ours, &["--no-multiplex"]);
    drop(ours);
    let mut python = SshFleet::start(&vec![Runs::PythonGenv; hosts], 2);
    typical_hosts(&mut python);
    let genv = median(
        (0..3)
            .map(|_| wall_ms(python.genv_remote(&["enforce", "--interval", "0"])))
            .collect(),
    );
    let ours_on_python = looped_cycle_ms(&python, &["--remote-command", "sudo genv"]);
    format!(
        "| {hosts} | {genv:.0} ms | {once:.0} ms | {plain:.0} ms | {multiplexed:.0} ms | {ours_on_python:.0} ms |\n"
    )
}

/// Which parts run: `GENV_BENCH_REMOTE` lists them (`cycles`, `reaction`), all if unset.
fn wanted(section: &str) -> bool {
    std::env::var("GENV_BENCH_REMOTE").map_or(true, |list| list.split(',').any(|s| s == section))
}

/// Min, median and max.
fn range(v: &[f64]) -> (f64, f64, f64) {
    let lo = v.iter().copied().fold(f64::MAX, f64::min);
    let hi = v.iter().copied().fold(0.0, f64::max);
    (lo, median(v.to_vec()), hi)
}

/// How the writes of a round, and the rounds, follow each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pace {
    /// The attach 1.5 s after the round's other writes (every host's snapshots done),
    /// as before the fixed waits went.
    Settled,
    /// The attach within milliseconds of two other writes on both hosts, as genv's own
    /// commands write; rounds [`ROUND_GAP`] apart, as a script's genv commands (each a
    /// Python process) come at most.
    Burst,
    /// Rounds back to back: a write loop on every host, which `usage watch`'s rate
    /// limit holds to its pace.
    Loop,
}

/// Between rounds, but for [`Pace::Loop`].
const ROUND_GAP: Duration = Duration::from_millis(300);

/// genv-enforcer's cross-host reaction over `rounds` at `pace`, after a first round
/// that is not counted (the streams' start).
fn our_reaction(rounds: usize, pace: Pace) -> Vec<f64> {
    let mut fleet = SshFleet::start(&[Runs::Enforcer, Runs::Enforcer], 2);
    let mut enforcer = Running::start(fleet.remote(&[
        "enforce",
        "--event-driven",
        "--interval",
        "600",
        "--max-devices-per-user",
        "1",
    ]));
    reaction_ms(&mut fleet, rounds, Pace::Settled);
    let ms = (0..rounds)
        .map(|round| reaction_ms(&mut fleet, round, pace))
        .collect();
    enforcer.stop();
    ms
}

/// genv 1.4.3's, at its default interval (the rounds are settled by its own pace).
fn genvs_reaction(rounds: usize) -> Vec<f64> {
    let mut python = SshFleet::start(&[Runs::PythonGenv, Runs::PythonGenv], 2);
    let mut genv =
        python.genv_remote(&["enforce", "--interval", "10", "--max-devices-per-user", "1"]);
    // Its own process group: its ssh children go with it.
    std::os::unix::process::CommandExt::process_group(&mut genv, 0);
    let mut genv = genv
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ms = (0..rounds)
        .map(|round| reaction_ms(&mut python, round, Pace::Burst))
        .collect();
    // SAFETY: kill(2) takes no pointer; the group is genv's, which this test started.
    unsafe { libc::kill(-(genv.id() as i32), libc::SIGTERM) };
    let _ = genv.wait();
    ms
}

fn reaction_table() -> String {
    let rounds: usize = std::env::var("GENV_BENCH_ROUNDS").map_or(9, |r| r.parse().unwrap());
    let mut table = String::from(
        "\nCross-host reaction: alice attaches a device on one host, one over `--max-devices-per-user 1`; \
         time until her device on the other host is detached (min / median / max), after a first round not counted. \
         After a burst: each round's attach follows two other state writes on both hosts within milliseconds, \
         as genv's own commands write, rounds 300 ms apart; settled: the attach 1.5 s after them; \
         a write loop: rounds back to back, which each host's snapshot rate limit (5, then 10 a second) holds to its pace:\n\n\
         | enforcer | scenario | runs | min | median | max |\n|---|---|---|---|---|---|\n",
    );
    let paces = [
        (Pace::Burst, "after a burst"),
        (Pace::Settled, "settled"),
        (Pace::Loop, "a write loop"),
    ];
    for (pace, name) in paces {
        let ms = our_reaction(rounds, pace);
        let (lo, mid, hi) = range(&ms);
        table.push_str(&format!(
            "| genv-enforcer `remote enforce --event-driven` (`usage watch` streams) | {name} | {} | {lo:.0} ms | {mid:.0} ms | {hi:.0} ms |\n",
            ms.len()
        ));
        eprintln!("bench remote: {name}: {ms:.0?}");
    }
    if std::env::var_os("GENV_BENCH_SKIP_GENV").is_none() {
        let ms = genvs_reaction(3);
        let (lo, mid, hi) = range(&ms);
        table.push_str(&format!(
            "| genv 1.4.3 `remote enforce` (`--interval 10`, its default) | after a burst | {} | {lo:.0} ms | {mid:.0} ms | {hi:.0} ms |\n",
            ms.len()
        ));
    }
    table
}

#[test]
#[ignore = "a benchmark: cargo xtask bench remote"]
fn bench_remote() {
    let out = std::env::var("GENV_BENCH_TABLE").expect("GENV_BENCH_TABLE: where the table goes");
    let mut table = String::new();
    if wanted("cycles") {
        table.push_str(
            "One remote cycle (snapshot every host, rules across them, nothing to execute), hosts \
             in network namespaces on this machine, each host 2 GPUs, one environment, one process:\n\n\
             | hosts | genv 1.4.3 `remote enforce --interval 0` (Python genv hosts) | genv-enforcer, one run (`--interval 0`) | genv-enforcer cycle, `--no-multiplex` | genv-enforcer cycle, multiplexed | genv-enforcer cycle, multiplexed, Python genv hosts (`--remote-command 'sudo genv'`) |\n\
             |---|---|---|---|---|---|\n",
        );
        for hosts in [1, 4, 16] {
            table.push_str(&cycle_row(hosts));
        }
    }
    if wanted("reaction") {
        table.push_str(&reaction_table());
    }
    std::fs::write(out, table).unwrap();
}
