//! The kernel's process events connector (`CONFIG_PROC_EVENTS`): which processes
//! exec'd, exited or changed their uid since the last look. With it a cycle re-reads
//! `/proc/<pid>/stat` only for the processes that changed, instead of all of them (the
//! read was most of a cycle's time on a node with a thousand GPU processes).
//!
//! Only the kernel can send on this socket (the connector family takes no messages from
//! user space without CAP_NET_ADMIN), and each datagram's sender is checked anyway.
//! Anything unexpected (a lost message, an error, a malformed record) is reported as
//! [`Changes::Unknown`]: the caller then re-reads everything, as it would without events.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

const NETLINK_CONNECTOR: libc::c_int = 11;
const CN_IDX_PROC: u32 = 1;
const CN_VAL_PROC: u32 = 1;
const PROC_CN_MCAST_LISTEN: u32 = 1;
const PROC_EVENT_NONE: u32 = 0;
const PROC_EVENT_EXEC: u32 = 0x0000_0002;
const PROC_EVENT_UID: u32 = 0x0000_0004;
const PROC_EVENT_EXIT: u32 = 0x8000_0000;
const NLMSG_DONE: u16 = 3;
/// `nlmsghdr` (16) + `cn_msg` (20).
const HEADERS: usize = 36;
/// `proc_event`'s `what`, `cpu`, `timestamp_ns`, then every event's pid and tgid.
const EVENT_MIN: usize = 24;
/// Room for a burst of events between two looks (about 70 bytes each); past it the
/// kernel drops and says so (ENOBUFS), and the caller re-reads everything.
const RECEIVE_BUFFER: libc::c_int = 4 << 20;

/// What changed since the last [`ProcEvents::drain`].
#[derive(Debug, PartialEq, Eq)]
pub enum Changes {
    /// These processes (thread-group ids) exec'd, exited or changed uid; no other did.
    Pids(Vec<u32>),
    /// Events were lost or could not be read: anything may have changed.
    Unknown,
}

/// A subscription to exec, exit and uid events of every process on the machine.
#[derive(Debug)]
pub struct ProcEvents {
    socket: OwnedFd,
}

impl ProcEvents {
    /// Subscribes; fails where the kernel has no connector, the caller lacks
    /// CAP_NET_ADMIN, or the socket is not in the initial network namespace (where the
    /// kernel sends these events).
    pub fn subscribe() -> io::Result<Self> {
        // SAFETY: plain socket(2); the descriptor is owned right below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                NETLINK_CONNECTOR,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        let events = Self { socket };
        events.set_receive_buffer();
        events.bind()?;
        // The 4-byte request is what every kernel takes; 6.6 and later also take the
        // 8-byte one with an event filter (ignored before), so only exec, exit and uid
        // changes are queued here, not every fork of the machine.
        let seq = std::process::id() ^ 0x6765_6e76;
        events.send(seq, &PROC_CN_MCAST_LISTEN.to_ne_bytes())?;
        events.await_ack(seq)?;
        let mut filtered = PROC_CN_MCAST_LISTEN.to_ne_bytes().to_vec();
        filtered.extend((PROC_EVENT_EXEC | PROC_EVENT_UID | PROC_EVENT_EXIT).to_ne_bytes());
        events.send(seq.wrapping_add(1), &filtered)?;
        Ok(events)
    }

