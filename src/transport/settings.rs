//! The `runtime:` section: which pods of the node are judged at run time, and how a
//! pod on sockets is told from one on RDMA (docs/runtime-transport.md).

use crate::config::duration::{bounded_duration, parse_bounded_duration};
use crate::config::{Config, FeatureSection, Section};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Default `runtime.window`: the inter-node TCP of a pod is measured over this long. With the
/// default probe interval (10 s) a pod on sockets is found within 40 s of its first bulk TCP.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(30);
/// Default `runtime.tcp_min_bytes_per_second`: 10 MB/s of TCP with other nodes. NCCL's socket
/// transport moves hundreds of MB/s to GB/s per rank; control traffic (NCCL's bootstrap,
/// rendezvous, metrics) stays far below.
pub const DEFAULT_TCP_MIN_BYTES_PER_SECOND: u64 = 10_000_000;
/// Default `runtime.evict_after`.
pub const DEFAULT_EVICT_AFTER: Duration = Duration::from_secs(120);
/// Default `runtime.confirm_windows`: a pod is `sockets` after two windows in a row show it,
/// so one window of a checkpoint restore or a peer streaming in never acts.
pub const DEFAULT_CONFIRM_WINDOWS: u32 = 2;
/// Default `runtime.clear_after`: a confirmed `False` with this long of quiet since returns to
/// `Unknown`/`NoInterNodeTraffic` (a finished warm-up never stays `False` by inertia).
pub const DEFAULT_CLEAR_AFTER: Duration = Duration::from_secs(600);
/// The labels that name a pod's job, in this order, after `runtime.job_labels`: JobSet before
/// Job (a JobSet's Jobs each have their own name), the training operators', LeaderWorkerSet's,
/// the gang schedulers' pod groups, then a Job's own.
pub const BUILTIN_JOB_LABELS: [&str; 7] = [
    "jobset.sigs.k8s.io/jobset-name",
    "training.kubeflow.org/job-name",
    "leaderworkerset.sigs.k8s.io/name",
    "kueue.x-k8s.io/pod-group-name",
    "scheduling.x-k8s.io/pod-group",
    "volcano.sh/job-name",
    "batch.kubernetes.io/job-name",
];

bounded_duration!(
    window,
    "runtime.window",
    Duration::from_secs(5),
    Duration::from_secs(600)
);
bounded_duration!(
    clear_after,
    "runtime.clear_after",
    Duration::from_secs(10),
    Duration::from_secs(24 * 3600)
);
bounded_duration!(
    evict_after,
    "runtime.evict_after",
    Duration::from_secs(10),
    Duration::from_secs(24 * 3600)
);

/// `runtime.on_sockets`: what happens to a pod found on sockets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnSockets {
    /// Metrics, the Event and the pod condition only.
    #[default]
    Record,
    /// Also: `fabricgate guard` evicts a pod whose `fabricgate.io/TransportReady` condition
    /// has been `False` for `runtime.evict_after` (never the agents).
    Evict,
}

/// `runtime:` in the config file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeSettings {
    /// Judge the pods of this node at run time. Off (the default): no pods watch, no QP dump,
    /// no request beyond today's. Opt-in because it needs what the base DaemonSet does not
    /// grant (deploy/overlays/runtime-transport: hostPID, capabilities, pods RBAC).
    pub enabled: bool,
    /// A label selector (`app=trainer,team=llm`): pods matching it are judged, beside those
    /// that request one of `kubernetes.rdma_resources` or claim a device of a
    /// `kubernetes.dra` driver. Empty (the default): only those.
    pub pod_selector: String,
    /// How long a pod's inter-node TCP is measured (5s to 10m).
    #[serde(with = "window")]
    pub window: Duration,
    /// A pod moving at least this much TCP per second with other nodes over `window`, with no
    /// data-path QP in RTS, is on sockets (> 0).
    pub tcp_min_bytes_per_second: u64,
    pub on_sockets: OnSockets,
    /// With `on_sockets: evict`: how long a pod's condition must have been `False` before the
    /// guard evicts it (10s to 24h).
    #[serde(with = "evict_after")]
    pub evict_after: Duration,
    /// TCP sockets counted in one judged pod's network namespace per window, at most: past it
    /// the pod is `unknown` for that window (the reason names this number) and the others go
    /// on being judged, so no pod can make the agent's memory or time per window grow with
    /// what it opens (1 or more).
    pub max_sockets_per_pod: usize,
    /// Windows in a row that must show a pod on sockets before it is `sockets` (its condition
    /// `False`, its Event, anything that acts on it): 1 to 10.
    pub confirm_windows: u32,
    /// How long a pod found on sockets must then be quiet (no bulk TCP with its job's peers,
    /// no data-path QP) before its condition returns to `Unknown`/`NoInterNodeTraffic`
    /// (10s to 24h).
    #[serde(with = "clear_after")]
    pub clear_after: Duration,
    /// Labels that name a pod's job, tried before the built-in ones (JobSet, Kubeflow,
    /// LeaderWorkerSet, Kueue and scheduler-plugins pod groups, Volcano, Job): the pods with
    /// the same value of the first label present are one job.
    pub job_labels: Vec<String>,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            pod_selector: String::new(),
            window: DEFAULT_WINDOW,
            tcp_min_bytes_per_second: DEFAULT_TCP_MIN_BYTES_PER_SECOND,
            on_sockets: OnSockets::Record,
            evict_after: DEFAULT_EVICT_AFTER,
            max_sockets_per_pod: fabricgate_probes::transport::tcp::DEFAULT_MAX_SOCKETS,
            confirm_windows: DEFAULT_CONFIRM_WINDOWS,
            clear_after: DEFAULT_CLEAR_AFTER,
            job_labels: Vec::new(),
        }
    }
}

