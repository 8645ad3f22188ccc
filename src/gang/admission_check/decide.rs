//! The check's judgements of Nodes, without API calls: which Nodes a Workload was given,
//! whether each is validated now, and which peers endpoint of theirs may be dialled (the
//! answers to a FabricCheck are `ring.rs`'s).

use super::model::{HOSTNAME_LABEL, PodSetAssignment, WorkloadStatus};
use k8s_openapi::api::core::v1::Node;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

/// At most this many names are listed in one message; the rest are counted.
const MAX_LISTED: usize = 16;

/// `names`, comma-separated, the first [`MAX_LISTED`] only.
pub fn list<S: AsRef<str>>(names: &[S]) -> String {
    let mut out = names
        .iter()
        .take(MAX_LISTED)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX_LISTED {
        let _ = write!(out, " and {} more", names.len() - MAX_LISTED);
    }
    out
}

/// Why `node` is not validated now, or `None` when it is: the agent's label
/// `<prefix>ready=true`, `FabricReady=True`, and no `<prefix>unvalidated` taint (the agent's,
/// or the guard's when the agent is gone).
pub fn node_problem(node: &Node, prefix: &str, taint_key: &str) -> Option<String> {
    let name = node.metadata.name.as_deref().unwrap_or("?");
    let fabric = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "FabricReady"));
    let mut why = Vec::new();
    match fabric {
        None => why.push("no FabricReady condition (no fabricgate agent has judged it)".to_owned()),
        Some(c) if c.status != "True" => why.push(format!(
            "FabricReady={} ({}: {})",
            c.status,
            c.reason.as_deref().unwrap_or("no reason"),
            c.message.as_deref().unwrap_or("")
        )),
        Some(_) => {}
    }
    let label = format!("{prefix}ready");
    let labelled = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(&label))
        .is_some_and(|v| v == "true");
    if !labelled {
        why.push(format!("label {label} is not \"true\""));
    }
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| t.key == taint_key));
    if tainted {
        why.push(format!("tainted {taint_key}"));
    }
    (!why.is_empty()).then(|| format!("{name}: {}", why.join("; ")))
}

/// `annotation` (a Node's peers endpoint, `host:port`) in canonical form when its host is one
/// of `node`'s `status.addresses` and its port is `port`; `None` otherwise. The value is
/// written by whoever may patch the Node, so nothing else is dialled, and it is never quoted
/// back in a message.
pub fn own_endpoint(node: &Node, annotation: &str, port: u16) -> Option<String> {
    let text = annotation.trim();
    if text.len() > 256 {
        return None;
    }
    let (host, p) = match text.parse::<std::net::SocketAddr>() {
        Ok(a) => (a.ip().to_string(), a.port()),
        Err(_) => {
            let (h, p) = text.rsplit_once(':')?;
            if h.contains(':') || h.is_empty() {
                return None;
            }
            (h.to_owned(), p.parse::<u16>().ok()?)
        }
    };
    if p != port {
        return None;
    }
    let addresses = node.status.as_ref()?.addresses.as_ref()?;
    let known = addresses
        .iter()
        .any(|a| match a.address.parse::<std::net::IpAddr>() {
            Ok(ip) => host.parse::<std::net::IpAddr>().is_ok_and(|h| h == ip),
            Err(_) => a.address.eq_ignore_ascii_case(&host),
        });
    known.then(|| match host.parse::<std::net::IpAddr>() {
        Ok(ip) => std::net::SocketAddr::new(ip, p).to_string(),
        Err(_) => format!("{host}:{p}"),
    })
}

/// The Nodes a Workload's admission names.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Assigned {
    /// From topology assignments: the gang's members, sorted (the ring's stable order).
    pub nodes: Vec<String>,
    /// Pod sets without a topology assignment (no TAS): their name, flavors and pod count.
    pub untopological: Vec<(String, BTreeSet<String>, i64)>,
}

