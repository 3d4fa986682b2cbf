//! Where the libcuda probes are registered and removed: a thread of its own, never the
//! event loop.
//!
//! Registering or removing a uprobe (`uprobe_register`, `uprobe_unregister`, and
//! `uprobe_apply` when a perf event changes who wants it) takes the global
//! `dup_mmap_sem` for writing, which every `fork()` on the node takes for reading, and
//! then write-locks the `mmap_lock` of **every** process that maps the file. A user
//! who holds their own process's lock (a FUSE page that never answers, see
//! `crate::backends::address_space`) keeps that going for as long as they like, and
//! the thread that registers waits in the kernel, uninterruptibly. So registrations are
//! made here: a hang costs the probes of the library being registered (and, for as
//! long as the kernel holds `dup_mmap_sem`, the node's forks: see SECURITY.md), never
//! the daemon's decisions. One that has not returned within [`SAY_AFTER`] is said,
//! with the processes that hold their address spaces, where they can be told.
//!
//! The probes are registered system-wide, once per library, so that processes' own
//! exec, fork and exit never register anything: the kernel places a registered probe's
//! breakpoints in each process that maps the library at its `mmap`, in that process's
//! own context (`uprobe_mmap`).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::holders::{held_mappers, holders, named};
use super::uprobe_events::{Side, UprobeEvent};

/// How long a registration may take before it is said.
pub const SAY_AFTER: Duration = Duration::from_secs(1);

/// One uprobe to make: its event name, entry or return, offset, and program.
pub struct Definition {
    pub name: String,
    pub side: Side,
    pub offset: u64,
    pub program: Arc<OwnedFd>,
    /// The program's name and the symbol, for messages.
    pub what: String,
}

/// A library's probes to register.
pub struct Registration {
    pub key: u64,
    /// The library, kept open: the kernel resolves `/proc/self/fd/N` of it.
    pub file: std::fs::File,
    pub name: String,
    pub definitions: Vec<Definition>,
    /// Said once every probe is in place.
    pub line: String,
}

enum Job {
    Register(Registration),
    Remove(u64),
}

/// What the registrar is doing now, for the watchdog.
#[derive(Default)]
struct Busy {
    what: Option<(String, Instant)>,
    said: bool,
}

/// The registrar thread and its watchdog. Dropped, it stops taking jobs; what it has
/// registered is removed on its way out (the kernel removes it at the daemon's exit
/// otherwise, and a dead daemon's tracefs events at the next start).
pub struct Registrar {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    busy: Arc<Mutex<Busy>>,
    queued: Arc<Queued>,
}

/// Jobs sent and not yet taken up (a registration put off counts as taken up).
#[derive(Default)]
struct Queued {
    count: Mutex<usize>,
    changed: Condvar,
}

impl Queued {
    fn add(&self, n: isize) {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        *count = count.saturating_add_signed(n);
        self.changed.notify_all();
    }
}

impl Registrar {
    pub fn start(tracefs: PathBuf) -> Self {
        let (jobs, queue) = mpsc::channel::<Job>();
        let busy = Arc::new(Mutex::new(Busy::default()));
        let queued = Arc::new(Queued::default());
        let (working, taking) = (Arc::clone(&busy), Arc::clone(&queued));
        let thread = std::thread::Builder::new()
            .name("uprobe-registrar".into())
            .spawn(move || run(&tracefs, &queue, &working, &taking))
            .ok();
        let watched = Arc::downgrade(&busy);
        let _ = std::thread::Builder::new()
            .name("uprobe-watchdog".into())
            .spawn(move || watch(&watched));
        Self {
            jobs: Some(jobs),
            thread,
            busy,
            queued,
        }
    }

