//! A process that "uses a GPU" in tests: the fake NVML lists its pid, and it waits.
//!
//! - `--ignore-sigterm`: ignore SIGTERM (to test the SIGKILL escalation);
//! - `--hold PATH`: keep PATH open with O_PATH (a GPU node held open, as the /proc
//!   fallback sees it; a node with no driver behind it cannot be opened for I/O);
//! - `--wait-stdin`: after `ready`, wait for a line on stdin before the opens below;
//! - opens of a device node, each kept open, each a different way in:
//!   `--open PATH` (openat from the working directory), `--open-syscall PATH` (open(2)),
//!   `--open2 PATH` (openat2(2)), `--open-at DIR NAME` (openat relative to a directory
//!   descriptor), `--reopen PATH` (O_PATH, then `/proc/self/fd/N`), `--open-in-thread
//!   PATH` (from a second thread).
//!
//!   `--open-uring PATH` (an io_uring `IORING_OP_OPENAT`), `--open-clone-files PATH` (in
//!   a `clone(CLONE_FILES)` child, which exits: the descriptor stays in the shared table;
//!   `returned none` if it is not there), `--open-int80 PATH` (a 32-bit `open` through
//!   `int 0x80`, x86-64 only). `--fresh-table` and `--grown-table`, before them: the
//!   opens come from the kernel's embedded descriptor table, or from a grown one.
//! - `--fork`: the opens happen in a child forked without exec; the parent waits for
//!   it and prints `child exited N` or `child killed by signal N`;
//! - `--attempts N PATH`: fork N children one after the other, each opening PATH once
//!   and exiting; print `attempts N returned R succeeded S killed K` (how many opens
//!   returned to the child at all, how many reached the device: a descriptor, or ENXIO
//!   from a node with no driver behind it; how many children died of SIGKILL) and exit;
//! - `--attempts-until STOP PATH`: the same until the file STOP exists, with a line for
//!   each attempt as it ends: `attempt START END ok|enxio|eperm|error|killed|silent`
//!   (CLOCK_MONOTONIC, microseconds, as systemd's `…TimestampMonotonic`);
//! - `--reexec-envp LIST`: first exec itself again with exactly the environment entries
//!   of LIST (separated by `|`; duplicates kept, order kept), same pid;
//! - `--reexec-env VALUE`: first exec itself again with `GENV_ENVIRONMENT_ID` set to
//!   VALUE (`-`: removed), same pid, the other arguments kept.
//!
//! An open that fails with ENXIO (a node with NVIDIA's major and no driver behind it,
//! which the LSM, fmod_ret and fentry tiers see all the same) or EPERM (refused by the kernel)
//! is reported and the process carries on, as a program probing GPUs would. After
//! `--wait-stdin`, each open prints `returned ok|ENXIO|EPERM <how>` the moment it
//! returns: a process killed inside the syscall prints nothing.
//!
//! It prints `ready` once set up (and `opened` after opens that waited for stdin), so
//! tests never race it.

#[path = "gpu-process/tables.rs"]
mod tables;

