//! Small files an administrator names (`--config`, `--hostfile`): read whole, with a
//! bound, and never waited on. They live where root put them, so a link is followed as
//! the administrator meant; but a FIFO or a device must not hold the daemon (a SIGHUP
//! reload runs on its event loop), nor a huge file fill its memory.

use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::safe_open::{OpenError, Refusal, read_capped, regular};

/// The file's text; the error says why, without the path (the caller names it).
pub fn read(path: &Path, limit: u64) -> Result<String, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let said = |e: OpenError| match e {
        OpenError::Refused(Refusal::NotRegular(_)) => "not a regular file".to_owned(),
        OpenError::Refused(Refusal::TooLarge { cap }) => format!("larger than {cap} bytes"),
        OpenError::Refused(refusal) => refusal.to_string(),
        OpenError::Io(e) => e.to_string(),
    };
    regular(&file).map_err(said)?;
    let bytes = read_capped(&file, limit).map_err(said)?;
    String::from_utf8(bytes).map_err(|_| "stream did not contain valid UTF-8".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_or_a_huge_file_is_refused_at_once() {
        let dir = std::env::temp_dir().join(format!("genv-admin-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(read(&fifo, 100).unwrap_err(), "not a regular file");
        let big = dir.join("big");
        std::fs::write(&big, vec![b'x'; 200]).unwrap();
        assert_eq!(read(&big, 100).unwrap_err(), "larger than 100 bytes");
        assert_eq!(read(&big, 200).unwrap().len(), 200);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
