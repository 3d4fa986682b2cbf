//! The `/metrics` endpoint's connections. Any process that reaches the port can open
//! some, so idle or slow ones must not keep a scrape out (a few idle sockets once held
//! every slot, 2 s each, and the scrapes failed):
//! - a connection delivers its whole request, at most [`REQUEST_BYTES`], within
//!   [`READ_WITHIN`] of its accept, and takes its answer within [`WRITE_WITHIN`]; else
//!   it is closed;
//! - at most [`PER_PEER`] are open from one address (an IPv6 one counted by its /64)
//!   and [`CONNECTIONS`] in all. A connection past either bound is served, and the
//!   oldest of those it counts against is closed instead: idle ones are the oldest, a
//!   scraper's is the newest and is answered as soon as its request is read.
//!
//! A client that accepts OpenMetrics (Prometheus does) gets it; any other (`curl`,
//! `promtool check metrics`) gets the text format 0.0.4 ([`super::text_format`]).
//!
//! So keeping a scrape out takes opening [`PER_PEER`] connections from the scraper's own
//! address, or [`CONNECTIONS`] in all, between its connect and its request: a flood.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout, timeout_at};

use super::Exposition;
use crate::limits::Connections;

/// Connections open at once, in all.
const CONNECTIONS: usize = 64;
/// Connections open at once from one peer ([`peer_of`]).
const PER_PEER: usize = 8;
/// From the accept to the end of the request's headers.
const READ_WITHIN: Duration = Duration::from_millis(500);
/// To write the answer, once the request is read.
const WRITE_WITHIN: Duration = Duration::from_secs(1);
/// The request line and headers; a scraper's are a few hundred bytes.
const REQUEST_BYTES: usize = 4096;

/// Serves `listener` on the daemon's runtime.
pub(super) fn start(
    listener: std::net::TcpListener,
    metrics: Arc<dyn Exposition>,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    tokio::spawn(async move {
        let mut open = Connections::new(PER_PEER, CONNECTIONS);
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                // Out of descriptors, mostly: wait rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let accepted = Instant::now();
            let peer = peer_of(peer);
            if let Some(oldest) = open.make_room(peer) {
                oldest.abort();
            }
            let task = tokio::spawn(serve(stream, accepted, Arc::clone(&metrics)));
            open.add(peer, task.abort_handle());
            // Let the new connection read what its client already sent before the next
            // accept can count against it.
            tokio::task::yield_now().await;
        }
    });
    Ok(())
}

/// Whom a connection counts against: its address; an IPv4-mapped one as IPv4, an IPv6
/// one by its /64 (one host may hold all of it), and every loopback address as one
/// (any local user can connect from any of 127.0.0.0/8, one peer's share each).
fn peer_of(addr: SocketAddr) -> IpAddr {
    let ip = match addr.ip() {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64))),
        },
        v4 => v4,
    };
    match ip.is_loopback() || addr.ip().is_loopback() {
        true => IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        false => ip,
    }
}

/// What a client asked for.
#[derive(Debug, PartialEq)]
enum Request {
    /// `GET /metrics`; whether the client accepts OpenMetrics.
    Metrics {
        openmetrics: bool,
    },
    Other,
    TooLarge,
}

async fn serve(mut stream: TcpStream, accepted: Instant, metrics: Arc<dyn Exposition>) {
    let request = match timeout_at(accepted + READ_WITHIN, read_request(&mut stream)).await {
        Ok(Ok(request)) => request,
        _ => return,
    };
    let answer = answer(&request, metrics.as_ref());
    let _ = timeout(WRITE_WITHIN, async {
        stream.write_all(&answer).await?;
        stream.shutdown().await
    })
    .await;
}

/// Reads up to the end of the headers (a blank line), or of what the client sends
/// before it closes its side, at most [`REQUEST_BYTES`].
async fn read_request(stream: &mut TcpStream) -> std::io::Result<Request> {
    let mut request = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let most = chunk.len();
    // Only the new bytes (and the three before them) are looked through for the blank
    // line: a request sent a byte at a time costs no more than one sent at once.
    let mut scanned = 0;
    loop {
        if let Some(end) = head_end(&request[scanned..]) {
            return Ok(route(&request[..scanned + end]));
        }
        scanned = request.len().saturating_sub(3);
        let room = REQUEST_BYTES - request.len();
        if room == 0 {
            return Ok(Request::TooLarge);
        }
        let n = stream.read(&mut chunk[..room.min(most)]).await?;
        if n == 0 {
            return Ok(route(&request));
        }
        request.extend_from_slice(&chunk[..n]);
    }
}

/// Where the headers end: the first blank line (CRLF, or a bare LF as lenient clients
/// send).
fn head_end(request: &[u8]) -> Option<usize> {
    let crlf = request.windows(4).position(|w| w == b"\r\n\r\n");
    let lf = request.windows(2).position(|w| w == b"\n\n");
    crlf.into_iter().chain(lf).min()
}

fn route(head: &[u8]) -> Request {
    let mut lines = head.split(|b| *b == b'\n');
    let line = lines.next().unwrap_or_default();
    if !(line.starts_with(b"GET /metrics ") || line.starts_with(b"GET /metrics?")) {
        return Request::Other;
    }
    let openmetrics = lines.any(|header| {
        let header = header.to_ascii_lowercase();
        header.starts_with(b"accept:")
            && header
                .windows(OPENMETRICS.len())
                .any(|w| w == OPENMETRICS.as_bytes())
    });
    Request::Metrics { openmetrics }
}

/// The media type a scraper names in `Accept` to get OpenMetrics.
const OPENMETRICS: &str = "application/openmetrics-text";

fn answer(request: &Request, metrics: &dyn Exposition) -> Vec<u8> {
    let (status, body, kind) = match request {
        Request::Metrics { openmetrics: true } => (
            "200 OK",
            metrics.text(),
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        ),
        Request::Metrics { openmetrics: false } => (
            "200 OK",
            super::text_format::from_openmetrics(&metrics.text()),
            "text/plain; version=0.0.4; charset=utf-8",
        ),
        Request::Other => (
            "404 Not Found",
            "only /metrics is here\n".to_owned(),
            "text/plain",
        ),
        Request::TooLarge => (
            "431 Request Header Fields Too Large",
            format!("at most {REQUEST_BYTES} bytes of request line and headers\n"),
            "text/plain",
        ),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    [head.into_bytes(), body.into_bytes()].concat()
}

#[cfg(test)]
mod tests;