use std::ffi::CString;
use std::io::{BufRead, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;

enum Open {
    At(String),
    Syscall(String),
    Openat2(String),
    Relative(String, String),
    Reopen(String),
    Thread(String),
    Uring(String),
    CloneFiles(String),
    Int80(String),
}

/// Whether open results are printed as they return (after `--wait-stdin`).
static REPORT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn report(result: &str, what: &str) {
    if REPORT.load(std::sync::atomic::Ordering::SeqCst) {
        let mut out = std::io::stdout().lock();
        writeln!(out, "returned {result} {what}").unwrap();
        out.flush().unwrap();
    }
}

fn cstr(path: &str) -> CString {
    CString::new(path).unwrap()
}

/// The descriptor, or `None` after an ENXIO (no driver behind the node) or an EPERM
/// (the kernel refused).
fn check(fd: i64, what: &str) -> Option<OwnedFd> {
    if fd < 0 {
        let error = std::io::Error::last_os_error();
        return failed(error, what);
    }
    report("ok", what);
    // SAFETY: a descriptor the kernel just returned to us.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn failed(error: std::io::Error, what: &str) -> Option<OwnedFd> {
    let name = match error.raw_os_error() {
        Some(libc::ENXIO) => "ENXIO",
        Some(libc::EPERM) => "EPERM",
        _ => panic!("{what}: {error}"),
    };
    report(name, what);
    eprintln!("{what}: {error} (carrying on)");
    None
}

fn openat(dirfd: i32, path: &str, flags: i32, what: &str) -> Option<OwnedFd> {
    // SAFETY: the path is a NUL-terminated `CString` alive across the call.
    let fd = unsafe { libc::openat(dirfd, cstr(path).as_ptr(), flags) };
    check(fd as i64, &format!("{what} {path}"))
}

fn open(how: &Open) -> Vec<OwnedFd> {
    match how {
        Open::At(path) => openat(libc::AT_FDCWD, path, libc::O_RDONLY, "open")
            .into_iter()
            .collect(),
        Open::Syscall(path) => {
            // SAFETY: the path is a NUL-terminated `CString` alive across the call.
            let fd = unsafe { libc::syscall(libc::SYS_open, cstr(path).as_ptr(), libc::O_RDONLY) };
            check(fd, "open(2)").into_iter().collect()
        }
        Open::Openat2(path) => {
            // struct open_how { u64 flags; u64 mode; u64 resolve; }
            let how: [u64; 3] = [libc::O_RDONLY as u64, 0, 0];
            // SAFETY: the path is a NUL-terminated `CString` and `how` a live
            // `open_how` of the size passed, both alive across the call.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_openat2,
                    libc::AT_FDCWD,
                    cstr(path).as_ptr(),
                    &how,
                    size_of::<[u64; 3]>(),
                )
            };
            check(fd, "openat2(2)").into_iter().collect()
        }
        Open::Relative(dir, name) => {
            let dirfd = openat(
                libc::AT_FDCWD,
                dir,
                libc::O_DIRECTORY | libc::O_RDONLY,
                "open dir",
            )
            .expect("a directory");
            let fd = openat(
                std::os::fd::AsRawFd::as_raw_fd(&dirfd),
                name,
                libc::O_RDONLY,
                "openat(dirfd)",
            );
            std::iter::once(dirfd).chain(fd).collect()
        }
        Open::Reopen(path) => {
            let path_fd = openat(libc::AT_FDCWD, path, libc::O_PATH, "O_PATH").expect("O_PATH");
            let via = format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(&path_fd)
            );
            let file = openat(libc::AT_FDCWD, &via, libc::O_RDONLY, "open");
            std::iter::once(path_fd).chain(file).collect()
        }
        Open::Thread(path) => {
            let path = path.clone();
            std::thread::spawn(move || open(&Open::At(path)))
                .join()
                .expect("the opening thread")
        }
        Open::Uring(path) => open_with_io_uring(path).into_iter().collect(),
        Open::CloneFiles(path) => open_in_clone_files_child(path).into_iter().collect(),
        Open::Int80(path) => open_through_int80(path).into_iter().collect(),
    }
}

/// A 32-bit `open` through `int 0x80` from this 64-bit process: the kernel runs it as a
/// compat syscall, which fires no `sys_exit_open*` tracepoint. Its pointers are 32-bit,
/// so the path is copied below 4 GiB first.
fn open_through_int80(path: &str) -> Option<OwnedFd> {
    let name = cstr(path);
    let bytes = name.as_bytes_with_nul();
    // SAFETY: a fresh private mapping of our own, below 4 GiB (MAP_32BIT).
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_32BIT,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED, "mmap below 4 GiB");
    assert!(bytes.len() <= 4096, "a path longer than a page");
    // SAFETY: `bytes` fits in the page just mapped.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), page.cast::<u8>(), bytes.len()) };
    let ret: i32;
    // SAFETY: the i386 `open(path, O_RDONLY)`: eax = 5, ebx = path, ecx = flags; the
    // kernel returns in eax and may clear r8-r11 on the way back. rbx belongs to LLVM:
    // the path goes in through a swap, and rbx is restored after.
    unsafe {
        std::arch::asm!(
            "xchg {path}, rbx",
            "int 0x80",
            "xchg {path}, rbx",
            path = inout(reg) page as u64 => _,
            inlateout("eax") 5i32 => ret,
            in("ecx") libc::O_RDONLY,
            in("edx") 0i32,
            lateout("r8") _,
            lateout("r9") _,
            lateout("r10") _,
            lateout("r11") _,
        );
    }
    // SAFETY: `page` is the page mapped above, used by nothing after this.
    unsafe { libc::munmap(page, 4096) };
    let what = format!("int 0x80 open {path}");
    if ret < 0 {
        return failed(std::io::Error::from_raw_os_error(-ret), &what);
    }
    check(ret as i64, &what)
}