impl FeatureSection for RuntimeSettings {
    const KEY: &'static str = "runtime";

    fn section(config: &Config) -> &Section {
        &config.runtime
    }

    /// [`Error::ConfigValue`] naming `runtime.pod_selector` (an empty term, or a term that is
    /// not `key=value`, `key!=value`, `key` or `!key`), `runtime.tcp_min_bytes_per_second`
    /// (0), `runtime.confirm_windows`, `runtime.job_labels` or `runtime.max_sockets_per_pod`.
    fn validate(&self) -> Result<()> {
        if !(1..=10).contains(&self.confirm_windows) {
            return Err(Error::ConfigValue {
                key: "runtime.confirm_windows".to_owned(),
                message: format!(
                    "{} is outside 1 to 10; give how many windows in a row must show a pod on \
                     sockets before it is acted on (e.g. 2)",
                    self.confirm_windows
                ),
            });
        }
        for key in &self.job_labels {
            if crate::config::labels::validate_label_key(key).is_err() {
                return Err(Error::ConfigValue {
                    key: "runtime.job_labels".to_owned(),
                    message: format!(
                        "{key:?} is not a label key; give label keys whose value names a \
                         pod's job (e.g. \"example.com/training-run\")"
                    ),
                });
            }
        }
        if self.max_sockets_per_pod == 0 {
            return Err(Error::ConfigValue {
                key: "runtime.max_sockets_per_pod".to_owned(),
                message: "0 would leave every pod unknown; give the most TCP sockets one pod's \
                          network namespace may hold and still be measured (e.g. 65536)"
                    .to_owned(),
            });
        }
        if self.tcp_min_bytes_per_second == 0 {
            return Err(Error::ConfigValue {
                key: "runtime.tcp_min_bytes_per_second".to_owned(),
                message: "0 would call every pod with any TCP a pod on sockets; give a rate in \
                          bytes per second (e.g. 10000000)"
                    .to_owned(),
            });
        }
        if !self.pod_selector.is_empty() {
            for term in self.pod_selector.split(',') {
                let key = term
                    .trim()
                    .trim_start_matches('!')
                    .split(['=', '!'])
                    .next()
                    .unwrap_or_default()
                    .trim();
                if key.is_empty() || crate::config::labels::validate_label_key(key).is_err() {
                    return Err(Error::ConfigValue {
                        key: "runtime.pod_selector".to_owned(),
                        message: format!(
                            "{:?} has the term {term:?}, which names no label key; give a \
                             label selector (e.g. \"app=trainer,team=llm\")",
                            self.pod_selector
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `runtime:` section, read from a parsed file.
    #[test]
    fn runtime_defaults_parse_and_bad_values_name_their_key() {
        let c = RuntimeSettings::of(&Config::default()).unwrap();
        assert!(!c.enabled, "opt-in: the base DaemonSet lacks what it needs");
        assert_eq!(c.window, DEFAULT_WINDOW);
        assert_eq!(c.on_sockets, OnSockets::Record);
        let c = Config::parse(
            "runtime:\n  enabled: true\n  pod_selector: app=trainer\n  window: 45s\n  on_sockets: evict\n  \
             evict_after: 5m\n  tcp_min_bytes_per_second: 1000\n",
        )
        .unwrap();
        let c = RuntimeSettings::of(&c).unwrap();
        assert!(c.enabled);
        assert_eq!(c.pod_selector, "app=trainer");
        assert_eq!(c.window, Duration::from_secs(45));
        assert_eq!(c.on_sockets, OnSockets::Evict);
        assert_eq!(c.evict_after, Duration::from_secs(300));
        assert_eq!(c.tcp_min_bytes_per_second, 1000);
        assert_eq!(c.confirm_windows, DEFAULT_CONFIRM_WINDOWS);
        assert_eq!(c.clear_after, DEFAULT_CLEAR_AFTER);
        let c = Config::parse(
            "runtime:\n  confirm_windows: 3\n  clear_after: 2m\n  job_labels: [example.com/run]\n",
        )
        .unwrap();
        let c = RuntimeSettings::of(&c).unwrap();
        assert_eq!(c.confirm_windows, 3);
        assert_eq!(c.clear_after, Duration::from_secs(120));
        assert_eq!(c.job_labels, ["example.com/run"]);
        for (yaml, key) in [
            ("runtime:\n  window: 1s\n", "runtime.window"),
            ("runtime:\n  evict_after: 1s\n", "runtime.evict_after"),
            ("runtime:\n  on_sockets: kill\n", "on_sockets"),
            (
                "runtime:\n  tcp_min_bytes_per_second: 0\n",
                "runtime.tcp_min",
            ),
            (
                "runtime:\n  pod_selector: \"app=a,,b=c\"\n",
                "runtime.pod_selector",
            ),
            ("runtime:\n  pod_selector: \"=x\"\n", "runtime.pod_selector"),
            ("runtime:\n  podselector: a\n", "podselector"),
            (
                "runtime:\n  confirm_windows: 0\n",
                "runtime.confirm_windows",
            ),
            (
                "runtime:\n  confirm_windows: 11\n",
                "runtime.confirm_windows",
            ),
            ("runtime:\n  clear_after: 1s\n", "runtime.clear_after"),
            ("runtime:\n  job_labels: [\"a b\"]\n", "runtime.job_labels"),
        ] {
            let e = RuntimeSettings::of(&Config::parse(yaml).unwrap())
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{yaml}: {e}");
        }
    }
}
