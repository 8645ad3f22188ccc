//! The objects the admission check reads and writes, as small serde views: Kueue's
//! `Workload` (v1beta2: the admission checks' states, the quota reservation, the topology
//! assignment). Only the fields used are modelled; everything else is ignored on read. The
//! gang pre-flight's own resources are in `crate::gang::fabriccheck`, shared with the agents.

use kube::api::ApiResource;
use kube::core::GroupVersionKind;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The label a node's hostname is under, the lowest level of a TAS topology.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// The pod condition the agents write.
pub const TRANSPORT_CONDITION: &str = "fabricgate.io/TransportReady";
/// Kueue's annotation on the pods of an admitted Workload (with TAS): the Workload's name.
pub const WORKLOAD_ANNOTATION: &str = "kueue.x-k8s.io/workload";
/// Kueue's label on the pods of an admitted Workload: its pod set (what the pod watch
/// selects on, so only Kueue's pods are cached).
pub const PODSET_LABEL: &str = "kueue.x-k8s.io/podset";

pub fn workloads() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "Workload"),
        "workloads",
    )
}

pub fn admission_checks() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "AdmissionCheck"),
        "admissionchecks",
    )
}

pub fn resource_flavors() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "ResourceFlavor"),
        "resourceflavors",
    )
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    pub last_transition_time: String,
}

/// `Workload.status`, the parts the check reads.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadStatus {
    pub conditions: Vec<Condition>,
    pub admission: Option<Admission>,
    pub admission_checks: Vec<CheckState>,
}