/// A child made with `clone(CLONE_FILES)`, a process of its own sharing this one's file
/// table, opens `path` and exits (or is killed in the open). The descriptor it made is
/// then this process's too: reported as `returned ok clone(CLONE_FILES)` if it is
/// there. The child reports nothing itself.
fn open_in_clone_files_child(path: &str) -> Option<OwnedFd> {
    let name = cstr(path);
    // SAFETY: without CLONE_VM the child runs on a copy of this stack, as after fork;
    // it only opens and exits.
    let child = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_FILES | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if child == 0 {
        // SAFETY: the child of clone(CLONE_FILES) makes raw calls only; `name` is a
        // NUL-terminated path.
        let fd = unsafe { libc::open(name.as_ptr(), libc::O_RDONLY) };
        // SAFETY: _exit(2) ends the child at once, touching no Rust state.
        unsafe { libc::_exit(if fd >= 0 { 0 } else { 1 }) };
    }
    assert!(child > 0, "clone: {}", std::io::Error::last_os_error());
    let mut status = 0;
    // SAFETY: `status` is a live int for waitpid(2) to write.
    unsafe { libc::waitpid(child as i32, &mut status, 0) };
    let node = std::fs::metadata(path).ok()?;
    let held = std::fs::read_dir("/proc/self/fd").ok()?.find_map(|entry| {
        let entry = entry.ok()?;
        let meta = std::fs::metadata(entry.path()).ok()?;
        let same = std::os::unix::fs::MetadataExt::rdev(&meta)
            == std::os::unix::fs::MetadataExt::rdev(&node)
            && std::os::unix::fs::FileTypeExt::is_char_device(&meta.file_type());
        same.then(|| entry.file_name().to_str()?.parse::<i32>().ok())?
    });
    match held {
        Some(fd) => check(fd as i64, "clone(CLONE_FILES)"),
        None => {
            report("none", "clone(CLONE_FILES)");
            None
        }
    }
}

/// An `openat` submitted through io_uring: no `open*` syscall is made by the process.
fn open_with_io_uring(path: &str) -> Option<OwnedFd> {
    let mut ring = io_uring::IoUring::new(4).expect("io_uring_setup");
    let name = cstr(path);
    let entry = io_uring::opcode::OpenAt::new(io_uring::types::Fd(libc::AT_FDCWD), name.as_ptr())
        .flags(libc::O_RDONLY)
        .build();
    // SAFETY: `name` outlives the submission, which completes before it is dropped.
    unsafe { ring.submission().push(&entry) }.expect("a free submission slot");
    ring.submit_and_wait(1).expect("io_uring_enter");
    let result = ring.completion().next().expect("a completion").result();
    let what = format!("io_uring openat {path}");
    if result < 0 {
        return failed(std::io::Error::from_raw_os_error(-result), &what);
    }
    check(result as i64, &what)
}

