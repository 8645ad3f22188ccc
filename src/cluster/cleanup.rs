//! `fabricgate cleanup`: removes every mark fabricgate leaves in the cluster once its agents
//! and guard are gone (the chart runs it on `helm uninstall`): on each Node the labels and
//! annotations under the label prefix, the taint and the conditions fabricgate owns; and the
//! agents' DeviceTaintRules (label [`NODE_LABEL`]). Anything else is left exactly as it is,
//! and a Node with nothing of ours is not written at all.

use crate::dra::rules::{NODE_LABEL, node_label_value};
use crate::error::{Error, Result};
use crate::node::{CONDITION_TYPES, FIELD_MANAGER};
use json_patch::jsonptr::PointerBuf;
use json_patch::{Patch as JsonPatch, PatchOperation, RemoveOperation, TestOperation};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::DeviceTaintRule;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::json;
use std::time::{Duration, Instant};

/// What was removed from one Node.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct NodeCleaned {
    pub node: String,
    pub labels: Vec<String>,
    pub annotations: Vec<String>,
    pub taints: Vec<String>,
    pub conditions: Vec<String>,
}

impl NodeCleaned {
    fn is_empty(&self) -> bool {
        self.labels.is_empty()
            && self.annotations.is_empty()
            && self.taints.is_empty()
            && self.conditions.is_empty()
    }
}

/// Everything removed.
#[derive(Debug, Default)]
pub struct Cleaned {
    /// The Nodes that had something of ours (and what).
    pub nodes: Vec<NodeCleaned>,
    /// Names of the DeviceTaintRules deleted.
    pub rules: Vec<String>,
    /// Nodes looked at.
    pub nodes_seen: usize,
}

