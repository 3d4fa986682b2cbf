//! A process whose address space is locked by its own user, as a hostile user can lock
//! theirs: whoever then waits for that process's `mmap_lock` (a read of
//! `/proc/PID/environ`, `cmdline` or `smaps_rollup`, a uprobe's registration) waits
//! until the user lets go. (`maps`, `stat` and `status` do not wait: on 6.18 `maps` is
//! read under per-VMA locks.)
//!
//! - `serve --mountpoint DIR --uid UID [--answer-after-ms N]` (as root): mounts a FUSE
//!   file system at DIR as `fusermount3` would for UID (`allow_other`,
//!   `default_permissions`), drops to UID and serves one file, `data` (1 MiB, 0644,
//!   UID's), whose READ requests it never answers, or answers (zeros) N ms after each
//!   came. Prints `mounted` once it answered the kernel's INIT.
//! - `hold --file PATH [--open DEV]... [--map LIB]...` (as the user): maps each LIB
//!   executable (as a program maps a library, so that a uprobe on it walks this
//!   process), maps PATH, then thread A reads
//!   the mapping through `/proc/self/mem`. That read takes the process's `mmap_lock` for
//!   reading (`access_remote_vm`, not a per-VMA lock) and faults the page in under it
//!   without leave to drop it (no `FAULT_FLAG_ALLOW_RETRY`), so it holds the lock for as
//!   long as the READ is unanswered. Thread B then calls `mmap`, which queues for the
//!   lock as a writer, and every later reader queues behind the writer. Then it opens
//!   each DEV (`O_RDWR`; a node with no driver behind it gives ENXIO, then `O_PATH`,
//!   printed as `opened DEV with O_PATH`), prints `held` and sleeps for good.
//!
//! Other ways in do not hold the lock (tried on 6.18: the writer's `mmap` went through
//! at once, `environ` read): `process_vm_readv`, `MADV_POPULATE_READ` and `mlock` fault
//! with leave to retry, so the fault drops `mmap_lock` while it waits for the page, and
//! a thread's own touch of the page faults under the VMA's lock and drops it the same
//! way.
//!
//! Killing the server (any way) aborts the FUSE connection: the READ fails, thread A's
//! read returns EIO, and everyone waiting goes on. Until then thread A cannot die, so
//! a holder killed first is not reaped before the server is gone.

use std::ffi::{CStr, CString};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("hold") => hold(&args[1..]),
        _ => bail!(
            "usage: fuse-stall serve --mountpoint DIR --uid UID [--answer-after-ms N]\n       \
             fuse-stall hold --file PATH [--open DEV]... [--map LIB]..."
        ),
    }
}

/// `--name value` pairs, in order.
fn options(args: &[String]) -> anyhow::Result<Vec<(&str, &str)>> {
    args.chunks(2)
        .map(|pair| match pair {
            [name, value] if name.starts_with("--") => Ok((&name[2..], value.as_str())),
            _ => bail!("expected `--name value`, got {pair:?}"),
        })
        .collect()
}

fn check(rc: libc::c_int, what: &str) -> anyhow::Result<()> {
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()).context(what.to_owned()),
    }
}

// The FUSE protocol, as `include/uapi/linux/fuse.h` defines it (7.31 is what this
// server speaks; the kernel speaks every older minor too).

const FUSE_LOOKUP: u32 = 1;
const FUSE_FORGET: u32 = 2;
const FUSE_GETATTR: u32 = 3;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_STATFS: u32 = 17;
const FUSE_RELEASE: u32 = 18;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_OPENDIR: u32 = 27;
const FUSE_READDIR: u32 = 28;
const FUSE_RELEASEDIR: u32 = 29;
const FUSE_INTERRUPT: u32 = 36;
const FUSE_BATCH_FORGET: u32 = 42;
/// Readahead is sent in the background: the faulting thread then waits on the page's
/// lock (state D) rather than on the request (state S, and interruptible).
const FUSE_ASYNC_READ: u32 = 1 << 0;

const ROOT: u64 = 1;
const DATA: u64 = 2;
const DATA_SIZE: u64 = 1024 * 1024;
/// How long the kernel may keep what it was told of names and attributes: for good.
const VALID_S: u64 = 3600;