/// Re-executes this program with exactly `entries` as its environment block.
fn reexec_raw(entries: &str, args: &[String]) -> ! {
    let exe = cstr("/proc/self/exe");
    let argv: Vec<CString> = std::iter::once("gpu-process".to_owned())
        .chain(args.iter().cloned())
        .map(|a| CString::new(a).unwrap())
        .collect();
    let envp: Vec<CString> = entries
        .split('|')
        .chain(["GPU_PROCESS_REEXECUTED=1"])
        .map(|e| CString::new(e).unwrap())
        .collect();
    let argv_ptrs: Vec<*const libc::c_char> = argv
        .iter()
        .map(|a| a.as_ptr())
        .chain([std::ptr::null()])
        .collect();
    let envp_ptrs: Vec<*const libc::c_char> = envp
        .iter()
        .map(|e| e.as_ptr())
        .chain([std::ptr::null()])
        .collect();
    // SAFETY: every pointer is a live NUL-terminated string, and both arrays end in a
    // null pointer.
    unsafe { libc::execve(exe.as_ptr(), argv_ptrs.as_ptr(), envp_ptrs.as_ptr()) };
    panic!("execve: {}", std::io::Error::last_os_error());
}

/// Re-executes this program with `GENV_ENVIRONMENT_ID` changed, keeping `args`.
fn reexec(value: &str, args: &[String]) -> ! {
    use std::os::unix::process::CommandExt;
    let mut command = std::process::Command::new("/proc/self/exe");
    command.args(args).env("GPU_PROCESS_REEXECUTED", "1");
    if value == "-" {
        command.env_remove("GENV_ENVIRONMENT_ID");
    } else {
        command.env("GENV_ENVIRONMENT_ID", value);
    }
    panic!("exec: {}", command.exec());
}

/// How `--attempts` runs on: a number of attempts, or until a file exists.
enum Until {
    Count(u32),
    Exists(CString),
}

impl Until {
    fn more(&self, done: u32) -> bool {
        match self {
            Self::Count(count) => done < *count,
            // SAFETY: a NUL-terminated path.
            Self::Exists(path) => (unsafe { libc::access(path.as_ptr(), libc::F_OK) }) != 0,
        }
    }
}

/// What became of one attempt: what its child's open returned (one byte through the
/// pipe), or that it died without saying.
fn outcome(byte: Option<u8>, killed: bool) -> &'static str {
    match byte {
        Some(b'o') => "ok",
        // No driver behind the node: the open reached the device all the same.
        Some(b'n') => "enxio",
        Some(b'p') => "eperm",
        Some(_) => "error",
        None if killed => "killed",
        None => "silent",
    }
}

fn monotonic_us() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a live `timespec` for the call to write.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000
}

/// `--attempts`: outside processes trying to open a GPU node, many times over. Each
/// child reports through a pipe the moment its open returns: one byte, `o` for a
/// descriptor, `n` for ENXIO, `p` for EPERM, `f` for another failure. A child killed
/// inside the open writes nothing.
fn attempt_loop(until: Until, path: &str, each: bool) -> ! {
    let name = cstr(path);
    let mut pipe = [0; 2];
    // SAFETY: `pipe` is a live array of two ints, what pipe(2) writes.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let (mut done, mut returned, mut succeeded, mut killed) = (0u32, 0u32, 0u32, 0u32);
    let mut out = std::io::stdout().lock();
    while until.more(done) {
        done += 1;
        let started = monotonic_us();
        // SAFETY: the child makes raw syscalls only, then _exits.
        let died_of_sigkill = match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            // SAFETY: the child makes raw calls on live buffers only (`name`, `byte`),
            // then _exits.
            0 => unsafe {
                let fd = libc::open(name.as_ptr(), libc::O_RDONLY);
                let byte: u8 = match *libc::__errno_location() {
                    _ if fd >= 0 => b'o',
                    libc::ENXIO => b'n',
                    libc::EPERM => b'p',
                    _ => b'f',
                };
                libc::write(pipe[1], (&byte as *const u8).cast(), 1);
                libc::_exit(0);
            },
            child => {
                let mut status = 0;
                // SAFETY: `status` is a live int for waitpid(2) to write.
                unsafe { libc::waitpid(child, &mut status, 0) };
                libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL
            }
        };
        killed += u32::from(died_of_sigkill);
        // The child has exited: its byte, if it wrote one, is in the pipe.
        let mut available = 0i32;
        // SAFETY: `available` is a live int for FIONREAD to write.
        unsafe { libc::ioctl(pipe[0], libc::FIONREAD, &mut available) };
        let mut byte = None;
        if available > 0 {
            let mut read = 0u8;
            // SAFETY: `read` is a live byte, the one byte asked for.
            unsafe { libc::read(pipe[0], (&mut read as *mut u8).cast(), 1) };
            byte = Some(read);
            returned += 1;
            // An open that reached the device: a descriptor, or the driver's ENXIO.
            succeeded += u32::from(matches!(read, b'o' | b'n'));
        }
        if each {
            let what = outcome(byte, died_of_sigkill);
            writeln!(out, "attempt {started} {} {what}", monotonic_us()).unwrap();
            out.flush().unwrap();
        }
    }
    writeln!(
        out,
        "attempts {done} returned {returned} succeeded {succeeded} killed {killed}"
    )
    .unwrap();
    out.flush().unwrap();
    std::process::exit(0)
}

