//! `--metrics-addr` as a scraper sees it: a free port to give, and `GET /metrics`.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// A free port on 127.0.0.1, as `--metrics-addr` takes it.
pub fn free_local_addr() -> String {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("127.0.0.1:{}", probe.local_addr().unwrap().port())
}

/// What the endpoint at `addr` serves now (empty if it does not answer).
pub fn scrape(addr: &str) -> String {
    let Ok(mut stream) = std::net::TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    text
}

/// `GET /metrics` on a connection of its own; its answer must come within `within`
/// (every read has what is left of it as its timeout), else the test fails.
pub fn scrape_within(addr: &str, within: Duration) -> String {
    let deadline = Instant::now() + within;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: scraper\r\nAccept: */*\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())
            .unwrap_or_else(|| panic!("no whole answer within {within:?}: {answer:?}"));
        stream.set_read_timeout(Some(left)).unwrap();
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&chunk[..n]),
            Err(e) => panic!(
                "no whole answer within {within:?} ({e}): {:?}",
                String::from_utf8_lossy(&answer)
            ),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// The body of an HTTP answer (what follows the blank line after its head).
pub fn body(answer: &str) -> &str {
    answer.split_once("\r\n\r\n").map_or("", |(_, body)| body)
}

/// `promtool ARGS` in `dir`, with `stdin` written to it: whether it succeeded, and what
/// it said. No promtool fails the test, never skips it: `cargo xtask test` unpacks
/// Debian's under `target/tools` (else the one on the PATH is used).
pub fn promtool(args: &[&str], dir: &std::path::Path, stdin: &str) -> (bool, String) {
    use std::process::{Command, Stdio};
    let unpacked = crate::target_dir().join("../tools/prometheus/usr/bin/promtool");
    let program = match unpacked.is_file() {
        true => unpacked,
        false => "promtool".into(),
    };
    let mut child = Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("promtool {args:?}: {e} (`cargo xtask test` unpacks Debian's prometheus under target/tools)")
        });
    let mut input = child.stdin.take().expect("piped");
    input
        .write_all(stdin.as_bytes())
        .expect("promtool reads its input");
    drop(input);
    let out = child.wait_with_output().expect("promtool ends");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// `promtool check metrics` passes on the scraped `answer`'s body (its lint: HELP on
/// every family, counters named `_total`, base units).
pub fn assert_promtool_passes(answer: &str) {
    let text = body(answer);
    assert!(!text.is_empty(), "nothing scraped: {answer:?}");
    let (passed, said) = promtool(&["check", "metrics"], &std::env::temp_dir(), text);
    assert!(passed, "promtool check metrics: {said}\non:\n{text}");
}
