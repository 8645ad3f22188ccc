//! `fabricgate guard`: the cluster-level half of failing closed. A dead or wedged agent
//! leaves its Node with its last verdict (the gate fails open); the guard, a Deployment of two
//! replicas of which only the holder of a `coordination.k8s.io` Lease acts, taints a pool Node
//! whose agent pod is missing or not Ready for `--stale-after`, with `FabricReady=False`
//! reason `AgentNotRunning`. It never untaints (the agent decides again when it is back), it
//! reads only what the kubelet already reports (pod readiness), writes only when it taints,
//! and it is subject to the same blast-radius breaker as the agent.

use crate::config::Config;
use crate::error::{Error, Result};
use crate::failclosed::{self, TaintDecision};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

/// Reason of `FabricReady` the guard sets.
pub const AGENT_NOT_RUNNING: &str = "AgentNotRunning";
/// Field manager of the guard's condition writes (the agent takes the condition back).
pub const GUARD_FIELD_MANAGER: &str = "fabricgate-guard";

/// Everything `fabricgate guard` needs.
pub struct GuardSettings {
    pub config: Config,
    pub namespace: String,
    pub pod_selector: String,
    pub stale_after: Duration,
    pub poll_interval: Duration,
    pub lease_name: String,
    pub lease_duration: Duration,
    pub identity: String,
}

/// Run the guard until `shutdown` completes.
///
/// # Errors
/// [`Error::Usage`] when `node.pool_selector` is empty (the guard must know the pool).
pub async fn run(
    client: kube::Client,
    s: GuardSettings,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    if s.config.node.pool_selector.is_empty() {
        return Err(Error::Usage {
            flag: "--config".into(),
            message: "node.pool_selector is empty: set it to the agent DaemonSet's nodeSelector \
                      (e.g. \"nvidia.com/gpu.present=true\")"
                .into(),
        });
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), &s.namespace);
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client, &s.namespace);
    let mut unhealthy_since: HashMap<String, Instant> = HashMap::new();
    let mut leading = false;
    tokio::pin!(shutdown);
    tracing::info!(identity = %s.identity, lease = %s.lease_name, "fabricgate guard started");
    loop {
        let lead = match try_lead(&leases, &s).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "lease: cannot read or renew; not acting");
                false
            }
        };
        if lead != leading {
            tracing::info!(identity = %s.identity, leader = lead, "leadership changed");
            unhealthy_since.clear();
            leading = lead;
        }
        if leading && let Err(e) = sweep(&nodes, &pods, &s, &mut unhealthy_since).await {
            tracing::warn!(error = %e, "guard sweep failed; retrying");
        }
        tokio::select! {
            () = &mut shutdown => break,
            () = tokio::time::sleep(s.poll_interval) => {}
        }
    }
    if leading {
        // Hand over at once: an expired lease lets the other replica take it.
        let _ = release(&leases, &s).await;
    }
    tracing::info!("fabricgate guard stopped");
    Ok(())
}

fn kube_err(action: &'static str, what: &str, source: kube::Error) -> Error {
    Error::Kube {
        action,
        node: what.to_owned(),
        source: Box::new(source),
    }
}

