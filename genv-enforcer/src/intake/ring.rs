//! The ring buffer, read when the kernel says it has data, and the count of events it had
//! no room for.

use std::io;

use aya::maps::{MapData, PerCpuArray, RingBuf};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use super::{BadRecord, KernelEvent};

pub struct EventIntake {
    ring: AsyncFd<RingBuf<MapData>>,
    lost: PerCpuArray<MapData, u64>,
    lost_seen: u64,
}

impl EventIntake {
    /// Must be called inside a tokio runtime with I/O enabled.
    pub fn new(ring: RingBuf<MapData>, lost: PerCpuArray<MapData, u64>) -> io::Result<Self> {
        Ok(Self {
            // SAFETY: the ring buffer owns its map descriptor for as long as it lives, and
            // the AsyncFd owns the ring buffer.
            ring: unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }?,
            lost,
            lost_seen: 0,
        })
    }

    /// Waits until the ring buffer has records, then moves them all into `events`;
    /// records the daemon cannot decode go to `unknown`.
    pub async fn next_batch(
        &mut self,
        events: &mut Vec<KernelEvent>,
        unknown: &mut Vec<BadRecord>,
    ) -> io::Result<()> {
        let mut guard = self.ring.readable_mut().await?;
        drain(guard.get_inner_mut(), events, unknown);
        guard.clear_ready();
        Ok(())
    }

    /// Moves whatever the ring buffer holds into `events` without waiting: lifecycle
    /// events do not wake the daemon (see the programs' `Wake`), so it reads them at
    /// every wake-up.
    pub fn drain_now(&mut self, events: &mut Vec<KernelEvent>, unknown: &mut Vec<BadRecord>) {
        drain(self.ring.get_mut(), events, unknown);
    }

    /// Events lost since the last call (the ring buffer was full).
    pub fn newly_lost(&mut self) -> u64 {
        let total: u64 = match self.lost.get(&0, 0) {
            Ok(per_cpu) => per_cpu.iter().sum(),
            // Unreadable: assume nothing new; the next read catches up.
            Err(_) => return 0,
        };
        let new = total.saturating_sub(self.lost_seen);
        self.lost_seen = total;
        new
    }
}

fn drain(ring: &mut RingBuf<MapData>, events: &mut Vec<KernelEvent>, unknown: &mut Vec<BadRecord>) {
    while let Some(item) = ring.next() {
        match KernelEvent::from_record(&item) {
            Ok(event) => events.push(event),
            Err(e) => unknown.push(e),
        }
    }
}