/// Writes over the environment block in place, as `setproctitle` does (Ray, gunicorn):
/// `/proc/self/environ` then shows the title, not the variables.
fn clobber_environ() {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    let fields: Vec<u64> = rest
        .split_ascii_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // proc(5): env_start and env_end are fields 50 and 51; `rest` starts at field 3.
    let (start, end) = (fields[50 - 3] as usize, fields[51 - 3] as usize);
    let title = b"gpu-process: worker\0";
    // SAFETY: our own environment block, which nothing reads from here on.
    unsafe {
        std::ptr::write_bytes(start as *mut u8, 0, end - start);
        std::ptr::copy_nonoverlapping(
            title.as_ptr(),
            start as *mut u8,
            title.len().min(end - start),
        );
    }
}

/// Goes on in a child forked now, without exec (its parent's environment identity
/// unresolved or not), which prints its pid before its opens; the parent waits, says
/// how the child ended, and exits.
fn fork_early() {
    // SAFETY: single-threaded here; both sides go on with plain calls.
    match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            // SAFETY: prctl(2) with PR_SET_PDEATHSIG takes no pointer.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            FORKED_EARLY.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        child => {
            report_child(child);
            std::process::exit(0);
        }
    }
}

/// Waits for `child` and says how it ended.
fn report_child(child: libc::pid_t) {
    let mut status = 0;
    // SAFETY: `status` is a live int for waitpid(2) to write.
    unsafe { libc::waitpid(child, &mut status, 0) };
    let mut out = std::io::stdout().lock();
    if libc::WIFSIGNALED(status) {
        writeln!(out, "child killed by signal {}", libc::WTERMSIG(status)).unwrap();
    } else {
        writeln!(out, "child exited {}", libc::WEXITSTATUS(status)).unwrap();
    }
    out.flush().unwrap();
}

static FORKED_EARLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs the opens in a child forked without exec; reports how it ended.
fn open_in_forked_child(opens: &[Open]) {
    // SAFETY: the child only opens files, prints and exits.
    match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            let held: Vec<OwnedFd> = opens.iter().flat_map(open).collect();
            drop(held);
            // SAFETY: _exit(2) ends the child at once, touching no Rust state.
            unsafe { libc::_exit(0) };
        }
        child => report_child(child),
    }
}

fn main() {
    let all: Vec<String> = std::env::args().skip(1).collect();
    if std::env::var_os("GPU_PROCESS_REEXECUTED").is_none() {
        if let Some(at) = all.iter().position(|a| a == "--reexec-envp") {
            let entries = all
                .get(at + 1)
                .expect("--reexec-envp needs a value")
                .clone();
            let mut rest = all.clone();
            rest.drain(at..at + 2);
            reexec_raw(&entries, &rest);
        }
        if let Some(at) = all.iter().position(|a| a == "--reexec-env") {
            let value = all.get(at + 1).expect("--reexec-env needs a value").clone();
            let mut rest = all.clone();
            rest.drain(at..at + 2);
            reexec(&value, &rest);
        }
    }
    if let Some(at) = all.iter().position(|a| a == "--leader-exits") {
        // The rest runs in a second thread; the leader thread exits now, as a program
        // that calls pthread_exit from main does.
        let mut rest = all.clone();
        rest.remove(at);
        std::thread::spawn(move || run(rest));
        // The raw exit(2) ends this thread alone, without unwinding through Rust frames.
        // SAFETY: exit(2) ends this thread alone; the other thread goes on, owning all
        // it uses.
        unsafe { libc::syscall(libc::SYS_exit, 0) };
        unreachable!();
    }
    run(all)
}

