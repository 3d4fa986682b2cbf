//! A process that "uses a GPU" in tests: the fake NVML lists its pid, and it waits.
//!
//! `--ignore-sigterm` makes it ignore SIGTERM (to test the SIGKILL escalation);
//! `--hold PATH` keeps PATH open with O_PATH (a GPU node held open, as the /proc
//! fallback sees it; a node with no driver behind it cannot be opened for I/O).
//! It prints `ready` once set up, so tests never race its start.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;

fn main() {
    let mut held = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ignore-sigterm" => unsafe {
                libc::signal(libc::SIGTERM, libc::SIG_IGN);
            },
            "--hold" => {
                let path = args.next().expect("--hold needs a path");
                let file = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_PATH)
                    .open(&path)
                    .unwrap_or_else(|e| panic!("cannot hold {path}: {e}"));
                held.push(file);
            }
            other => panic!("unknown argument {other}"),
        }
    }
    println!("ready");
    std::io::stdout().flush().unwrap();
    loop {
        unsafe { libc::pause() };
    }
}
