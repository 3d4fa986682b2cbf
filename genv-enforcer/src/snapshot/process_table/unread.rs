//! GPU processes whose `stat` could not be read this cycle.

use std::io;

use super::super::Warning;

/// The processes whose `stat` could not be read for a reason other than their end: left
/// out of this cycle like the gone ones (no rule may act on a process it cannot tell),
/// but said, once per cycle, so that a node short of descriptors is not quietly
/// unenforced.
#[derive(Default)]
pub(super) struct Unread {
    count: usize,
    first: Option<(u32, String)>,
}

impl Unread {
    pub(super) fn note(&mut self, pid: u32, e: &io::Error) {
        let gone = e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH);
        if !gone {
            self.count += 1;
            self.first.get_or_insert_with(|| (pid, e.to_string()));
        }
    }

    pub(super) fn warning(self) -> Option<Warning> {
        let (pid, error) = self.first?;
        Some(warning!(
            "cannot read /proc/{pid}/stat ({error}): {} GPU process(es) left out of this cycle, read again next cycle",
            self.count
        ))
    }
}
