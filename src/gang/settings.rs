//! The `gang:` section: what `fabricgate admission-check` (the Kueue admission-check
//! controller, docs/gangs.md) asks of a gang's nodes before Kueue releases it.

use crate::config::duration::{bounded_duration, parse_bounded_duration};
use crate::config::{Config, FeatureSection, Section};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Default `gang.namespace`: where the FabricCheck objects live.
pub const DEFAULT_NAMESPACE: &str = "fabricgate";
/// Default `gang.timeout`.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);
/// Default `gang.max_nodes`.
pub const DEFAULT_MAX_NODES: usize = 256;
/// Upper bound of `gang.max_nodes` (a FabricCheck's members stay far below the object limit).
pub const MAX_MAX_NODES: usize = 4096;
/// Default `gang.retry_backoff`: Kueue requeues after the first `Retry` no sooner than this.
pub const DEFAULT_RETRY_BACKOFF: Duration = Duration::from_secs(5);
/// Default `gang.retry_backoff_max`: the doubling delay stops growing here. Kueue v0.19 keeps
/// the Workload's quota reserved (its nodes idle) until the delay ends, so it stays short.
pub const DEFAULT_RETRY_BACKOFF_MAX: Duration = Duration::from_secs(120);
/// Default `gang.max_attempts`: the pre-flight fails this many times, then the Workload is
/// `Rejected`.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 10;
/// Upper bound of `gang.max_attempts`.
pub const MAX_MAX_ATTEMPTS: u32 = 1000;
/// Default `gang.requeue_grace`: a member unvalidated (or a member pod on sockets) for less
/// than this does not requeue an admitted gang (a flapping port).
pub const DEFAULT_REQUEUE_GRACE: Duration = Duration::from_secs(60);
/// Default `gang.max_requeues_per_window`: admitted gangs requeued per `gang.requeue_window`.
pub const DEFAULT_MAX_REQUEUES_PER_WINDOW: u32 = 10;
/// Default `gang.max_requeues_per_namespace`: one namespace's share of the window's requeues.
pub const DEFAULT_MAX_REQUEUES_PER_NAMESPACE: u32 = 5;
/// Default `gang.requeue_window`.
pub const DEFAULT_REQUEUE_WINDOW: Duration = Duration::from_secs(600);

/// `gang.after_admission`: what the controller does about a gang it admitted whose member
/// goes bad.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AfterAdmission {
    /// Nothing: an admitted Workload is not looked at again.
    Ignore,
    /// Set the check `Retry` (Kueue evicts and requeues the gang whole) once a member stayed
    /// bad for `gang.requeue_grace`.
    #[default]
    Requeue,
}
/// Default `gang.min_bandwidth_gbps`: every rail of every pair moves at least this much in
/// its WRITE burst (a 200-400G rail does several times more from one queue pair; a link
/// trained down, a congested or misrouted path, or a rail on the wrong switch does not).
pub const DEFAULT_MIN_BANDWIDTH_GBPS: f64 = 25.0;
/// Default `gang.max_rtt_micros`: the median RTT of every rail of every pair stays below this
/// (an HCA-to-HCA WRITE through a leaf or a spine takes a few µs).
pub const DEFAULT_MAX_RTT_MICROS: f64 = 50.0;

