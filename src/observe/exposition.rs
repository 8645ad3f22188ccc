//! `/metrics` bytes encoded once per change, not once per scrape.
//!
//! Almost every series changes only when a probe is recorded (or a node write, or the agent
//! error), all under [`crate::observe::metrics::Metrics`]'s state lock, and taking that lock bumps a
//! generation. That registry is encoded at most once per generation and per format, lazily,
//! on the first scrape that asks for the format, and kept. The few families that change
//! without the lock (open HTTP connections and connections dropped, set by the server at
//! every connection; the peers' families, set by their own thread) live in a second, small
//! registry that is encoded at every scrape and written after the cached part (they are the
//! last families of the exposition, as before). When that part did not change either (the
//! usual case), the scrape is served the previous response's buffer as it is: no encoding,
//! no copy, one write.
//!
//! The served bytes are exactly what [`crate::observe::metrics::Metrics::encode`] gives at the same
//! moment (`tests/metrics.rs`: the golden files through the cache, and after every kind of
//! change).

use axum::body::Bytes;
use prometheus_client::registry::Registry;
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// The OpenMetrics terminator, written once at the very end.
pub const EOF: &str = "# EOF\n";

/// Encode `registry` in one format with its series sorted ([`sort_series`]),
/// without the OpenMetrics `# EOF` line. Empty on an encoder error (a bug in a label value:
/// half an exposition is worse than none).
pub fn encode_registry(registry: &Registry, openmetrics: bool) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let result = if openmetrics {
        prometheus_client::encoding::text::encode_registry(&mut out, registry)
    } else {
        prometheus_client::encoding::prometheus_text::encode(&mut out, registry)
    };
    if result.is_err() {
        out.clear();
    }
    sort_series(&out)
}

/// One format's cached exposition.
#[derive(Debug)]
struct Entry {
    /// The generation the cached part was encoded at.
    generation: u64,
    /// The registry changed under the state lock, encoded.
    cached: String,
    /// The live part the last response was assembled with, and that response.
    served: Option<(String, Bytes)>,
}

/// The cache behind [`crate::observe::metrics::Metrics::exposition`].
#[derive(Debug, Default)]
pub struct Cache {
    /// Bumped by every change made under the metrics state lock.
    generation: AtomicU64,
    /// `[Prometheus text, OpenMetrics]`.
    entries: Mutex<[Option<Entry>; 2]>,
    /// Encodings of the cached part (one per change and format scraped), for tests and
    /// benchmarks.
    encodes: AtomicU64,
}

impl Cache {
    /// The registry is about to change (called with the state lock held).
    pub fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// The current generation (read under the state lock to pair it with an encoding).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// How many times the cached part was encoded.
    pub fn encodes(&self) -> u64 {
        self.encodes.load(Ordering::Relaxed)
    }

    fn entries(&self) -> MutexGuard<'_, [Option<Entry>; 2]> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The exposition in one format. `encode_cached` encodes the registry changed under the
    /// state lock; it is called only when the generation moved, must hold the state lock
    /// while it encodes, and returns the generation read under that lock with the text.
    /// `live` is encoded at every call and written after it.
    pub fn get(
        &self,
        openmetrics: bool,
        live: &Registry,
        encode_cached: impl FnOnce() -> (u64, String),
    ) -> Bytes {
        let live_text = encode_registry(live, openmetrics);
        let mut entries = self.entries();
        let slot = &mut entries[usize::from(openmetrics)];
        let now = self.generation();
        let entry = match slot {
            Some(e) if e.generation == now => e,
            _ => {
                let (generation, cached) = encode_cached();
                self.encodes.fetch_add(1, Ordering::Relaxed);
                slot.insert(Entry {
                    generation,
                    cached,
                    served: None,
                })
            }
        };
        if let Some((text, bytes)) = &entry.served
            && *text == live_text
        {
            return bytes.clone();
        }
        let mut out = Vec::with_capacity(entry.cached.len() + live_text.len() + EOF.len());
        out.extend_from_slice(entry.cached.as_bytes());
        out.extend_from_slice(live_text.as_bytes());
        if openmetrics {
            out.extend_from_slice(EOF.as_bytes());
        }
        let bytes = Bytes::from(out);
        entry.served = Some((live_text, bytes.clone()));
        bytes
    }
}

