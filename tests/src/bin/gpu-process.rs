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
//! An open that fails with ENXIO (a node with NVIDIA's major and no driver behind it,
//! which the LSM and fentry tiers see all the same) is reported on stderr and the
//! process carries on, as a program probing GPUs would.
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

/// The descriptor, or `None` after an ENXIO (no driver behind the node).
fn check(fd: i64, what: &str) -> Option<OwnedFd> {
    if fd < 0 {
        let error = std::io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::ENXIO) {
            eprintln!("{what}: {error} (no driver behind the node; carrying on)");
            return None;
        }
        panic!("{what}: {error}");
    }
    // SAFETY: a descriptor the kernel just returned to us.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn openat(dirfd: i32, path: &str, flags: i32, what: &str) -> Option<OwnedFd> {
    let fd = unsafe { libc::openat(dirfd, cstr(path).as_ptr(), flags) };
    check(fd as i64, &format!("{what} {path}"))
}

fn open(how: &Open) -> Vec<OwnedFd> {
    match how {
        Open::At(path) => openat(libc::AT_FDCWD, path, libc::O_RDONLY, "open")
            .into_iter()
            .collect(),
        Open::Syscall(path) => {
            let fd = unsafe { libc::syscall(libc::SYS_open, cstr(path).as_ptr(), libc::O_RDONLY) };
            check(fd, "open(2)").into_iter().collect()
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
