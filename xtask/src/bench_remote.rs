//! Remote enforcement over SSH: one cycle over 1, 4 and 16 simulated hosts (with and
//! without multiplexing, and genv 1.4.3's own `remote enforce` on the same kind of
//! hosts), and the cross-host reaction time with `usage watch` streams against genv's
//! interval. The hosts are the test suite's (`tests/src/sshd.rs`: Debian's sshd in
//! network namespaces), so the measurement is `tests/bench_remote.rs`'s `bench_remote`, run
//! on the release build.

use std::path::Path;

use anyhow::{Context, Result};

pub fn run(release: &Path) -> Result<String> {
    crate::ensure_openssh()?;
    let table = release.join("bench-remote.md");
    let _ = std::fs::remove_file(&table);
    crate::run(
        crate::cargo(&[
            "test",
            "--release",
            "-p",
            "genv-enforcer-tests",
            "--test",
            "bench_remote",
            "--",
            "--ignored",
            "--exact",
            "bench_remote",
            "--nocapture",
        ])
        .env("GENV_BENCH_TABLE", &table)
        // The harness is this tree's; the product is the build in `release` (another
        // commit's, for `bench --compare`).
        .env("GENV_BENCH_ARTEFACTS", release),
    )?;
    let measured =
        std::fs::read_to_string(&table).with_context(|| format!("reading {}", table.display()))?;
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    Ok(format!(
        "\n## Remote enforcement over SSH\n\nAll hosts share this machine's {cpus} CPUs, so \
         the 16-host rows measure its CPU as much as the protocol: each host's snapshot is a \
         process started through sudo.\n\n{measured}"
    ))
}
