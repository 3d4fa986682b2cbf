//! The two clocks the daemon reads: wall-clock seconds, for what people read (status
//! files, the journal), and CLOCK_MONOTONIC, the clock of the programs'
//! `bpf_ktime_get_ns`, for what is measured against them.

use std::time::SystemTime;

/// Seconds since the epoch (0 on a clock set before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// CLOCK_MONOTONIC in nanoseconds, as `bpf_ktime_get_ns` reads it.
pub fn monotonic_ns() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
