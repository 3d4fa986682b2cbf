//! The buffer a refused program's verifier log is read into, and what is kept of it.
//!
//! The log can run to megabytes, so the buffer is large (16 MiB), but it is a fresh
//! anonymous mapping: its pages cost memory only once the kernel writes them, and go back
//! whole when it is dropped. A zeroed heap buffer of that size is zeroed by hand where the
//! allocator reuses memory it freed before, and then stays resident: 14 MiB of the
//! daemon's peak, on a host that refuses the trampoline tiers one after the other.

use std::io;
use std::ptr::NonNull;

/// A writable, zero-filled buffer of its own mapping.
pub(super) struct LogBuffer {
    start: NonNull<u8>,
    len: usize,
}

impl LogBuffer {
    pub(super) const LEN: usize = 16 << 20;

    pub(super) fn new() -> io::Result<Self> {
        // SAFETY: a new private anonymous mapping, placed by the kernel; no other memory
        // is touched.
        let start = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                Self::LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if start == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let start = NonNull::new(start.cast()).ok_or_else(io::Error::last_os_error)?;
        Ok(Self {
            start,
            len: Self::LEN,
        })
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes of this buffer's own mapping, borrowed mutably through it.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), self.len) }
    }

    /// The log's last lines (where the verifier says why), as `: verifier: ... | ...`;
    /// empty when the kernel refused before verifying.
    pub(super) fn tail(&mut self) -> String {
        let log = self.as_mut_slice();
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        let text = String::from_utf8_lossy(&log[..end]);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.is_empty() {
            return String::new();
        }
        let tail = &lines[lines.len().saturating_sub(8)..];
        format!(": verifier: {}", tail.join(" | "))
    }
}

impl Drop for LogBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, not used after this.
        unsafe { libc::munmap(self.start.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_lines_of_what_the_kernel_wrote() {
        let mut log = LogBuffer::new().unwrap();
        assert_eq!(log.tail(), "");
        let text: String = (1..=10).map(|i| format!("line {i}\n\n")).collect();
        log.as_mut_slice()[..text.len()].copy_from_slice(text.as_bytes());
        assert_eq!(
            log.tail(),
            ": verifier: line 3 | line 4 | line 5 | line 6 | line 7 | line 8 | line 9 | line 10"
        );
    }
}
