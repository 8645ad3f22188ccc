//! The checks of the agent's own Node object (`kubernetes.rdma_resources`): each watched
//! version becomes device-plugin findings on a `watch` channel, which the probe loop judges at
//! once with its last report.

use super::assess as device_plugin;
use crate::config::KubernetesRequirements;
use crate::policy::Finding;
use std::time::Duration;
use tokio::sync::watch;

/// Checks of the agent's own Node object, fed from the watch to the probe loop.
pub struct NodeChecks {
    rdma_resources: Vec<String>,
    findings: watch::Sender<Vec<Finding>>,
    /// `kubernetes.plugin_grace`.
    plugin_grace: Duration,
    /// A kubelet restart being held back: (generation, the findings to publish if it outlasts
    /// the grace). The generation tells a timer whether its hold is still the current one.
    held: std::sync::Arc<std::sync::Mutex<(u64, Option<Vec<Finding>>)>>,
}

fn publish_findings(tx: &watch::Sender<Vec<Finding>>, found: Vec<Finding>) {
    tx.send_if_modified(|have| {
        if *have == found {
            false
        } else {
            if found.is_empty() {
                tracing::info!("device-plugin resources are allocatable again");
            } else {
                for f in &found {
                    tracing::warn!(reason = f.code, "{}", f.message);
                }
            }
            *have = found;
            true
        }
    });
}

impl NodeChecks {
    /// The checks of `kubernetes.*`, and the receiving end of their findings.
    pub fn new(k: &KubernetesRequirements) -> (Self, watch::Receiver<Vec<Finding>>) {
        let (findings, rx) = watch::channel(Vec::new());
        let checks = Self {
            rdma_resources: k.rdma_resources.clone(),
            findings,
            plugin_grace: k.plugin_grace,
            held: std::sync::Arc::default(),
        };
        (checks, rx)
    }

    pub fn observe(&self, node: &k8s_openapi::api::core::v1::Node) {
        let found = device_plugin::device_plugin_findings(node, &self.rdma_resources);
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A healthy node whose plugin resources all read 0/0: a kubelet restart, until the
        // plugins register again. Hold it back for the grace (a timer publishes it if it
        // lasts); anything else is published at once and ends a hold.
        let runtime = tokio::runtime::Handle::try_current();
        if !found.is_empty()
            && !self.plugin_grace.is_zero()
            && (held.1.is_some() || self.findings.borrow().is_empty())
            && device_plugin::kubelet_restart_signature(node, &self.rdma_resources)
            && let Ok(runtime) = runtime
        {
            if held.1.replace(found).is_none() {
                held.0 += 1;
                let generation = held.0;
                let grace = self.plugin_grace;
                tracing::info!(
                    grace = %humantime::format_duration(grace),
                    "device-plugin resources read 0 in capacity and allocatable, as after a \
                     kubelet restart: waiting up to kubernetes.plugin_grace for the plugins \
                     to register again"
                );
                let slot = std::sync::Arc::clone(&self.held);
                let tx = self.findings.clone();
                runtime.spawn(async move {
                    tokio::time::sleep(grace).await;
                    let due = {
                        let mut h = slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        if h.0 == generation { h.1.take() } else { None }
                    };
                    if let Some(found) = due {
                        tracing::warn!(
                            grace = %humantime::format_duration(grace),
                            "the device plugins did not register again within kubernetes.plugin_grace"
                        );
                        publish_findings(&tx, found);
                    }
                });
            }
            return;
        }
        held.1 = None;
        drop(held);
        publish_findings(&self.findings, found);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Node, NodeStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    const R: &str = "rdma/hca_shared_devices_a";

    fn node(capacity: &str, allocatable: &str) -> Node {
        let map = |v: &str| {
            Some(
                [(R.to_owned(), Quantity(v.to_owned()))]
                    .into_iter()
                    .collect(),
            )
        };
        Node {
            status: Some(NodeStatus {
                capacity: map(capacity),
                allocatable: map(allocatable),
                ..NodeStatus::default()
            }),
            ..Node::default()
        }
    }

    fn checks(grace: Duration) -> (NodeChecks, watch::Receiver<Vec<Finding>>) {
        let (tx, rx) = watch::channel(Vec::new());
        let checks = NodeChecks {
            rdma_resources: vec![R.into()],
            findings: tx,
            plugin_grace: grace,
            held: std::sync::Arc::default(),
        };
        (checks, rx)
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_kubelet_restart_is_held_back_for_the_grace_and_a_dead_plugin_is_not() {
        let grace = Duration::from_secs(30);
        // Restart, plugins back within the grace: nothing is ever published.
        let (c, rx) = checks(grace);
        c.observe(&node("0", "0"));
        settle().await;
        assert!(rx.borrow().is_empty());
        tokio::time::advance(Duration::from_secs(10)).await;
        c.observe(&node("4", "4"));
        tokio::time::advance(Duration::from_secs(30)).await;
        settle().await;
        assert!(rx.borrow().is_empty(), "{:?}", rx.borrow());

        // Restart, plugins never back: published once the grace is over, not before.
        c.observe(&node("0", "0"));
        settle().await;
        tokio::time::advance(Duration::from_secs(29)).await;
        settle().await;
        assert!(rx.borrow().is_empty());
        tokio::time::advance(Duration::from_secs(2)).await;
        settle().await;
        assert_eq!(rx.borrow().len(), 1);
        assert_eq!(
            rx.borrow()[0].code,
            super::super::assess::DEVICE_PLUGIN_UNAVAILABLE
        );

        // A plugin that dies under a running kubelet: at once.
        let (c, rx) = checks(grace);
        c.observe(&node("4", "0"));
        assert_eq!(rx.borrow().len(), 1);
        // Already failed: a later 0/0 is published at once too (no new hold).
        c.observe(&node("0", "0"));
        assert!(rx.borrow()[0].message.contains("capacity 0"));

        // Grace off: a restart fails at once.
        let (c, rx) = checks(Duration::ZERO);
        c.observe(&node("0", "0"));
        assert_eq!(rx.borrow().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_old_holds_timer_does_not_cut_a_new_hold_short() {
        let (c, rx) = checks(Duration::from_secs(30));
        c.observe(&node("0", "0"));
        settle().await;
        tokio::time::advance(Duration::from_secs(10)).await;
        c.observe(&node("4", "4"));
        tokio::time::advance(Duration::from_secs(10)).await;
        c.observe(&node("0", "0")); // a second restart, 20 s after the first
        settle().await;
        tokio::time::advance(Duration::from_secs(15)).await; // the first timer fires here
        settle().await;
        assert!(
            rx.borrow().is_empty(),
            "the first hold's timer published the second"
        );
        tokio::time::advance(Duration::from_secs(16)).await;
        settle().await;
        assert_eq!(rx.borrow().len(), 1);
    }
}