    /// Waits, at most `within`, until every job sent so far was taken up: registered,
    /// or put off (said). Whether it was. The daemon's start waits for its first
    /// libraries this way, so that "held at the allocation" is true once it is said,
    /// without waiting on a user who holds a mapper.
    pub fn settle(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut count = self.queued.count.lock().unwrap_or_else(|e| e.into_inner());
        while *count > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            count = self
                .queued
                .changed
                .wait_timeout(count, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Registers a library's probes, in the background.
    pub fn register(&self, registration: Registration) {
        self.send(Job::Register(registration));
    }

    /// Removes the probes of library `key`, in the background.
    pub fn remove(&self, key: u64) {
        self.send(Job::Remove(key));
    }

    fn send(&self, job: Job) {
        if let Some(jobs) = &self.jobs {
            self.queued.add(1);
            if jobs.send(job).is_err() {
                self.queued.add(-1);
                tracing::error!("--memory-at-alloc: the uprobe registrar is gone");
            }
        }
    }

    /// Whether a registration is running past [`SAY_AFTER`] (for `status`).
    pub fn stalled(&self) -> bool {
        let busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        busy.what
            .as_ref()
            .is_some_and(|(_, since)| since.elapsed() >= SAY_AFTER)
    }
}

impl Drop for Registrar {
    /// Waits for the registrar to remove what it registered, for as long as a
    /// registration would be said; a registrar held in the kernel is left there.
    fn drop(&mut self) {
        drop(self.jobs.take());
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + SAY_AFTER * 3;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if thread.is_finished() {
            let _ = thread.join();
        } else {
            tracing::warn!(
                "--memory-at-alloc: the libcuda probes could not be removed in time (a process that maps libcuda holds its address space); the kernel removes them as the daemon exits"
            );
        }
    }
}

/// How often a registration put off (a process that maps the library holds its
/// address space) is tried again.
const TRY_AGAIN: Duration = Duration::from_secs(2);

/// A registration put off, and the holders last said for it.
type PutOff = (Registration, Vec<(u32, u32)>);

fn run(
    tracefs: &std::path::Path,
    queue: &mpsc::Receiver<Job>,
    busy: &Mutex<Busy>,
    queued: &Queued,
) {
    let mut libraries: HashMap<u64, Vec<UprobeEvent>> = HashMap::new();
    let mut put_off: Vec<PutOff> = Vec::new();
    let set_busy = |what: Option<String>| {
        let mut busy = busy.lock().unwrap_or_else(|e| e.into_inner());
        busy.what = what.map(|w| (w, Instant::now()));
        busy.said = false;
    };
    loop {
        let job = match put_off.is_empty() {
            true => queue.recv().ok(),
            false => match queue.recv_timeout(TRY_AGAIN) {
                Ok(job) => Some(job),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            },
        };
        let took_one = job.is_some();
        match job {
            Some(Job::Register(registration)) => put_off.push((registration, Vec::new())),
            Some(Job::Remove(key)) => {
                put_off.retain(|(registration, _)| registration.key != key);
                set_busy(Some("removing the probes of a libcuda copy".into()));
                drop(libraries.remove(&key));
            }
            None if put_off.is_empty() => break,
            None => {}
        }
        for (registration, said) in std::mem::take(&mut put_off) {
            if let Some(held) = still_held(&registration, said) {
                put_off.push((registration, held));
                continue;
            }
            set_busy(Some(format!(
                "registering the probes of {}",
                registration.name
            )));
            if let Some(events) = register(tracefs, registration) {
                libraries.insert(events.0, events.1);
            }
        }
        set_busy(None);
        if took_one {
            queued.add(-1);
        }
    }
    set_busy(Some("removing the libcuda probes".into()));
    libraries.clear();
    set_busy(None);
}

/// Makes every event of `registration`; said once in place, or else why not (those
/// made already are removed again).
fn register(
    tracefs: &std::path::Path,
    registration: Registration,
) -> Option<(u64, Vec<UprobeEvent>)> {
    use std::os::fd::{AsFd, AsRawFd};
    let Registration {
        key,
        file,
        name,
        definitions,
        line,
    } = registration;
    let target = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
    let mut events = Vec::with_capacity(definitions.len());
    for definition in definitions {
        let made = UprobeEvent::new(
            tracefs,
            definition.name,
            definition.side,
            &target,
            definition.offset,
            definition.program.as_fd(),
        );
        match made {
            Ok(event) => events.push(event),
            Err(e) => {
                tracing::warn!(
                    "--memory-at-alloc: not probing {name}: {}: {e}",
                    definition.what
                );
                return None;
            }
        }
    }
    tracing::info!("{line}");
    Some((key, events))
}

/// The processes holding a registration off now (said when they are not those `said`
/// last time), or `None` when it can go ahead.
fn still_held(registration: &Registration, said: Vec<(u32, u32)>) -> Option<Vec<(u32, u32)>> {
    let held = held_mappers(&registration.file);
    if held.is_empty() {
        return None;
    }
    if held != said {
        tracing::warn!(
            "--memory-at-alloc: not probing {} yet: {} map it and hold their address spaces (a registration would wait for them, and every fork() on the node with it); tried again every {} s",
            registration.name,
            named(&held),
            TRY_AGAIN.as_secs()
        );
    }
    Some(held)
}

/// Says a registration that runs past [`SAY_AFTER`], once, with the processes that
/// hold their address spaces; ends with the registrar.
fn watch(busy: &std::sync::Weak<Mutex<Busy>>) {
    loop {
        std::thread::sleep(SAY_AFTER / 4);
        let Some(busy) = busy.upgrade() else {
            return;
        };
        let mut busy = busy.lock().unwrap_or_else(|e| e.into_inner());
        let Some((what, since)) = busy.what.clone() else {
            continue;
        };
        if busy.said || since.elapsed() < SAY_AFTER {
            continue;
        }
        busy.said = true;
        drop(busy);
        let holders = holders();
        let named = match holders.is_empty() {
            true => "no process is seen waiting on FUSE".to_owned(),
            false => format!(
                "{} wait on FUSE or to map, and hold their address spaces",
                named(&holders)
            ),
        };
        tracing::warn!(
            "--memory-at-alloc: {what} has not returned in {} s: the kernel waits for the address space of a process that maps it ({named}); the probes of that library are not in place until it returns, and the node's fork() calls wait with it",
            since.elapsed().as_secs()
        );
    }
}
