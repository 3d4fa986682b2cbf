//! A command the test leaves running (a remote enforcer, a stream): its stdout read as
//! it comes, its stderr kept, stopped with SIGTERM; and a command run to its end.

use std::process::Output;
use std::time::{Duration, Instant};

use crate::{harness, wait_for_or};

pub fn lines(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::to_owned)
        .collect()
}

pub fn run(mut command: std::process::Command) -> (Output, Vec<String>, String) {
    let output = command.output().unwrap();
    let stdout = lines(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output, stdout, stderr)
}

/// A remote enforcer left running, its stdout read as it comes.
pub struct Running {
    pub child: std::process::Child,
    stdout: std::sync::mpsc::Receiver<String>,
    pub seen: Vec<String>,
    /// Its stderr, read as it comes (a full pipe would stall it).
    pub stderr: std::sync::Arc<std::sync::Mutex<String>>,
    /// The thread reading stderr, which ends at its end.
    reading: Option<std::thread::JoinHandle<()>>,
}

impl Running {
    pub fn start(mut command: std::process::Command) -> Self {
        let mut child = command
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (err, kept) = (child.stderr.take().unwrap(), std::sync::Arc::clone(&stderr));
        let reading = std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let mut kept = kept.lock().unwrap();
                if kept.len() < 1 << 20 {
                    kept.push_str(&line);
                    kept.push('\n');
                }
            }
        });
        Self {
            child,
            stdout: rx,
            seen: Vec::new(),
            stderr,
            reading: Some(reading),
        }
    }

    /// Waits for this many lines; fails with what came, and stderr, past the timeout.
    pub fn lines(&mut self, count: usize, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        while self.seen.len() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => {
                    let stderr = self.stop();
                    panic!(
                        "{} lines of {count} within {timeout:?}: {:?}; stderr: {stderr}",
                        self.seen.len(),
                        self.seen
                    );
                }
            }
        }
        self.seen.clone()
    }

    /// Waits (60 s at most) for a line containing `needle`; every line so far.
    pub fn expect_printed(&mut self, needle: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.seen.iter().any(|l| l.contains(needle)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stdout.recv_timeout(left) {
                Ok(line) => self.seen.push(line),
                Err(_) => {
                    let stderr = self.stop();
                    panic!(
                        "waited 60 s for {needle:?}: {:?}; stderr: {stderr}",
                        self.seen
                    );
                }
            }
        }
        self.seen.clone()
    }

    /// Waits (60 s at most) until `done`; past that, stops the enforcer and fails with
    /// the end of its stderr.
    pub fn wait_until(&mut self, what: &str, done: impl FnMut() -> bool) {
        let mut done = done;
        wait_for_or(
            what,
            Duration::from_secs(60),
            || done().then_some(()),
            || {
                let stderr = self.stop();
                let tail: Vec<char> = stderr.chars().rev().take(2000).collect();
                let tail: String = tail.into_iter().rev().collect();
                format!("stderr ends: {tail}")
            },
        );
    }

    /// SIGTERM; its whole stderr, once read to its end.
    pub fn stop(&mut self) -> String {
        // SAFETY: kill(2) takes no pointer; the child is this test's.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        // Its ssh children may hold the pipe a moment longer; its end comes with them
        // (one left running past 10 s is another test's failure: what came is kept).
        if let Some(reading) = self.reading.take() {
            harness::poll(Duration::from_secs(10), Duration::from_millis(5), || {
                reading.is_finished().then_some(())
            });
        }
        self.stderr.lock().unwrap().clone()
    }
}

/// A test that failed while its enforcer ran leaves no enforcer behind.
impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
