//! The guard's `/metrics`, `/healthz` and `/readyz` (docs/metrics.md, "The guard"), served by
//! `observe::server` within the same bounds as the agent's.
//!
//! - `/readyz` fails while the guard's Node writes are refused (its admission policy, its
//!   RBAC): the backstop that taints a Node whose agent died cannot act, and says so.
//! - `/healthz` fails when the guard's loop has not turned for far longer than its
//!   `--poll-interval` (a wedged loop; the kubelet restarts it).

use crate::observe::exposition::{EOF, encode_registry};
use crate::observe::metrics::{exposition_response, health_response, negotiate};
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::Response;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What deploy/guard.yaml's admission policy says when a Node is outside its pool: the
/// guard's `node.pool_selector` and the policy's `pool` disagree.
pub const POOL_REFUSAL: &str = "may modify only Nodes of the pool";

/// A Node write of the guard, the `kind` label of `fabricgate_guard_writes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    /// The taint.
    Taint,
    /// `FabricReady=False` on the status subresource.
    Condition,
    /// The server-side dry run of the taint at the start of a leadership.
    DryRun,
}

impl WriteKind {
    pub const ALL: [WriteKind; 3] = [Self::Taint, Self::Condition, Self::DryRun];

    pub fn label(self) -> &'static str {
        match self {
            Self::Taint => "taint",
            Self::Condition => "condition",
            Self::DryRun => "dry_run",
        }
    }
}

/// How a write ended, the `result` label of `fabricgate_guard_writes_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    /// The server refused it (`reason`: a [`REFUSAL_REASONS`] value): retrying will not help.
    Refused(&'static str),
    /// Anything else (a conflict, a timeout, an unreachable server): retried on the next sweep.
    Failed,
}

impl Outcome {
    pub const RESULTS: [&'static str; 3] = ["ok", "refused", "failed"];

    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Refused(_) => "refused",
            Self::Failed => "failed",
        }
    }

    /// What a write's result says about the guard's right to write.
    pub fn of<T>(result: &Result<T, kube::Error>) -> Self {
        match result {
            Ok(_) => Self::Ok,
            Err(e) => refusal_reason(e).map_or(Self::Failed, Self::Refused),
        }
    }
}

/// The `reason` values of `fabricgate_guard_refused_writes_total`.
pub const REFUSAL_REASONS: [&str; 4] = ["pool", "policy", "rbac", "other"];

/// Why the server refused a write, or `None` when it did not (a conflict, a missing Node, a
/// throttled or failed request): `pool` (the admission policy's pool does not hold the Node:
/// [`POOL_REFUSAL`]), `policy` (another rule of the admission policy), `rbac` (the token may
/// not), `other` (another admission plugin, an invalid request).
pub fn refusal_reason(e: &kube::Error) -> Option<&'static str> {
    let kube::Error::Api(status) = e else {
        return None;
    };
    let message = &status.message;
    match status.code {
        403 if message.contains(POOL_REFUSAL) => Some("pool"),
        403 if message.contains("ValidatingAdmissionPolicy") => Some("policy"),
        403 if message.contains("cannot") => Some("rbac"),
        401 => Some("rbac"),
        400 | 403 | 422 => Some("other"),
        _ => None,
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WriteLabels {
    kind: &'static str,
    result: &'static str,
}

/// How an eviction of a pod on sockets ended, the `result` label of
/// `fabricgate_guard_evictions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionResult {
    /// The Eviction API admitted it: the pod is terminating.
    Evicted,
    /// Its PodDisruptionBudget refused (429, or 403 naming the budget): retried later.
    PdbBlocked,
    /// Due, but held back by the breaker's cap (counted once per pod).
    BreakerHeld,
    /// Any other error (retried later).
    Failed,
}

