//! Reads that wait on another process's address space, made with a deadline.
//!
//! `/proc/<pid>/environ`, `cmdline`, `maps` and `map_files` take the process's
//! `mmap_lock`, and its owner can hold that lock for as long as they like: a thread
//! reading `/proc/self/mem` over a page of a FUSE file whose server never answers keeps
//! it read-locked, and another thread's `mmap` then queues a writer that every later
//! reader waits behind, uninterruptibly for all but SIGKILL. A reader that waited there
//! on the daemon's event loop, or under genv's lock, would stop enforcement on the node.
//!
//! So each read runs on a worker thread and the caller waits at most a deadline. A read
//! that has not returned by then, and whose worker sleeps in the kernel, is *held*: its
//! worker stays blocked there (it cannot be interrupted) until the owner lets go, and its
//! result, if it ever comes, is kept for the next ask about the same process. A worker
//! that has not reached the kernel's wait by the deadline (still queued, or runnable on a
//! loaded machine: nobody holds anything) is waited for a while longer
//! ([`RUNNABLE_WAIT`]). Meanwhile:
//! - a second read of the same process and file is not made: it is answered `Held` at
//!   once (one blocked worker per process and file, however often it is asked about);
//! - a uid with [`HELD_PER_UID`] reads held has its other processes answered `Held` at
//!   once too: only a process's owner can keep its lock held, so holding it costs that
//!   user alone;
//! - at most [`MAX_WORKERS`] workers exist; past that a read is answered `Busy`, which
//!   the callers never count against the process (it is nobody's own doing).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Condvar, Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

/// How long a caller waits for one read. A `/proc` read of an address space that is not
/// held takes microseconds; a burst of `mmap` or a page fault on a slow disk takes
/// milliseconds.
pub const READ_WAIT: Duration = Duration::from_millis(100);

/// How long a read is waited for, at most, while its worker has not gone to sleep in the
/// kernel: on a machine whose CPUs are all busy a worker can wait that long to run, and
/// a read that did not wait on anyone is not its owner's doing.
pub const RUNNABLE_WAIT: Duration = Duration::from_secs(2);

/// How often the worker's state is looked at past the deadline.
const STATE_STEP: Duration = Duration::from_millis(10);

/// Reads of one uid's processes that may be held at once.
pub const HELD_PER_UID: usize = 4;

/// Workers, held ones included.
pub const MAX_WORKERS: usize = 128;

/// The stack of a worker: it reads a bounded `/proc` file and parses it.
const WORKER_STACK: usize = 256 * 1024;

/// Which file of the process is read (one held read per process and file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpaceFile {
    Environ,
    Maps,
}

/// Why a read gave no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoAnswer {
    /// The process's address space did not answer within the deadline, or an earlier
    /// read of it still waits, or its uid has [`HELD_PER_UID`] reads waiting: its owner
    /// holds it.
    #[error("its address space is held (a read of it did not return within {} ms)", READ_WAIT.as_millis())]
    Held,
    /// Every worker is taken: nothing is known of this process.
    #[error("no reader free ({MAX_WORKERS} reads of held address spaces are waiting)")]
    Busy,
}

type Job = Box<dyn FnOnce() + Send>;
type Answer = Box<dyn std::any::Any + Send>;

/// One read in flight: its answer, once there is one.
struct Slot {
    answer: Mutex<Option<Answer>>,
    /// The worker making the read, once it has started (its thread id).
    worker: Mutex<Option<i32>>,
    done: Condvar,
    uid: u32,
    /// The image read, so that an answer that came late is never taken for another.
    process: Process,
}

#[derive(Default)]
struct Book {
    /// Reads that outlived their deadline, by process and file.
    held: HashMap<(u32, SpaceFile), Arc<Slot>>,
    workers: usize,
    idle: usize,
}

struct Reader {
    book: Mutex<Book>,
    jobs: Mutex<mpsc::Sender<Job>>,
    queue: Arc<Mutex<mpsc::Receiver<Job>>>,
}

fn reader() -> &'static Reader {
    static READER: OnceLock<Reader> = OnceLock::new();
    READER.get_or_init(|| {
        let (jobs, queue) = mpsc::channel();
        Reader {
            book: Mutex::default(),
            jobs: Mutex::new(jobs),
            queue: Arc::new(Mutex::new(queue)),
        }
    })
}

/// The owner of process `pid` (its `/proc` directory's, the effective uid), which takes
/// no lock of its address space; `None` when it is gone.
fn owner_of(pid: u32) -> Option<u32> {
    Some(std::fs::metadata(format!("/proc/{pid}")).ok()?.uid())
}