/// Order the series of every family by their labels. prometheus-client keeps a family's
/// series in a hash map, so its order changes from scrape to scrape; a stable order keeps the
/// golden file exact and diffs of two scrapes readable. The lines of one series (a
/// histogram's buckets, sum and count) stay together and in their order.
fn sort_series(text: &str) -> String {
    /// The series' labels without `le` (a histogram's bucket lines differ only in `le`,
    /// which the classic encoder writes last and the OpenMetrics encoder first).
    fn series_key(line: &str) -> Cow<'_, str> {
        let labels = line.find('{').map_or("", |open| {
            let close = line.rfind('}').unwrap_or(line.len());
            &line[open + 1..close]
        });
        let le = if labels.starts_with("le=\"") {
            Some(0)
        } else {
            labels.find(",le=\"").map(|i| i + 1)
        };
        let Some(start) = le else {
            return Cow::Borrowed(labels);
        };
        let value_start = start + 4;
        let end = labels[value_start..]
            .find('"')
            .map_or(labels.len(), |i| value_start + i + 1);
        let (before, after) = (
            labels[..start].trim_end_matches(','),
            labels[end..].trim_start_matches(','),
        );
        match (before.is_empty(), after.is_empty()) {
            (_, true) => Cow::Borrowed(before),
            (true, false) => Cow::Borrowed(after),
            (false, false) => Cow::Owned(format!("{before},{after}")),
        }
    }
    fn flush(out: &mut String, groups: &mut Vec<(Cow<'_, str>, Vec<&str>)>) {
        groups.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, lines) in groups.drain(..) {
            for l in lines {
                out.push_str(l);
                out.push('\n');
            }
        }
    }
    let mut out = String::with_capacity(text.len());
    let mut groups: Vec<(Cow<'_, str>, Vec<&str>)> = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            flush(&mut out, &mut groups);
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let key = series_key(line);
        match groups.last_mut() {
            Some((k, lines)) if *k == key => lines.push(line),
            _ => groups.push((key, vec![line])),
        }
    }
    flush(&mut out, &mut groups);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_sorted_by_labels_and_histogram_lines_stay_together() {
        let text = "# TYPE a gauge\na{d=\"b\"} 2\na{d=\"a\"} 1\n# TYPE h histogram\n\
                    h_bucket{p=\"z\",le=\"1\"} 1\nh_bucket{p=\"z\",le=\"+Inf\"} 1\n\
                    h_sum{p=\"z\"} 1\nh_count{p=\"z\"} 1\nh_bucket{p=\"a\",le=\"1\"} 0\n\
                    h_bucket{p=\"a\",le=\"+Inf\"} 0\nh_sum{p=\"a\"} 0\nh_count{p=\"a\"} 0\n\
                    # TYPE u histogram\nu_bucket{le=\"5\"} 1\nu_bucket{le=\"10\"} 1\nu_sum 1\nu_count 1\n";
        let want = "# TYPE a gauge\na{d=\"a\"} 1\na{d=\"b\"} 2\n# TYPE h histogram\n\
                    h_bucket{p=\"a\",le=\"1\"} 0\nh_bucket{p=\"a\",le=\"+Inf\"} 0\n\
                    h_sum{p=\"a\"} 0\nh_count{p=\"a\"} 0\nh_bucket{p=\"z\",le=\"1\"} 1\n\
                    h_bucket{p=\"z\",le=\"+Inf\"} 1\nh_sum{p=\"z\"} 1\nh_count{p=\"z\"} 1\n\
                    # TYPE u histogram\nu_bucket{le=\"5\"} 1\nu_bucket{le=\"10\"} 1\nu_sum 1\nu_count 1\n";
        assert_eq!(sort_series(text), want);
        let om = "# TYPE h histogram\nh_bucket{le=\"1\",p=\"z\"} 1\nh_bucket{le=\"+Inf\",p=\"z\"} 1\n\
                  h_count{p=\"z\"} 1\nh_bucket{le=\"1\",p=\"a\"} 0\nh_bucket{le=\"+Inf\",p=\"a\"} 0\n\
                  h_count{p=\"a\"} 0\n# EOF\n";
        let want = "# TYPE h histogram\nh_bucket{le=\"1\",p=\"a\"} 0\nh_bucket{le=\"+Inf\",p=\"a\"} 0\n\
                    h_count{p=\"a\"} 0\nh_bucket{le=\"1\",p=\"z\"} 1\nh_bucket{le=\"+Inf\",p=\"z\"} 1\n\
                    h_count{p=\"z\"} 1\n# EOF\n";
        assert_eq!(sort_series(om), want);
    }
}
