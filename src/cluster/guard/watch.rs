//! The leader's two watches (the pool's Nodes, the agent pods) and what they report.

use super::cache::Cache;
use super::sweep::sweep;
use super::{FIRST_BACKOFF, GuardSettings, WATCH_TIMEOUT_SECS, max_backoff};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// The next change from the leader's watches; never, while there are none.
pub(super) async fn next_update(watched: &mut Option<Watched>) -> Option<Update> {
    match watched {
        Some(w) => w.rx.recv().await,
        None => std::future::pending().await,
    }
}

/// What one of the leader's watches reports.
#[derive(Debug)]
pub(super) enum Change<K> {
    /// A fresh LIST: everything there is (replaces the cache).
    Listed(Vec<K>),
    Applied(Box<K>),
    Deleted(Box<K>),
    /// The watch is established (again): the cache follows the server.
    Up,
    /// The watch broke or cannot be established: the cache may be behind.
    Down,
}

#[derive(Debug)]
pub(super) enum Update {
    Node(Change<Node>),
    Pod(Change<Pod>),
}

/// The leader's two watches and the cache they feed. Dropping it stops the watches.
pub(super) struct Watched {
    pub(super) rx: mpsc::Receiver<Update>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub(super) cache: Cache,
}

impl Watched {
    pub(super) fn start(
        requests: &kube::Client,
        watch: &kube::Client,
        s: &GuardSettings,
    ) -> Watched {
        let (tx, rx) = mpsc::channel(1024);
        let backoff = max_backoff(s);
        let nodes = tokio::spawn(reflect(
            Api::<Node>::all(requests.clone()),
            Api::<Node>::all(watch.clone()),
            s.config.node.pool_selector.clone(),
            "the pool's Nodes",
            tx.clone(),
            Update::Node,
            backoff,
        ));
        let pods = tokio::spawn(reflect(
            Api::<Pod>::namespaced(requests.clone(), &s.namespace),
            Api::<Pod>::namespaced(watch.clone(), &s.namespace),
            s.pod_selector.clone(),
            "the agent pods",
            tx,
            Update::Pod,
            backoff,
        ));
        Watched {
            rx,
            tasks: vec![nodes, pods],
            cache: Cache::default(),
        }
    }

    /// [`sweep`] over the cache, once both watches have listed and are up; the Nodes the
    /// guard wrote go back into the cache.
    pub(super) async fn sweep(
        &mut self,
        nodes: &Api<Node>,
        s: &GuardSettings,
        since: &mut HashMap<String, Instant>,
    ) {
        if !self.cache.ready() {
            return;
        }
        let mut wrote = Vec::new();
        if let Err(e) = sweep(nodes, &self.cache, s, since, &mut wrote).await {
            tracing::warn!(error = %e, "guard sweep failed; retrying");
        }
        for node in wrote {
            self.cache.wrote(node);
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// LIST `selector` once (from the watch cache), then WATCH from the list's resourceVersion
/// with bookmarks, resuming from the last version seen when a watch ends or breaks, and
/// listing again only on `410 Gone`. Failures back off from [`FIRST_BACKOFF`], doubling up to
/// `max_backoff`. Ends when `tx` is closed.
async fn reflect<K>(
    lists: Api<K>,
    watches: Api<K>,
    selector: String,
    what: &'static str,
    tx: mpsc::Sender<Update>,
    wrap: fn(Change<K>) -> Update,
    max_backoff: Duration,
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    use futures::StreamExt;
    let lp = ListParams::default().labels(&selector).match_any();
    let wp = WatchParams::default()
        .labels(&selector)
        .timeout(WATCH_TIMEOUT_SECS);
    let mut delay = FIRST_BACKOFF;
    let backoff = |delay: &mut Duration| {
        let now = *delay;
        *delay = (*delay * 2).min(max_backoff);
        now
    };
    let mut listed_at: Option<Instant> = None;
    'list: loop {
        // Listing again within a second of the last list (its version expired at once):
        // back off, never a tight loop.
        if listed_at.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            tokio::time::sleep(backoff(&mut delay)).await;
        }
        let list = match lists.list(&lp).await {
            Ok(l) => l,
            Err(e) => {
                let wait = backoff(&mut delay);
                tracing::warn!(error = %e, retry_in = ?wait, "cannot list {what}");
                if tx.send(wrap(Change::Down)).await.is_err() {
                    return;
                }
                tokio::time::sleep(wait).await;
                continue;
            }
        };
        let mut version = list
            .metadata
            .resource_version
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "0".to_owned());
        listed_at = Some(Instant::now());
        tracing::info!(objects = list.items.len(), version = %version, "listed {what}");
        if tx.send(wrap(Change::Listed(list.items))).await.is_err() {
            return;
        }
        loop {
            let broke = match watches.watch(&wp, &version).await {
                Ok(stream) => {
                    if tx.send(wrap(Change::Up)).await.is_err() {
                        return;
                    }
                    let mut stream = stream.boxed();
                    let opened = Instant::now();
                    let mut broke = false;
                    while let Some(event) = stream.next().await {
                        let change = match event {
                            Ok(WatchEvent::Added(o) | WatchEvent::Modified(o)) => {
                                Change::Applied(Box::new(o))
                            }
                            Ok(WatchEvent::Deleted(o)) => Change::Deleted(Box::new(o)),
                            Ok(WatchEvent::Bookmark(b)) => {
                                version = b.metadata.resource_version;
                                continue;
                            }
                            Ok(WatchEvent::Error(e)) if e.code == 410 => {
                                tracing::info!(error = %e.message, "watch of {what} expired; listing again");
                                continue 'list;
                            }
                            Ok(WatchEvent::Error(e)) => {
                                tracing::warn!(error = %e.message, "watch of {what} failed");
                                broke = true;
                                break;
                            }
                            Err(e) => {
                                tracing::warn!(error = %e, "watch of {what} broke");
                                broke = true;
                                break;
                            }
                        };
                        if let Some(v) = resource_version(&change) {
                            version = v;
                        }
                        delay = FIRST_BACKOFF;
                        if tx.send(wrap(change)).await.is_err() {
                            return;
                        }
                    }
                    // The server ends a watch after WATCH_TIMEOUT_SECS: re-watch at once. One
                    // that ends within a second is treated as broken (no tight loop).
                    broke || opened.elapsed() < Duration::from_secs(1)
                }
                Err(kube::Error::Api(e)) if e.code == 410 => {
                    tracing::info!(error = %e.message, "watch of {what} expired; listing again");
                    continue 'list;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch {what}");
                    true
                }
            };
            if broke {
                if tx.send(wrap(Change::Down)).await.is_err() {
                    return;
                }
                tokio::time::sleep(backoff(&mut delay)).await;
            }
        }
    }
}

fn resource_version<K: kube::Resource>(change: &Change<K>) -> Option<String> {
    match change {
        Change::Applied(o) | Change::Deleted(o) => o.meta().resource_version.clone(),
        _ => None,
    }
}