/// The process image a read is of: its pid, start time and exec fingerprint
/// (`/proc/<pid>/stat`'s), so that a late answer is never taken for another process
/// given the pid, nor for the image the process exec'd since.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process {
    pub pid: u32,
    pub started: u64,
    pub image: [u64; 3],
}

/// Runs `read` (a read of `process`'s `file`) on a worker, and waits for it at most
/// [`READ_WAIT`]. A process that is gone is read all the same (the read then says so).
pub fn read<R: Send + 'static>(
    process: Process,
    file: SpaceFile,
    read: impl FnOnce() -> R + Send + 'static,
) -> Result<R, NoAnswer> {
    read_within(process, file, READ_WAIT, read)
}

/// [`read`] with a deadline of its own.
fn read_within<R: Send + 'static>(
    process: Process,
    file: SpaceFile,
    wait: Duration,
    read: impl FnOnce() -> R + Send + 'static,
) -> Result<R, NoAnswer> {
    let reader = reader();
    let pid = process.pid;
    let Some(uid) = owner_of(pid) else {
        return Ok(read()); // gone: the read says so at once, holding nothing
    };
    let slot = match book(reader, (pid, file), uid, process)? {
        Booked::Answered(answer) => {
            if let Ok(answer) = answer.downcast::<R>() {
                return Ok(*answer);
            }
            book(reader, (pid, file), uid, process)?.into_slot()?
        }
        Booked::Slot(slot) => slot,
    };
    let answering = Arc::clone(&slot);
    let job: Job = Box::new(move || {
        // The raw syscall: glibc's `gettid` wrapper is newer (2.30) than the oldest
        // glibc the packages support (2.28), and would not link there.
        // SAFETY: gettid(2) takes no argument and cannot fail.
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
        *answering.worker.lock().unwrap_or_else(|e| e.into_inner()) = Some(tid);
        let answer: Answer = Box::new(read());
        *answering.answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(answer);
        answering.done.notify_all();
    });
    let sent = reader
        .jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(job);
    if sent.is_err() {
        return Err(NoAnswer::Busy);
    }
    if let Some(answer) = wait_for(&slot, wait).or_else(|| while_runnable(&slot, wait)) {
        return Ok(*answer.downcast::<R>().expect("the answer of this read"));
    }
    let mut book = reader.book.lock().unwrap_or_else(|e| e.into_inner());
    // A read raced to the same key is kept: one blocked worker is as good as two.
    book.held.entry((pid, file)).or_insert(slot);
    Err(NoAnswer::Held)
}

/// What [`book`] found for a read.
enum Booked {
    /// An earlier read of the same process and file, held, has answered since.
    Answered(Answer),
    /// A worker is taken for this read, which is to answer into this slot.
    Slot(Arc<Slot>),
}

impl Booked {
    fn into_slot(self) -> Result<Arc<Slot>, NoAnswer> {
        match self {
            Self::Slot(slot) => Ok(slot),
            Self::Answered(_) => Err(NoAnswer::Busy),
        }
    }
}

/// Takes a worker for a read of `key` (the image `process`, owned by `uid`),
/// unless an earlier read of it is held, or answered late, or `uid` holds
/// [`HELD_PER_UID`] reads, or every worker is taken.
fn book(
    reader: &'static Reader,
    key: (u32, SpaceFile),
    uid: u32,
    process: Process,
) -> Result<Booked, NoAnswer> {
    let mut book = reader.book.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(held) = book.held.get(&key).cloned() {
        let answered = held.answer.lock().unwrap_or_else(|e| e.into_inner()).take();
        match answered {
            None if held.process == process => return Err(NoAnswer::Held),
            // Another process now has the pid, or it exec'd: its read is its own.
            None => {}
            Some(answer) => {
                book.held.remove(&key);
                if held.process == process {
                    return Ok(Booked::Answered(answer));
                }
            }
        }
    }
    book.held.retain(|_, slot| !is_answered(slot));
    if book.held.values().filter(|s| s.uid == uid).count() >= HELD_PER_UID {
        return Err(NoAnswer::Held);
    }
    if book.idle == 0 {
        if book.workers >= MAX_WORKERS || spawn_worker(reader).is_err() {
            return Err(NoAnswer::Busy);
        }
        book.workers += 1;
        book.idle += 1;
    }
    book.idle -= 1;
    Ok(Booked::Slot(Arc::new(Slot {
        answer: Mutex::new(None),
        worker: Mutex::new(None),
        done: Condvar::new(),
        uid,
        process,
    })))
}

