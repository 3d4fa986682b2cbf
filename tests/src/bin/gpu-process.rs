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
//! It prints `ready` once set up (and `opened` after opens that waited for stdin), so
//! tests never race it.

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
}

fn cstr(path: &str) -> CString {
    CString::new(path).unwrap()
}

fn check(fd: i64, what: &str) -> OwnedFd {
    if fd < 0 {
        panic!("{what}: {}", std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned to us.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

fn open(how: &Open) -> Vec<OwnedFd> {
    match how {
        Open::At(path) => vec![
            std::fs::OpenOptions::new()
                .read(true)
                .open(path)
                .unwrap_or_else(|e| panic!("open {path}: {e}"))
                .into(),
        ],
        Open::Syscall(path) => {
            let fd = unsafe { libc::syscall(libc::SYS_open, cstr(path).as_ptr(), libc::O_RDONLY) };
            vec![check(fd, "open(2)")]
        }
        Open::Openat2(path) => {
            // struct open_how { u64 flags; u64 mode; u64 resolve; }
            let how: [u64; 3] = [libc::O_RDONLY as u64, 0, 0];
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_openat2,
                    libc::AT_FDCWD,
                    cstr(path).as_ptr(),
                    &how,
                    size_of::<[u64; 3]>(),
                )
            };
            vec![check(fd, "openat2(2)")]
        }
        Open::Relative(dir, name) => {
            let dirfd =
                unsafe { libc::open(cstr(dir).as_ptr(), libc::O_DIRECTORY | libc::O_RDONLY) };
            let dirfd = check(dirfd as i64, "open dir");
            let fd = unsafe {
                libc::openat(
                    std::os::fd::AsRawFd::as_raw_fd(&dirfd),
                    cstr(name).as_ptr(),
                    libc::O_RDONLY,
                )
            };
            vec![dirfd, check(fd as i64, "openat(dirfd)")]
        }
        Open::Reopen(path) => {
            let path_fd = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_PATH)
                .open(path)
                .unwrap_or_else(|e| panic!("O_PATH {path}: {e}"));
            let via = format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(&path_fd)
            );
            let file = std::fs::File::open(&via).unwrap_or_else(|e| panic!("open {via}: {e}"));
            vec![path_fd.into(), file.into()]
        }
        Open::Thread(path) => {
            let path = path.clone();
            std::thread::spawn(move || open(&Open::At(path)))
                .join()
                .expect("the opening thread")
        }
    }
}

fn main() {
    let mut held: Vec<OwnedFd> = Vec::new();
    let mut opens = Vec::new();
    let mut wait_stdin = false;
    let mut args = std::env::args().skip(1);
    let value = |args: &mut dyn Iterator<Item = String>, flag: &str| {
        args.next()
            .unwrap_or_else(|| panic!("{flag} needs a value"))
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
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
            other => panic!("unknown argument {other}"),
        }
    }
    if !wait_stdin {
        held.extend(opens.iter().flat_map(open));
    }
    println!("ready");
    std::io::stdout().flush().unwrap();
    if wait_stdin {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        held.extend(opens.iter().flat_map(open));
        println!("opened");
        std::io::stdout().flush().unwrap();
    }
    loop {
        unsafe { libc::pause() };
    }
}
