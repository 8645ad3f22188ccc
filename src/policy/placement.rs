//! `placement.required_labels`: labels a topology-aware scheduler needs on the Node.

use super::*;

/// Fold `placement.required_labels` into a verdict, given the Node's current labels: a missing
/// key makes the node not ready (with the taint and a `FabricReady=False` reason naming it).
/// The agent calls this with the labels of its Node on every reconcile; `check`, which reads no
/// Node, does not.
pub fn apply_placement(
    verdict: &Verdict,
    node_labels: &BTreeMap<String, String>,
    required_labels: &[String],
    node: &crate::config::NodeSettings,
) -> Verdict {
    let missing: Vec<&str> = required_labels
        .iter()
        .filter(|k| !node_labels.contains_key(k.as_str()))
        .map(String::as_str)
        .collect();
    if missing.is_empty() {
        return verdict.clone();
    }
    let mut v = verdict.clone();
    v.placement = PartVerdict {
        ready: false,
        findings: vec![Finding {
            scope: Scope::Placement,
            code: "PlacementLabelsMissing",
            message: format!(
                "the Node lacks placement label{} {} (placement.required_labels): topology-aware \
                 schedulers (Kueue TAS) cannot place pods on it; label the Node",
                if missing.len() == 1 { "" } else { "s" },
                missing.join(", ")
            ),
        }],
        warnings: Vec::new(),
    };
    v.ready = false;
    v.labels
        .insert(format!("{}ready", node.label_prefix), "false".into());
    v.taints = vec![Taint {
        key: node.taint_key(),
        value: None,
        effect: node.taint_effect.as_str().to_owned(),
    }];
    let parts: Vec<&PartVerdict> = v.parts().collect();
    let fabric = condition("FabricReady", false, "FabricValidated", &parts);
    for c in v.conditions.iter_mut().filter(|c| c.type_ == "FabricReady") {
        *c = fabric.clone();
    }
    v
}