impl EvictionResult {
    pub const ALL: [Self; 4] = [
        Self::Evicted,
        Self::PdbBlocked,
        Self::BreakerHeld,
        Self::Failed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Evicted => "evicted",
            Self::PdbBlocked => "pdb_blocked",
            Self::BreakerHeld => "breaker_held",
            Self::Failed => "failed",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// The guard's series and its health.
pub struct GuardMetrics {
    registry: Registry,
    leader: Gauge,
    sweeps: Counter,
    pool_nodes: Gauge,
    stale_agents: Gauge,
    writes: Family<WriteLabels, Counter>,
    refused: Family<ReasonLabels, Counter>,
    blocked: Gauge,
    confined: Gauge,
    /// Why the guard is not confined to its pool (a dry run outside it was admitted).
    unconfined: Mutex<Option<String>>,
    evictions: Family<ResultLabels, Counter>,
    /// Why the guard's writes are refused now (the last write or dry run refused, none
    /// admitted since); `None`: not known to be refused.
    refusal: Mutex<Option<String>>,
    epoch: Instant,
    /// Milliseconds from `epoch` to the last turn of the guard's loop.
    last_turn_ms: AtomicU64,
    /// `/healthz` fails when the loop has not turned for this long.
    wedged_after: Mutex<Duration>,
}

impl Default for GuardMetrics {
    fn default() -> Self {
        Self::new()
    }
}

fn gauge_of(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl GuardMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let leader = Gauge::default();
        registry.register(
            "fabricgate_guard_leader",
            "1 while this replica holds the guard's Lease and acts",
            leader.clone(),
        );
        let sweeps = Counter::default();
        registry.register(
            "fabricgate_guard_sweeps",
            "Sweeps of the leader's cache (every pool Node judged)",
            sweeps.clone(),
        );
        let pool_nodes = Gauge::default();
        registry.register(
            "fabricgate_guard_pool_nodes",
            "Pool Nodes (node.pool_selector) in the leader's cache at its last sweep",
            pool_nodes.clone(),
        );
        let stale_agents = Gauge::default();
        registry.register(
            "fabricgate_guard_stale_agents",
            "Pool Nodes whose agent pod was missing or not Ready at the leader's last sweep \
             (tainted once that lasts --stale-after)",
            stale_agents.clone(),
        );
        let writes = Family::<WriteLabels, Counter>::default();
        registry.register(
            "fabricgate_guard_writes",
            "Node writes of the guard by kind (taint, condition, dry_run: the start's proof that \
             its admission policy admits its taint) and result (ok, refused, failed)",
            writes.clone(),
        );
        let refused = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "fabricgate_guard_refused_writes",
            "Node writes the API server refused, by reason: pool (the admission policy's pool \
             does not hold a Node of node.pool_selector), policy (another rule of the policy), \
             rbac, other",
            refused.clone(),
        );
        let blocked = Gauge::default();
        registry.register(
            "fabricgate_guard_blocked",
            "1 while the guard's Node writes are refused (its last write or dry run was, none \
             admitted since): it cannot taint a Node whose agent died; /readyz fails",
            blocked.clone(),
        );
        let confined = Gauge::default();
        registry.register(
            "fabricgate_guard_confined",
            "1 when the leader's last dry run of its taint on a Node outside the pool was \
             refused (its admission policy confines it to the pool), 0 when it was admitted \
             (the requirements ConfigMap is missing or the policy was changed: /readyz fails), \
             -1 not proven (no Node outside the pool, or not leading)",
            confined.clone(),
        );
        confined.set(-1);
        let evictions = Family::<ResultLabels, Counter>::default();
        registry.register(
            "fabricgate_guard_evictions",
            "Evictions of pods on sockets (runtime.on_sockets: evict) by result: evicted, \
             pdb_blocked (a PodDisruptionBudget refused; retried), breaker_held (due but held \
             by node.breaker.max_new_per_window; once per pod), failed",
            evictions.clone(),
        );
        for result in EvictionResult::ALL {
            evictions
                .get_or_create(&ResultLabels {
                    result: result.label(),
                })
                .inc_by(0);
        }
        for kind in WriteKind::ALL {
            for result in Outcome::RESULTS {
                let labels = WriteLabels {
                    kind: kind.label(),
                    result,
                };
                writes.get_or_create(&labels).inc_by(0);
            }
        }
        for reason in REFUSAL_REASONS {
            refused.get_or_create(&ReasonLabels { reason }).inc_by(0);
        }
        Self {
            registry,
            leader,
            sweeps,
            pool_nodes,
            stale_agents,
            writes,
            refused,
            blocked,
            confined,
            unconfined: Mutex::new(None),
            evictions,
            refusal: Mutex::new(None),
            epoch: Instant::now(),
            last_turn_ms: AtomicU64::new(0),
            wedged_after: Mutex::new(Duration::from_secs(120)),
        }
    }

