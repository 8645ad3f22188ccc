//! The watch of this node's pods (a field selector on `spec.nodeName`, from the watch cache,
//! no polling), shared: the runtime transport judges them, DRA reads their claims.

use super::WATCH_TIMEOUT_SECS;
use super::watch::WatchBackoff;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};
use std::collections::BTreeMap;
use std::time::Duration;

/// Follow the pods of `node` (a field selector, no polling) and send each change as the
/// whole set by UID. A 403 (the agent's RBAC lacks pods: deploy/overlays/runtime-transport
/// not applied) is logged once and retried only every [`FORBIDDEN_RETRY`]: a missing grant
/// is not fixed in seconds, and each refused list is a line in the API server's audit log.
/// How long a pods watch refused by 403 waits before asking again.
pub const FORBIDDEN_RETRY: Duration = Duration::from_secs(300);

pub async fn watch_pods(
    client: kube::Client,
    node: String,
    tx: tokio::sync::watch::Sender<BTreeMap<String, Pod>>,
    max_backoff: Duration,
) {
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .timeout(WATCH_TIMEOUT_SECS)
        .any_semantic();
    let mut events = watcher(Api::<Pod>::all(client), config)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed();
    let mut pods = BTreeMap::new();
    let mut staged = BTreeMap::new();
    let mut told = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(WatchEvent::Init) => staged.clear(),
            Ok(WatchEvent::InitApply(p)) => {
                if let Some(uid) = p.metadata.uid.clone() {
                    staged.insert(uid, p);
                }
            }
            Ok(WatchEvent::InitDone) => pods = std::mem::take(&mut staged),
            Ok(WatchEvent::Apply(p)) => {
                if let Some(uid) = p.metadata.uid.clone() {
                    pods.insert(uid, p);
                }
            }
            Ok(WatchEvent::Delete(p)) => {
                if let Some(uid) = &p.metadata.uid {
                    pods.remove(uid);
                }
            }
            Err(e) => {
                let forbidden = matches!(&e,
                    watcher::Error::InitialListFailed(kube::Error::Api(s))
                    | watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 403);
                if !told {
                    tracing::warn!(node = %node, error = %e,
                        "cannot watch this node's pods: runtime transport judges no pod; \
                         apply deploy/overlays/runtime-transport (pods list/watch)");
                    told = true;
                }
                if forbidden {
                    // The stream is not polled while sleeping, so no request is made.
                    tokio::time::sleep(FORBIDDEN_RETRY).await;
                }
                continue;
            }
        }
        if tx.send(pods.clone()).is_err() {
            return;
        }
    }
}