/// Acquire or renew the Lease; `true` while this replica holds it. Optimistic concurrency
/// (`resourceVersion`) decides between replicas racing for an expired Lease.
async fn try_lead(leases: &Api<Lease>, s: &GuardSettings) -> Result<bool> {
    let now = Timestamp::now();
    let secs = i32::try_from(s.lease_duration.as_secs())
        .unwrap_or(i32::MAX)
        .max(1);
    let current = leases
        .get_opt(&s.lease_name)
        .await
        .map_err(|e| kube_err("read", &s.lease_name, e))?;
    let Some(mut lease) = current else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(s.lease_name.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(s.identity.clone()),
                lease_duration_seconds: Some(secs),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        };
        return match leases.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(kube_err("create", &s.lease_name, e)),
        };
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let mine = spec.holder_identity.as_deref() == Some(s.identity.as_str());
    let duration = Duration::from_secs(
        u64::try_from(spec.lease_duration_seconds.unwrap_or(secs)).unwrap_or(0),
    );
    let expired = spec.renew_time.as_ref().is_none_or(|t| {
        now.duration_since(t.0)
            .try_into()
            .is_ok_and(|age: Duration| age > duration)
    }) || spec.holder_identity.as_deref().is_none_or(str::is_empty);
    if !mine && !expired {
        return Ok(false);
    }
    let mut new_spec = spec.clone();
    new_spec.holder_identity = Some(s.identity.clone());
    new_spec.lease_duration_seconds = Some(secs);
    new_spec.renew_time = Some(MicroTime(now));
    if !mine {
        new_spec.acquire_time = Some(MicroTime(now));
        new_spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    lease.spec = Some(new_spec);
    match leases
        .replace(&s.lease_name, &PostParams::default(), &lease)
        .await
    {
        Ok(_) => {
            if !mine {
                tracing::info!(identity = %s.identity, "acquired the lease");
            }
            Ok(true)
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(kube_err("renew", &s.lease_name, e)),
    }
}

async fn release(leases: &Api<Lease>, s: &GuardSettings) -> Result<()> {
    let patch = json!({ "spec": { "holderIdentity": null, "renewTime": null } });
    leases
        .patch(
            &s.lease_name,
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|e| kube_err("release", &s.lease_name, e))?;
    Ok(())
}

/// Why a Node's agent counts as not running, or `None` when its pod is Ready.
pub fn agent_problem(node: &str, pods: &[Pod]) -> Option<String> {
    let on_node: Vec<&Pod> = pods
        .iter()
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

async fn sweep(
    nodes: &Api<Node>,
    pods: &Api<Pod>,
    s: &GuardSettings,
    since: &mut HashMap<String, Instant>,
) -> Result<()> {
    // Both lists are served from the API server's watch cache (resourceVersion=0).
    let pool = nodes
        .list(
            &ListParams::default()
                .labels(&s.config.node.pool_selector)
                .match_any(),
        )
        .await
        .map_err(|e| kube_err("list", "the pool's Nodes", e))?
        .items;
    let agents = pods
        .list(&ListParams::default().labels(&s.pod_selector).match_any())
        .await
        .map_err(|e| kube_err("list", "the agent pods", e))?
        .items;
    let key = s.config.node.taint_key();
    let now = Instant::now();
    since.retain(|n, _| pool.iter().any(|p| p.metadata.name.as_deref() == Some(n)));
    for node in &pool {
        let Some(name) = node.metadata.name.clone() else {
            continue;
        };
        let Some(problem) = agent_problem(&name, &agents) else {
            since.remove(&name);
            continue;
        };
        let first = *since.entry(name.clone()).or_insert(now);
        if now.duration_since(first) < s.stale_after {
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
        let annotation = format!("{}breaker-override", s.config.node.label_prefix);
        let overridden = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&annotation))
            .is_some_and(|v| v == "true");
        let counted = failclosed::count_pool(
            &pool,
            &name,
            &key,
            s.config.node.breaker.window,
            &Timestamp::now(),
        );
        let message = format!(
            "{problem} for over {}; tainted by fabricgate guard until the agent validates \
             the node again",
            humantime::format_duration(s.stale_after)
        );
        match failclosed::taint_decision(
            &s.config.node.breaker,
            Some(&counted),
            overridden,
            &annotation,
        ) {
            TaintDecision::Taint => {
                taint(nodes, node, &key, s).await?;
                set_condition(nodes, &name, AGENT_NOT_RUNNING, &message).await?;
                tracing::warn!(node = %name, "{message}");
            }
            TaintDecision::BreakerOpen { message: why } => {
                let reason_now = fabric_reason(node);
                if reason_now.as_deref() != Some(failclosed::BREAKER_OPEN) {
                    let text = format!("{why}; would taint for {AGENT_NOT_RUNNING}: {message}");
                    set_condition(nodes, &name, failclosed::BREAKER_OPEN, &text).await?;
                    tracing::error!(node = %name, "BLAST-RADIUS BREAKER OPEN (guard): {why}");
                }
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
async fn taint(nodes: &Api<Node>, node: &Node, key: &str, s: &GuardSettings) -> Result<()> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let mut taints = node
        .spec
        .as_ref()
        .and_then(|sp| sp.taints.clone())
        .unwrap_or_default();
    taints.push(k8s_openapi::api::core::v1::Taint {
        key: key.to_owned(),
        effect: s.config.node.taint_effect.as_str().to_owned(),
        ..Default::default()
    });
    let rv = node.metadata.resource_version.clone().unwrap_or_default();
    let patch: json_patch::Patch = serde_json::from_value(json!([
        { "op": "test", "path": "/metadata/resourceVersion", "value": rv },
        { "op": "add", "path": "/spec/taints", "value": taints },
    ]))
    .map_err(|e| Error::Internal {
        message: format!("building the taint patch: {e}"),
    })?;
    let pp = PatchParams {
        field_manager: Some(GUARD_FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    nodes
        .patch(&name, &pp, &Patch::Json::<()>(patch))
        .await
        .map_err(|e| kube_err("taint", &name, e))?;
    Ok(())
}

async fn set_condition(nodes: &Api<Node>, name: &str, reason: &str, message: &str) -> Result<()> {
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
        .map_err(|e| kube_err("set FabricReady on", name, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};

    fn pod(node: &str, ready: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(format!("agent-{node}")),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                ..PodSpec::default()
            }),
            status: Some(PodStatus {
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..PodCondition::default()
                }]),
                ..PodStatus::default()
            }),
        }
    }

    #[test]
    fn missing_or_not_ready_agent_pods_are_problems() {
        let pods = vec![pod("a", true), pod("b", false)];
        assert_eq!(agent_problem("a", &pods), None);
        assert!(agent_problem("b", &pods).unwrap().contains("not Ready"));
        assert!(
            agent_problem("c", &pods)
                .unwrap()
                .contains("no fabricgate agent pod")
        );
    }
}
