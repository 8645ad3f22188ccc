//! The agent's two API clients: one for reads and writes, one for the watch of its Node.

use crate::error::{Error, Result};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// `Retry-After` of the last 429 the client saw, filled in by a layer of the HTTP stack
/// (kube's error type keeps the body, not the headers).
#[derive(Debug, Clone, Default)]
pub struct RetryAfter(Arc<Mutex<Option<Duration>>>);

impl RetryAfter {
    pub fn set(&self, d: Duration) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(d);
        }
    }

    pub fn take(&self) -> Option<Duration> {
        self.0.lock().ok().and_then(|mut slot| slot.take())
    }
}

/// Read timeout of the client that watches: a connection silent this long is dead. The
/// API server's watch cache sends each watch a bookmark about every minute (kube-apiserver
/// 1.37, `defaultBookmarkFrequency`), so a live watch is never this quiet; where no bookmarks
/// come (no watch cache), a quiet watch is re-made at this period, as before.
const WATCH_READ_TIMEOUT: Duration = Duration::from_secs(320);
/// The server ends each watch after this long; the agent then re-watches from the last
/// resourceVersion. Every agent re-makes each of its watches at this period, so the pool
/// costs the API server `nodes × watches / WATCH_TIMEOUT_SECS` requests a second at steady
/// state: at 5,000 Nodes with the gang pre-flight on (two watches each), 34 a second at
/// 290 s, 5.6 at 30 minutes (kube-apiserver's own default is 30 to 60 minutes).
pub const WATCH_TIMEOUT_SECS: u32 = 1800;

/// The two clients of the agent: one for reads and writes (15 s timeouts), one for the
/// long-lived watch of its own Node.
pub struct Clients {
    pub requests: kube::Client,
    /// For `kube::runtime::watcher`: its watch requests go to a connection whose read timeout
    /// is above [`WATCH_TIMEOUT_SECS`], its lists through `requests`. `None`: no watch; the
    /// Node is re-read every resync interval instead.
    pub watch: Option<kube::Client>,
}

/// Build the clients from in-cluster config or `KUBECONFIG`, with our own retry handling:
/// kube's default retry would wait up to 15 times inside one request, hiding the outage from us.
///
/// # Errors
/// [`Error::KubeConfig`] when no configuration is found or it is unusable.
pub async fn client(retry_after: RetryAfter) -> Result<Clients> {
    let config = kube::Config::infer().await.map_err(|e| Error::KubeConfig {
        message: format!(
            "{e}; run in a pod with a service account, set KUBECONFIG, or use --dry-run"
        ),
    })?;
    clients_from(config, retry_after)
}

/// [`client`] from an explicit configuration (one process running many agents, in tests).
///
/// # Errors
/// [`Error::KubeConfig`] when the configuration is unusable.
pub fn clients_from(mut config: kube::Config, retry_after: RetryAfter) -> Result<Clients> {
    config.default_retry = false;
    config.connect_timeout = Some(Duration::from_secs(5));
    config.read_timeout = Some(Duration::from_secs(15));
    config.write_timeout = Some(Duration::from_secs(15));
    let mut watch_config = config.clone();
    watch_config.read_timeout = Some(WATCH_READ_TIMEOUT);
    let layer = tower::ServiceBuilder::new().map_response(
        move |res: http::Response<Box<kube::client::DynBody>>| {
            if res.status() == http::StatusCode::TOO_MANY_REQUESTS
                && let Some(secs) = res
                    .headers()
                    .get(http::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
            {
                retry_after.set(Duration::from_secs(secs));
            }
            res
        },
    );
    let build = |config: kube::Config| {
        kube::client::ClientBuilder::try_from(config).map_err(|e| Error::KubeConfig {
            message: format!("cannot build the Kubernetes client: {e}"),
        })
    };
    let requests = build(config)?.with_layer(&layer).build();
    let watch = watch_or_list(build(watch_config)?.build(), requests.clone());
    Ok(Clients {
        requests,
        watch: Some(watch),
    })
}

/// One client for a watcher that sends its watch requests through `watches` and everything
/// else (its lists) through `lists`: a list keeps the short timeouts of ordinary requests.
fn watch_or_list(watches: kube::Client, lists: kube::Client) -> kube::Client {
    let namespace = watches.default_namespace().to_owned();
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let client = if is_watch(req.uri()) {
            watches.clone()
        } else {
            lists.clone()
        };
        async move { client.send(req).await }
    });
    kube::Client::new(service, namespace)
}

/// A watch request (`?watch=true`), not a list.
pub(crate) fn is_watch(uri: &http::Uri) -> bool {
    uri.query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"))
}

#[cfg(test)]
mod tests {
    use super::is_watch;

    #[test]
    fn watch_requests_are_told_from_lists_by_their_query() {
        let uri = |s: &str| s.parse::<http::Uri>().unwrap();
        assert!(is_watch(&uri(
            "/api/v1/nodes?&watch=true&timeoutSeconds=290&allowWatchBookmarks=true"
        )));
        assert!(!is_watch(&uri("/api/v1/nodes?&resourceVersion=0")));
        assert!(!is_watch(&uri("/api/v1/nodes")));
        assert!(!is_watch(&uri("/api/v1/nodes?labelSelector=watch%3Dtrue")));
    }
}