/// `gang:` in the config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GangSettings {
    /// Namespace of the FabricCheck objects (the agents' namespace).
    pub namespace: String,
    /// How long the gang's agents have to write their results (1s to 10m); a member that has
    /// not answered by then fails the check (`Retry`, never `Ready`).
    #[serde(with = "timeout")]
    pub timeout: Duration,
    /// Also run an RDMA WRITE bandwidth burst on every rail of every pair and require this
    /// much (Gbit/s); default [`DEFAULT_MIN_BANDWIDTH_GBPS`], `null`: no burst.
    pub min_bandwidth_gbps: Option<f64>,
    /// The median RTT of every rail of every pair must stay below this (µs); default
    /// [`DEFAULT_MAX_RTT_MICROS`], `null`: no ceiling.
    pub max_rtt_micros: Option<f64>,
    /// Largest gang the pre-flight runs on (2 to 4096); a larger one is `Rejected`.
    pub max_nodes: usize,
    /// A pair is good only when it was measured over RDMA. `false`: for clusters (and
    /// tests) without verbs, an answer over the peers' side channel is enough, and the
    /// check's message says so.
    pub require_rdma: bool,
    /// Every pod set must have a topology assignment (Kueue Topology Aware Scheduling), so
    /// that its nodes are known and ring-tested; one without is `Retry`, never `Ready`.
    /// `false`: such a pod set gets node validation of its flavors' nodes only, and the
    /// message says the RDMA pre-flight did not run.
    pub require_topology: bool,
    /// The delay Kueue waits before it reserves again after the first `Retry`
    /// (`requeueAfterSeconds` on the check's state), doubled for every earlier retry of the
    /// Workload (Kueue's `retryCount`), at most `retry_backoff_max`. 1s to 1h.
    #[serde(with = "retry_backoff")]
    pub retry_backoff: Duration,
    /// The longest delay between two attempts (1s to 24h, not below `retry_backoff`).
    #[serde(with = "retry_backoff_max")]
    pub retry_backoff_max: Duration,
    /// A Workload whose pre-flight failed this many times (its check's `retryCount` + 1) is
    /// `Rejected` instead of retried again (1 to 1000; 1: the first failure rejects).
    pub max_attempts: u32,
    /// After admission: `requeue` (default) a gang whose member node turned unvalidated, or
    /// whose member pod is on sockets, for `requeue_grace`; or `ignore`.
    pub after_admission: AfterAdmission,
    /// How long a member stays bad before its admitted gang is requeued (1s to 1h).
    #[serde(with = "requeue_grace")]
    pub requeue_grace: Duration,
    /// At most this many admitted gangs requeued per `requeue_window` (the breaker: a
    /// fleet-wide event is more likely a bad requirements rollout); the rest are reported
    /// and stay admitted. 1 to 100000.
    pub max_requeues_per_window: u32,
    /// At most this many of them in one namespace (a tenant's many small gangs on sockets
    /// cannot spend every other tenant's requeues); 0: no limit per namespace. 0 to 100000.
    pub max_requeues_per_namespace: u32,
    /// The breaker's window (1m to 24h).
    #[serde(with = "requeue_window")]
    pub requeue_window: Duration,
}

impl Default for GangSettings {
    fn default() -> Self {
        Self {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            min_bandwidth_gbps: Some(DEFAULT_MIN_BANDWIDTH_GBPS),
            max_rtt_micros: Some(DEFAULT_MAX_RTT_MICROS),
            max_nodes: DEFAULT_MAX_NODES,
            require_rdma: true,
            require_topology: true,
            retry_backoff: DEFAULT_RETRY_BACKOFF,
            retry_backoff_max: DEFAULT_RETRY_BACKOFF_MAX,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            after_admission: AfterAdmission::Requeue,
            requeue_grace: DEFAULT_REQUEUE_GRACE,
            max_requeues_per_window: DEFAULT_MAX_REQUEUES_PER_WINDOW,
            max_requeues_per_namespace: DEFAULT_MAX_REQUEUES_PER_NAMESPACE,
            requeue_window: DEFAULT_REQUEUE_WINDOW,
        }
    }
}

bounded_duration!(
    timeout,
    "gang.timeout",
    Duration::from_secs(1),
    Duration::from_secs(600)
);

bounded_duration!(
    retry_backoff,
    "gang.retry_backoff",
    Duration::from_secs(1),
    Duration::from_secs(3600)
);

bounded_duration!(
    retry_backoff_max,
    "gang.retry_backoff_max",
    Duration::from_secs(1),
    Duration::from_secs(86_400)
);

bounded_duration!(
    requeue_grace,
    "gang.requeue_grace",
    Duration::from_secs(1),
    Duration::from_secs(3600)
);

bounded_duration!(
    requeue_window,
    "gang.requeue_window",
    Duration::from_secs(60),
    Duration::from_secs(86_400)
);

/// What the check does with a pre-flight that failed: retry after a delay, or give up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Escalation {
    /// `Retry`, Kueue to reserve again no sooner than this (`requeueAfterSeconds`).
    Retry { after_secs: u32, attempt: u32 },
    /// `Rejected`: the Workload failed `gang.max_attempts` times.
    Reject { attempt: u32 },
}

impl GangSettings {
    /// After a failed pre-flight of a Workload whose check was retried `retry_count` times
    /// before (Kueue's `retryCount`): `retry_backoff` doubled per earlier retry, at most
    /// `retry_backoff_max`, in whole seconds; or `Reject` once `max_attempts` are used up.
    pub fn escalate(&self, retry_count: u32) -> Escalation {
        let attempt = retry_count.saturating_add(1);
        if attempt >= self.max_attempts {
            return Escalation::Reject { attempt };
        }
        let base = self.retry_backoff.as_secs().max(1);
        let max = self.retry_backoff_max.as_secs().max(base);
        let delay = base
            .checked_shl(retry_count.min(63))
            .filter(|d| d >> retry_count.min(63) == base)
            .unwrap_or(u64::MAX)
            .min(max);
        Escalation::Retry {
            after_secs: u32::try_from(delay).unwrap_or(u32::MAX),
            attempt,
        }
    }
}

impl FeatureSection for GangSettings {
    const KEY: &'static str = "gang";

    fn section(config: &Config) -> &Section {
        &config.gang
    }

