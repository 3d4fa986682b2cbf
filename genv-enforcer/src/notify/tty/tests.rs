use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use super::*;

/// A pseudo-terminal pair: the master (the terminal emulator's side) and the slave's
/// path and device number.
pub(crate) struct Pty {
    pub master: OwnedFd,
    pub slave: OwnedFd,
    pub path: PathBuf,
    pub rdev: Rdev,
}

pub(crate) fn pty() -> Pty {
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty writes two descriptors; no name buffer, no settings.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both are ours, just opened.
    let (master, slave) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    let rdev = rustix::fs::fstat(&slave).unwrap().st_rdev;
    let path = std::fs::read_link(format!("/proc/self/fd/{}", slave.as_raw_fd())).unwrap();
    Pty {
        master,
        slave,
        path,
        rdev,
    }
}

/// `program` in a session of its own, with the slave as its controlling terminal (and
/// its stdin), as a login shell's job has.
pub(crate) fn child_on(pty: &Pty, program: &str, args: &[&str]) -> std::process::Child {
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::from(pty.slave.try_clone().unwrap()))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: setsid and ioctl are async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let child = command.spawn().unwrap();
    await_exec(child.id(), program);
    child
}

/// Waits until `pid` runs `program` (its `comm`, which names the process in a notice).
/// `spawn` returns when the child's exec closes its error pipe, a moment before the
/// kernel sets the new name: a test reading the name at once could see the forked
/// test thread's.
pub(crate) fn await_exec(pid: u32, program: &str) {
    let name = std::path::Path::new(program).file_name().unwrap();
    let want = format!("{}\n", name.to_str().unwrap());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default() != want {
        assert!(
            std::time::Instant::now() < deadline,
            "{pid} never ran {program}"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn me() -> u32 {
    rustix::process::getuid().as_raw()
}

/// What the terminal emulator would read now (the master is non-blocking for this).
pub(crate) fn shown(pty: &Pty) -> String {
    rustix::fs::fcntl_setfl(&pty.master, OFlags::NONBLOCK).unwrap();
    let mut file = std::fs::File::from(pty.master.try_clone().unwrap());
    let mut text = Vec::new();
    let mut chunk = [0u8; 4096];
    while let Ok(n) = file.read(&mut chunk) {
        if n == 0 {
            break;
        }
        text.extend_from_slice(&chunk[..n]);
    }
    String::from_utf8_lossy(&text).into_owned()
}

#[test]
fn a_users_own_terminal_is_opened_and_written() {
    let pty = pty();
    assert_eq!(path_of(pty.rdev).as_deref(), Some(pty.path.as_path()));
    let fd = open(pty.rdev, me()).unwrap();
    assert_eq!(write_once(&fd, b"hello\r\n"), Ok(7));
    assert!(shown(&pty).contains("hello"));
}

#[test]
fn another_users_terminal_is_refused() {
    let pty = pty();
    assert_eq!(
        open_checked(&pty.path, pty.rdev, me() ^ 1).unwrap_err(),
        TtyRefusal::OtherOwner
    );
}

#[test]
fn a_node_of_another_number_is_refused() {
    let (a, b) = (pty(), pty());
    assert_eq!(
        open_checked(&a.path, b.rdev, me()).unwrap_err(),
        TtyRefusal::OtherDevice
    );
}

#[test]
fn what_is_not_a_terminal_is_refused() {
    // A character device that is not a terminal.
    let null = rustix::fs::stat("/dev/null").unwrap();
    assert_eq!(
        open_checked(Path::new("/dev/null"), null.st_rdev, null.st_uid).unwrap_err(),
        TtyRefusal::NotATerminal
    );
    // A regular file.
    let file = std::env::temp_dir().join(format!("genv-notify-file-{}", std::process::id()));
    std::fs::write(&file, "").unwrap();
    let refused = open_checked(&file, 0, me()).unwrap_err();
    std::fs::remove_file(&file).unwrap();
    assert_eq!(refused, TtyRefusal::NotCharDevice);
}

#[test]
fn a_link_to_a_terminal_is_not_followed() {
    let pty = pty();
    let link = std::env::temp_dir().join(format!("genv-notify-link-{}", std::process::id()));
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&pty.path, &link).unwrap();
    let refused = open_checked(&link, pty.rdev, me()).unwrap_err();
    std::fs::remove_file(&link).unwrap();
    assert_eq!(refused, TtyRefusal::Open(Errno::LOOP));
}

/// Nobody reads the master: the terminal fills, and the write says so at once instead
/// of waiting (a blocking write would hang this test).
#[test]
fn a_terminal_nobody_reads_never_blocks_the_write() {
    let pty = pty();
    let fd = open(pty.rdev, me()).unwrap();
    let line = [b'x'; 200];
    let mut full = false;
    for _ in 0..100_000 {
        match write_once(&fd, &line) {
            Ok(_) => {}
            Err(TtyRefusal::Full) => {
                full = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(full, "20 MB went into a terminal nobody reads");
}

#[test]
fn tty_numbers_map_to_their_nodes() {
    let at = |major, minor| path_of(rustix::fs::makedev(major, minor));
    assert_eq!(at(136, 3).unwrap(), Path::new("/dev/pts/3"));
    assert_eq!(at(136, 4000).unwrap(), Path::new("/dev/pts/4000"));
    assert_eq!(at(4, 2).unwrap(), Path::new("/dev/tty2"));
    assert_eq!(at(4, 65).unwrap(), Path::new("/dev/ttyS1"));
    assert_eq!(at(4, 0), None, "tty0 is whichever console is in front");
    assert_eq!(at(5, 1), None, "the console");
    assert_eq!(at(1, 3), None, "/dev/null");
    // /proc's encoding: minor's low byte, major, then the minor's high bits.
    assert_eq!(rdev_of_tty_nr(34816 + 3), Some(rustix::fs::makedev(136, 3)));
    assert_eq!(
        rdev_of_tty_nr((136 << 8) | (0x0f << 20) | 0xa0),
        Some(rustix::fs::makedev(136, 0xfa0))
    );
    assert_eq!(rdev_of_tty_nr(0), None);
}
