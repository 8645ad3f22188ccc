//! The HTTPS server: axum over rustls, inside the bounds of [`crate::observe::server`]
//! (connection cap with eviction of idle connections, header-read and idle timeouts, a
//! connection age, and a per-request timeout), so idle, slow or half-open clients cannot
//! hold the webhook's descriptors or memory.

use super::tls::{CertReloader, provider};
use super::{MUTATE_PATH, MutationConfig, review};
use crate::error::{Error, Result};
use crate::observe::server::{self as bounded, Limits};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Default `--max-connections`: the API server keeps a few connections per replica, the
/// kubelet's probes one each.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;
/// A request (body included) and its answer must be done within this; the API server gives
/// up after the configuration's `timeoutSeconds` (5 s) anyway.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything [`serve`] needs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub mutation: MutationConfig,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// How often the certificate files are checked for a change.
    pub reload_interval: Duration,
    /// Connection cap and timeouts ([`ServerConfig::default_limits`]).
    pub limits: Limits,
}

impl ServerConfig {
    /// The webhook's bounds: [`DEFAULT_MAX_CONNECTIONS`] (lowered to what the open-file
    /// limit leaves, as for the metrics server), the metrics server's header-read timeout
    /// (idle keep-alive included) and connection age, and [`DEFAULT_REQUEST_TIMEOUT`].
    pub fn default_limits(max_connections: usize, nofile_soft: Option<u64>) -> Limits {
        Limits {
            request_timeout: Some(DEFAULT_REQUEST_TIMEOUT),
            ..Limits::for_nofile(max_connections, nofile_soft)
        }
    }

    /// A configuration with the default reload interval (10 s) and bounds.
    pub fn new(mutation: MutationConfig, cert_file: PathBuf, key_file: PathBuf) -> Self {
        Self {
            mutation,
            cert_file,
            key_file,
            reload_interval: Duration::from_secs(10),
            limits: Self::default_limits(DEFAULT_MAX_CONNECTIONS, None),
        }
    }
}

async fn mutate_handler(State(cfg): State<Arc<MutationConfig>>, body: Bytes) -> Response {
    let started = std::time::Instant::now();
    match review(&body, &cfg) {
        Ok(review) => {
            let patched = review["response"]["patch"].is_string();
            let allowed = review["response"]["allowed"] == true;
            tracing::debug!(
                patched,
                allowed,
                micros = started.elapsed().as_micros() as u64,
                "admission review answered"
            );
            (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                review.to_string(),
            )
                .into_response()
        }
        Err(e) => {
            tracing::warn!("bad admission request: {e}");
            (StatusCode::BAD_REQUEST, e.to_string()).into_response()
        }
    }
}

/// The HTTP routes: `POST /mutate` (AdmissionReview v1) and `GET /healthz`.
pub fn router(cfg: MutationConfig) -> Router {
    Router::new()
        .route(MUTATE_PATH, post(mutate_handler))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(Arc::new(cfg))
}

/// Serve the webhook over TLS on `listener` until `shutdown` completes. The certificate is
/// loaded before the first connection (a bad one is an error here, not a failing handshake)
/// and re-read every `reload_interval`; a broken replacement is logged and the old one kept.
/// The TLS handshake counts against the connection's header-read timeout.
///
/// # Errors
/// The certificate load error at start; [`MutationConfig::check`]'s.
pub async fn serve(
    config: ServerConfig,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    config.mutation.check()?;
    let resolver = Arc::new(CertReloader::load(&config.cert_file, &config.key_file)?);
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Internal {
            message: format!("TLS setup: {e}"),
        })?
        .with_no_client_auth()
        .with_cert_resolver(resolver.clone());
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let app = router(config.mutation.clone());

    let reloader = {
        let resolver = resolver.clone();
        let every = config.reload_interval.max(Duration::from_millis(10));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match resolver.reload() {
                    Ok(true) => tracing::info!("reloaded the TLS certificate"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!("keeping the current TLS certificate: {e}"),
                }
            }
        })
    };

    let handshake = move |tcp: tokio::net::TcpStream| {
        let acceptor = acceptor.clone();
        async move {
            match acceptor.accept(tcp).await {
                Ok(stream) => Some(stream),
                Err(e) => {
                    tracing::debug!("TLS handshake failed: {e}");
                    None
                }
            }
        }
    };
    let served = bounded::serve_with(
        listener,
        app,
        config.limits,
        Arc::new(()),
        shutdown,
        handshake,
    )
    .await;
    reloader.abort();
    served.map_err(|e| Error::Internal {
        message: format!("webhook server: {e}"),
    })
}