    fn validate(&self) -> Result<()> {
        let bad = |key: &str, message: String| {
            Err(Error::ConfigValue {
                key: format!("gang.{key}"),
                message,
            })
        };
        let dns_label = !self.namespace.is_empty()
            && self.namespace.len() <= 63
            && self
                .namespace
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !self.namespace.starts_with('-')
            && !self.namespace.ends_with('-');
        if !dns_label {
            return bad(
                "namespace",
                format!(
                    "{:?} is not a namespace name; give a DNS label such as {DEFAULT_NAMESPACE}",
                    self.namespace
                ),
            );
        }
        if !(2..=MAX_MAX_NODES).contains(&self.max_nodes) {
            return bad(
                "max_nodes",
                format!(
                    "{} is out of range; give 2 to {MAX_MAX_NODES} (default {DEFAULT_MAX_NODES})",
                    self.max_nodes
                ),
            );
        }
        if let Some(g) = self.min_bandwidth_gbps
            && !(g.is_finite() && g > 0.0 && g <= 100_000.0)
        {
            return bad(
                "min_bandwidth_gbps",
                format!("{g} is out of range; give Gbit/s above 0 (e.g. 25), or null for none"),
            );
        }
        if let Some(r) = self.max_rtt_micros
            && !(r.is_finite() && r > 0.0 && r <= 10_000_000.0)
        {
            return bad(
                "max_rtt_micros",
                format!("{r} is out of range; give µs above 0 (e.g. 50), or null for none"),
            );
        }
        if self.max_attempts == 0 || self.max_attempts > MAX_MAX_ATTEMPTS {
            return bad(
                "max_attempts",
                format!(
                    "{} is out of range; give 1 to {MAX_MAX_ATTEMPTS} (default \
                     {DEFAULT_MAX_ATTEMPTS})",
                    self.max_attempts
                ),
            );
        }
        if self.max_requeues_per_namespace > 100_000 {
            return bad(
                "max_requeues_per_namespace",
                format!(
                    "{} is out of range; give 0 (no limit per namespace) to 100000 (default \
                     {DEFAULT_MAX_REQUEUES_PER_NAMESPACE})",
                    self.max_requeues_per_namespace
                ),
            );
        }
        if self.max_requeues_per_window == 0 || self.max_requeues_per_window > 100_000 {
            return bad(
                "max_requeues_per_window",
                format!(
                    "{} is out of range; give 1 to 100000 (default \
                     {DEFAULT_MAX_REQUEUES_PER_WINDOW}), or gang.after_admission: ignore",
                    self.max_requeues_per_window
                ),
            );
        }
        if self.retry_backoff_max < self.retry_backoff {
            return bad(
                "retry_backoff_max",
                format!(
                    "{} is below gang.retry_backoff ({}); give at least that",
                    humantime::format_duration(self.retry_backoff_max),
                    humantime::format_duration(self.retry_backoff)
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_bounds_and_errors_name_the_key() {
        let d = GangSettings::default();
        d.validate().unwrap();
        assert_eq!(d.namespace, "fabricgate");
        assert_eq!(d.timeout, Duration::from_secs(20));
        assert_eq!(d.max_nodes, 256);
        assert!(d.require_rdma);
        assert!(d.require_topology, "require_topology is on by default");
        let ok: GangSettings = serde_norway::from_str(
            "namespace: gangs\ntimeout: 5s\nmin_bandwidth_gbps: 25\nmax_nodes: 64\n\
             require_rdma: false\nrequire_topology: false\n",
        )
        .unwrap();
        ok.validate().unwrap();
        assert_eq!(ok.timeout, Duration::from_secs(5));
        assert_eq!(ok.min_bandwidth_gbps, Some(25.0));
        assert!(!ok.require_rdma && !ok.require_topology);
        let e = serde_norway::from_str::<GangSettings>("timeout: 0s\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gang.timeout"), "{e}");
        for (yaml, key) in [
            ("max_nodes: 1\n", "gang.max_nodes"),
            ("max_nodes: 5000\n", "gang.max_nodes"),
            ("namespace: Bad_NS\n", "gang.namespace"),
            ("min_bandwidth_gbps: 0\n", "gang.min_bandwidth_gbps"),
            ("max_rtt_micros: -1\n", "gang.max_rtt_micros"),
        ] {
            let s: GangSettings = serde_norway::from_str(yaml).unwrap();
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
        assert!(serde_norway::from_str::<GangSettings>("peers_port: 1\n").is_err());
    }

    /// After admission, requeue by default after a minute, at most 10 per 10 min.
    #[test]
    fn after_admission_defaults_and_bounds() {
        let d = GangSettings::default();
        assert_eq!(d.after_admission, AfterAdmission::Requeue);
        assert_eq!(d.requeue_grace, Duration::from_secs(60));
        assert_eq!(
            (d.max_requeues_per_window, d.requeue_window),
            (10, Duration::from_secs(600))
        );
        let s: GangSettings = serde_norway::from_str(
            "after_admission: ignore\nrequeue_grace: 2s\nmax_requeues_per_window: 3\n\
             requeue_window: 5m\n",
        )
        .unwrap();
        s.validate().unwrap();
        assert_eq!(s.after_admission, AfterAdmission::Ignore);
        assert_eq!(s.requeue_grace, Duration::from_secs(2));
        assert_eq!(s.requeue_window, Duration::from_secs(300));
        for (yaml, key) in [
            ("requeue_grace: 0s\n", "gang.requeue_grace"),
            ("requeue_window: 1s\n", "gang.requeue_window"),
        ] {
            let e = serde_norway::from_str::<GangSettings>(yaml)
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
        assert!(serde_norway::from_str::<GangSettings>("after_admission: evict\n").is_err());
        let zero: GangSettings = serde_norway::from_str("max_requeues_per_window: 0\n").unwrap();
        let e = zero.validate().unwrap_err().to_string();
        assert!(e.contains("gang.max_requeues_per_window"), "{e}");
    }

    /// "ok" proves bandwidth and latency by default: a minimum bandwidth
    /// and an RTT ceiling ship on, and `null` turns each off.
    #[test]
    fn redteam_ok_has_a_default_bandwidth_floor_and_rtt_ceiling() {
        let d = GangSettings::default();
        assert_eq!(d.min_bandwidth_gbps, Some(DEFAULT_MIN_BANDWIDTH_GBPS));
        assert_eq!(d.max_rtt_micros, Some(DEFAULT_MAX_RTT_MICROS));
        let off: GangSettings =
            serde_norway::from_str("min_bandwidth_gbps: null\nmax_rtt_micros: null\n").unwrap();
        off.validate().unwrap();
        assert_eq!((off.min_bandwidth_gbps, off.max_rtt_micros), (None, None));
        let set: GangSettings = serde_norway::from_str("max_rtt_micros: 8\n").unwrap();
        assert_eq!(set.max_rtt_micros, Some(8.0));
    }

    /// A failing gang is retried with a doubling delay from Kueue's
    /// `retryCount`, bounded, and `Rejected` after `gang.max_attempts` failures.
    #[test]
    fn redteam_retry_backs_off_exponentially_and_rejects_after_max_attempts() {
        let d = GangSettings::default();
        assert_eq!(
            (d.retry_backoff, d.retry_backoff_max, d.max_attempts),
            (Duration::from_secs(5), Duration::from_secs(120), 10)
        );
        let delays: Vec<Escalation> = (0..10).map(|n| d.escalate(n)).collect();
        let secs: Vec<u32> = delays
            .iter()
            .filter_map(|e| match e {
                Escalation::Retry { after_secs, .. } => Some(*after_secs),
                Escalation::Reject { .. } => None,
            })
            .collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 120, 120, 120, 120]);
        assert_eq!(delays[9], Escalation::Reject { attempt: 10 });
        assert_eq!(
            d.escalate(u32::MAX),
            Escalation::Reject { attempt: u32::MAX }
        );
        // A huge retryCount (Kueue's is an int32) neither overflows nor wraps.
        let forever = GangSettings {
            max_attempts: MAX_MAX_ATTEMPTS,
            ..GangSettings::default()
        };
        assert_eq!(
            forever.escalate(200),
            Escalation::Retry {
                after_secs: 120,
                attempt: 201
            }
        );
        let once = GangSettings {
            max_attempts: 1,
            ..GangSettings::default()
        };
        assert_eq!(once.escalate(0), Escalation::Reject { attempt: 1 });

        let ok: GangSettings =
            serde_norway::from_str("retry_backoff: 2s\nretry_backoff_max: 1m\nmax_attempts: 3\n")
                .unwrap();
        ok.validate().unwrap();
        assert_eq!(
            ok.escalate(1),
            Escalation::Retry {
                after_secs: 4,
                attempt: 2
            }
        );
        assert_eq!(ok.escalate(2), Escalation::Reject { attempt: 3 });
        for (yaml, key) in [
            ("max_attempts: 0\n", "gang.max_attempts"),
            ("max_attempts: 1001\n", "gang.max_attempts"),
            (
                "retry_backoff: 1m\nretry_backoff_max: 10s\n",
                "gang.retry_backoff_max",
            ),
        ] {
            let s: GangSettings = serde_norway::from_str(yaml).unwrap();
            let e = s.validate().unwrap_err().to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
        let e = serde_norway::from_str::<GangSettings>("retry_backoff: 0s\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gang.retry_backoff"), "{e}");
    }
}
