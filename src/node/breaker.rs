//! [`PoolBreaker`]: the blast-radius breaker's API work before a new taint. It reads the pool
//! (the guard's summary on its Lease, else one list of the pool's Nodes) and takes this Node's
//! entry in the ledger by compare-and-swap; every decision is [`breaker`]'s (pure).

use super::Outcome;
use crate::config::NodeSettings;
use crate::observe::metrics::Metrics;
use crate::policy::breaker;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, PostParams};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Compare-and-swap rounds on the ledger before holding back (a burst that large fails safe).
const RESERVE_ROUNDS: u32 = 20;

/// The pause before reservation round `round + 1` after a conflict: a share of a ceiling that
/// doubles each round (20 ms, 40 ms, ... 640 ms), the share differing between nodes and
/// rounds. In a burst hundreds of agents race for the ledger; retrying in step would make
/// every round a collision of all of them (measured at 5,000 Nodes with a 512-node leaf:
/// docs/scale.md).
pub(super) fn conflict_pause_ms(node: &str, round: u32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in node.bytes().chain(round.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let ceiling = 20u64 << round.min(5);
    5 + h % ceiling
}

/// The pool as read for one decision.
struct PoolView {
    summary: breaker::PoolSummary,
    /// Whether this Node is one of the Nodes the summary counted.
    in_pool: bool,
    /// Read from the guard's Lease (not a list).
    from_guard: bool,
}

/// Asks the breaker before this agent newly taints its Node.
pub(super) struct PoolBreaker {
    node_name: String,
    settings: NodeSettings,
    metrics: Arc<Metrics>,
    /// The breaker's ledger ([`breaker::LEDGER`]) in the agent's namespace.
    ledger: Option<Api<ConfigMap>>,
    /// Leases in the agent's namespace: the guard's holds the pool summary
    /// (`node.breaker.guard_lease`).
    leases: Option<Api<Lease>>,
    /// Whether the breaker last counted the pool from the guard's summary (`Some(true)`) or a
    /// list (`Some(false)`): a change is logged once.
    pool_from_guard: Option<bool>,
}

impl PoolBreaker {
    /// Without a ledger (see [`PoolBreaker::use_ledger`]): the pool's count alone decides.
    pub(super) fn new(node_name: String, settings: NodeSettings, metrics: Arc<Metrics>) -> Self {
        Self {
            node_name,
            settings,
            metrics,
            ledger: None,
            leases: None,
            pool_from_guard: None,
        }
    }

    /// Reserve new taints in the ledger in `namespace` (the agent's own), and read the guard's
    /// Lease there when `node.breaker.guard_lease` names one.
    pub(super) fn use_ledger(&mut self, client: kube::Client, namespace: &str) {
        if !self.settings.breaker.guard_lease.is_empty() {
            self.leases = Some(Api::namespaced(client.clone(), namespace));
        }
        self.ledger = Some(Api::namespaced(client, namespace));
    }

    /// The breaker's answer for newly tainting `node` (this agent's), only asked when a taint
    /// is due. The pool comes from the guard's Lease (one small object, whatever the pool's
    /// size) while the guard's leader publishes a fresh summary there, else from one list of
    /// the pool's Nodes served from the API server's watch cache (`resourceVersion=0`). A
    /// failed list decides from the ledger alone (its reservations in flight), with a warning.
    pub(super) async fn decide(
        &mut self,
        nodes: &Api<Node>,
        node: &Node,
        outcome: &mut Outcome,
    ) -> breaker::TaintDecision {
        let settings = self.settings.breaker.clone();
        let (annotation, overridden) = breaker::breaker_override(node, &self.settings.label_prefix);
        if self.settings.pool_selector.is_empty() || !settings.enabled || overridden {
            return breaker::taint_decision(&settings, None, overridden, &annotation);
        }
        let started = Instant::now();
        let pool = self.read_pool(nodes, node, outcome).await;
        let count = pool.summary.count(&self.node_name, pool.in_pool);
        tracing::info!(
            node = %self.node_name,
            pool_nodes = count.nodes,
            tainted_others = count.tainted_others,
            new_in_window = count.new_in_window,
            source = if pool.from_guard { "guard" } else { "list" },
            read_ms = started.elapsed().as_millis() as u64,
            "breaker: counted the pool before tainting"
        );
        let decision = breaker::taint_decision(&settings, Some(&count), false, &annotation);
        if decision != breaker::TaintDecision::Taint || !breaker::uses_ledger(&settings) {
            return decision;
        }
        match self
            .reserve(&pool.summary, count, &annotation, outcome)
            .await
        {
            Ok(decision) => decision,
            Err(e) => {
                // Without the ledger the pool's count stands (a burst may overshoot the caps).
                tracing::warn!(
                    node = %self.node_name,
                    error = %e,
                    "cannot use the breaker's ledger ConfigMap {}; deciding from the pool's \
                     count alone",
                    breaker::LEDGER
                );
                decision
            }
        }
    }

    /// The pool from the guard's summary, else from a list; logs a change of source once.
    async fn read_pool(
        &mut self,
        nodes: &Api<Node>,
        node: &Node,
        outcome: &mut Outcome,
    ) -> PoolView {
        let pool = match self.published_pool(outcome).await {
            Ok(summary) => {
                // A summary names only failures: whether this Node is one of the pool it
                // counted, its own labels tell (a selector it cannot read: it is, as the
                // DaemonSet's nodeSelector put the agent here).
                let labels = node.metadata.labels.clone().unwrap_or_default();
                let in_pool = breaker::selector_matches(&self.settings.pool_selector, &labels)
                    .unwrap_or(true);
                PoolView {
                    summary,
                    in_pool,
                    from_guard: true,
                }
            }
            Err(why) => {
                if self.pool_from_guard != Some(false) {
                    tracing::info!(
                        node = %self.node_name,
                        "breaker: listing the pool's Nodes, no summary from the guard: {why}"
                    );
                }
                self.list_pool(nodes, outcome).await
            }
        };
        if pool.from_guard && self.pool_from_guard != Some(true) {
            tracing::info!(
                node = %self.node_name,
                lease = %self.settings.breaker.guard_lease,
                "breaker: counting the pool from the guard's summary"
            );
        }
        self.pool_from_guard = Some(pool.from_guard);
        pool
    }

    /// The pool from one list of its Nodes (from the watch cache); a failed list is a pool
    /// unseen, where only the ledger's reservations count.
    async fn list_pool(&self, nodes: &Api<Node>, outcome: &mut Outcome) -> PoolView {
        let window = self.settings.breaker.window;
        outcome.requests += 1;
        let params = ListParams::default()
            .labels(&self.settings.pool_selector)
            .match_any();
        let listed_at = Timestamp::now();
        match nodes.list(&params).await {
            Ok(list) => {
                let mut summary = breaker::PoolSummary::of(
                    &list.items,
                    &self.settings.taint_key(),
                    window,
                    &Timestamp::now(),
                );
                summary.selector.clone_from(&self.settings.pool_selector);
                summary.observed_at = Some(listed_at);
                let in_pool = summary.has_member(&self.node_name) == Some(true);
                PoolView {
                    summary,
                    in_pool,
                    from_guard: false,
                }
            }
            Err(e) => {
                // Under a burst at thousands of Nodes such a list can time out (docs/
                // scale.md); tainting at once would lift the cap. The ledger still
                // counts the pool's reservations in flight; past those, taint.
                tracing::warn!(
                    node = %self.node_name,
                    selector = %self.settings.pool_selector,
                    error = %e,
                    "cannot list the pool's Nodes for the breaker; deciding from the \
                     ledger alone (tainting unless it holds the cap)"
                );
                PoolView {
                    summary: breaker::PoolSummary::unseen(
                        &self.settings.pool_selector,
                        window,
                        listed_at,
                    ),
                    in_pool: true,
                    from_guard: false,
                }
            }
        }
    }

    /// The pool as the guard's leader last published it on its Lease, or why there is none
    /// to use (no guard Lease configured or found, not renewed, no summary on it).
    async fn published_pool(
        &self,
        outcome: &mut Outcome,
    ) -> std::result::Result<breaker::PoolSummary, String> {
        let name = &self.settings.breaker.guard_lease;
        let Some(leases) = &self.leases else {
            return Err("node.breaker.guard_lease is empty".to_owned());
        };
        outcome.requests += 1;
        let lease = match leases.get_opt(name).await {
            Ok(Some(lease)) => lease,
            Ok(None) => return Err(format!("no Lease {name} (is the guard deployed?)")),
            Err(e) => return Err(format!("cannot read the guard's Lease {name}: {e}")),
        };
        breaker::published_summary(
            &lease,
            &self.settings.label_prefix,
            &self.settings.pool_selector,
            self.settings.breaker.window,
            &Timestamp::now(),
        )
    }

    /// Decide again under the ledger's compare-and-swap ([`reserve`]) and reserve this
    /// node's new taint if it may be tainted.
    async fn reserve(
        &self,
        pool: &breaker::PoolSummary,
        count: breaker::PoolCount,
        annotation: &str,
        outcome: &mut Outcome,
    ) -> std::result::Result<breaker::TaintDecision, kube::Error> {
        let Some(ledger) = &self.ledger else {
            return Ok(breaker::TaintDecision::Taint);
        };
        let slot = Slot {
            node: &self.node_name,
            pool_selector: &self.settings.pool_selector,
            settings: &self.settings.breaker,
            override_annotation: annotation,
        };
        let mut writes = 0;
        let decision = reserve(
            ledger,
            &slot,
            pool,
            count,
            &mut outcome.requests,
            &mut writes,
        )
        .await;
        if writes > 0 {
            outcome.writes += writes;
            self.metrics.record_node_write("ledger");
        }
        decision
    }
}

/// Whose new taint [`reserve`] reserves, and under which breaker.
pub(crate) struct Slot<'a> {
    /// The Node to taint (its entry's key).
    pub node: &'a str,
    /// `node.pool_selector`: the pool the entry is made in.
    pub pool_selector: &'a str,
    pub settings: &'a crate::config::BreakerSettings,
    /// The Node's override annotation, for the message of a held taint.
    pub override_annotation: &'a str,
}

