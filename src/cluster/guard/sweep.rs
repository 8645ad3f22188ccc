//! Judging the cache: which pool Nodes to taint because their agent is not running.

use super::cache::Cache;
use super::metrics::{GuardMetrics, WriteKind};
use super::{AGENT_NOT_RUNNING, GUARD_FIELD_MANAGER, GuardSettings, record};
use crate::error::Result;
use crate::policy::breaker::{self, TaintDecision};
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use std::collections::HashMap;
use std::time::Instant;

/// Why a Node's agent counts as not running, or `None` when its pod is Ready.
pub fn agent_problem<'a>(node: &str, pods: impl IntoIterator<Item = &'a Pod>) -> Option<String> {
    let on_node: Vec<&Pod> = pods
        .into_iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    if on_node.is_empty() {
        return Some(format!("no fabricgate agent pod runs on {node}"));
    }
    let ready = on_node.iter().any(|p| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    });
    if ready {
        None
    } else {
        let name = on_node[0].metadata.name.as_deref().unwrap_or("?");
        Some(format!(
            "the fabricgate agent pod {name} on {node} is not Ready (probe loop stalled, \
             crashing or not started)"
        ))
    }
}

/// Judge every pool Node of the cache: taint one whose agent has been missing or not Ready
/// for `stale_after` (no API reads; the Nodes written go to `wrote`). After a failed write the
/// sweep writes nothing more (the next one retries) but still counts the pool for `m`.
pub(super) async fn sweep(
    nodes: &Api<Node>,
    cache: &Cache,
    s: &GuardSettings,
    since: &mut HashMap<String, Instant>,
    wrote: &mut Vec<Node>,
    m: &GuardMetrics,
) -> Result<()> {
    let pool = cache.nodes();
    let pods = cache.pods_by_node();
    let key = s.config.node.taint_key();
    let now = Instant::now();
    let ledger: Api<ConfigMap> = Api::namespaced(nodes.clone().into_client(), &s.namespace);
    since.retain(|n, _| cache.has_node(n));
    // The pool as the breaker counts it, counted only when a taint is due.
    let mut summary: Option<breaker::PoolSummary> = None;
    let mut stale = 0;
    let mut outcome = Ok(());
    for node in &pool {
        let Some(name) = node.metadata.name.clone() else {
            continue;
        };
        let on_node = pods.get(&name).into_iter().flatten().map(AsRef::as_ref);
        let Some(problem) = agent_problem(&name, on_node) else {
            since.remove(&name);
            continue;
        };
        stale += 1;
        let first = *since.entry(name.clone()).or_insert(now);
        if outcome.is_err() || now.duration_since(first) < s.stale_after {
            continue;
        }
        let tainted = node
            .spec
            .as_ref()
            .and_then(|sp| sp.taints.as_ref())
            .is_some_and(|ts| ts.iter().any(|t| t.key == key));
        if tainted {
            continue;
        }
        let counted = summary.get_or_insert_with(|| {
            let now = Timestamp::now();
            let mut counted = breaker::PoolSummary::of(
                pool.iter().map(AsRef::as_ref),
                &key,
                s.config.node.breaker.window,
                &now,
            );
            counted.selector.clone_from(&s.config.node.pool_selector);
            counted.observed_at = Some(now);
            counted
        });
        let target = Target {
            node,
            name: &name,
            problem: &problem,
        };
        outcome = act(nodes, &ledger, &target, counted, s, wrote, m).await;
    }
    m.swept(pool.len(), stale);
    outcome
}

/// A Node the guard would taint: its agent is not running (`problem`).
struct Target<'a> {
    node: &'a Node,
    name: &'a str,
    problem: &'a str,
}