/// The Nodes of each pod set's topology assignment; a domain is matched on all its levels'
/// labels (the hostname level also on the Node's name, as the kubelet names it so).
///
/// # Errors
/// A message for the check: the Workload has no admission, an assignment is malformed, its
/// lowest level is not the hostname (its domains are groups of nodes, any of which a pod may
/// land on), or a domain matches no Node.
pub fn assigned_nodes<'a>(
    status: &WorkloadStatus,
    nodes: impl Iterator<Item = &'a Node> + Clone,
) -> Result<Assigned, String> {
    let admission = status
        .admission
        .as_ref()
        .ok_or("the Workload has quota reserved but no status.admission")?;
    let mut members = BTreeSet::new();
    let mut out = Assigned::default();
    // Most domains name a host: find its Node by name, not by matching every Node of the
    // pool (a 512-node gang at 5,000 Nodes: 2.5 million matches, seconds per pass).
    let mut by_host: Option<HashMap<&str, Vec<&Node>>> = None;
    for psa in &admission.pod_set_assignments {
        let Some(topology) = &psa.topology_assignment else {
            out.untopological.push(untopological(psa));
            continue;
        };
        if topology.levels.last().map(String::as_str) != Some(HOSTNAME_LABEL) {
            return Err(format!(
                "pod set {}: the topology assignment's lowest level is {}, not \
                 {HOSTNAME_LABEL}: Kueue assigned domains, not nodes, so the nodes the pods \
                 will run on are not known and cannot be ring-tested; give the Topology \
                 {HOSTNAME_LABEL} as its lowest level",
                psa.name,
                topology.levels.last().map_or("missing", String::as_str)
            ));
        }
        let domains = topology
            .domains()
            .map_err(|e| format!("pod set {}: topology assignment: {e}", psa.name))?;
        for domain in domains {
            let mut matched = false;
            let candidates: Vec<&Node> = match domain.get(HOSTNAME_LABEL) {
                Some(host) => by_host
                    .get_or_insert_with(|| hosts(nodes.clone()))
                    .get(host.as_str())
                    .cloned()
                    .unwrap_or_default(),
                None => nodes.clone().collect(),
            };
            for node in candidates {
                if domain_matches(node, &domain) {
                    matched = true;
                    if let Some(n) = &node.metadata.name {
                        members.insert(n.clone());
                    }
                }
            }
            if !matched {
                let text: Vec<String> = domain.iter().map(|(k, v)| format!("{k}={v}")).collect();
                return Err(format!(
                    "pod set {}: the assigned domain {} matches no Node",
                    psa.name,
                    text.join(",")
                ));
            }
        }
    }
    out.nodes = members.into_iter().collect();
    Ok(out)
}

fn untopological(psa: &PodSetAssignment) -> (String, BTreeSet<String>, i64) {
    (
        psa.name.clone(),
        psa.flavors.values().cloned().collect(),
        psa.count.unwrap_or(1),
    )
}

/// The Nodes by the value a domain's hostname level matches ([`domain_matches`]): their
/// hostname label, else their name.
fn hosts<'a>(nodes: impl Iterator<Item = &'a Node>) -> HashMap<&'a str, Vec<&'a Node>> {
    let mut by_host: HashMap<&str, Vec<&Node>> = HashMap::new();
    for node in nodes {
        let host = node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(HOSTNAME_LABEL))
            .or(node.metadata.name.as_ref());
        if let Some(host) = host {
            by_host.entry(host.as_str()).or_default().push(node);
        }
    }
    by_host
}

fn domain_matches(node: &Node, domain: &BTreeMap<String, String>) -> bool {
    let labels = node.metadata.labels.as_ref();
    domain.iter().all(|(k, v)| {
        let label = labels.and_then(|l| l.get(k));
        match label {
            Some(l) => l == v,
            None => k == HOSTNAME_LABEL && node.metadata.name.as_deref() == Some(v.as_str()),
        }
    })
}

