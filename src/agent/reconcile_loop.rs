//! The Node writer's loop: applies the latest verdict whenever it changes, re-reads the Node
//! on `resync`, and backs off with jitter while the API server fails.

use super::mesh::Advertised;
use super::timing::{BACKOFF_BASE, Failpoint, Jitter, WRITE_GRACE, later, wait_stop};
use crate::config::Config;
use crate::device_plugin::node_checks::NodeChecks;
use crate::node::{self, Clients, Reconciler, RetryAfter};
use crate::observe::metrics::Metrics;
use crate::policy::Verdict;
use k8s_openapi::api::core::v1::Node;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};

/// The Node writer of `node`: its placement labels, the breaker's ledger in `namespace`, and
/// what the gang pre-flight advertises.
pub(super) fn node_writer(
    node: &str,
    config: &Config,
    client: Option<kube::Client>,
    dry_run: bool,
    metrics: &Arc<Metrics>,
    namespace: &str,
    advertised: Advertised,
) -> Reconciler {
    let reconciler = Reconciler::new(
        node.to_owned(),
        config.node.clone(),
        client,
        dry_run,
        Arc::clone(metrics),
    )
    .with_required_labels(config.placement.required_labels.clone())
    .with_breaker_ledger(namespace)
    .with_annotations(advertised.annotations);
    match advertised.gids {
        Some(gids) => {
            reconciler.with_shared_annotation(crate::gang::fabriccheck::GIDS_ANNOTATION, gids)
        }
        None => reconciler,
    }
}

/// The agent's own Node, watched: drift is undone at once and steady state reads nothing. The
/// watch task (none without a watch client: the channel is closed), and its versions.
pub(super) fn watch_own_node(
    clients: Option<&Clients>,
    node: &str,
    interval: Duration,
) -> (Option<JoinHandle<()>>, mpsc::Receiver<Option<Node>>) {
    let (tx, rx) = mpsc::channel(16);
    let task = clients
        .and_then(|c| c.watch.clone())
        .map(|watch| tokio::spawn(node::watch_node(watch, node.to_owned(), tx, interval)));
    (task, rx)
}

/// When the Node writer acts: the probe interval caps its backoff, `resync` re-reads the Node,
/// `retry_after` is the API server's last `Retry-After`.
pub(super) struct LoopTiming {
    pub(super) interval: Duration,
    pub(super) resync: Duration,
    pub(super) retry_after: RetryAfter,
}

/// Applies the latest verdict whenever it changes, re-reads the Node every `resync` to undo
/// drift, and backs off with jitter (honouring `Retry-After`) while the API server fails.
pub(super) async fn reconcile_loop(
    mut rec: Reconciler,
    mut desired: watch::Receiver<Option<Verdict>>,
    mut node_updates: mpsc::Receiver<Option<Node>>,
    mut stop: watch::Receiver<bool>,
    timing: LoopTiming,
    checks: NodeChecks,
    failpoint: Failpoint,
) {
    let mut failures: u32 = 0;
    let mut deadline: Option<Instant> = None;
    let mut jitter = Jitter::new();
    let mut last_error: Option<&'static str> = None;
    let mut watching = true;
    loop {
        let wake = deadline.unwrap_or_else(|| later(Instant::now(), Duration::from_secs(86_400)));
        tokio::select! {
            biased;
            () = wait_stop(&mut stop) => return,
            // While failing, wait for the backoff deadline; it reconciles the latest verdict.
            r = desired.changed(), if failures == 0 => {
                if r.is_err() {
                    return;
                }
            }
            () = sleep_until(wake), if deadline.is_some() => {
                if failures == 0 {
                    rec.invalidate();
                }
            }
            // Someone else changed the Node (or the watch broke): reconcile against it now.
            update = node_updates.recv(), if watching => {
                match update {
                    Some(Some(node)) => {
                        checks.observe(&node);
                        if !rec.observe(node) || failures > 0 {
                            continue;
                        }
                    }
                    Some(None) => {
                        rec.forget_observed();
                        continue;
                    }
                    // No watch (dry run without a cluster): stop polling this arm.
                    None => {
                        watching = false;
                        continue;
                    }
                }
            }
        }
        let Some(verdict) = desired.borrow_and_update().clone() else {
            continue;
        };
        if failpoint == Failpoint::ReconcilePanic {
            panic!("failpoint reconcile-panic: the reconcile task panics");
        }
        let result = {
            let fut = rec.reconcile(&verdict);
            tokio::pin!(fut);
            tokio::select! {
                r = &mut fut => r,
                () = wait_stop(&mut stop) => {
                    match timeout(WRITE_GRACE, &mut fut).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => tracing::warn!(error = %e, "last Node write failed at shutdown"),
                        Err(_) => tracing::warn!("abandoned an in-flight Node write at shutdown"),
                    }
                    return;
                }
            }
        };
        match result {
            Ok(outcome) => {
                if failures > 0 {
                    tracing::info!(
                        node = %rec.node_name(),
                        failures,
                        writes = outcome.writes,
                        "API server reachable again; Node reconciled"
                    );
                }
                failures = 0;
                last_error = None;
                deadline = Some(later(Instant::now(), timing.resync));
            }
            Err(e) => {
                // What the watch showed may be what the failed write was based on.
                rec.distrust_observed();
                failures = failures.saturating_add(1);
                let mut delay = backoff(failures, timing.interval, &mut jitter);
                if e.is_throttled() {
                    // The header (seen by the client layer) or the Status body carries it.
                    let header = timing.retry_after.take();
                    if let Some(server) = e.retry_after().or(header) {
                        delay = delay.max(server);
                    }
                }
                let label = e.metric_label();
                if last_error != Some(label) {
                    tracing::warn!(error = %e, retry_in = ?delay, "Node reconcile failed; backing off");
                } else {
                    tracing::debug!(error = %e, retry_in = ?delay, failures, "Node reconcile failed again");
                }
                last_error = Some(label);
                deadline = Some(later(Instant::now(), delay));
            }
        }
    }
}

/// Exponential from [`BACKOFF_BASE`], capped at the probe interval (so the agent converges
/// within one interval of the server's return), with "equal jitter" (half fixed, half random).
pub(super) fn backoff(failures: u32, interval: Duration, jitter: &mut Jitter) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    let capped = exp.min(interval.max(BACKOFF_BASE));
    capped.mul_f64(0.5 + 0.5 * jitter.next_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped_by_the_interval() {
        let mut j = Jitter::new();
        let interval = Duration::from_secs(10);
        for failures in 1..40 {
            let d = backoff(failures, interval, &mut j);
            let full = BACKOFF_BASE
                .saturating_mul(1u32 << (failures - 1).min(16))
                .min(interval);
            assert!(d >= full / 2 && d <= full, "{failures}: {d:?} vs {full:?}");
        }
        assert!(backoff(30, interval, &mut j) >= Duration::from_secs(5));
    }
}
