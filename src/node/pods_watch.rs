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

/// How long a pods watch refused by 403 waits before asking again.
pub const FORBIDDEN_RETRY: Duration = Duration::from_secs(300);

/// This node's pods by UID, as the watch last saw them.
pub type PodsByUid = BTreeMap<String, Pod>;

/// The shared watch's task and the features' end of it (both `None` when not started).
pub struct PodsWatch {
    pub task: Option<tokio::task::JoinHandle<()>>,
    pub pods: Option<tokio::sync::watch::Receiver<PodsByUid>>,
}

/// The watch of this node's pods when a feature reads them (runtime transport, its window
/// given as `transport_window`, or DRA for its claims: `claims`) and there is a cluster:
/// its task (it only reads: aborted at shutdown) and the receiver the features share. Its
/// longest backoff is the runtime window when runtime transport is on, the probe interval
/// otherwise.
pub fn start(
    clients: Option<&super::Clients>,
    node: &str,
    transport_window: Option<Duration>,
    claims: bool,
    interval: Duration,
) -> PodsWatch {
    let wanted = transport_window.is_some() || claims;
    let Some(watch_client) = clients.and_then(|c| c.watch.clone()).filter(|_| wanted) else {
        return PodsWatch {
            task: None,
            pods: None,
        };
    };
    let backoff = transport_window.unwrap_or(interval);
    let (tx, rx) = tokio::sync::watch::channel(BTreeMap::new());
    let task = tokio::spawn(watch_pods(watch_client, node.to_owned(), tx, backoff));
    PodsWatch {
        task: Some(task),
        pods: Some(rx),
    }
}

/// Follow the pods of `node` (a field selector, no polling) and send each change as the
/// whole set by UID. A 403 (the agent's RBAC lacks pods: neither deploy/overlays/dra nor
/// deploy/overlays/runtime-transport applied) is logged once and retried only every
/// [`FORBIDDEN_RETRY`]: a missing grant is not fixed in seconds, and each refused list is a
/// line in the API server's audit log.
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
                        "cannot watch this node's pods: runtime transport judges no pod and \
                         DRA reads no claim; apply deploy/overlays/runtime-transport or \
                         deploy/overlays/dra (pods list/watch)");
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
