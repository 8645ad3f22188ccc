//! The HTTP side: `/metrics` (format negotiation), `/healthz`, `/readyz`, and the server's
//! connection counts.

use super::{Metrics, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE, WhyLabels};
use crate::observe::server::Limits;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::future::Future;
use std::sync::Arc;

/// True when the scraper's `Accept` header asks for OpenMetrics (Prometheus 2.x asks for it
/// first, with the classic text format as a fallback).
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').any(|part| {
            let mut params = part.split(';');
            let media = params.next().unwrap_or("").trim();
            let q_zero = params.any(|p| {
                p.trim()
                    .strip_prefix("q=")
                    .and_then(|q| q.trim().parse::<f64>().ok())
                    == Some(0.0)
            });
            media.eq_ignore_ascii_case("application/openmetrics-text") && !q_zero
        })
    })
}

/// `?format=openmetrics|prometheus` overrides the `Accept` header (Prometheus before 2.49
/// cannot choose the format a scrape asks for, but can add URL parameters).
fn format_override(query: Option<&str>) -> Option<bool> {
    query?.split('&').find_map(|kv| match kv {
        "format=openmetrics" => Some(true),
        "format=prometheus" => Some(false),
        _ => None,
    })
}

/// Whether a scrape gets OpenMetrics: `?format=` first, then the `Accept` header.
pub fn negotiate(uri: &Uri, headers: &HeaderMap) -> bool {
    format_override(uri.query()).unwrap_or_else(|| {
        wants_openmetrics(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()))
    })
}

/// An exposition `body` with the content type of its format.
pub fn exposition_response(openmetrics: bool, body: impl IntoResponse) -> Response {
    let content_type = if openmetrics {
        OPENMETRICS_CONTENT_TYPE
    } else {
        PROMETHEUS_CONTENT_TYPE
    };
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
        body,
    )
        .into_response()
}

/// A health endpoint's answer: `200 {ok}` or `503 {failed}: why`.
pub fn health_response(state: Result<(), String>, ok: &'static str, failed: &str) -> Response {
    match state {
        Ok(()) => (StatusCode::OK, ok).into_response(),
        Err(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{failed}: {why}\n"),
        )
            .into_response(),
    }
}

async fn metrics_handler(
    State(metrics): State<Arc<Metrics>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let openmetrics = negotiate(&uri, &headers);
    exposition_response(openmetrics, metrics.exposition(openmetrics))
}

async fn readyz_handler(State(metrics): State<Arc<Metrics>>) -> Response {
    health_response(metrics.health.readiness(), "ready\n", "not ready")
}

async fn healthz_handler(State(metrics): State<Arc<Metrics>>) -> Response {
    health_response(metrics.health.liveness(), "ok\n", "unhealthy")
}

impl crate::observe::server::ServerObserver for Metrics {
    fn connection(&self, admission: crate::observe::server::Admission, open: usize) {
        let f = &self.families;
        f.http_connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
        let why = match admission {
            crate::observe::server::Admission::Admitted => return,
            crate::observe::server::Admission::Evicted => "evicted",
            crate::observe::server::Admission::Rejected => "rejected",
        };
        f.http_dropped.get_or_create(&WhyLabels { why }).inc();
    }

    fn closed(&self, open: usize) {
        self.families
            .http_connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }
}

async fn index_handler() -> &'static str {
    "fabricgate: /metrics /healthz /readyz\n"
}

/// The HTTP routes, for callers that embed them in their own server.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/", get(index_handler))
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz_handler))
        .route("/readyz", get(readyz_handler))
        .with_state(metrics)
}

/// Serve `/metrics`, `/healthz`, `/readyz` on `listener` until `shutdown` completes.
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_limits(listener, metrics, Limits::default(), shutdown).await
}

/// [`serve`] within explicit connection limits (the agent derives them from `RLIMIT_NOFILE`).
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve_with_limits(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let observer: Arc<dyn crate::observe::server::ServerObserver> = Arc::clone(&metrics) as _;
    crate::observe::server::serve(listener, router(metrics), limits, observer, shutdown).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_header_negotiation() {
        let prom2 = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                     version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prom2)));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
        assert_eq!(format_override(Some("format=prometheus")), Some(false));
        assert_eq!(format_override(Some("a=b&format=openmetrics")), Some(true));
        assert_eq!(format_override(Some("format=xml")), None);
        assert_eq!(format_override(None), None);
    }
}