/// Whether `node` carries every one of `labels` (a ResourceFlavor's `nodeLabels`).
pub fn has_labels(node: &Node, labels: &BTreeMap<String, String>) -> bool {
    let have = node.metadata.labels.as_ref();
    labels
        .iter()
        .all(|(k, v)| have.and_then(|l| l.get(k)) == Some(v))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(v: serde_json::Value) -> Node {
        serde_json::from_value(v).unwrap()
    }

    fn good_node(name: &str) -> Node {
        node(json!({
            "metadata": { "name": name, "labels": { "fabricgate.io/ready": "true" } },
            "status": { "conditions": [{ "type": "FabricReady", "status": "True" }] },
        }))
    }

    #[test]
    fn a_node_is_validated_only_with_label_condition_and_no_taint() {
        let key = "fabricgate.io/unvalidated";
        assert_eq!(node_problem(&good_node("a"), "fabricgate.io/", key), None);
        let bad = node(json!({
            "metadata": { "name": "b", "labels": { "fabricgate.io/ready": "false" } },
            "spec": { "taints": [{ "key": key, "effect": "NoSchedule" }] },
            "status": { "conditions": [{ "type": "FabricReady", "status": "False",
                "reason": "RdmaPortDown", "message": "mlx5_0 port 1 is DOWN" }] },
        }));
        let p = node_problem(&bad, "fabricgate.io/", key).unwrap();
        assert!(p.starts_with("b: FabricReady=False (RdmaPortDown: mlx5_0 port 1 is DOWN)"));
        assert!(
            p.contains("label fabricgate.io/ready") && p.contains("tainted"),
            "{p}"
        );
        let bare = node(json!({ "metadata": { "name": "c" } }));
        assert!(
            node_problem(&bare, "fabricgate.io/", key)
                .unwrap()
                .contains("no FabricReady")
        );
    }

    #[test]
    fn assigned_nodes_match_domains_and_sort() {
        let nodes = [good_node("n-2"), good_node("n-1"), good_node("other")];
        let status: WorkloadStatus = serde_json::from_value(json!({
            "admission": { "podSetAssignments": [
                { "name": "workers", "count": 2, "topologyAssignment": {
                    "levels": [HOSTNAME_LABEL],
                    "slices": [{ "domainCount": 2, "valuesPerLevel": [
                        { "individual": { "prefix": "n-", "roots": ["2", "1"] } }] }] } },
                { "name": "launcher", "count": 1, "flavors": { "cpu": "default" } },
            ]},
        }))
        .unwrap();
        let a = assigned_nodes(&status, nodes.iter()).unwrap();
        assert_eq!(a.nodes, ["n-1", "n-2"]);
        assert_eq!(a.untopological.len(), 1);
        assert_eq!(a.untopological[0].2, 1);
        let gone: WorkloadStatus = serde_json::from_value(json!({
            "admission": { "podSetAssignments": [{ "name": "w", "topologyAssignment": {
                "levels": [HOSTNAME_LABEL],
                "slices": [{ "domainCount": 1, "valuesPerLevel": [{ "universal": "x" }] }] } }]},
        }))
        .unwrap();
        let e = assigned_nodes(&gone, nodes.iter()).unwrap_err();
        assert!(
            e.contains("kubernetes.io/hostname=x matches no Node"),
            "{e}"
        );
        // A hostname label that is not the Node's name is what the domain matches, and every
        // other level still has to match.
        let labelled = |name: &str, host: &str, rack: &str| {
            node(json!({ "metadata": { "name": name, "labels": {
                HOSTNAME_LABEL: host, "rack": rack } } }))
        };
        let racked = [
            labelled("node-a", "host-a", "r1"),
            labelled("host-b", "host-c", "r1"),
            labelled("node-c", "host-b", "r2"),
        ];
        let at = |hosts: &[&str]| -> WorkloadStatus {
            serde_json::from_value(json!({
                "admission": { "podSetAssignments": [{ "name": "w", "topologyAssignment": {
                    "levels": ["rack", HOSTNAME_LABEL],
                    "slices": [{ "domainCount": hosts.len(), "valuesPerLevel": [
                        { "universal": "r1" },
                        { "individual": { "roots": hosts } }] }] } }]},
            }))
            .unwrap()
        };
        let a = assigned_nodes(&at(&["host-a", "host-c"]), racked.iter()).unwrap();
        assert_eq!(a.nodes, ["host-b", "node-a"]);
        // host-b is node-c's hostname, in rack r2: no Node of r1.
        assert!(assigned_nodes(&at(&["host-b"]), racked.iter()).is_err());
    }

    /// Without a hostname level a domain is a group of nodes (a pod may
    /// land on any of them), not the gang's nodes: refused, never matched to every Node of it.
    #[test]
    fn redteam_only_a_hostname_level_names_the_gangs_nodes() {
        let leaf = "network.topology.nvidia.com/leaf";
        let mut nodes = vec![good_node("n-1"), good_node("n-2")];
        for n in &mut nodes {
            n.metadata
                .labels
                .get_or_insert_default()
                .insert(leaf.into(), "l1".into());
        }
        for levels in [json!([leaf]), json!([HOSTNAME_LABEL, leaf]), json!([])] {
            let values: Vec<_> = levels
                .as_array()
                .unwrap()
                .iter()
                .map(|_| json!({ "universal": "l1" }))
                .collect();
            let status: WorkloadStatus = serde_json::from_value(json!({
                "admission": { "podSetAssignments": [{ "name": "w", "count": 2,
                    "topologyAssignment": { "levels": levels,
                        "slices": [{ "domainCount": 1, "valuesPerLevel": values }] } }]},
            }))
            .unwrap();
            let e = assigned_nodes(&status, nodes.iter()).unwrap_err();
            assert!(
                e.starts_with("pod set w: the topology assignment's lowest level is")
                    && e.contains("give the Topology kubernetes.io/hostname as its lowest level"),
                "{levels}: {e}"
            );
        }
    }

    /// The peers endpoint annotation is any text anyone who may patch the
    /// Node writes; only one of the Node's own addresses at the configured port is dialled.
    #[test]
    fn redteam_only_an_address_of_the_node_itself_is_a_peers_endpoint() {
        let n = node(json!({
            "metadata": { "name": "gpu-1" },
            "status": { "addresses": [
                { "type": "InternalIP", "address": "10.0.9.1" },
                { "type": "InternalIP", "address": "fd00::9" },
                { "type": "Hostname", "address": "gpu-1" } ] },
        }));
        let ok = |e| own_endpoint(&n, e, 9465);
        assert_eq!(ok("10.0.9.1:9465").as_deref(), Some("10.0.9.1:9465"));
        assert_eq!(ok(" 10.0.9.1:9465 ").as_deref(), Some("10.0.9.1:9465"));
        assert_eq!(ok("[fd00::9]:9465").as_deref(), Some("[fd00::9]:9465"));
        assert_eq!(ok("[fd00:0::9]:9465").as_deref(), Some("[fd00::9]:9465"));
        assert_eq!(ok("gpu-1:9465").as_deref(), Some("gpu-1:9465"));
        for bad in [
            "10.0.9.1:22",                    // another port
            "169.254.169.254:9465",           // not the Node's: a metadata service
            "10.0.9.2:9465",                  // another node
            "10.0.9.1",                       // no port
            "kubernetes.default.svc:9465",    // a name not among its addresses
            "10.0.9.1:9465\nerror: all good", // text to be echoed
            "10.0.9.1:9465:9465",
            ":9465",
            "",
        ] {
            assert_eq!(ok(bad), None, "{bad:?}");
        }
        let bare = node(json!({ "metadata": { "name": "gpu-2" } }));
        assert_eq!(own_endpoint(&bare, "10.0.9.1:9465", 9465), None);
    }

    #[test]
    fn lists_are_bounded() {
        let names: Vec<String> = (0..40).map(|i| format!("n{i}")).collect();
        let l = list(&names);
        assert!(l.ends_with("and 24 more") && l.contains("n15") && !l.contains("n16,"));
    }
}
