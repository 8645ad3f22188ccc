//! What the agent's long-running jobs share about time and faults: checked instants
//! ([`later`]), the shutdown signal ([`wait_stop`]), jitter ([`Jitter`]), the Node writer's
//! delays, and the test-only [`Failpoint`].

use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long an in-flight Node write may finish after a shutdown signal before it is abandoned.
pub(super) const WRITE_GRACE: Duration = Duration::from_secs(2);
/// First retry delay after an API error; doubles up to the probe interval.
pub(super) const BACKOFF_BASE: Duration = Duration::from_millis(200);

/// Faults the integration tests inject into the real binary through the environment variable
/// `FABRICGATE_FAILPOINT` (never set in a deployment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Failpoint {
    #[default]
    None,
    /// The reconcile task panics on its first verdict.
    ReconcilePanic,
    /// The probe thread panics on its second probe.
    ProbePanic,
    /// Every probe after the first blocks forever.
    ProbeStall,
    /// The gang ring's view of this node's clock reads [`CLOCK_AHEAD`] ahead.
    ClockAhead,
}

/// How far the `clock-ahead` failpoint sets the gang ring's clock ahead: more than the
/// largest `gang.timeout`.
pub const CLOCK_AHEAD: Duration = Duration::from_secs(15 * 60);

impl Failpoint {
    pub(super) fn from_env() -> Self {
        match std::env::var("FABRICGATE_FAILPOINT").as_deref() {
            Ok("reconcile-panic") => Self::ReconcilePanic,
            Ok("probe-panic") => Self::ProbePanic,
            Ok("probe-stall") => Self::ProbeStall,
            Ok("clock-ahead") => Self::ClockAhead,
            _ => Self::None,
        }
    }

    /// How far ahead the gang ring's clock reads: [`CLOCK_AHEAD`] under `clock-ahead`, else 0.
    pub(super) fn clock_ahead(self) -> Duration {
        if self == Self::ClockAhead {
            CLOCK_AHEAD
        } else {
            Duration::ZERO
        }
    }
}

/// `now + d`, or a day from now when that overflows the clock (never panics).
pub(super) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

/// Completes once shutdown was requested (the watch `Ref` is not held across awaits).
pub(super) async fn wait_stop(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// [`wait_stop`] owning its receiver, for a task's shutdown future.
pub(super) async fn stopped(mut stop: watch::Receiver<bool>) {
    wait_stop(&mut stop).await;
}

/// splitmix64: jitter needs spread, not cryptographic randomness.
pub(super) struct Jitter(u64);

impl Jitter {
    pub(super) fn new() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self(t ^ (u64::from(std::process::id()) << 32))
    }

    /// Uniform in [0, 1).
    pub(super) fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_is_spread_over_the_unit_interval() {
        let mut j = Jitter::new();
        let xs: Vec<f64> = (0..1000).map(|_| j.next_f64()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(xs.iter().any(|&x| x < 0.1) && xs.iter().any(|&x| x > 0.9));
    }
}
