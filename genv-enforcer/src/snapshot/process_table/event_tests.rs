//! The table with the kernel's process events, on real processes: a process with no
//! event since it was read is not read again, and one that exec'd is.

use std::io::{self, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

use super::*;
use crate::backends::devmap::DeviceMap;
use crate::backends::proc_events::tests::await_events;
use crate::snapshot::inspect::Procfs;

/// The real `/proc`, counting `stat` reads.
#[derive(Default)]
struct Counting {
    procfs: Procfs,
    stats: AtomicU32,
}

impl ProcessInspector for Counting {
    fn stat(&self, pid: u32) -> io::Result<ProcStat> {
        self.stats.fetch_add(1, Relaxed);
        self.procfs.stat(pid)
    }
    fn stat_cached(&self, pid: u32, handle: &mut Option<StatFile>) -> io::Result<ProcStat> {
        self.stats.fetch_add(1, Relaxed);
        self.procfs.stat_cached(pid, handle)
    }
    fn environment_id(&self, pid: u32) -> Result<Option<String>, EnvironError> {
        self.procfs.environment_id(pid)
    }
    fn real_uid(&self, pid: u32) -> io::Result<u32> {
        self.procfs.real_uid(pid)
    }
    fn process_events(&self) -> Option<ProcEvents> {
        Some(ProcEvents::subscribe().expect("process events (the suites run as root)"))
    }
    fn gpu_node_holders(&self, map: &DeviceMap) -> io::Result<Vec<(u32, Vec<u32>)>> {
        self.procfs.gpu_node_holders(map)
    }
}

/// A shell in environment `a` that, told to, execs into environment `b`.
fn shell_in_a() -> Child {
    Command::new("/bin/sh")
        .args(["-c", "read x; exec env GENV_ENVIRONMENT_ID=b sleep 600"])
        .env("GENV_ENVIRONMENT_ID", "a")
        .stdin(Stdio::piped())
        .spawn()
        .unwrap()
}

fn env(eid: &str) -> Env {
    serde_json::from_value(serde_json::json!({"eid": eid, "uid": 0, "pids": [1]})).unwrap()
}

#[test]
fn reads_again_only_the_processes_the_kernel_says_changed() {
    let inspector = Counting::default();
    let mut witness = ProcEvents::subscribe().expect("process events (the suites run as root)");
    let (mut still, mut execs) = (shell_in_a(), shell_in_a());
    let mut seen = Vec::new();
    for child in [&still, &execs] {
        // Their exec events were sent, so the table's subscription cannot get them:
        // `spawn` returns before the kernel sends a child's exec event, and the kernel
        // delivers an event to every subscriber at once.
        await_events(&mut witness, &mut seen, child.id(), 1);
    }
    if still.id() > execs.id() {
        std::mem::swap(&mut still, &mut execs); // claims are listed by pid
    }
    let contexts = [still.id(), execs.id()].map(|pid| ComputeContext {
        pid,
        index: 0,
        used_memory: Some(1),
    });
    let envs = [env("a"), env("b")];
    let mut table = ProcessTable::default();
    let mut assemble = || {
        let mut warnings = Vec::new();
        let processes = assemble_processes(
            &contexts,
            Some(&envs),
            &inspector,
            EnvPolicy::default(),
            &mut table,
            &mut warnings,
        );
        let mut claims: Vec<_> = processes.into_iter().map(|p| (p.pid, p.eid)).collect();
        claims.sort(); // genv's order is Python's set order
        (claims, inspector.stats.swap(0, Relaxed))
    };
    let a = Some("a".to_owned());
    let first = assemble();
    assert_eq!(first.0, [(still.id(), a.clone()), (execs.id(), a.clone())]);
    assert_eq!(first.1, 2, "the first assembly reads every process");
    assert_eq!(
        assemble(),
        (first.0.clone(), 0),
        "no event: nothing read again"
    );

    writeln!(execs.stdin.as_mut().unwrap()).unwrap();
    // Its execs of `env` and then `sleep`: both sent, so the table has them too.
    await_events(&mut witness, &mut seen, execs.id(), 3);
    let (claims, reads) = assemble();
    assert_eq!(
        claims,
        [(still.id(), a), (execs.id(), Some("b".to_owned()))]
    );
    assert_eq!(reads, 1, "only the process that exec'd is read again");
    for child in [&mut still, &mut execs] {
        let _ = child.kill();
        let _ = child.wait();
    }
}