#[repr(C)]
#[derive(Clone, Copy)]
struct InHeader {
    len: u32,
    opcode: u32,
    unique: u64,
    nodeid: u64,
    uid: u32,
    gid: u32,
    pid: u32,
    total_extlen: u16,
    padding: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct OutHeader {
    len: u32,
    error: i32,
    unique: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct InitIn {
    major: u32,
    minor: u32,
    max_readahead: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct InitOut {
    major: u32,
    minor: u32,
    max_readahead: u32,
    flags: u32,
    max_background: u16,
    congestion_threshold: u16,
    max_write: u32,
    time_gran: u32,
    max_pages: u16,
    map_alignment: u16,
    flags2: u32,
    unused: [u32; 7],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Attr {
    ino: u64,
    size: u64,
    blocks: u64,
    atime: u64,
    mtime: u64,
    ctime: u64,
    atimensec: u32,
    mtimensec: u32,
    ctimensec: u32,
    mode: u32,
    nlink: u32,
    uid: u32,
    gid: u32,
    rdev: u32,
    blksize: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct EntryOut {
    nodeid: u64,
    generation: u64,
    entry_valid: u64,
    attr_valid: u64,
    entry_valid_nsec: u32,
    attr_valid_nsec: u32,
    attr: Attr,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct AttrOut {
    attr_valid: u64,
    attr_valid_nsec: u32,
    dummy: u32,
    attr: Attr,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct OpenOut {
    fh: u64,
    open_flags: u32,
    padding: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct ReadIn {
    fh: u64,
    offset: u64,
    size: u32,
    read_flags: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct StatfsOut {
    blocks: u64,
    bfree: u64,
    bavail: u64,
    files: u64,
    ffree: u64,
    bsize: u32,
    namelen: u32,
    frsize: u32,
    padding: u32,
    spare: [u32; 6],
}

/// The bytes of one of the structs above (all `repr(C)` with no padding inside).
fn bytes_of<T: Copy>(value: &T) -> &[u8] {
    // SAFETY: `value` is a live `T` of `size_of::<T>()` bytes; the structs passed here
    // have no padding, so every byte is initialised.
    unsafe { std::slice::from_raw_parts((value as *const T).cast(), size_of::<T>()) }
}

/// The `T` at the start of `bytes`, if they are that long.
fn read_struct<T: Copy>(bytes: &[u8]) -> Option<T> {
    (bytes.len() >= size_of::<T>()).then(|| {
        // SAFETY: at least `size_of::<T>()` readable bytes; `T` is plain integers, valid
        // for any bits; read unaligned since a byte buffer has no alignment.
        unsafe { bytes.as_ptr().cast::<T>().read_unaligned() }
    })
}

/// Writes one reply to the kernel. ENOENT (the request was interrupted or the
/// connection aborted meanwhile) is no failure of the server's.
fn reply(fuse: RawFd, unique: u64, error: i32, payload: &[u8]) -> anyhow::Result<()> {
    let header = OutHeader {
        len: (size_of::<OutHeader>() + payload.len()) as u32,
        error: -error,
        unique,
    };
    let mut message = bytes_of(&header).to_vec();
    message.extend_from_slice(payload);
    // SAFETY: a live buffer of `message.len()` bytes; `fuse` is the open /dev/fuse.
    let written = unsafe { libc::write(fuse, message.as_ptr().cast(), message.len()) };
    if written < 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::ENOENT) {
            return Err(error).context("writing a reply to /dev/fuse");
        }
    }
    Ok(())
}

struct Server {
    fuse: RawFd,
    uid: u32,
    answer_after: Option<Duration>,
}

impl Server {
    fn attr(&self, node: u64) -> Option<Attr> {
        let (mode, size, nlink) = match node {
            ROOT => (libc::S_IFDIR | 0o755, 0, 2),
            DATA => (libc::S_IFREG | 0o644, DATA_SIZE, 1),
            _ => return None,
        };
        Some(Attr {
            ino: node,
            size,
            blocks: size / 512,
            mode,
            nlink,
            uid: self.uid,
            gid: self.uid,
            blksize: 4096,
            ..Attr::default()
        })
    }

    /// Answers one request (or, for READ, FORGET and INTERRUPT, not).
    fn handle(&self, request: &[u8]) -> anyhow::Result<()> {
        let header: InHeader = read_struct(request).context("a short request")?;
        let body = &request[size_of::<InHeader>()..];
        let (unique, node) = (header.unique, header.nodeid);
        let ok = |payload: &[u8]| reply(self.fuse, unique, 0, payload);
        let fail = |error: i32| reply(self.fuse, unique, error, &[]);
        match header.opcode {
            FUSE_INIT => self.init(unique, body),
            FUSE_LOOKUP if node == ROOT && body.starts_with(b"data\0") => {
                let attr = self.attr(DATA).unwrap();
                let entry_out = EntryOut {
                    nodeid: DATA,
                    generation: 1,
                    entry_valid: VALID_S,
                    attr_valid: VALID_S,
                    entry_valid_nsec: 0,
                    attr_valid_nsec: 0,
                    attr,
                };
                ok(bytes_of(&entry_out))
            }
            FUSE_LOOKUP => fail(libc::ENOENT),
            FUSE_GETATTR => match self.attr(node) {
                Some(attr) => ok(bytes_of(&AttrOut {
                    attr_valid: VALID_S,
                    attr_valid_nsec: 0,
                    dummy: 0,
                    attr,
                })),
                None => fail(libc::ENOENT),
            },
            FUSE_OPEN | FUSE_OPENDIR => ok(bytes_of(&OpenOut::default())),
            FUSE_READ => self.read(unique, body),
            // An empty listing: nothing here needs `ls` to see `data`.
            FUSE_READDIR | FUSE_FLUSH | FUSE_RELEASE | FUSE_RELEASEDIR => ok(&[]),
            FUSE_STATFS => ok(bytes_of(&StatfsOut {
                blocks: DATA_SIZE / 4096,
                bsize: 4096,
                namelen: 255,
                frsize: 4096,
                ..StatfsOut::default()
            })),
            // No reply is expected to a FORGET; an INTERRUPT is left unanswered so that
            // the READ it is about stays held.
            FUSE_FORGET | FUSE_BATCH_FORGET | FUSE_INTERRUPT => Ok(()),
            _ => fail(libc::ENOSYS),
        }
    }

    fn init(&self, unique: u64, body: &[u8]) -> anyhow::Result<()> {
        let init: InitIn = read_struct(body).context("a short INIT")?;
        if init.major != 7 {
            bail!(
                "the kernel speaks FUSE {}.{}, not 7",
                init.major,
                init.minor
            );
        }
        let init_out = InitOut {
            major: 7,
            minor: init.minor.min(31),
            max_readahead: init.max_readahead,
            flags: init.flags & FUSE_ASYNC_READ,
            max_background: 16,
            congestion_threshold: 12,
            max_write: 4096,
            time_gran: 1,
            ..InitOut::default()
        };
        reply(self.fuse, unique, 0, bytes_of(&init_out))?;
        let mut stdout = std::io::stdout();
        writeln!(stdout, "mounted")?;
        stdout.flush()?;
        Ok(())
    }

    /// Holds the READ (nothing remembers it: the kernel ends it when the connection
    /// goes), or answers it with zeros `answer_after` from now, from a thread of its own.
    fn read(&self, unique: u64, body: &[u8]) -> anyhow::Result<()> {
        let Some(after) = self.answer_after else {
            return Ok(());
        };
        let read: ReadIn = read_struct(body).context("a short READ")?;
        let length = (read.size as u64).min(DATA_SIZE.saturating_sub(read.offset));
        let fuse = self.fuse;
        std::thread::spawn(move || {
            std::thread::sleep(after);
            let zeros = vec![0; length as usize];
            if let Err(error) = reply(fuse, unique, 0, &zeros) {
                eprintln!("fuse-stall: {error:#}");
            }
        });
        Ok(())
    }
}

extern "C" fn exit_now(_: libc::c_int) {
    // SAFETY: _exit(2) is async-signal-safe and touches nothing of the process's.
    unsafe { libc::_exit(0) }
}

fn serve(args: &[String]) -> anyhow::Result<()> {
    let (mut mountpoint, mut uid, mut answer_after) = (None, None, None);
    for (name, value) in options(args)? {
        match name {
            "mountpoint" => mountpoint = Some(CString::new(value)?),
            "uid" => uid = Some(value.parse::<u32>()?),
            "answer-after-ms" => answer_after = Some(Duration::from_millis(value.parse()?)),
            _ => bail!("serve: unknown option --{name}"),
        }
    }
    let (mountpoint, uid) = (mountpoint.context("--mountpoint")?, uid.context("--uid")?);
    let flags = rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC;
    let fuse = rustix::fs::open("/dev/fuse", flags, rustix::fs::Mode::empty())
        .context("opening /dev/fuse")?;
    let options = CString::new(format!(
        "fd={},rootmode=40000,user_id={uid},group_id={uid},allow_other,default_permissions,subtype=stall",
        fuse.as_raw_fd()
    ))?;
    // SAFETY: NUL-terminated strings alive across the call.
    let rc = unsafe {
        libc::mount(
            c"stall".as_ptr(),
            mountpoint.as_ptr(),
            c"fuse".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            options.as_ptr().cast(),
        )
    };
    check(rc, "mounting FUSE (needs root)")?;
    // The server runs as the user from here on, as a user's own server would.
    // SAFETY: setgroups(2) with no groups reads no pointer; the others take integers.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }, "setgroups")?;
    // SAFETY: as above.
    check(unsafe { libc::setgid(uid) }, "setgid")?;
    // SAFETY: as above.
    check(unsafe { libc::setuid(uid) }, "setuid")?;
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: the handler is an `extern "C" fn(c_int)` that only calls _exit.
        unsafe { libc::signal(signal, exit_now as *const () as libc::sighandler_t) };
    }
    let server = Server {
        fuse: fuse.as_raw_fd(),
        uid,
        answer_after,
    };
    // Big enough for any request at max_write 4096 (the kernel wants at least 8 KiB).
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        match rustix::io::read(&fuse, &mut buffer) {
            Ok(length) => server.handle(&buffer[..length])?,
            // An interrupted request, gone before it was read: the next one.
            Err(rustix::io::Errno::INTR | rustix::io::Errno::NOENT) => {}
            // Unmounted, or the connection aborted.
            Err(rustix::io::Errno::NODEV) => return Ok(()),
            Err(error) => return Err(error).context("reading /dev/fuse"),
        }
    }
}

/// A thread that does `work` once told to go, and where to read its state.
struct Stalled {
    go: OwnedFd,
    stat: CString,
}

impl Stalled {
    fn spawn(work: impl FnOnce() + Send + 'static) -> anyhow::Result<Self> {
        let mut ends = [0; 2];
        // SAFETY: pipe2(2) writes two descriptors into the array.
        let rc = unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) };
        check(rc, "pipe2")?;
        // SAFETY: both descriptors are fresh and owned by nothing else.
        let (wait, go) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
        let tid = Arc::new(AtomicI32::new(0));
        let told = tid.clone();
        std::thread::spawn(move || {
            // SAFETY: gettid(2) takes nothing.
            told.store(unsafe { libc::gettid() }, Ordering::SeqCst);
            let mut byte = 0u8;
            // SAFETY: reads one byte into a live local.
            unsafe { libc::read(wait.as_raw_fd(), (&raw mut byte).cast(), 1) };
            work();
        });
        let started = Instant::now();
        while tid.load(Ordering::SeqCst) == 0 {
            if started.elapsed() > Duration::from_secs(10) {
                bail!("a thread did not start");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let stat = CString::new(format!(
            "/proc/self/task/{}/stat",
            tid.load(Ordering::SeqCst)
        ))?;
        Ok(Self { go, stat })
    }

    /// Lets it go and waits (10 s at most) for it to sleep uninterruptibly, without
    /// allocating: from the first go on, a `brk` or `mmap` here would queue for the lock.
    fn go_and_wait_blocked(&self) -> bool {
        let byte = 1u8;
        // SAFETY: writes one byte from a live local to the pipe.
        unsafe { libc::write(self.go.as_raw_fd(), (&raw const byte).cast(), 1) };
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if task_state(&self.stat) == b'D' {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }
}

/// A task's state letter from its `stat` (which takes no `mmap_lock`), read into the
/// stack; `?` if unreadable.
fn task_state(stat: &CStr) -> u8 {
    let mut text = [0u8; 1024];
    // SAFETY: a NUL-terminated path alive across the call.
    let fd = unsafe { libc::open(stat.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return b'?';
    }
    // SAFETY: reads at most `text.len()` bytes into it; `fd` is ours, closed once.
    let length = unsafe { libc::read(fd, text.as_mut_ptr().cast(), text.len()) };
    // SAFETY: as above.
    unsafe { libc::close(fd) };
    let text = &text[..length.max(0) as usize];
    // `pid (comm) S ...`: the name may hold anything, so from the last `)`.
    match text.iter().rposition(|&b| b == b')') {
        Some(end) if end + 2 < text.len() => text[end + 2],
        _ => b'?',
    }
}

/// Writes to stdout unbuffered (Rust's stdout would allocate its buffer on first use).
fn say(line: &[u8]) {
    // SAFETY: a live buffer of `line.len()` bytes.
    unsafe { libc::write(1, line.as_ptr().cast(), line.len()) };
}

/// Faults in the next 256 KiB of stack, so that nothing after `held` grows it.
#[inline(never)]
fn touch_stack() {
    let mut stack = [0u8; 256 * 1024];
    for page in stack.chunks_mut(4096) {
        // SAFETY: a write to a live local byte.
        unsafe { std::ptr::write_volatile(&raw mut page[0], 1) };
    }
    std::hint::black_box(&stack);
}

/// A device to open after the lock is held, and what is said of it.
struct Open {
    path: CString,
    as_path_only: Vec<u8>,
    failed: Vec<u8>,
}

fn hold(args: &[String]) -> anyhow::Result<()> {
    let (mut file, mut opens, mut maps) = (None, Vec::new(), Vec::new());
    for (name, value) in options(args)? {
        match name {
            "file" => file = Some(value.to_owned()),
            "map" => maps.push(std::fs::File::open(value).context("opening --map")?),
            "open" => opens.push(Open {
                path: CString::new(value)?,
                as_path_only: format!("opened {value} with O_PATH\n").into_bytes(),
                failed: format!("fuse-stall: cannot open {value}\n").into_bytes(),
            }),
            _ => bail!("hold: unknown option --{name}"),
        }
    }
    for library in &maps {
        // SAFETY: a fresh mapping of a file kept open for the process's life, as a
        // program maps a library; nothing reads it.
        let mapped = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                library.metadata()?.len() as usize,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE,
                library.as_raw_fd(),
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mmap of --map");
        }
    }
    let file = std::fs::File::open(file.context("--file")?).context("opening --file")?;
    let length = 4096;
    // SAFETY: a fresh mapping of a file we keep open; nothing else is at its address.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            length,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error()).context("mmap of --file");
    }
    let memory = std::fs::File::open("/proc/self/mem").context("opening /proc/self/mem")?;
    let offset = address as libc::off_t;
    let reader = Stalled::spawn(move || {
        let mut page = [0u8; 64];
        // SAFETY: reads into a live local; the offset is the mapping's address, read
        // through the kernel's side door (which is the point).
        unsafe {
            libc::pread(
                memory.as_raw_fd(),
                page.as_mut_ptr().cast(),
                page.len(),
                offset,
            )
        };
    })?;
    let writer = Stalled::spawn(|| {
        // SAFETY: a fresh anonymous mapping, never used; it only has to ask for the lock.
        unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
    })?;
    let mut held_open = Vec::with_capacity(opens.len());
    touch_stack();
    // From here on nothing allocates: a thread's heap or stack that grows needs the lock.
    if !reader.go_and_wait_blocked() {
        say(b"fuse-stall: the read of the mapping did not block\n");
        // SAFETY: leaves at once; the threads go with the process.
        unsafe { libc::_exit(1) };
    }
    if !writer.go_and_wait_blocked() {
        say(b"fuse-stall: the mmap did not queue for the lock\n");
        // SAFETY: as above.
        unsafe { libc::_exit(1) };
    }
    for open in &opens {
        held_open.push(open_device(open));
    }
    say(b"held\n");
    loop {
        // SAFETY: pause(2) takes nothing; it returns only to a handled signal.
        unsafe { libc::pause() };
    }
}

/// Opens `open`'s device read-write, or with `O_PATH` where no driver is behind it.
fn open_device(open: &Open) -> RawFd {
    // SAFETY: a NUL-terminated path alive across the call.
    let fd = unsafe { libc::open(open.path.as_ptr(), libc::O_RDWR) };
    if fd >= 0 {
        return fd;
    }
    if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
        // SAFETY: as above.
        let fd = unsafe { libc::open(open.path.as_ptr(), libc::O_PATH) };
        if fd >= 0 {
            say(&open.as_path_only);
            return fd;
        }
    }
    say(&open.failed);
    // SAFETY: leaves at once; the threads go with the process.
    unsafe { libc::_exit(1) }
}
