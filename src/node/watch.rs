//! The watch of the agent's own Node.

use super::client::WATCH_TIMEOUT_SECS;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use std::time::Duration;

/// Watch this agent's own Node (a field selector on its name) and send every version of it
/// the server reports (`None` when the watch broke, so the reconciler reads again until it is
/// back), until `tx` is closed. Re-watches from the last resourceVersion when
/// the server ends a watch, from scratch when that version is too old (410 Gone), and backs
/// off (capped at `max_backoff`) while the server fails. A watch means drift (a hand-removed
/// taint, a changed allocatable) is seen at once, and steady state costs no periodic reads.
pub async fn watch_node(
    client: kube::Client,
    node_name: String,
    tx: tokio::sync::mpsc::Sender<Option<Node>>,
    max_backoff: Duration,
) {
    use futures::StreamExt;
    use kube::api::{WatchEvent, WatchParams};
    let nodes: Api<Node> = Api::all(client);
    let params = WatchParams::default()
        .fields(&format!("metadata.name={node_name}"))
        .timeout(WATCH_TIMEOUT_SECS)
        .disable_bookmarks();
    let mut version = "0".to_owned();
    let mut delay = Duration::from_millis(200);
    loop {
        match nodes.watch(&params, &version).await {
            Ok(stream) => {
                let mut stream = stream.boxed();
                while let Some(event) = stream.next().await {
                    match event {
                        Ok(WatchEvent::Added(node) | WatchEvent::Modified(node)) => {
                            delay = Duration::from_millis(200);
                            if let Some(rv) = &node.metadata.resource_version {
                                version.clone_from(rv);
                            }
                            if tx.send(Some(node)).await.is_err() {
                                return;
                            }
                        }
                        Ok(WatchEvent::Bookmark(b)) => {
                            version = b.metadata.resource_version;
                        }
                        Ok(WatchEvent::Deleted(_)) => {}
                        Ok(WatchEvent::Error(e)) if e.code == 410 => {
                            version = "0".to_owned();
                            let _ = tx.send(None).await;
                            break;
                        }
                        Ok(WatchEvent::Error(e)) => {
                            tracing::debug!(node = %node_name, error = %e.message, "watch error");
                            let _ = tx.send(None).await;
                            break;
                        }
                        Err(e) => {
                            tracing::debug!(node = %node_name, error = %e, "watch stream ended");
                            let _ = tx.send(None).await;
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(node = %node_name, error = %e, retry_in = ?delay, "cannot watch the Node");
                if tx.send(None).await.is_err() {
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(max_backoff.max(Duration::from_millis(200)));
            }
        }
        if tx.is_closed() {
            return;
        }
    }
}