/// The breaker's answer for the guard's taint of `t`: from `pool` (its cache), then, when it
/// may taint, under the breaker ledger's compare-and-swap as every agent's new taint is
/// (`node::breaker::reserve`), so that the guard's taint and the agents' in the same instant
/// count each other. Without the ledger (missing, refused), the cache's count decides.
async fn decide(
    ledger: &Api<ConfigMap>,
    t: &Target<'_>,
    pool: &breaker::PoolSummary,
    s: &GuardSettings,
) -> TaintDecision {
    let settings = &s.config.node.breaker;
    let (annotation, overridden) = breaker::breaker_override(t.node, &s.config.node.label_prefix);
    let count = pool.count(t.name, true);
    let decision = breaker::taint_decision(settings, Some(&count), overridden, &annotation);
    if decision != TaintDecision::Taint
        || overridden
        || !settings.enabled
        || !breaker::uses_ledger(settings)
    {
        return decision;
    }
    let slot = crate::node::breaker::Slot {
        node: t.name,
        pool_selector: &s.config.node.pool_selector,
        settings,
        override_annotation: &annotation,
    };
    let (mut requests, mut writes) = (0, 0);
    match crate::node::breaker::reserve(ledger, &slot, pool, count, &mut requests, &mut writes)
        .await
    {
        Ok(decision) => decision,
        Err(e) => {
            tracing::warn!(
                node = %t.name,
                error = %e,
                "cannot use the breaker's ledger ConfigMap {} in {}; deciding from the pool's \
                 count alone (grant the guard get and update on it, deploy/guard.yaml)",
                breaker::LEDGER,
                s.namespace
            );
            decision
        }
    }
}

/// Taint `t` (its agent is not running), or mark it `BreakerOpen` when the breaker holds the
/// taint back (`pool`: the pool as the cache shows it).
async fn act(
    nodes: &Api<Node>,
    ledger: &Api<ConfigMap>,
    t: &Target<'_>,
    pool: &breaker::PoolSummary,
    s: &GuardSettings,
    wrote: &mut Vec<Node>,
    m: &GuardMetrics,
) -> Result<()> {
    let (node, name, problem) = (t.node, t.name, t.problem);
    let message = format!(
        "{problem} for over {}; tainted by fabricgate guard until the agent validates \
         the node again",
        humantime::format_duration(s.stale_after)
    );
    match decide(ledger, t, pool, s).await {
        TaintDecision::Taint => {
            let tainted = taint(nodes, node, s).await;
            wrote.push(record(m, WriteKind::Taint, "taint", name, tainted)?);
            let set = set_condition(nodes, name, AGENT_NOT_RUNNING, &message).await;
            wrote.push(record(
                m,
                WriteKind::Condition,
                "set FabricReady on",
                name,
                set,
            )?);
            tracing::warn!(node = %name, "{message}");
        }
        TaintDecision::BreakerOpen { message: why } => {
            let reason_now = fabric_reason(node);
            if reason_now.as_deref() != Some(breaker::BREAKER_OPEN) {
                let text = format!("{why}; would taint for {AGENT_NOT_RUNNING}: {message}");
                let set = set_condition(nodes, name, breaker::BREAKER_OPEN, &text).await;
                wrote.push(record(
                    m,
                    WriteKind::Condition,
                    "set FabricReady on",
                    name,
                    set,
                )?);
                tracing::error!(node = %name, "BLAST-RADIUS BREAKER OPEN (guard): {why}");
            }
        }
    }
    Ok(())
}

fn fabric_reason(node: &Node) -> Option<String> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "FabricReady")?
        .reason
        .clone()
}

/// Add our taint, guarded by the resourceVersion it was computed from (a conflict is retried
/// on the next sweep).
async fn taint(
    nodes: &Api<Node>,
    node: &Node,
    s: &GuardSettings,
) -> std::result::Result<Node, kube::Error> {
    let taints = with_our_taint(node, s);
    crate::node::patch_taints(nodes, node, &taints, GUARD_FIELD_MANAGER).await
}

/// `node`'s taints with the guard's added last.
pub(super) fn with_our_taint(
    node: &Node,
    s: &GuardSettings,
) -> Vec<k8s_openapi::api::core::v1::Taint> {
    let mut taints = node
        .spec
        .as_ref()
        .and_then(|sp| sp.taints.clone())
        .unwrap_or_default();
    taints.push(k8s_openapi::api::core::v1::Taint {
        key: s.config.node.taint_key(),
        effect: s.config.node.taint_effect.as_str().to_owned(),
        ..Default::default()
    });
    taints
}

async fn set_condition(
    nodes: &Api<Node>,
    name: &str,
    reason: &str,
    message: &str,
) -> std::result::Result<Node, kube::Error> {
    let now = Timestamp::now();
    let body = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": { "name": name },
        "status": { "conditions": [{
            "type": "FabricReady", "status": "False", "reason": reason, "message": message,
            "lastTransitionTime": now.to_string(), "lastHeartbeatTime": now.to_string(),
        }]},
    });
    nodes
        .patch_status(
            name,
            &PatchParams::apply(GUARD_FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
}
