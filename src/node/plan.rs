//! What must change on the Node for it to show a verdict: pure, no I/O, no clock.

use super::FIELD_MANAGER;
use crate::policy::{self, Verdict};
use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use std::collections::{BTreeMap, BTreeSet};

/// What must change on the Node; `None` fields are already right.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// The full set of labels fabricgate applies (SSA removes owned labels not in it).
    pub labels: Option<BTreeMap<String, String>>,
    /// The whole new `spec.taints` list.
    pub taints: Option<Vec<Taint>>,
    /// Our conditions, as applied.
    pub conditions: Option<Vec<NodeCondition>>,
    /// `FabricReady` changes status: an Event is due.
    pub transition: Option<Transition>,
}

/// A change of `FabricReady`, reported as an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    pub ready: bool,
    pub reason: String,
    pub message: String,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.labels.is_none() && self.taints.is_none() && self.conditions.is_none()
    }

    /// One human line per write, for `--dry-run` and logs.
    pub fn describe(&self, node: &Node, taint_key: &str) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(want) = &self.labels {
            let have = node.metadata.labels.clone().unwrap_or_default();
            let mut diffs = Vec::new();
            for (k, v) in want {
                match have.get(k) {
                    Some(old) if old == v => {}
                    Some(old) => diffs.push(format!("{k}: {old} -> {v}")),
                    None => diffs.push(format!("{k}: (none) -> {v}")),
                }
            }
            for k in owned_labels(node) {
                if !want.contains_key(&k) {
                    diffs.push(format!("{k}: removed"));
                }
            }
            out.push(format!("labels: {}", diffs.join(", ")));
        }
        if let Some(taints) = &self.taints {
            out.push(match taints.iter().find(|t| t.key == taint_key) {
                Some(t) => format!("taint: add {}:{}", t.key, t.effect),
                None => format!("taint: remove {taint_key}"),
            });
        }
        if let Some(conds) = &self.conditions {
            for c in conds {
                out.push(format!(
                    "condition {}={} reason={} message={:?}",
                    c.type_,
                    c.status,
                    c.reason.as_deref().unwrap_or(""),
                    c.message.as_deref().unwrap_or("")
                ));
            }
        }
        if let Some(t) = &self.transition {
            out.push(format!(
                "event: {} ({})",
                if t.ready {
                    "FabricReady"
                } else {
                    "FabricNotReady"
                },
                t.reason
            ));
        }
        out
    }
}

/// Labels fabricgate owns on the Node according to its managed fields (server-side apply).
pub fn owned_labels(node: &Node) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for entry in node.metadata.managed_fields.iter().flatten() {
        if entry.manager.as_deref() != Some(FIELD_MANAGER)
            || entry.operation.as_deref() != Some("Apply")
            || entry.subresource.as_deref().is_some_and(|s| !s.is_empty())
        {
            continue;
        }
        let labels = entry
            .fields_v1
            .as_ref()
            .and_then(|f| f.0.get("f:metadata"))
            .and_then(|m| m.get("f:labels"))
            .and_then(|l| l.as_object());
        for key in labels.into_iter().flat_map(|l| l.keys()) {
            if let Some(k) = key.strip_prefix("f:") {
                out.insert(k.to_owned());
            }
        }
    }
    out
}

/// The writes that make `node` show `verdict`. Pure: `now` stamps changed conditions.
pub fn plan(node: &Node, verdict: &Verdict, taint_key: &str, now: &Timestamp) -> Plan {
    let mut plan = Plan::default();

    let have = node.metadata.labels.clone().unwrap_or_default();
    let labels_differ = verdict.labels.iter().any(|(k, v)| have.get(k) != Some(v))
        || owned_labels(node)
            .iter()
            .any(|k| !verdict.labels.contains_key(k));
    if labels_differ {
        plan.labels = Some(verdict.labels.clone());
    }

    plan.taints = plan_taints(node, verdict, taint_key, now);

    let observed: Vec<NodeCondition> = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let find = |t: &str| observed.iter().find(|c| c.type_ == t);
    let conditions_differ = verdict.conditions.iter().any(|want| {
        find(&want.type_).is_none_or(|have| {
            have.status != want.status
                || have.reason.as_deref() != Some(want.reason.as_str())
                || have.message.as_deref() != Some(want.message.as_str())
        })
    });
    if conditions_differ {
        plan.conditions = Some(
            verdict
                .conditions
                .iter()
                .map(|want| {
                    let since = find(&want.type_)
                        .filter(|have| have.status == want.status)
                        .and_then(|have| have.last_transition_time.clone())
                        .unwrap_or(Time(*now));
                    NodeCondition {
                        type_: want.type_.clone(),
                        status: want.status.clone(),
                        reason: Some(want.reason.clone()),
                        message: Some(want.message.clone()),
                        last_transition_time: Some(since),
                        // Stamped only when we write, so it never causes a write by itself.
                        last_heartbeat_time: Some(Time(*now)),
                    }
                })
                .collect(),
        );
    }

    if let Some(fabric) = verdict.conditions.iter().find(|c| c.type_ == "FabricReady") {
        let before = find("FabricReady").map(|c| c.status.as_str());
        let first_wait = before.is_none() && fabric.reason == policy::AWAITING_VALIDATION;
        // Entering an agent error is worth one Event even when FabricReady was already False.
        let agent_error = fabric.reason == crate::policy::agent_fault::REASON
            && find("FabricReady").and_then(|c| c.reason.as_deref())
                != Some(crate::policy::agent_fault::REASON);
        if (before != Some(fabric.status.as_str()) || agent_error) && !first_wait {
            plan.transition = Some(Transition {
                ready: fabric.status == "True",
                reason: fabric.reason.clone(),
                message: fabric.message.clone(),
            });
        }
    }
    plan
}

/// The new taint list, or `None` when ours is already right. Taints of other owners keep their
/// place; ours replaces our first one in place or goes last.
pub(super) fn plan_taints(
    node: &Node,
    verdict: &Verdict,
    taint_key: &str,
    now: &Timestamp,
) -> Option<Vec<Taint>> {
    let current: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    if verdict.keep_taint {
        // An agent error under `node.on_agent_error: keep`: our taint stays as it is.
        return None;
    }
    let want = verdict.taints.iter().find(|t| t.key == taint_key);
    let ours: Vec<&Taint> = current.iter().filter(|t| t.key == taint_key).collect();
    let already = match (want, ours.as_slice()) {
        (None, []) => true,
        (Some(w), [have]) => {
            have.effect == w.effect
                && have.value.as_deref().unwrap_or("") == w.value.as_deref().unwrap_or("")
        }
        _ => false,
    };
    if already {
        return None;
    }
    let ours_new = want.map(|w| Taint {
        key: w.key.clone(),
        value: w.value.clone(),
        effect: w.effect.clone(),
        // kubectl stamps NoExecute taints; tolerationSeconds count from it.
        time_added: (w.effect == "NoExecute").then_some(Time(*now)),
    });
    let mut out = Vec::with_capacity(current.len() + 1);
    let mut placed = false;
    for t in current {
        if t.key != taint_key {
            out.push(t);
        } else if !placed {
            placed = true;
            out.extend(ours_new.clone());
        }
    }
    if !placed {
        out.extend(ours_new);
    }
    Some(out)
}

/// Whether `verdict` adds our taint to a Node that does not carry it (the only write the
/// breaker may hold back).
pub(super) fn wants_new_taint(node: &Node, verdict: &Verdict, taint_key: &str) -> bool {
    let has = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == taint_key));
    !has && verdict.taints.iter().any(|t| t.key == taint_key)
}
