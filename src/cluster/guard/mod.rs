//! `fabricgate guard`: the cluster-level half of failing closed. A dead or wedged agent
//! leaves its Node with its last verdict (the gate fails open); the guard, a Deployment of two
//! replicas of which only the holder of a `coordination.k8s.io` Lease acts, taints a pool Node
//! whose agent pod is missing or not Ready for `--stale-after`, with `FabricReady=False`
//! reason `AgentNotRunning`. It never untaints (the agent decides again when it is back), it
//! reads only what the kubelet already reports (pod readiness), writes only when it taints,
//! and it is subject to the same blast-radius breaker as the agent.
//!
//! The leader keeps a local cache of the pool's Nodes and the agent pods (two
//! `kube::runtime` reflector stores, fed by `watcher` streams): one LIST of each (from the
//! watch cache) when it takes the Lease, then a WATCH of each from the list's resourceVersion
//! (with bookmarks), resumed from the last version seen when a watch ends and listed again
//! only on `410 Gone`. `sweep` judges that cache on every change, at the next `--stale-after`
//! deadline and every `--poll-interval`, with no API reads. A replica that does not hold the
//! Lease keeps no watches.

mod cache;
mod evict;
mod metrics;
mod proof;
mod sweep;
mod watch;

use crate::cluster::lease::{Election, Leadership, release};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::policy::breaker;
use futures::FutureExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::events::v1::Event;
use kube::api::Api;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use watch::{Watched, next_update};

pub use metrics::{
    EvictionResult, GuardMetrics, Outcome, POOL_REFUSAL, REFUSAL_REASONS, WriteKind, refusal_reason,
};
pub use proof::{CONFINED, NOT_CONFINED, POLICY_ADMITS, POLICY_REFUSES};
pub use sweep::agent_problem;

/// Reason of `FabricReady` the guard sets.
pub const AGENT_NOT_RUNNING: &str = "AgentNotRunning";
/// Field manager of the guard's condition writes (the agent takes the condition back).
pub const GUARD_FIELD_MANAGER: &str = "fabricgate-guard";

/// Everything `fabricgate guard` needs.
pub struct GuardSettings {
    pub config: Config,
    /// Runtime transport's section of `config` (`runtime:`: whether and when to evict).
    pub transport: crate::transport::settings::RuntimeSettings,
    pub namespace: String,
    pub pod_selector: String,
    pub stale_after: Duration,
    pub poll_interval: Duration,
    /// How often the leader proves its confinement to the pool again (`proof::prove_confined`).
    pub prove_every: Duration,
    pub lease_name: String,
    pub lease_duration: Duration,
    pub identity: String,
}

/// The server ends each watch after this long; the leader then re-watches from the last
/// resourceVersion (as the agent's watch of its own Node does).
const WATCH_TIMEOUT_SECS: u32 = 290;
/// Least time between two sweeps triggered by cache changes.
const MIN_SWEEP_GAP: Duration = Duration::from_millis(100);

impl GuardSettings {
    fn election(&self) -> Election<'_> {
        Election {
            lease_name: &self.lease_name,
            identity: &self.identity,
            lease_duration: self.lease_duration,
        }
    }
}

/// Longest wait between retries of a failed list or watch: `--poll-interval`, within 1–30 s.
fn max_backoff(s: &GuardSettings) -> Duration {
    s.poll_interval
        .clamp(Duration::from_secs(1), Duration::from_secs(30))
}

