//! The watch of the agent's own Node, and the backoff every watch of the crate uses.

use super::client::WATCH_TIMEOUT_SECS;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use std::time::Duration;

/// First wait after a failed list or watch.
pub(crate) const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// Watch this agent's own Node (a field selector on its name) and send every version of it
/// the server reports (`None` when the watch broke, so the reconciler reads again until it is
/// back), until `tx` is closed. `kube::runtime::watcher` lists it once (from the watch cache),
/// re-watches from the last resourceVersion (kept fresh by bookmarks) when the server ends a
/// watch, lists again only when that version is too old (410 Gone), and [`WatchBackoff`] spaces
/// the retries (capped at `max_backoff`) while the server fails. A watch means drift (a
/// hand-removed taint, a changed allocatable) is seen at once, and steady state costs no
/// periodic reads.
pub async fn watch_node(
    client: kube::Client,
    node_name: String,
    tx: tokio::sync::mpsc::Sender<Option<Node>>,
    max_backoff: Duration,
) {
    let nodes: Api<Node> = Api::all(client);
    let config = watcher::Config::default()
        .fields(&format!("metadata.name={node_name}"))
        .timeout(WATCH_TIMEOUT_SECS)
        // The list is served from the apiserver's watch cache, not a quorum read of etcd.
        .any_semantic();
    let mut events = watcher(nodes, config)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed();
    loop {
        let event = tokio::select! {
            () = tx.closed() => return,
            event = events.next() => event,
        };
        let update = match event {
            Some(Ok(Event::Apply(node) | Event::InitApply(node))) => Some(node),
            // The reconciler needs a Node to plan against; a deleted one is read (and not
            // found) like any other while the watch shows none.
            Some(Ok(Event::Delete(_) | Event::Init | Event::InitDone)) => continue,
            Some(Err(e)) => {
                tracing::debug!(node = %node_name, error = %e, "watch of the Node broke");
                None
            }
            // The watcher never ends; should it, the reconciler reads from now on.
            None => {
                let _ = tx.send(None).await;
                return;
            }
        };
        if tx.send(update).await.is_err() {
            return;
        }
    }
}

/// Doubling backoff from [`FIRST_BACKOFF`] up to a cap, for `WatchStreamExt::backoff`.
///
/// `StreamBackoff` resets its backoff on every item that is not an error, and the watcher
/// yields `Init` before each list is even tried; resetting on it would retry a failing list
/// at the first delay forever. So a reset takes effect only on the second success in a row.
#[derive(Debug, Clone)]
pub(crate) struct WatchBackoff {
    next: Duration,
    max: Duration,
    /// An error was the last thing seen: the next reset is the first success after it.
    after_error: bool,
}

impl WatchBackoff {
    pub(crate) fn new(max: Duration) -> Self {
        Self {
            next: FIRST_BACKOFF,
            max: max.max(FIRST_BACKOFF),
            after_error: false,
        }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let now = self.next;
        self.next = (self.next * 2).min(self.max);
        self.after_error = true;
        Some(now)
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        if std::mem::take(&mut self.after_error) {
            return;
        }
        self.next = FIRST_BACKOFF;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff;

    #[test]
    fn the_backoff_doubles_to_its_cap_and_one_success_alone_does_not_reset_it() {
        let mut b = WatchBackoff::new(Duration::from_secs(1));
        let ms = |d: Option<Duration>| d.map(|d| d.as_millis());
        assert_eq!(ms(b.next()), Some(200));
        // `Init` before a list that fails again: not a reset.
        b.reset();
        assert_eq!(ms(b.next()), Some(400));
        b.reset();
        assert_eq!(ms(b.next()), Some(800));
        assert_eq!(ms(b.next()), Some(1000), "capped");
        // Two successes in a row (a list and its first object): back to the first delay.
        b.reset();
        b.reset();
        assert_eq!(ms(b.next()), Some(200));
        // A cap below the first delay is raised to it.
        assert_eq!(ms(WatchBackoff::new(Duration::ZERO).next()), Some(200));
    }
}
