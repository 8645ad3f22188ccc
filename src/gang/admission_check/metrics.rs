//! The controller's `/metrics` (docs/metrics.md), served by `observe::server` with its
//! connection bounds, with `/healthz` and `/readyz`.

use crate::observe::exposition::{EOF, encode_registry};
use crate::observe::metrics::wants_openmetrics;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Arc;

type Labels = Vec<(String, String)>;

/// The controller's series.
pub struct CheckMetrics {
    registry: Registry,
    decisions: Family<Labels, Counter>,
    pair_failures: Counter,
    in_flight: Gauge,
    answers_cached: Gauge,
    leader: Gauge,
    decide_seconds: Histogram,
    requeues_held: Counter,
    requeue_breaker_open: Gauge,
}

impl Default for CheckMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl CheckMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let decisions = Family::<Labels, Counter>::default();
        registry.register(
            "fabricgate_admission_checks",
            "Admission check states written on Workloads: ready, retry, rejected, and requeued \
             (Retry on an admitted gang whose member went bad)",
            decisions.clone(),
        );
        let pair_failures = Counter::default();
        registry.register(
            "fabricgate_gang_pair_failures",
            "Ring pairs of a gang pre-flight that failed (one per failed pair)",
            pair_failures.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "fabricgate_gang_checks_in_flight",
            "FabricChecks created and not yet decided",
            in_flight.clone(),
        );
        let answers_cached = Gauge::default();
        registry.register(
            "fabricgate_gang_answers_cached",
            "FabricCheckResults held in the leader's cache (only answers to live FabricChecks)",
            answers_cached.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "fabricgate_admission_check_leader",
            "1 while this replica holds the Lease and acts",
            leader.clone(),
        );
        let decide_seconds = Histogram::new([0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0]);
        registry.register(
            "fabricgate_gang_check_seconds",
            "From the first pass that saw a Workload's check Pending to its state written",
            decide_seconds.clone(),
        );
        let requeues_held = Counter::default();
        registry.register(
            "fabricgate_gang_requeues_held",
            "Admitted gangs the requeue breaker held (gang.max_requeues_per_window reached), \
             one per gang and hold",
            requeues_held.clone(),
        );
        let requeue_breaker_open = Gauge::default();
        registry.register(
            "fabricgate_gang_requeue_breaker_open",
            "1 while gang.max_requeues_per_window admitted gangs were requeued within \
             gang.requeue_window (further requeues are held)",
            requeue_breaker_open.clone(),
        );
        for result in ["ready", "retry", "rejected", "requeued"] {
            let _ = decisions.get_or_create(&vec![("result".to_owned(), result.to_owned())]);
        }
        Self {
            registry,
            decisions,
            pair_failures,
            in_flight,
            answers_cached,
            leader,
            decide_seconds,
            requeues_held,
            requeue_breaker_open,
        }
    }

    /// An admitted gang's requeue held by the breaker.
    pub fn requeue_held(&self) {
        self.requeues_held.inc();
    }

    pub fn set_requeue_breaker_open(&self, open: bool) {
        self.requeue_breaker_open.set(i64::from(open));
    }

    /// A state written: `ready`, `retry` or `rejected`.
    pub fn decided(&self, result: &str, seconds: Option<f64>) {
        self.decisions
            .get_or_create(&vec![("result".to_owned(), result.to_owned())])
            .inc();
        if let Some(s) = seconds {
            self.decide_seconds.observe(s);
        }
    }

    pub fn pair_failures(&self, n: usize) {
        self.pair_failures.inc_by(n as u64);
    }

    pub fn set_in_flight(&self, n: usize) {
        self.in_flight.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn set_answers_cached(&self, n: usize) {
        self.answers_cached
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    pub fn set_leader(&self, leading: bool) {
        self.leader.set(i64::from(leading));
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
            .route("/metrics", get(metrics_handler))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(|| async { "ok\n" }))
            .with_state(self)
    }
}

async fn metrics_handler(
    State(m): State<Arc<CheckMetrics>>,
    headers: HeaderMap,
) -> impl IntoResponse {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    let open = wants_openmetrics(accept);
    let content_type = if open {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4; charset=utf-8"
    };
    ([(header::CONTENT_TYPE, content_type)], m.encode(open))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_are_named_as_documented() {
        let m = CheckMetrics::new();
        m.decided("retry", Some(0.3));
        m.pair_failures(2);
        let text = m.encode(false);
        assert!(
            text.contains("fabricgate_admission_checks_total{result=\"retry\"} 1"),
            "{text}"
        );
        assert!(text.contains("fabricgate_admission_checks_total{result=\"ready\"} 0"));
        assert!(
            text.contains("fabricgate_gang_pair_failures_total 2"),
            "{text}"
        );
        assert!(text.contains("fabricgate_admission_checks_total{result=\"requeued\"} 0"));
        assert!(
            text.contains("fabricgate_gang_requeue_breaker_open 0"),
            "{text}"
        );
        m.requeue_held();
        m.set_requeue_breaker_open(true);
        let text = m.encode(false);
        assert!(
            text.contains("fabricgate_gang_requeues_held_total 1"),
            "{text}"
        );
        assert!(text.contains("fabricgate_gang_requeue_breaker_open 1"));
        assert!(m.encode(true).ends_with("# EOF\n"));
    }
}