    fn set_receive_buffer(&self) {
        // As root the kernel's cap does not apply (SO_RCVBUFFORCE); a smaller buffer
        // only means re-reading everything after a larger burst.
        let size = RECEIVE_BUFFER;
        for option in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF] {
            // SAFETY: setsockopt with a pointer to a live c_int of the size given.
            let ok = unsafe {
                libc::setsockopt(
                    self.socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    option,
                    (&raw const size).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                )
            } == 0;
            if ok {
                return;
            }
        }
    }

    fn bind(&self) -> io::Result<()> {
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
        let mut address: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        address.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        address.nl_groups = CN_IDX_PROC;
        // SAFETY: bind(2) with a live sockaddr_nl and its size.
        let rc = unsafe {
            libc::bind(
                self.socket.as_raw_fd(),
                (&raw const address).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// One connector request to the kernel's process-events listener.
    fn send(&self, seq: u32, payload: &[u8]) -> io::Result<()> {
        let total = HEADERS + payload.len();
        let mut message = Vec::with_capacity(total);
        message.extend((total as u32).to_ne_bytes());
        message.extend(NLMSG_DONE.to_ne_bytes());
        message.extend(0u16.to_ne_bytes()); // flags
        message.extend(seq.to_ne_bytes());
        message.extend(std::process::id().to_ne_bytes());
        message.extend(CN_IDX_PROC.to_ne_bytes());
        message.extend(CN_VAL_PROC.to_ne_bytes());
        message.extend(seq.to_ne_bytes());
        message.extend(seq.to_ne_bytes()); // ack: the answer carries it plus one
        message.extend((payload.len() as u16).to_ne_bytes());
        message.extend(0u16.to_ne_bytes()); // flags
        message.extend_from_slice(payload);
        // SAFETY: send(2) of a live buffer of the length given.
        let sent = unsafe {
            libc::send(
                self.socket.as_raw_fd(),
                message.as_ptr().cast(),
                message.len(),
                0,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The kernel answers a request with an event of type none carrying its error and
    /// the request's `ack` plus one (its `seq` is the kernel's own); the answer is
    /// queued before `send` returns, so the wait is a formality, bounded.
    fn await_ack(&self, seq: u32) -> io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(1);
        let mut buffer = [0u8; 256];
        loop {
            match self.receive(&mut buffer) {
                Ok(Some(n)) => {
                    if let Some(event) = event_of(&buffer[..n])
                        && event.what == PROC_EVENT_NONE
                        && event.ack == seq.wrapping_add(1)
                    {
                        // The ack's error is the first word after the header.
                        return match event.pid {
                            0 => Ok(()),
                            errno => Err(io::Error::from_raw_os_error(errno as i32)),
                        };
                    }
                }
                Ok(None) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the kernel did not answer the process-events subscription",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// One datagram: `Ok(None)` when it is not from the kernel (dropped).
    fn receive(&self, buffer: &mut [u8]) -> io::Result<Option<usize>> {
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
        let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        let mut length = size_of::<libc::sockaddr_nl>() as libc::socklen_t;
        // SAFETY: recvfrom(2) into a live buffer and a live sockaddr of the sizes given.
        let n = unsafe {
            libc::recvfrom(
                self.socket.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                libc::MSG_DONTWAIT,
                (&raw mut from).cast(),
                &mut length,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((from.nl_pid == 0).then_some(n as usize))
    }

    /// Everything queued since the last drain.
    pub fn drain(&mut self) -> Changes {
        let mut pids = Vec::new();
        let mut lost = false;
        let mut buffer = [0u8; 512];
        loop {
            match self.receive(&mut buffer) {
                Ok(Some(n)) => match event_of(&buffer[..n]) {
                    Some(e)
                        if matches!(e.what, PROC_EVENT_EXEC | PROC_EVENT_EXIT | PROC_EVENT_UID) =>
                    {
                        pids.push(e.tgid)
                    }
                    Some(_) => {} // forks on kernels without the filter, acks
                    None => lost = true,
                },
                Ok(None) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // ENOBUFS: the kernel dropped events; go on reading what it kept.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => lost = true,
                Err(_) => return Changes::Unknown,
            }
        }
        match lost {
            true => Changes::Unknown,
            false => Changes::Pids(pids),
        }
    }
}

/// The fields of one connector datagram this module reads.
#[derive(Debug, PartialEq, Eq)]
struct Event {
    ack: u32,
    what: u32,
    /// The event's first word after its header: the pid (or, for an ack, the error).
    pid: u32,
    tgid: u32,
}

/// Parses one datagram, checking every length against what was received; `None` when
/// it is not a well-formed process event.
fn event_of(datagram: &[u8]) -> Option<Event> {
    let word = |at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(
            datagram.get(at..at + 4)?.try_into().ok()?,
        ))
    };
    let declared = word(0)? as usize;
    let payload = u16::from_ne_bytes(datagram.get(32..34)?.try_into().ok()?) as usize;
    let fits = declared <= datagram.len() && HEADERS + payload <= declared;
    if !fits || payload < EVENT_MIN || word(16)? != CN_IDX_PROC || word(20)? != CN_VAL_PROC {
        return None;
    }
    Some(Event {
        ack: word(28)?,
        what: word(HEADERS)?,
        pid: word(HEADERS + 16)?,
        tgid: word(HEADERS + 20)?,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Waits, up to 30 s, until `events` has reported `count` events of `pid` in all
    /// (`seen` keeps what was drained across calls).
    pub(crate) fn await_events(
        events: &mut ProcEvents,
        seen: &mut Vec<u32>,
        pid: u32,
        count: usize,
    ) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen.iter().filter(|p| **p == pid).count() < count {
            match events.drain() {
                Changes::Pids(pids) => seen.extend(pids),
                Changes::Unknown => panic!("process events lost on a quiet machine"),
            }
            assert!(
                Instant::now() < deadline,
                "{count} events of {pid} not seen: {seen:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn datagram(what: u32, pid: u32, tgid: u32) -> Vec<u8> {
        let mut d = Vec::new();
        let payload = 40u16;
        d.extend((HEADERS as u32 + payload as u32).to_ne_bytes());
        d.extend([0u8; 12]);
        d.extend(CN_IDX_PROC.to_ne_bytes());
        d.extend(CN_VAL_PROC.to_ne_bytes());
        d.extend(0u32.to_ne_bytes());
        d.extend(7u32.to_ne_bytes());
        d.extend(payload.to_ne_bytes());
        d.extend(0u16.to_ne_bytes());
        d.extend(what.to_ne_bytes());
        d.extend([0u8; 12]);
        d.extend(pid.to_ne_bytes());
        d.extend(tgid.to_ne_bytes());
        d.extend([0u8; 16]);
        d
    }

    #[test]
    fn reads_an_event_and_refuses_what_does_not_fit() {
        let good = datagram(PROC_EVENT_EXEC, 12, 10);
        let event = event_of(&good).unwrap();
        assert_eq!(
            (event.what, event.pid, event.tgid, event.ack),
            (PROC_EVENT_EXEC, 12, 10, 7)
        );
        // Cut short, or claiming more than was received: refused, never read past.
        for cut in [0, 10, HEADERS, good.len() - 1] {
            assert_eq!(event_of(&good[..cut]), None, "cut at {cut}");
        }
        let mut other = good.clone();
        other[16] = 9; // another connector's index
        assert_eq!(event_of(&other), None);
    }

    /// The real connector: a child that execs and exits is reported, by its tgid.
    #[test]
    fn sees_a_real_exec_and_exit() {
        // Subscribing needs CAP_NET_ADMIN: the suites run as root.
        let mut events = ProcEvents::subscribe().expect("subscribe to process events");
        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        // Its exec and its exit.
        await_events(&mut events, &mut Vec::new(), pid, 2);
    }
}
