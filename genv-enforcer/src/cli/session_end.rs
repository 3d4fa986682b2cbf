//! The `usage` commands a remote enforcer runs over SSH end with their session: when
//! the admin side's deadline fires it ends its local ssh, and sshd closes the pipes of
//! the command it ran. A command stuck in NVML (whose init hangs on a failed GPU) would
//! otherwise stay behind on the host, one more at every cycle; it reads and writes
//! nothing while stuck, so only a thread of its own can see its reader go.

use std::os::fd::AsFd;

/// When stdout is a pipe or socket (as under ssh), ends the process as soon as nothing
/// reads it any more. What runs is read-only or acted on by a report whose sender gave
/// up on it: nothing is left half-written that an exit here would spoil.
pub fn end_with_reader() {
    let stdout = std::io::stdout();
    let watched = rustix::fs::fstat(stdout.as_fd()).is_ok_and(|st| {
        let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
        matches!(
            kind,
            rustix::fs::FileType::Fifo | rustix::fs::FileType::Socket
        )
    });
    if !watched {
        return;
    }
    // A thread the process's exit does not wait for.
    std::thread::spawn(|| {
        if reader_gone(libc::STDOUT_FILENO) {
            // Not `exit`: the main thread may hold locks (NVML's) that exit handlers
            // would wait on.
            // SAFETY: _exit(2) ends the process at once: no Rust state is touched after
            // it.
            unsafe { libc::_exit(1) };
        }
    });
}

/// Waits until `fd` reports an error or hang-up (a pipe with no reader left, a socket
/// closed by its peer); `false` if it cannot be polled.
fn reader_gone(fd: libc::c_int) -> bool {
    loop {
        let mut fds = [libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        }];
        // Events 0: only POLLERR and POLLHUP, which poll always reports, wake it.
        // SAFETY: `fds` is a live array of one `pollfd`, the length passed.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 1, -1) };
        if ready < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            return true;
        }
        if fds[0].revents & libc::POLLNVAL != 0 {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipe whose read end closes ends the wait.
    #[test]
    fn a_pipe_without_a_reader_is_seen() {
        let mut ends = [0; 2];
        // SAFETY: `ends` is a live array of two ints, what pipe(2) writes.
        assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
        let [read, write] = ends;
        let waiting = std::thread::spawn(move || reader_gone(write));
        // SAFETY: closes the read end this test opened and owns; nothing else holds it.
        unsafe { libc::close(read) };
        assert!(waiting.join().unwrap());
        // SAFETY: closes the write end this test opened, once the thread using it has
        // returned.
        unsafe { libc::close(write) };
    }
}
