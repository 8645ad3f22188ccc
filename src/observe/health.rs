//! What `/healthz` and `/readyz` answer (docs/hardening.md, "Health endpoints").
//!
//! - `/readyz` fails until the first probe completed, at once while a probe has run past the
//!   probe deadline, when no probe completed for three intervals (a stalled probe loop), and
//!   while the agent has an agent error (`AgentError`).
//! - `/healthz` fails when a probe has run past the deadline plus the liveness grace, or when
//!   no probe started for three intervals plus the grace: the kubelet then restarts a wedged
//!   agent. An agent error alone does not fail it (a restart would not fix a missing device
//!   mount; it would only hide the condition).
//!
//! Lock-free: the probe loop writes atomics, the HTTP handlers read them.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// `/readyz` fails when no probe completed for this many intervals.
pub const STALL_INTERVALS: u32 = 3;

const NEVER: u64 = u64::MAX;

/// Timing the health answers depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HealthTiming {
    pub interval: Duration,
    /// A probe running longer than this is stalled (`--probe-deadline`).
    pub probe_deadline: Duration,
    /// `/healthz` fails this long after a probe became stalled (`--liveness-grace`).
    pub liveness_grace: Duration,
}

impl Default for HealthTiming {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            probe_deadline: Duration::from_secs(60),
            liveness_grace: Duration::from_secs(60),
        }
    }
}

/// Shared health state of the agent.
#[derive(Debug)]
pub struct Health {
    epoch: Instant,
    timing: Mutex<HealthTiming>,
    /// Milliseconds since `epoch` when the probe in flight started; `NEVER`: none in flight.
    probe_started: AtomicU64,
    /// Milliseconds since `epoch` when a probe last started / completed; `NEVER`: not yet.
    last_started: AtomicU64,
    last_completed: AtomicU64,
    agent_error: Mutex<Option<String>>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new(HealthTiming::default())
    }
}

fn saturating_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX - 1)
}

impl Health {
    pub fn new(timing: HealthTiming) -> Self {
        Self {
            epoch: Instant::now(),
            timing: Mutex::new(timing),
            probe_started: AtomicU64::new(NEVER),
            last_started: AtomicU64::new(NEVER),
            last_completed: AtomicU64::new(NEVER),
            agent_error: Mutex::new(None),
        }
    }

    pub fn set_timing(&self, timing: HealthTiming) {
        *self
            .timing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = timing;
    }

