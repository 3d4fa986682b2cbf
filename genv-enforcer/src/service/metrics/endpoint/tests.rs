use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream as StdStream};

use super::*;
use crate::service::metrics::Metrics;
use tokio::task::AbortHandle;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn peer(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
}

/// A connection that never ends on its own.
fn pending() -> AbortHandle {
    tokio::spawn(std::future::pending::<()>()).abort_handle()
}

#[test]
fn a_peer_past_its_bound_closes_its_own_oldest_not_anothers() {
    runtime().block_on(async {
        let mut open = Connections::new(PER_PEER, CONNECTIONS);
        let scraper = pending();
        open.add(peer(1), scraper.clone());
        let mut first = None;
        for _ in 0..PER_PEER {
            assert!(open.make_room(peer(2)).is_none());
            let task = pending();
            first.get_or_insert_with(|| task.clone());
            open.add(peer(2), task);
        }
        let closed = open.make_room(peer(2)).expect("peer 2 is at its bound");
        assert_eq!(closed.id(), first.unwrap().id());
        assert!(open.holds(&scraper));
        // Another peer is not at its bound, nor are all connections open.
        assert!(open.make_room(peer(3)).is_none());
    });
}

#[test]
fn past_the_bound_in_all_the_oldest_is_closed() {
    runtime().block_on(async {
        let mut open = Connections::new(PER_PEER, CONNECTIONS);
        let oldest = pending();
        open.add(peer(0), oldest.clone());
        for i in 1..CONNECTIONS {
            let p = peer(u8::try_from(i / PER_PEER).unwrap());
            assert!(open.make_room(p).is_none(), "{i}");
            open.add(p, pending());
        }
        let closed = open.make_room(peer(200)).expect("all are open");
        assert_eq!(closed.id(), oldest.id());
    });
}

#[test]
fn connections_that_ended_free_their_room() {
    runtime().block_on(async {
        let mut open = Connections::new(PER_PEER, CONNECTIONS);
        let mut ended = Vec::new();
        for _ in 0..PER_PEER {
            let task = tokio::spawn(async {});
            open.add(peer(1), task.abort_handle());
            ended.push(task);
        }
        for task in ended {
            task.await.unwrap();
        }
        assert!(open.make_room(peer(1)).is_none());
        assert!(open.is_empty());
    });
}

#[test]
fn peers_are_addresses_ipv6_ones_by_their_64() {
    let at = |ip: &str| peer_of(SocketAddr::new(ip.parse().unwrap(), 1));
    assert_eq!(at("::ffff:10.0.0.1"), at("10.0.0.1"));
    assert_eq!(at("2001:db8:1:2::5"), at("2001:db8:1:2:ffff::9"));
    assert_ne!(at("2001:db8:1:2::5"), at("2001:db8:1:3::5"));
    assert_ne!(at("10.0.0.1"), at("10.0.0.2"));
    // Any local user can connect from any loopback address: they are one peer.
    assert_eq!(at("127.0.0.1"), at("127.9.8.7"));
    assert_eq!(at("127.0.0.1"), at("::1"));
    assert_eq!(at("127.0.0.1"), at("::ffff:127.0.0.2"));
}

#[test]
fn the_end_of_the_headers_is_a_blank_line_crlf_or_bare() {
    assert_eq!(head_end(b"GET /metrics HTTP/1.1\r\nA: b\r\n\r\n"), Some(27));
    assert_eq!(head_end(b"GET /metrics HTTP/1.0\n\n"), Some(21));
    assert_eq!(head_end(b"GET /metrics HTTP/1.1\r\nA: b\r\n"), None);
    let text = Request::Metrics { openmetrics: false };
    assert_eq!(route(b"GET /metrics?x=1 HTTP/1.1"), text);
    assert_eq!(route(b"GET /metricsx HTTP/1.1"), Request::Other);
    assert_eq!(route(b""), Request::Other);
}

/// Prometheus names OpenMetrics first in `Accept`; `curl` sends `*/*`.
#[test]
fn openmetrics_goes_to_whoever_accepts_it() {
    let prometheus = b"GET /metrics HTTP/1.1\r\nHost: n\r\nAccept: \
        application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n";
    assert_eq!(route(prometheus), Request::Metrics { openmetrics: true });
    let curl = b"GET /metrics HTTP/1.1\r\nHost: n\r\nAccept: */*\r\n";
    assert_eq!(route(curl), Request::Metrics { openmetrics: false });
    let (_, text) = answered(&Request::Metrics { openmetrics: false });
    assert!(!text.contains("# EOF"), "{text}");
    assert!(
        text.contains("# TYPE genv_enforcer_lost_events_total counter"),
        "{text}"
    );
    let (head, openmetrics) = answered(&Request::Metrics { openmetrics: true });
    assert!(head.contains("application/openmetrics-text"), "{head}");
    assert!(openmetrics.ends_with("# EOF\n"), "{openmetrics}");
}

/// The head and the body of the answer to `request`.
fn answered(request: &Request) -> (String, String) {
    let answer = String::from_utf8(answer(request, Metrics::new().as_ref())).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

/// The endpoint on a port of its own, on a runtime of its own (a thread that lives as
/// long as the test process).
fn served() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        runtime().block_on(async {
            start(listener, Metrics::new()).unwrap();
            std::future::pending::<()>().await
        })
    });
    addr
}

/// Sends `request`, then reads until the server closes (at most 10 s, generously).
fn exchange(addr: SocketAddr, request: &[u8]) -> std::io::Result<String> {
    let mut stream = StdStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(request)?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

#[test]
fn requests_are_answered_and_oversized_ones_refused() {
    let addr = served();
    let ok = exchange(addr, b"GET /metrics HTTP/1.0\n\n").unwrap();
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    assert!(ok.contains("genv_enforcer_lost_events_total 0"), "{ok}");
    let other = exchange(addr, b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(other.starts_with("HTTP/1.1 404 "), "{other}");
    // Exactly as much as is read, with no end of headers (more would be left unread,
    // and the close would be a reset).
    let mut huge = b"GET /metrics HTTP/1.1\r\n".to_vec();
    huge.resize(REQUEST_BYTES, b'a');
    let refused = exchange(addr, &huge).unwrap();
    assert!(refused.starts_with("HTTP/1.1 431 "), "{refused}");
}

#[test]
fn silent_and_half_sent_requests_are_closed_unanswered() {
    let addr = served();
    for request in [&b""[..], b"GET /metrics HTTP/1.1\r\nHost: x\r\n"] {
        // Within the generous 10 s read timeout: the server closed it, with nothing.
        let answer = exchange(addr, request).unwrap();
        assert_eq!(answer, "", "{request:?}");
    }
}