/// Decide again under the ledger's compare-and-swap, with `count` (the pool as `pool` shows
/// it) raised by the reservations it cannot show yet ([`breaker::count_with_ledger`]), and
/// reserve the new taint of `slot.node` if it may be tainted. Every new taint goes through
/// here, the agents' and the guard's, so neither cap can be passed by deciding at once: a
/// conflict means another reserved meanwhile, and the retry counts it. `requests` and
/// `writes` count what was sent and what was written.
pub(crate) async fn reserve(
    ledger: &Api<ConfigMap>,
    slot: &Slot<'_>,
    pool: &breaker::PoolSummary,
    count: breaker::PoolCount,
    requests: &mut u32,
    writes: &mut u32,
) -> std::result::Result<breaker::TaintDecision, kube::Error> {
    let settings = slot.settings;
    // Conflicts mean others reserved meanwhile: each retry reads their entries.
    for round in 0..RESERVE_ROUNDS {
        *requests += 1;
        let mut cm = ledger.get(breaker::LEDGER).await?;
        let now = Timestamp::now();
        let data = cm.data.clone().unwrap_or_default();
        let exact =
            breaker::count_with_ledger(count, &data, slot.node, pool, settings.window, &now);
        let decision =
            breaker::taint_decision(settings, Some(&exact), false, slot.override_annotation);
        if decision != breaker::TaintDecision::Taint {
            return Ok(decision);
        }
        cm.data = Some(breaker::ledger_with(
            &data,
            slot.node,
            slot.pool_selector,
            settings.window,
            &now,
        ));
        // Counted whatever the answer (as the taint's write is).
        *requests += 1;
        match ledger
            .replace(breaker::LEDGER, &PostParams::default(), &cm)
            .await
        {
            Ok(_) => {
                *writes += 1;
                return Ok(breaker::TaintDecision::Taint);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => {
                let pause = conflict_pause_ms(slot.node, round);
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            Err(e) => return Err(e),
        }
    }
    // Still contended after every round: the burst is large; hold back (fail safe).
    Ok(breaker::contended_decision(
        RESERVE_ROUNDS,
        slot.override_annotation,
    ))
}