impl WorkloadStatus {
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }

    /// When the current quota reservation was made (its condition's transition time), or
    /// `None` without one. A new reservation (after a `Retry`, say) is a new check. A
    /// Workload being evicted (`Evicted=True`: Kueue reset its checks to `Pending` and is
    /// about to release the quota) has none: judging it then would write a state over the
    /// reset, and Kueue never reserves again for a Workload left with a `Retry` check (seen
    /// with Kueue v0.19.2; `Evicted` turns `False` at the next reservation).
    pub fn reservation(&self) -> Option<&str> {
        if self
            .condition("Evicted")
            .is_some_and(|c| c.status == "True")
        {
            return None;
        }
        self.condition("QuotaReserved")
            .filter(|c| c.status == "True")
            .map(|c| c.last_transition_time.as_str())
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CheckState {
    pub name: String,
    pub state: String,
    pub message: String,
    /// How many times Kueue moved this check to `Retry` before (it counts them itself).
    pub retry_count: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Admission {
    pub cluster_queue: String,
    pub pod_set_assignments: Vec<PodSetAssignment>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PodSetAssignment {
    pub name: String,
    pub flavors: BTreeMap<String, String>,
    pub count: Option<i64>,
    pub topology_assignment: Option<TopologyAssignment>,
}

/// v0.19's compact topology assignment: per slice, `domainCount` domains, each level's value
/// either one for all (`universal`) or one per domain (`prefix` + root + `suffix`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TopologyAssignment {
    pub levels: Vec<String>,
    pub slices: Vec<TopologySlice>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct TopologySlice {
    pub domain_count: usize,
    pub values_per_level: Vec<LevelValues>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LevelValues {
    pub universal: Option<String>,
    pub individual: Option<IndividualValues>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IndividualValues {
    pub prefix: Option<String>,
    pub suffix: Option<String>,
    pub roots: Vec<String>,
}

/// Largest number of domains expanded from one assignment (Kueue allows 100000 roots per
/// slice; a gang is far smaller, and `gang.max_nodes` applies after).
pub const MAX_DOMAINS: usize = 100_000;

impl TopologyAssignment {
    /// Each assigned domain as its labels (level -> value), in the assignment's order.
    ///
    /// # Errors
    /// A message naming what is malformed (a level count that does not match, a domain
    /// without a value).
    pub fn domains(&self) -> Result<Vec<BTreeMap<String, String>>, String> {
        let mut out = Vec::new();
        for (s, slice) in self.slices.iter().enumerate() {
            if slice.values_per_level.len() != self.levels.len() {
                return Err(format!(
                    "slice {s} has {} level values for {} levels",
                    slice.values_per_level.len(),
                    self.levels.len()
                ));
            }
            if out.len() + slice.domain_count > MAX_DOMAINS {
                return Err(format!("more than {MAX_DOMAINS} domains"));
            }
            for d in 0..slice.domain_count {
                let mut domain = BTreeMap::new();
                for (level, values) in self.levels.iter().zip(&slice.values_per_level) {
                    let value = match (&values.universal, &values.individual) {
                        (Some(u), _) => u.clone(),
                        (None, Some(i)) => {
                            let root = i.roots.get(d).ok_or_else(|| {
                                format!(
                                    "slice {s}: level {level} has {} values for {} domains",
                                    i.roots.len(),
                                    slice.domain_count
                                )
                            })?;
                            format!(
                                "{}{root}{}",
                                i.prefix.as_deref().unwrap_or(""),
                                i.suffix.as_deref().unwrap_or("")
                            )
                        }
                        (None, None) => {
                            return Err(format!("slice {s}: level {level} has no value"));
                        }
                    };
                    domain.insert(level.clone(), value);
                }
                out.push(domain);
            }
        }
        Ok(out)
    }
}

/// The FabricCheck's name for a Workload: `<namespace>.<name>.<first 8 of uid>`, within the
/// 253 characters of a name.
pub fn fabric_check_name(namespace: &str, name: &str, uid: &str) -> String {
    let short: String = uid.chars().take(8).collect();
    let suffix = format!(".{short}");
    let mut head = format!("{namespace}.{name}");
    let room = 253 - suffix.len();
    if head.len() > room {
        head.truncate(room);
        // A name may not end in a dot or dash before the suffix's dot.
        while head.ends_with(['.', '-']) {
            head.pop();
        }
    }
    format!("{head}{suffix}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn topology_domains_expand_universal_and_individual_values() {
        // Kueue's Example 3/4 shapes: hostname-only levels with prefixes, and a leaf level
        // that is universal within a slice.
        let t: TopologyAssignment = serde_json::from_value(json!({
            "levels": ["network.topology.nvidia.com/leaf", HOSTNAME_LABEL],
            "slices": [
                { "domainCount": 2, "valuesPerLevel": [
                    { "universal": "leaf-a" },
                    { "individual": { "prefix": "gpu-a-", "roots": ["1", "2"] } }],
                  "podCounts": { "universal": 1 } },
                { "domainCount": 1, "valuesPerLevel": [
                    { "universal": "leaf-b" },
                    { "individual": { "roots": ["gpu-b"], "suffix": "-x" } }],
                  "podCounts": { "individual": [2] } },
            ],
        }))
        .unwrap();
        let d = t.domains().unwrap();
        let hosts: Vec<&str> = d.iter().map(|m| m[HOSTNAME_LABEL].as_str()).collect();
        assert_eq!(hosts, ["gpu-a-1", "gpu-a-2", "gpu-b-x"]);
        assert_eq!(d[2]["network.topology.nvidia.com/leaf"], "leaf-b");

        let short: TopologyAssignment = serde_json::from_value(json!({
            "levels": [HOSTNAME_LABEL],
            "slices": [{ "domainCount": 3, "valuesPerLevel": [
                { "individual": { "roots": ["a", "b"] } }] }],
        }))
        .unwrap();
        assert!(
            short
                .domains()
                .unwrap_err()
                .contains("2 values for 3 domains")
        );
        let mismatch: TopologyAssignment = serde_json::from_value(json!({
            "levels": ["x", HOSTNAME_LABEL],
            "slices": [{ "domainCount": 1, "valuesPerLevel": [{ "universal": "a" }] }],
        }))
        .unwrap();
        assert!(
            mismatch
                .domains()
                .unwrap_err()
                .contains("1 level values for 2")
        );
    }

    #[test]
    fn names_are_bounded_and_keep_the_uid() {
        assert_eq!(
            fabric_check_name("team-a", "job-train", "0123456789abcdef"),
            "team-a.job-train.01234567"
        );
        let long = "x".repeat(300);
        let n = fabric_check_name("ns", &long, "abcdefgh-1234");
        assert_eq!(n.len(), 253);
        assert!(n.ends_with(".abcdefgh"));
    }

    #[test]
    fn workload_status_reads_kueues_fields() {
        let s: WorkloadStatus = serde_json::from_value(json!({
            "conditions": [{ "type": "QuotaReserved", "status": "True",
                             "lastTransitionTime": "2026-12-02T03:00:00Z", "reason": "QuotaReserved",
                             "message": "" }],
            "admission": { "clusterQueue": "cq", "podSetAssignments": [{
                "name": "main", "flavors": { "nvidia.com/gpu": "gpu" }, "count": 3 }] },
            "admissionChecks": [{ "name": "fabric", "state": "Pending", "message": "",
                                  "lastTransitionTime": "2026-12-02T03:00:00Z" }],
        }))
        .unwrap();
        assert_eq!(s.reservation(), Some("2026-12-02T03:00:00Z"));
        assert_eq!(s.admission_checks[0].state, "Pending");
        // Being evicted (checks reset, quota not yet released): not a reservation to judge.
        let mut evicted = s.clone();
        evicted.conditions.push(Condition {
            type_: "Evicted".into(),
            status: "True".into(),
            ..Default::default()
        });
        assert_eq!(evicted.reservation(), None);
        assert_eq!(
            s.admission.unwrap().pod_set_assignments[0].flavors["nvidia.com/gpu"],
            "gpu"
        );
    }
}