    /// `/healthz` fails when the loop has not turned for `limit`.
    pub fn set_wedged_after(&self, limit: Duration) {
        *self
            .wedged_after
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = limit;
    }

    /// The guard's loop turned (renewed or tried to take the Lease).
    pub fn turned(&self, leading: bool) {
        let ms = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_turn_ms.store(ms, Ordering::Release);
        self.leader.set(i64::from(leading));
    }

    /// A sweep of `pool` Nodes, `stale` of them with no running agent.
    pub fn swept(&self, pool: usize, stale: usize) {
        self.sweeps.inc();
        self.pool_nodes.set(gauge_of(pool));
        self.stale_agents.set(gauge_of(stale));
    }

    /// An eviction (or a pod held back by the breaker) ended with `result`.
    pub fn evicted(&self, result: EvictionResult) {
        self.evictions
            .get_or_create(&ResultLabels {
                result: result.label(),
            })
            .inc();
    }

    /// A write ended with `outcome`; `message`: the server's answer when it refused it.
    /// Returns whether this changed what `/readyz` says (refused now, or admitted again).
    pub fn wrote(&self, kind: WriteKind, outcome: Outcome, message: Option<&str>) -> bool {
        self.writes
            .get_or_create(&WriteLabels {
                kind: kind.label(),
                result: outcome.label(),
            })
            .inc();
        let mut refusal = self
            .refusal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let was = refusal.is_some();
        match outcome {
            Outcome::Ok => *refusal = None,
            Outcome::Refused(reason) => {
                self.refused.get_or_create(&ReasonLabels { reason }).inc();
                *refusal = Some(format!(
                    "the API server refuses the guard's {} writes ({reason}): {}",
                    kind.label(),
                    message.unwrap_or("no message")
                ));
            }
            Outcome::Failed => return false,
        }
        self.blocked.set(i64::from(refusal.is_some()));
        was != refusal.is_some()
    }

    /// What the last proof of confinement found: `Some(true)` refused outside the pool,
    /// `Some(false)` admitted there (`why` says where and what to do), `None` not proven.
    pub fn set_confined(&self, confined: Option<bool>, why: &str) {
        self.confined.set(match confined {
            Some(true) => 1,
            Some(false) => 0,
            None => -1,
        });
        *self
            .unconfined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            (confined == Some(false)).then(|| why.to_owned());
    }

    /// Whether the guard's writes are known to be refused now.
    pub fn is_blocked(&self) -> bool {
        self.refusal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some()
    }

    /// `Ok` when the guard can act (not known to be refused); otherwise why not.
    ///
    /// # Errors
    /// The reason `/readyz` answers 503.
    pub fn readiness(&self) -> Result<(), String> {
        if let Some(why) = &*self
            .unconfined
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            return Err(why.clone());
        }
        match &*self
            .refusal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            None => Ok(()),
            Some(why) => Err(why.clone()),
        }
    }

    /// `Ok` while the loop turns; otherwise why the kubelet should restart the guard.
    ///
    /// # Errors
    /// The reason `/healthz` answers 503.
    pub fn liveness(&self) -> Result<(), String> {
        let limit = *self
            .wedged_after
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let last = Duration::from_millis(self.last_turn_ms.load(Ordering::Acquire));
        let idle = self.epoch.elapsed().saturating_sub(last);
        if idle > limit {
            return Err(format!(
                "the guard's loop has not turned for {}s: it is wedged",
                idle.as_secs()
            ));
        }
        Ok(())
    }

    /// The exposition in one format.
    pub fn encode(&self, openmetrics: bool) -> String {
        let mut out = encode_registry(&self.registry, openmetrics);
        if openmetrics {
            out.push_str(EOF);
        }
        out
    }

    /// `/metrics`, `/healthz`, `/readyz`.
    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route(
                "/",
                get(|| async { "fabricgate guard: /metrics /healthz /readyz\n" }),
            )
            .route("/metrics", get(metrics_handler))
            .route("/healthz", get(healthz_handler))
            .route("/readyz", get(readyz_handler))
            .with_state(self)
    }
}

