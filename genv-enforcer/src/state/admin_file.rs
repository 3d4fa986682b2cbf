//! Small files an administrator names (`--config`, `--hostfile`): read whole, with a
//! bound, and never waited on. They live where root put them, so a link is followed as
//! the administrator meant; but a FIFO or a device must not hold the daemon (a SIGHUP
//! reload runs on its event loop), nor a huge file fill its memory.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The file's text; the error says why, without the path (the caller names it).
pub fn read(path: &Path, limit: u64) -> Result<String, String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".to_owned());
    }
    if meta.len() > limit {
        return Err(format!("larger than {limit} bytes"));
    }
    let mut text = String::new();
    file.take(limit + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > limit {
        return Err(format!("larger than {limit} bytes"));
    }
    Ok(text)
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
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(read(&fifo, 100).unwrap_err(), "not a regular file");
        let big = dir.join("big");
        std::fs::write(&big, vec![b'x'; 200]).unwrap();
        assert_eq!(read(&big, 100).unwrap_err(), "larger than 100 bytes");
        assert_eq!(read(&big, 200).unwrap().len(), 200);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
