//! Waiting for a condition with a deadline: one loop for every test that polls a process or
//! the apiserver.

use std::time::{Duration, Instant};

/// Polls `done` every 10 ms until it holds and returns how long that took; past `limit` the
/// test fails with "timed out after {limit:?} waiting for {what}".
pub fn wait_until(what: &str, limit: Duration, done: impl FnMut() -> bool) -> Duration {
    poll_until(what, limit, Duration::from_millis(10), done, String::new)
}

/// Polls `done` every `every` until it holds and returns how long that took; past `limit` the
/// test fails with "timed out after {limit:?} waiting for {what}" followed by what `context`
/// adds (the end of a log, say).
pub fn poll_until(
    what: &str,
    limit: Duration,
    every: Duration,
    mut done: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) -> Duration {
    let started = Instant::now();
    loop {
        if done() {
            return started.elapsed();
        }
        if started.elapsed() >= limit {
            panic!("timed out after {limit:?} waiting for {what}{}", context());
        }
        std::thread::sleep(every);
    }
}

/// The last `n` lines of `text`, in their order, joined by newlines.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
