//! What the service manager and the operator say to a running daemon (SIGTERM and
//! SIGINT to stop, SIGHUP to read `--config` again), and what the daemon tells systemd
//! back (`sd_notify`).

use anyhow::{Context, Result};
use tokio::signal::unix::{Signal, SignalKind, signal};

/// SIGTERM and SIGINT, installed before anything slow so that neither is lost.
pub struct StopSignals {
    term: Signal,
    int: Signal,
}

impl StopSignals {
    pub fn install() -> Result<Self> {
        Ok(Self {
            term: signal(SignalKind::terminate()).context("installing the SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing the SIGINT handler")?,
        })
    }

    pub async fn recv(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }
}

/// SIGHUP, installed with the stop signals so that none is lost (its default would end
/// the daemon).
pub struct Hangup(Signal);

impl Hangup {
    pub fn install() -> Result<Self> {
        let signal = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        Ok(Self(signal))
    }

    pub async fn recv(&mut self) {
        self.0.recv().await;
    }
}

/// `sd_notify`: tells systemd (`Type=notify`) how the daemon stands, when it runs under
/// it (`NOTIFY_SOCKET`); nothing otherwise.
pub fn notify(state: &str) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let address = match path.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None => SocketAddr::from_pathname(&path),
    };
    let sent = UnixDatagram::unbound()
        .and_then(|socket| address.and_then(|a| socket.send_to_addr(state.as_bytes(), &a)));
    if let Err(e) = sent {
        tracing::warn!("Cannot tell systemd {state:?} through {path}: {e}");
    }
}
