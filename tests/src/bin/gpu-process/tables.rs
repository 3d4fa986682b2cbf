//! Opens from a descriptor table of a known kind: the tracepoint tier reads the
//! kernel's embedded table (`files_struct.fd_array`, at most `NR_OPEN_DEFAULT` = 64
//! descriptors) by direct loads and a grown one through probe reads, and a test must
//! reach each whatever table the harness hands down (a descriptor past 63 inherited
//! grows every descendant's table at its fork, and a table never shrinks).

/// `close_range`'s flag: the caller's table is copied first, when shared.
const CLOSE_RANGE_UNSHARE: u32 = 1 << 1;

/// Gives this process's main thread a fresh table holding descriptors 0–2 alone, the
/// embedded one. `close_range(3, ~0, CLOSE_RANGE_UNSHARE)` copies a table only if it is
/// shared, so a second thread shares it meanwhile; the copy is sized for what is kept.
pub fn fresh() {
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let sharer = std::thread::spawn(move || wait.recv());
    // SAFETY: close_range(2) on descriptors this process no longer uses (the Rust
    // runtime keeps none open); no pointers.
    let ret = unsafe { libc::syscall(libc::SYS_close_range, 3, u32::MAX, CLOSE_RANGE_UNSHARE) };
    assert_eq!(ret, 0, "close_range: {}", std::io::Error::last_os_error());
    drop(done);
    let _ = sharer.join();
    assert_eq!(
        slots(),
        64,
        "the main thread's table is not the embedded one"
    );
}

/// Grows this process's table past the embedded one: a descriptor at 300, closed again.
pub fn grown() {
    // SAFETY: dup2(2) and close(2) on descriptor numbers only.
    unsafe {
        assert_eq!(libc::dup2(0, 300), 300, "dup2 to 300");
        libc::close(300);
    }
    assert!(slots() > 64, "the table did not grow");
}

/// `FDSize` of this process: the slots of its descriptor table.
fn slots() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("FDSize:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("FDSize in /proc/self/status")
}