/// Run the guard until `shutdown` completes. `requests` serves the Lease and the writes;
/// `watch` (`node::Clients::watch`: watch requests with a read timeout above
/// [`WATCH_TIMEOUT_SECS`], lists with the short ones) the leader's two watchers; `metrics`
/// is what its `/metrics`, `/healthz` and `/readyz` tell.
///
/// # Errors
/// [`Error::Usage`] when `node.pool_selector` is empty (the guard must know the pool; it
/// comes from [`crate::config::POOL_SELECTOR_FILE`] beside the requirements file).
pub async fn run(
    requests: kube::Client,
    watch: kube::Client,
    s: GuardSettings,
    metrics: Arc<GuardMetrics>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    if s.config.node.pool_selector.is_empty() {
        return Err(Error::Usage {
            flag: "--config".into(),
            message: "the pool is empty: give the agent DaemonSet's nodeSelector in the file \
                      pool-selector beside it (the ConfigMap's key pool-selector, e.g. \
                      \"nvidia.com/gpu.present=true\"), or as node.pool_selector"
                .into(),
        });
    }
    let leases: Api<Lease> = Api::namespaced(requests.clone(), &s.namespace);
    let nodes: Api<Node> = Api::all(requests.clone());
    let events: Api<Event> = Api::namespaced(requests.clone(), &s.namespace);
    metrics.set_wedged_after(wedged_after(&s));
    // What the dry run of this leadership found (`proof::prove`); `None`: not proven yet.
    let mut proof: Option<bool> = None;
    // What the dry run outside the pool found (`proof::prove_confined`), and when it is due.
    let mut confined = proof::Confinement::default();
    let mut unhealthy_since: HashMap<String, Instant> = HashMap::new();
    let mut leadership = Leadership::default();
    let mut leading = false;
    // The leader's watches and cache; `None` on a replica that does not hold the Lease.
    let mut watched: Option<Watched> = None;
    let mut tick = tokio::time::interval(s.poll_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A change seen since the last sweep; sweeps on changes are at least MIN_SWEEP_GAP apart
    // (a burst of watch events costs one sweep).
    let mut changed = false;
    let mut last_sweep = tokio::time::Instant::now();
    // The next `--stale-after` deadline of a Node whose agent is not running: judged when due,
    // not only on the next tick.
    let mut due: Option<tokio::time::Instant> = None;
    let summary_key = breaker::pool_annotation(&s.config.node.label_prefix);
    let ledger_key = crate::transport::eviction::ledger_annotation(&s.config.node.label_prefix);
    // The leader's evictions of pods on sockets (`runtime.on_sockets: evict`).
    let mut evictor = evict::Evictor::default();
    tokio::pin!(shutdown);
    tracing::info!(identity = %s.identity, lease = %s.lease_name, "fabricgate guard started");
    warn_if_agents_read_another_lease(&s);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = tick.tick() => {
                let published = Published {
                    summary: (&summary_key, pool_summary(watched.as_ref(), &s)),
                    ledger: (&ledger_key, evictor.annotation()),
                };
                let renewal = published.renew(&mut leadership, &leases, &s).await;
                leading = renewal.leading;
                metrics.turned(leading);
                if renewal.changed {
                    unhealthy_since.clear();
                    proof = None;
                    confined = proof::Confinement::default();
                    metrics.set_confined(None, "");
                    evictor = evict::Evictor::default();
                }
                if leading
                    && !evictor.loaded()
                    && s.transport.on_sockets == crate::transport::settings::OnSockets::Evict
                {
                    evictor.load(&leases, &s).await;
                }
                let keep = renewal.keep_watches;
                if keep && watched.is_none() {
                    watched = Some(Watched::start(&watch, &s));
                } else if !keep && watched.take().is_some() {
                    tracing::info!("not leading: watches stopped, cache dropped");
                }
                if leading && let Some(w) = &mut watched {
                    // Proven once per leadership, and again while the writes are refused.
                    if w.cache.ready() && (proof != Some(true) || metrics.is_blocked()) {
                        proof = proof::prove(&nodes, &events, &w.cache, &s, &metrics, proof).await;
                    }
                    if w.cache.ready() && confined.due(s.prove_every) {
                        confined.prove(&nodes, &events, &s, &metrics).await;
                    }
                    due = judge(w, &mut evictor, &nodes, &requests, &s, &mut unhealthy_since, &metrics, &mut tick).await;
                    changed = false;
                    last_sweep = tokio::time::Instant::now();
                }
            }
            () = tokio::time::sleep_until(due.unwrap_or(last_sweep)), if due.is_some() && leading => {
                due = None;
                changed = true;
            }
            () = tokio::time::sleep_until(last_sweep + MIN_SWEEP_GAP), if changed && leading => {
                if let Some(w) = &mut watched {
                    due = judge(w, &mut evictor, &nodes, &requests, &s, &mut unhealthy_since, &metrics, &mut tick).await;
                }
                changed = false;
                last_sweep = tokio::time::Instant::now();
            }
            Some(update) = next_update(&mut watched) => {
                let Some(w) = &mut watched else { continue };
                w.cache.apply(update);
                // What is ready already joins this burst (a list's objects, events queued).
                while let Some(more) = w.next().now_or_never() {
                    w.cache.apply(more);
                }
                changed = true;
            }
        }
    }
    drop(watched);
    if leading {
        // Hand over at once: an expired lease lets the other replica take it.
        let _ = release(&leases, &s.election()).await;
    }
    tracing::info!("fabricgate guard stopped");
    Ok(())
}

/// Warn when the agents' breakers read the pool summary from another Lease than this guard's.
fn warn_if_agents_read_another_lease(s: &GuardSettings) {
    if s.config.node.breaker.guard_lease != s.lease_name {
        tracing::warn!(
            lease = %s.lease_name,
            agents_read = %s.config.node.breaker.guard_lease,
            "the agents read the pool summary from node.breaker.guard_lease, not this guard's \
             Lease: their breakers list the pool instead; give both the same name"
        );
    }
}