async fn metrics_handler(
    State(m): State<Arc<GuardMetrics>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let openmetrics = negotiate(&uri, &headers);
    exposition_response(openmetrics, m.encode(openmetrics))
}

async fn readyz_handler(State(m): State<Arc<GuardMetrics>>) -> Response {
    health_response(m.readiness(), "ready\n", "not ready")
}

async fn healthz_handler(State(m): State<Arc<GuardMetrics>>) -> Response {
    health_response(m.liveness(), "ok\n", "unhealthy")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: message.to_owned(),
            ..kube::core::Status::default()
        }))
    }

    #[test]
    fn refusals_are_told_apart_from_failures() {
        let pool = api_error(
            403,
            "nodes \"gpu-1\" is forbidden: ValidatingAdmissionPolicy 'fabricgate-guard' with \
             binding 'fabricgate-guard' denied request: the fabricgate guard may modify only \
             Nodes of the pool {nvidia.com/gpu.present=true}; gpu-1 is not",
        );
        assert_eq!(refusal_reason(&pool), Some("pool"));
        let policy = api_error(
            403,
            "ValidatingAdmissionPolicy 'fabricgate-guard' denied request: the fabricgate guard \
             may only add the taint",
        );
        assert_eq!(refusal_reason(&policy), Some("policy"));
        let rbac = api_error(
            403,
            "nodes \"gpu-1\" is forbidden: User \"system:serviceaccount:fabricgate:x\" cannot \
             patch resource \"nodes\"",
        );
        assert_eq!(refusal_reason(&rbac), Some("rbac"));
        assert_eq!(refusal_reason(&api_error(422, "invalid")), Some("other"));
        for code in [404, 409, 429, 500, 503] {
            assert_eq!(refusal_reason(&api_error(code, "x")), None, "{code}");
        }
    }

    #[test]
    fn readiness_fails_while_writes_are_refused_and_recovers_when_one_is_admitted() {
        let m = GuardMetrics::new();
        assert!(m.readiness().is_ok());
        assert!(!m.wrote(WriteKind::Taint, Outcome::Failed, None));
        assert!(
            m.readiness().is_ok(),
            "a failed write is retried, not refused"
        );
        assert!(m.wrote(
            WriteKind::DryRun,
            Outcome::Refused("pool"),
            Some("may modify only Nodes of the pool")
        ));
        let why = m.readiness().unwrap_err();
        assert!(why.contains("dry_run") && why.contains("(pool)"), "{why}");
        assert!(!m.wrote(WriteKind::DryRun, Outcome::Refused("pool"), None));
        let text = m.encode(false);
        assert!(text.contains("fabricgate_guard_blocked 1"), "{text}");
        assert!(
            text.contains("fabricgate_guard_refused_writes_total{reason=\"pool\"} 2"),
            "{text}"
        );
        assert!(m.wrote(WriteKind::Taint, Outcome::Ok, None));
        assert!(m.readiness().is_ok());
        assert!(m.encode(false).contains("fabricgate_guard_blocked 0"));
        assert!(m.encode(true).ends_with("# EOF\n"));
    }

    #[test]
    fn liveness_fails_when_the_loop_stops_turning() {
        let m = GuardMetrics::new();
        m.set_wedged_after(Duration::from_millis(20));
        m.turned(true);
        assert!(m.liveness().is_ok());
        std::thread::sleep(Duration::from_millis(40));
        assert!(m.liveness().unwrap_err().contains("wedged"));
        m.turned(false);
        assert!(m.liveness().is_ok());
    }
}
