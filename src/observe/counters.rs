//! Kernel counters read again and again, turned into increases that never go backwards.
//! Shared by the exported counters (`metrics`) and the fallback detector (`fallback`), so
//! neither of those modules needs the other; and the exported counters' bookkeeping
//! ([`accumulate`], [`expire`], [`drop_series`]) the built-in metrics and a registered
//! subsystem's (src/checks/) share.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::collections::HashMap;
use std::hash::Hash;

/// A kernel counter seen through successive reads, turned into increments that never go
/// backwards: a decrease means the counter restarted from zero (reset, driver reload, or a
/// wrap), so everything read since then is new.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Monotonic {
    last: u64,
}

impl Monotonic {
    pub fn starting_at(raw: u64) -> Self {
        Self { last: raw }
    }

    /// The increase since the previous read.
    pub fn observe(&mut self, raw: u64) -> u64 {
        let delta = if raw >= self.last {
            raw - self.last
        } else {
            raw
        };
        self.last = raw;
        delta
    }
}

/// Remember who was seen now and return the names unseen for longer than `grace`.
pub fn expire(
    seen: &mut HashMap<String, std::time::Instant>,
    present: impl Iterator<Item = String>,
    now: std::time::Instant,
    grace: std::time::Duration,
) -> Vec<String> {
    for name in present {
        seen.insert(name, now);
    }
    let gone: Vec<String> = seen
        .iter()
        .filter(|(_, t)| now.saturating_duration_since(**t) > grace)
        .map(|(n, _)| n.clone())
        .collect();
    for n in &gone {
        seen.remove(n);
    }
    gone
}

/// Drop the series (and their accumulators) whose labels `is_gone`.
pub fn drop_series<L: Clone + Hash + Eq + EncodeLabelSet + std::fmt::Debug>(
    family: &Family<L, Counter>,
    readers: &mut HashMap<L, Monotonic>,
    is_gone: impl Fn(&L) -> bool,
) {
    readers.retain(|labels, _| {
        if is_gone(labels) {
            family.remove(labels);
            false
        } else {
            true
        }
    });
}

/// Add the increase of one kernel counter read to its exported counter.
pub fn accumulate<L: Clone + Hash + Eq + EncodeLabelSet + std::fmt::Debug>(
    family: &Family<L, Counter>,
    readers: &mut HashMap<L, Monotonic>,
    labels: L,
    raw: u64,
) {
    let delta = match readers.get_mut(&labels) {
        Some(m) => m.observe(raw),
        None => {
            readers.insert(labels.clone(), Monotonic::starting_at(raw));
            raw
        }
    };
    family.get_or_create(&labels).inc_by(delta);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_treats_a_decrease_as_a_restart_from_zero() {
        let mut m = Monotonic::starting_at(100);
        assert_eq!(m.observe(150), 50);
        assert_eq!(m.observe(150), 0);
        assert_eq!(m.observe(20), 20, "reset: the 20 since the restart are new");
        assert_eq!(m.observe(25), 5);
        let mut m = Monotonic::starting_at(u64::MAX - 1);
        assert_eq!(m.observe(3), 3, "64-bit wrap counts as a restart");
    }
}