    fn timing(&self) -> HealthTiming {
        *self
            .timing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now_ms(&self) -> u64 {
        saturating_ms(self.epoch.elapsed())
    }

    pub fn probe_started(&self) {
        let now = self.now_ms();
        self.probe_started.store(now, Ordering::Release);
        self.last_started.store(now, Ordering::Release);
    }

    pub fn probe_completed(&self) {
        self.probe_started.store(NEVER, Ordering::Release);
        self.last_completed.store(self.now_ms(), Ordering::Release);
        if self.last_started.load(Ordering::Acquire) == NEVER {
            self.last_started.store(self.now_ms(), Ordering::Release);
        }
    }

    pub fn set_agent_error(&self, message: Option<String>) {
        *self
            .agent_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = message;
    }

    pub fn agent_error(&self) -> Option<String> {
        self.agent_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// How long the probe in flight has been running; `None` when none is.
    pub fn probe_running_for(&self) -> Option<Duration> {
        let started = self.probe_started.load(Ordering::Acquire);
        (started != NEVER).then(|| Duration::from_millis(self.now_ms().saturating_sub(started)))
    }

    fn since(&self, mark: &AtomicU64) -> Option<Duration> {
        let at = mark.load(Ordering::Acquire);
        (at != NEVER).then(|| Duration::from_millis(self.now_ms().saturating_sub(at)))
    }

    /// `Ok` when ready; otherwise why not.
    ///
    /// # Errors
    /// The reason `/readyz` answers 503.
    pub fn readiness(&self) -> Result<(), String> {
        let t = self.timing();
        if let Some(running) = self.probe_running_for()
            && running > t.probe_deadline
        {
            return Err(format!(
                "a probe has been running for {}s, past the probe deadline of {}s",
                running.as_secs(),
                t.probe_deadline.as_secs()
            ));
        }
        let Some(since_done) = self.since(&self.last_completed) else {
            return Err("the first probe has not completed".into());
        };
        let stall = t.interval.saturating_mul(STALL_INTERVALS);
        if since_done > stall.max(t.probe_deadline) {
            return Err(format!(
                "no probe completed for {}s ({STALL_INTERVALS} intervals of {}s): the probe loop \
                 has stalled",
                since_done.as_secs(),
                t.interval.as_secs_f64()
            ));
        }
        if let Some(e) = self.agent_error() {
            return Err(format!("agent error: {e}"));
        }
        Ok(())
    }

    /// `Ok` when alive; otherwise why the kubelet should restart the agent.
    ///
    /// # Errors
    /// The reason `/healthz` answers 503.
    pub fn liveness(&self) -> Result<(), String> {
        let t = self.timing();
        let limit = t.probe_deadline.saturating_add(t.liveness_grace);
        if let Some(running) = self.probe_running_for()
            && running > limit
        {
            return Err(format!(
                "a probe has been running for {}s, past the probe deadline ({}s) plus the \
                 liveness grace ({}s): the agent is wedged",
                running.as_secs(),
                t.probe_deadline.as_secs(),
                t.liveness_grace.as_secs()
            ));
        }
        // The loop starts a probe every interval; none for this long means the loop is stuck.
        let idle_limit = t
            .interval
            .saturating_mul(STALL_INTERVALS)
            .saturating_add(t.liveness_grace);
        let idle = self
            .since(&self.last_started)
            .unwrap_or_else(|| self.epoch.elapsed());
        if self.probe_running_for().is_none() && idle > idle_limit {
            return Err(format!(
                "no probe started for {}s: the probe loop is wedged",
                idle.as_secs()
            ));
        }
        Ok(())
    }

    pub fn is_ready(&self) -> bool {
        self.readiness().is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(interval_ms: u64, deadline_ms: u64, grace_ms: u64) -> Health {
        Health::new(HealthTiming {
            interval: Duration::from_millis(interval_ms),
            probe_deadline: Duration::from_millis(deadline_ms),
            liveness_grace: Duration::from_millis(grace_ms),
        })
    }

    #[test]
    fn ready_after_the_first_probe_until_an_agent_error() {
        let h = health(10_000, 10_000, 10_000);
        assert!(h.readiness().unwrap_err().contains("first probe"));
        assert!(h.liveness().is_ok());
        h.probe_started();
        h.probe_completed();
        assert!(h.readiness().is_ok());
        h.set_agent_error(Some("no access to /dev/infiniband".into()));
        assert!(h.readiness().unwrap_err().contains("/dev/infiniband"));
        assert!(
            h.liveness().is_ok(),
            "an agent error is not a reason to restart"
        );
        h.set_agent_error(None);
        assert!(h.readiness().is_ok());
    }

    #[test]
    fn a_probe_past_its_deadline_fails_readiness_then_liveness() {
        let h = health(10_000, 20, 40);
        h.probe_started();
        h.probe_completed();
        h.probe_started();
        std::thread::sleep(Duration::from_millis(30));
        assert!(h.readiness().unwrap_err().contains("deadline"));
        assert!(h.liveness().is_ok(), "within the grace");
        std::thread::sleep(Duration::from_millis(40));
        assert!(h.liveness().unwrap_err().contains("wedged"));
        h.probe_completed();
        assert!(h.readiness().is_ok());
        assert!(h.liveness().is_ok());
    }

    #[test]
    fn a_stalled_loop_fails_readiness_after_three_intervals() {
        let h = health(10, 10, 1_000);
        h.probe_started();
        h.probe_completed();
        std::thread::sleep(Duration::from_millis(40));
        assert!(h.readiness().unwrap_err().contains("stalled"));
        assert!(h.liveness().is_ok());
    }
}