/// What rides on a Lease renewal, each as (annotation, text).
struct Published<'a> {
    /// The pool summary: agents read it instead of listing the pool
    /// (`policy::breaker::PoolSummary`); removed (`None`) while the cache does not follow the
    /// server.
    summary: (&'a str, Option<String>),
    /// The eviction ledger, only once read from the Lease (`None` leaves it as it is: a new
    /// leader must not overwrite its predecessor's count with an empty one).
    ledger: (&'a str, Option<String>),
}

impl Published<'_> {
    async fn renew(
        &self,
        leadership: &mut Leadership,
        leases: &Api<Lease>,
        s: &GuardSettings,
    ) -> crate::cluster::lease::Renewal {
        let mut publish = vec![(self.summary.0, self.summary.1.as_deref())];
        if let Some(text) = self.ledger.1.as_deref() {
            publish.push((self.ledger.0, Some(text)));
        }
        leadership
            .renew_publishing(leases, &s.election(), &publish)
            .await
    }
}

/// One judgement of the cache: the pool's Nodes ([`Watched::sweep`]), then the pods on sockets
/// ([`evict::Evictor::step`]). Returns the next deadline of either; after an eviction the
/// next renewal (which publishes the eviction ledger) is due at once.
#[allow(clippy::too_many_arguments)]
async fn judge(
    w: &mut Watched,
    evictor: &mut evict::Evictor,
    nodes: &Api<Node>,
    client: &kube::Client,
    s: &GuardSettings,
    since: &mut HashMap<String, Instant>,
    m: &GuardMetrics,
    tick: &mut tokio::time::Interval,
) -> Option<tokio::time::Instant> {
    w.sweep(nodes, s, since, m).await;
    let (evict_due, evicted) = evictor.step(client, &w.cache, s, m).await;
    if evicted {
        tick.reset_immediately();
    }
    let taint_due = next_deadline(since, s.stale_after);
    match (taint_due, evict_due) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The pool summary the leader publishes on its Lease for the agents' breakers: counted from a
/// cache that follows the server, else `None` (removed: the agents list the pool meanwhile).
fn pool_summary(watched: Option<&Watched>, s: &GuardSettings) -> Option<String> {
    let w = watched.filter(|w| w.cache.ready())?;
    let nodes = w.cache.nodes();
    let mut summary = breaker::PoolSummary::of(
        nodes.iter().map(AsRef::as_ref),
        &s.config.node.taint_key(),
        s.config.node.breaker.window,
        &k8s_openapi::jiff::Timestamp::now(),
    );
    summary.selector.clone_from(&s.config.node.pool_selector);
    let text = summary.annotation();
    if text.is_none() {
        tracing::warn!(
            pool_nodes = summary.nodes,
            failing =
                summary.tainted_new.len() + summary.tainted_old.len() + summary.not_ready.len(),
            "the pool summary is too large for the Lease; agents list the pool until fewer \
             Nodes fail"
        );
    }
    text
}

/// The earliest `--stale-after` deadline still ahead among the Nodes whose agent is not
/// running (those past it were judged already).
fn next_deadline(
    since: &HashMap<String, Instant>,
    stale_after: Duration,
) -> Option<tokio::time::Instant> {
    let now = Instant::now();
    since
        .values()
        .filter_map(|first| first.checked_add(stale_after))
        .filter(|d| *d > now)
        .min()
        .map(tokio::time::Instant::from_std)
}

/// `/healthz` fails when the loop has not turned for this long: ten `--poll-interval`s, at
/// least a minute, plus a `--lease-duration` (one turn's requests are bounded by the client's
/// timeouts, well within it).
fn wedged_after(s: &GuardSettings) -> Duration {
    s.poll_interval
        .saturating_mul(10)
        .max(Duration::from_secs(60))
        .saturating_add(s.lease_duration)
}

/// Count a Node write in `m` and say when the guard's writes turn refused (or admitted again).
fn record<T>(
    m: &GuardMetrics,
    kind: WriteKind,
    action: &'static str,
    node: &str,
    result: std::result::Result<T, kube::Error>,
) -> Result<T> {
    let outcome = Outcome::of(&result);
    let message = match &result {
        Err(kube::Error::Api(status)) => Some(status.message.as_str()),
        _ => None,
    };
    if m.wrote(kind, outcome, message) {
        match outcome {
            Outcome::Refused(reason) => tracing::error!(
                node,
                reason,
                error = message.unwrap_or_default(),
                "the API server refuses the guard's Node writes: it cannot taint a Node whose \
                 agent died; /readyz fails until a write is admitted"
            ),
            _ => tracing::info!(node, "the guard's Node writes are admitted again"),
        }
    }
    result.map_err(|e| kube_err(action, node, e))
}

fn kube_err(action: &'static str, what: &str, source: kube::Error) -> Error {
    Error::Kube {
        action,
        node: what.to_owned(),
        source: Box::new(source),
    }
}

#[cfg(test)]
mod tests;