fn run(all: Vec<String>) -> ! {
    let mut held: Vec<OwnedFd> = Vec::new();
    let mut opens = Vec::new();
    let mut wait_stdin = false;
    let mut in_child = false;
    let mut args = all.into_iter();
    let value = |args: &mut dyn Iterator<Item = String>, flag: &str| {
        args.next()
            .unwrap_or_else(|| panic!("{flag} needs a value"))
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            // SAFETY: signal(2) only changes this process's SIGTERM disposition.
            "--ignore-sigterm" => unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_IGN);
            },
            "--hold" => {
                let path = value(&mut args, "--hold");
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_PATH)
                    .open(&path)
                    .unwrap_or_else(|e| panic!("cannot hold {path}: {e}"));
                held.push(file.into());
            }
            "--wait-stdin" => wait_stdin = true,
            "--open" => opens.push(Open::At(value(&mut args, "--open"))),
            "--open-syscall" => opens.push(Open::Syscall(value(&mut args, "--open-syscall"))),
            "--open2" => opens.push(Open::Openat2(value(&mut args, "--open2"))),
            "--open-at" => {
                let dir = value(&mut args, "--open-at");
                opens.push(Open::Relative(dir, value(&mut args, "--open-at")));
            }
            "--reopen" => opens.push(Open::Reopen(value(&mut args, "--reopen"))),
            "--open-in-thread" => opens.push(Open::Thread(value(&mut args, "--open-in-thread"))),
            "--open-uring" => opens.push(Open::Uring(value(&mut args, "--open-uring"))),
            "--open-int80" => opens.push(Open::Int80(value(&mut args, "--open-int80"))),
            "--open-clone-files" => {
                opens.push(Open::CloneFiles(value(&mut args, "--open-clone-files")))
            }
            "--fork" => in_child = true,
            "--fork-early" => fork_early(),
            "--fresh-table" => tables::fresh(),
            "--grown-table" => tables::grown(),
            "--clobber-environ" => clobber_environ(),
            "--attempts" => {
                let count = value(&mut args, "--attempts").parse().expect("a count");
                attempt_loop(Until::Count(count), &value(&mut args, "--attempts"), false);
            }
            "--attempts-until" => {
                let stop = cstr(&value(&mut args, "--attempts-until"));
                attempt_loop(
                    Until::Exists(stop),
                    &value(&mut args, "--attempts-until"),
                    true,
                );
            }
            "--reexec-env" | "--reexec-envp" => {
                value(&mut args, "--reexec-env"); // done above
            }
            other => panic!("unknown argument {other}"),
        }
    }
    let do_opens = |held: &mut Vec<OwnedFd>| {
        if in_child {
            open_in_forked_child(&opens);
        } else {
            held.extend(opens.iter().flat_map(open));
        }
    };
    if !wait_stdin {
        do_opens(&mut held);
    }
    println!("ready");
    std::io::stdout().flush().unwrap();
    if wait_stdin {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        REPORT.store(true, std::sync::atomic::Ordering::SeqCst);
        if FORKED_EARLY.load(std::sync::atomic::Ordering::SeqCst) {
            println!("pid {}", std::process::id());
        }
        do_opens(&mut held);
        println!("opened");
        std::io::stdout().flush().unwrap();
    }
    loop {
        // SAFETY: pause(2) takes nothing; it waits for a signal.
        unsafe { libc::pause() };
    }
}
