//! The process a kernel decision was about, as the program read it at the decision:
//! its controlling terminal and its name. The user is told there, even when the
//! process is gone (killed, reaped) by the time the daemon reads the event.

use genv_ebpf_common::{Subject, split_kernel_dev};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelSubject {
    /// Its controlling terminal's (major, minor); `None` for none.
    pub tty: Option<(u32, u32)>,
    /// Its `comm`, NUL-padded, as the kernel holds it (any bytes).
    comm: [u8; 16],
}

impl KernelSubject {
    pub fn comm(&self) -> &[u8] {
        let end = self.comm.iter().position(|b| *b == 0).unwrap_or(16);
        &self.comm[..end]
    }
}

impl From<Subject> for KernelSubject {
    fn from(raw: Subject) -> Self {
        Self {
            tty: (raw.tty != 0).then(|| split_kernel_dev(raw.tty)),
            comm: raw.comm,
        }
    }
}

#[cfg(test)]
mod tests {
    use genv_ebpf_common::kernel_dev;

    use super::*;

    #[test]
    fn a_terminal_and_a_name_as_the_program_read_them() {
        let mut comm = [0u8; 16];
        comm[..6].copy_from_slice(b"python");
        let subject = KernelSubject::from(Subject {
            tty: kernel_dev(136, 3),
            _pad: 0,
            comm,
        });
        assert_eq!(
            (subject.tty, subject.comm()),
            (Some((136, 3)), &b"python"[..])
        );
        // No terminal; a name of all 16 bytes.
        let subject = KernelSubject::from(Subject {
            tty: 0,
            _pad: 0,
            comm: [b'x'; 16],
        });
        assert_eq!((subject.tty, subject.comm().len()), (None, 16));
    }
}