/// Past the deadline (`waited`), the slot's answer if it comes while its worker has not
/// gone to sleep in the kernel, up to [`RUNNABLE_WAIT`] in all.
fn while_runnable(slot: &Slot, waited: Duration) -> Option<Answer> {
    let mut waited = waited;
    while waited < RUNNABLE_WAIT && !sleeps_in_kernel(slot) {
        if let Some(answer) = wait_for(slot, STATE_STEP) {
            return Some(answer);
        }
        waited += STATE_STEP;
    }
    wait_for(slot, Duration::ZERO)
}

/// Whether the slot's worker has started its read and sleeps in the kernel (`D`, as a
/// reader queued on a held `mmap_lock` does, or `S`): not merely queued or runnable.
fn sleeps_in_kernel(slot: &Slot) -> bool {
    let Some(tid) = *slot.worker.lock().unwrap_or_else(|e| e.into_inner()) else {
        return false;
    };
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    let state = stat
        .rsplit_once(") ")
        .and_then(|(_, rest)| rest.chars().next());
    // Unreadable (the thread gone?): counted as sleeping, so that nothing waits on it.
    matches!(state, Some('D' | 'S') | None)
}

/// The slot's answer, if it comes within `wait`.
fn wait_for(slot: &Slot, wait: Duration) -> Option<Answer> {
    let deadline = Instant::now() + wait;
    let mut answer = slot.answer.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        if let Some(answer) = answer.take() {
            return Some(answer);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        answer = slot
            .done
            .wait_timeout(answer, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn is_answered(slot: &Slot) -> bool {
    slot.answer
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some()
}

/// A worker: takes jobs one at a time; back to idle after each.
fn spawn_worker(reader: &'static Reader) -> std::io::Result<()> {
    let queue = Arc::clone(&reader.queue);
    std::thread::Builder::new()
        .name("address-space".into())
        .stack_size(WORKER_STACK)
        .spawn(move || {
            loop {
                let job = {
                    let queue = queue.lock().unwrap_or_else(|e| e.into_inner());
                    match queue.recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    }
                };
                job();
                reader.book.lock().unwrap_or_else(|e| e.into_inner()).idle += 1;
            }
        })
        .map(drop)
}

/// How many reads are held now (for `status` and tests).
pub fn held_now() -> usize {
    let book = reader().book.lock().unwrap_or_else(|e| e.into_inner());
    book.held.values().filter(|slot| !is_answered(slot)).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Process {
        let pid = std::process::id();
        let stat = crate::backends::procfs::stat(pid).unwrap();
        Process {
            pid,
            started: stat.start_time,
            image: stat.exec_fingerprint,
        }
    }

    #[test]
    fn a_read_that_answers_in_time_is_returned() {
        assert_eq!(read(me(), SpaceFile::Environ, || 42), Ok(42));
    }

    /// A read that outlives its deadline is held: asked again it is not made again, and
    /// once it answers its answer is the next ask's.
    #[test]
    fn a_held_read_is_made_once_and_its_late_answer_kept() {
        let me = me();
        let (go, wait) = mpsc::channel::<()>();
        let made = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let count = Arc::clone(&made);
        let first = read_within(me, SpaceFile::Maps, Duration::from_millis(20), move || {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            wait.recv().ok();
            7u32
        });
        assert_eq!(first, Err(NoAnswer::Held));
        let again = read(me, SpaceFile::Maps, || 8u32);
        assert_eq!(
            again,
            Err(NoAnswer::Held),
            "made again while the first waits"
        );
        go.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let late = loop {
            match read(me, SpaceFile::Maps, || 9u32) {
                Err(NoAnswer::Held) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                other => break other,
            }
        };
        assert_eq!(late, Ok(7), "the late answer is the next ask's");
        assert_eq!(made.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(read(me, SpaceFile::Maps, || 9u32), Ok(9));
    }

    /// A read that is slow because its worker waits for a CPU, not for anyone's lock, is
    /// not held: on a loaded machine a worker may run late (as in CI, with two guests
    /// busy on two cores, where a process of an environment was left out of a snapshot).
    #[test]
    fn a_read_whose_worker_is_runnable_past_the_deadline_is_waited_for() {
        let busy = read_within(me(), SpaceFile::Environ, Duration::from_millis(20), || {
            let until = Instant::now() + Duration::from_millis(200);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            5u32
        });
        assert_eq!(busy, Ok(5));
    }
}
