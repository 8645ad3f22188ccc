//! The leader's watches (the pool's Nodes, the agent pods, and with `runtime.on_sockets:
//! evict` the running pods): `kube::runtime::watcher` streams, polled by the guard's loop, that
//! feed the [`Cache`].

use super::cache::{Cache, Update, slim_pod, slim_transport_pod};
use super::metrics::GuardMetrics;
use super::sweep::sweep;
use super::{GuardSettings, WATCH_TIMEOUT_SECS, max_backoff};
use crate::cluster::{LIST_PAGE, slim_node};
use crate::node::{WatchBackoff, is_watch};
use crate::transport::settings::OnSockets;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::sync::watch as signal;

/// One watch's events, slimmed and with the backoff applied.
type Events<K> = BoxStream<'static, watcher::Result<Event<K>>>;

/// The next change from the leader's watches; never, while there are none.
pub(super) async fn next_update(watched: &mut Option<Watched>) -> Option<Update> {
    match watched {
        Some(w) => Some(w.next().await),
        None => std::future::pending().await,
    }
}

/// The leader's two watches and the cache they feed. Dropping it stops the watches.
pub(super) struct Watched {
    nodes: Events<Node>,
    pods: Events<Pod>,
    nodes_watching: signal::Receiver<u64>,
    pods_watching: signal::Receiver<u64>,
    /// The running pods, cluster-wide (`runtime.on_sockets: evict` only; docs/scale.md).
    transport: Option<(Events<Pod>, signal::Receiver<u64>)>,
    pub(super) cache: Cache,
}

/// Only running pods: a pod on sockets is running, and the field selector is served from the
/// apiserver's watch cache (a pod leaving Running arrives as a deletion).
pub(super) const TRANSPORT_FIELDS: &str = "status.phase=Running";

impl Watched {
    /// Start both watches on `watch` (its lists with short timeouts, its watches with a read
    /// timeout above [`WATCH_TIMEOUT_SECS`]: `node::clients_from` builds it so).
    pub(super) fn start(watch: &kube::Client, s: &GuardSettings) -> Watched {
        let backoff = max_backoff(s);
        let (nodes_client, nodes_watching) = signalling(watch);
        let (pods_client, pods_watching) = signalling(watch);
        let transport = (s.transport.on_sockets == OnSockets::Evict).then(|| {
            let (client, watching) = signalling(watch);
            let config = watch_config("").fields(TRANSPORT_FIELDS);
            (
                events_with(Api::all(client), config, backoff, slim_transport_pod),
                watching,
            )
        });
        Watched {
            nodes: events(
                Api::all(nodes_client),
                &s.config.node.pool_selector,
                backoff,
                slim_node,
            ),
            pods: events(
                Api::namespaced(pods_client, &s.namespace),
                &s.pod_selector,
                backoff,
                slim_pod,
            ),
            nodes_watching,
            pods_watching,
            transport,
            cache: Cache::default(),
        }
    }

    /// The next event of either watch. Cancel-safe: the watchers keep their state (and any
    /// request in flight) in their streams, not in this future.
    pub(super) async fn next(&mut self) -> Update {
        tokio::select! {
            Some(e) = self.nodes.next() => Update::Node(Box::new(e)),
            Some(e) = self.pods.next() => Update::Pod(Box::new(e)),
            Ok(()) = self.nodes_watching.changed() => Update::NodesWatching,
            Ok(()) = self.pods_watching.changed() => Update::PodsWatching,
            update = transport_next(self.transport.as_mut()) => update,
            // A watcher's stream does not end; should both, there is nothing left to wait for.
            else => std::future::pending().await,
        }
    }

    /// [`sweep`] over the cache, once both watches have listed and are up; the Nodes the
    /// guard wrote go back into the cache.
    pub(super) async fn sweep(
        &mut self,
        nodes: &Api<Node>,
        s: &GuardSettings,
        since: &mut HashMap<String, Instant>,
        m: &GuardMetrics,
    ) {
        if !self.cache.ready() {
            return;
        }
        let mut wrote = Vec::new();
        if let Err(e) = sweep(nodes, &self.cache, s, since, &mut wrote, m).await {
            tracing::warn!(error = %e, "guard sweep failed; retrying");
        }
        for node in wrote {
            self.cache.wrote(node);
        }
    }
}

/// LIST `selector` once (from the watch cache, in pages of [`LIST_PAGE`]), then WATCH from the list's
/// resourceVersion with bookmarks, resuming from the last version seen when a watch ends or
/// breaks, and listing again only on `410 Gone`; failures back off ([`WatchBackoff`], up to
/// `max_backoff`). Each object is slimmed before it reaches the cache.
fn events<K>(api: Api<K>, selector: &str, max_backoff: Duration, slim: fn(&mut K)) -> Events<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    events_with(api, watch_config(selector), max_backoff, slim)
}

fn watch_config(selector: &str) -> watcher::Config {
    watcher::Config::default()
        .labels(selector)
        .timeout(WATCH_TIMEOUT_SECS)
        .any_semantic()
}

/// The next event of the running pods' watch; never, without it.
async fn transport_next(t: Option<&mut (Events<Pod>, signal::Receiver<u64>)>) -> Update {
    let Some((events, watching)) = t else {
        return std::future::pending().await;
    };
    tokio::select! {
        Some(e) = events.next() => Update::Transport(Box::new(e)),
        Ok(()) = watching.changed() => Update::TransportWatching,
        else => std::future::pending().await,
    }
}

/// [`events`] with its own watcher configuration.
fn events_with<K>(
    api: Api<K>,
    mut config: watcher::Config,
    max_backoff: Duration,
    slim: fn(&mut K),
) -> Events<K>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    // In pages: each is deserialized whole before it is slimmed, and one list of 5,000 GPU
    // Nodes at once (65 MB of JSON) left the leader at 285 MiB for good (the allocator keeps
    // what the transient objects took). The cache is still replaced only once the last page
    // is in (the watcher's `InitDone`).
    config.page_size = Some(LIST_PAGE);
    watcher(api, config)
        .modify(slim)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed()
}

/// `client`, and a counter of the watch requests the server accepted through it. The
/// watcher hides a watch that resumes after an error until something changes; this tells the
/// cache it is live again at once, as the guard's own watch loop did.
fn signalling(client: &kube::Client) -> (kube::Client, signal::Receiver<u64>) {
    let (accepted, rx) = signal::channel(0u64);
    let inner = client.clone();
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let inner = inner.clone();
        let accepted = accepted.clone();
        let watching = is_watch(req.uri());
        async move {
            let res = inner.send(req).await?;
            if watching && res.status().is_success() {
                accepted.send_modify(|n| *n = n.wrapping_add(1));
            }
            Ok::<_, kube::Error>(res)
        }
    });
    (
        kube::Client::new(service, client.default_namespace().to_owned()),
        rx,
    )
}
