//! What the slice watch and the rule writer share: how a resource the API server does not
//! serve shows, and a sleep that may have no end.

use kube::runtime::watcher;
use tokio::time::Instant;

/// Until `at`; forever when there is none.
pub(super) async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A list or watch of a resource the API server does not serve: 404 (or the discovery
/// errors kube reports for it).
pub(super) fn is_not_served(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => is_404(e),
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
    }
}

fn is_404(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}