/// Wait until no pod of `namespace` matches any of `selectors` (the agents and the guard would
/// write their marks again), for at most `timeout`.
///
/// # Errors
/// [`Error::KubeObject`] when the pods cannot be listed; [`Error::Internal`] naming the pods
/// still there after `timeout`.
pub async fn wait_pods_gone(
    client: &kube::Client,
    namespace: &str,
    selectors: &[String],
    timeout: Duration,
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let start = Instant::now();
    loop {
        let mut left = Vec::new();
        for selector in selectors {
            let list = pods
                .list(&ListParams::default().labels(selector))
                .await
                .map_err(|e| Error::KubeObject {
                    action: "list",
                    object: format!("pods {namespace}/{selector}"),
                    source: Box::new(e),
                })?;
            left.extend(list.items.into_iter().filter_map(|p| p.metadata.name));
        }
        if left.is_empty() {
            return Ok(());
        }
        if start.elapsed() >= timeout {
            return Err(Error::Internal {
                message: format!(
                    "pods still running after {timeout:?} (they would mark the Nodes again): {}",
                    left.join(", ")
                ),
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Remove fabricgate's marks from `only` (empty: every Node) and delete the agents'
/// DeviceTaintRules of those Nodes (none where the cluster does not serve
/// `resource.k8s.io/v1`).
///
/// # Errors
/// [`Error::Kube`]/[`Error::KubeObject`] when a read or write is refused (a write that
/// conflicts with another writer is retried on a fresh read).
pub async fn cleanup(client: &kube::Client, prefix: &str, only: &[String]) -> Result<Cleaned> {
    let nodes: Api<Node> = Api::all(client.clone());
    let names: Vec<String> = if only.is_empty() {
        nodes
            .list(&ListParams::default())
            .await
            .map_err(|e| Error::KubeObject {
                action: "list",
                object: "Nodes".into(),
                source: Box::new(e),
            })?
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect()
    } else {
        only.to_vec()
    };
    let mut cleaned = Cleaned {
        nodes_seen: names.len(),
        ..Cleaned::default()
    };
    for name in &names {
        let done = clean_node(&nodes, name, prefix).await?;
        if !done.is_empty() {
            cleaned.nodes.push(done);
        }
    }
    let rules: Api<DeviceTaintRule> = Api::all(client.clone());
    // Every agent's rules, or those of the Nodes named.
    let selectors: Vec<String> = if only.is_empty() {
        vec![NODE_LABEL.to_owned()]
    } else {
        only.iter()
            .map(|n| format!("{NODE_LABEL}={}", node_label_value(n)))
            .collect()
    };
    for selector in selectors {
        let list = match rules.list(&ListParams::default().labels(&selector)).await {
            Ok(list) => list,
            // DRA's v1 API not served: there is no rule to remove.
            Err(e) if is_not_found(&e) => break,
            Err(e) => {
                return Err(Error::KubeObject {
                    action: "list",
                    object: "DeviceTaintRules".into(),
                    source: Box::new(e),
                });
            }
        };
        for rule in list.items {
            let name = rule.metadata.name.unwrap_or_default();
            match rules.delete(&name, &DeleteParams::default()).await {
                Ok(_) => cleaned.rules.push(name),
                Err(e) if is_not_found(&e) => {}
                Err(e) => {
                    return Err(Error::KubeObject {
                        action: "delete",
                        object: format!("DeviceTaintRule {name}"),
                        source: Box::new(e),
                    });
                }
            }
        }
    }
    Ok(cleaned)
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 || s.code == 422)
}

const ATTEMPTS: u32 = 5;

/// One Node: its metadata and taints in one JSON patch, then its conditions in another on the
/// status subresource, each guarded by `test` operations so that a concurrent write makes it
/// fail (and be retried on a fresh read) instead of removing the wrong entry.
async fn clean_node(nodes: &Api<Node>, name: &str, prefix: &str) -> Result<NodeCleaned> {
    let kube_err = |action, e| Error::Kube {
        action,
        node: name.to_owned(),
        source: Box::new(e),
    };
    let taint_key = format!("{prefix}unvalidated");
    let pp = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let mut done = NodeCleaned {
        node: name.to_owned(),
        ..NodeCleaned::default()
    };
    for attempt in 1..=ATTEMPTS {
        let node = match nodes.get(name).await {
            Ok(n) => n,
            Err(e) if is_not_found(&e) => return Ok(done),
            Err(e) => return Err(kube_err("read", e)),
        };
        let meta = &node.metadata;
        let owned = |m: &Option<std::collections::BTreeMap<String, String>>| -> Vec<String> {
            m.iter()
                .flatten()
                .map(|(k, _)| k.clone())
                .filter(|k| k.starts_with(prefix))
                .collect()
        };
        let labels = owned(&meta.labels);
        let annotations = owned(&meta.annotations);
        let taints = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default();
        let kept: Vec<_> = taints
            .iter()
            .filter(|t| t.key != taint_key)
            .cloned()
            .collect();
        if labels.is_empty() && annotations.is_empty() && kept.len() == taints.len() {
            break;
        }
        let mut ops = vec![PatchOperation::Test(TestOperation {
            path: PointerBuf::from_tokens(["metadata", "resourceVersion"]),
            value: json!(meta.resource_version.clone().unwrap_or_default()),
        })];
        for key in &labels {
            ops.push(remove(&["metadata", "labels", key]));
        }
        for key in &annotations {
            ops.push(remove(&["metadata", "annotations", key]));
        }
        if kept.len() != taints.len() {
            ops.push(PatchOperation::Replace(json_patch::ReplaceOperation {
                path: PointerBuf::from_tokens(["spec", "taints"]),
                value: json!(kept),
            }));
        }
        match nodes
            .patch(name, &pp, &Patch::Json::<()>(JsonPatch(ops)))
            .await
        {
            Ok(_) => {
                done.labels = labels;
                done.annotations = annotations;
                if kept.len() != taints.len() {
                    done.taints.push(taint_key.clone());
                }
                break;
            }
            Err(e) if is_not_found(&e) => return Ok(done),
            Err(e) if is_conflict(&e) && attempt < ATTEMPTS => {}
            Err(e) => return Err(kube_err("patch", e)),
        }
    }
    for attempt in 1..=ATTEMPTS {
        let node = match nodes.get_status(name).await {
            Ok(n) => n,
            Err(e) if is_not_found(&e) => return Ok(done),
            Err(e) => return Err(kube_err("read", e)),
        };
        let conditions = node.status.and_then(|s| s.conditions).unwrap_or_default();
        // Highest index first, so that each removal leaves the earlier indexes in place.
        let ours: Vec<(usize, String)> = conditions
            .iter()
            .enumerate()
            .filter(|(_, c)| CONDITION_TYPES.contains(&c.type_.as_str()))
            .map(|(i, c)| (i, c.type_.clone()))
            .rev()
            .collect();
        if ours.is_empty() {
            break;
        }
        let mut ops = Vec::new();
        for (i, kind) in &ours {
            let index = i.to_string();
            ops.push(PatchOperation::Test(TestOperation {
                path: PointerBuf::from_tokens(["status", "conditions", index.as_str(), "type"]),
                value: json!(kind),
            }));
            ops.push(remove(&["status", "conditions", index.as_str()]));
        }
        match nodes
            .patch_status(name, &pp, &Patch::Json::<()>(JsonPatch(ops)))
            .await
        {
            Ok(_) => {
                done.conditions = ours.into_iter().rev().map(|(_, k)| k).collect();
                break;
            }
            Err(e) if is_not_found(&e) => return Ok(done),
            Err(e) if is_conflict(&e) && attempt < ATTEMPTS => {}
            Err(e) => return Err(kube_err("patch the status of", e)),
        }
    }
    Ok(done)
}

fn remove(tokens: &[&str]) -> PatchOperation {
    PatchOperation::Remove(RemoveOperation {
        path: PointerBuf::from_tokens(tokens.iter().copied()),
    })
}
