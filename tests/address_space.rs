//! A process whose address space its own user holds locked (through FUSE, as any user
//! with `fusermount3` can): the harness that makes one, checked against the kernel.
//! Whatever waits for such a process's `mmap_lock` (a read of its `environ`) waits
//! until the user's server lets go, or dies.
//!
//! Needs root (the server's mount; the holder runs as nobody).

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::Duration;

use genv_enforcer_tests::harness::{KillOnDrop, wait_exit};
use genv_enforcer_tests::stall::{StallFuse, blocks_reading, hold_lock_in, holder_command};

const NOBODY: u32 = 65534;

/// A holder of `fuse`'s lock, running as nobody.
fn holder(fuse: &StallFuse) -> KillOnDrop {
    let mut command = holder_command(fuse, &[]);
    command.uid(NOBODY).gid(NOBODY);
    KillOnDrop(hold_lock_in(&mut command))
}

fn environ(holder: &KillOnDrop) -> PathBuf {
    PathBuf::from(format!("/proc/{}/environ", holder.0.id()))
}

#[test]
fn stall_harness_holds_and_releases() {
    // Declared before the server, so dropped after it: a holder cannot finish dying
    // while its READ is held.
    let mut holder: KillOnDrop;
    let fuse = StallFuse::new(NOBODY);
    holder = self::holder(&fuse);
    let environ = environ(&holder);
    assert!(
        blocks_reading(&environ, Duration::from_secs(1)),
        "root read the holder's environ while its user held its mmap_lock"
    );
    drop(fuse);
    assert!(
        !blocks_reading(&environ, Duration::from_secs(5)),
        "the holder's environ still cannot be read 5 s after its FUSE server died"
    );
    holder.0.kill().unwrap();
    let status = wait_exit(&mut holder.0, Duration::from_secs(5));
    assert!(
        status.is_some(),
        "the holder was not reaped 5 s after SIGKILL"
    );
}

#[test]
fn stall_harness_answering_after_releases_by_itself() {
    // Dropped after the server, as above.
    let held: KillOnDrop;
    let fuse = StallFuse::answering_after(NOBODY, Duration::from_secs(2));
    held = holder(&fuse);
    let environ = environ(&held);
    // The READ came before `held`; its answer comes 2 s after it.
    assert!(
        blocks_reading(&environ, Duration::from_millis(500)),
        "root read the holder's environ while its READ was unanswered"
    );
    assert!(
        !blocks_reading(&environ, Duration::from_secs(10)),
        "the holder's environ still cannot be read 10 s after its READ came (answered \
         after 2 s)"
    );
}
