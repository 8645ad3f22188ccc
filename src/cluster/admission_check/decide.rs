//! The check's judgements, without API calls: which Nodes a Workload was given, whether each
//! is validated now, and what the answers to a FabricCheck say.

use super::model::{HOSTNAME_LABEL, PodSetAssignment, WorkloadStatus};
use crate::node::fabriccheck::{CheckSpec, PairResult, Rdma};
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
/// land on: issue 36, item 11), or a domain matches no Node.
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

/// What the results of a FabricCheck say.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Members have not all answered and the deadline has not passed.
    Waiting,
    Ready(String),
    /// A pair failed, or a member did not answer in time.
    Retry {
        message: String,
        failed_pairs: usize,
    },
}

/// Judge a FabricCheck: `Waiting` until every member answered or `past_deadline`; then every
/// pair good -> `Ready`, else `Retry` naming the failed pairs (with port and error) and the
/// members that did not answer. A pair is good when `ok` and measured over RDMA (or only
/// `ok`, with `require_rdma` off), at the bandwidth asked for, and its receiving end attests
/// it: the next member's answer says it received from this one, verified (issue 36, item 3).
pub fn judge(
    spec: &CheckSpec,
    results: &[PairResult],
    past_deadline: bool,
    require_rdma: bool,
    timeout: std::time::Duration,
) -> Verdict {
    let n = spec.members.len();
    let mut failed = Vec::new();
    let mut missing = Vec::new();
    let mut unmeasured = 0usize;
    let mut worst_rtt: Option<f64> = None;
    for (i, m) in spec.members.iter().enumerate() {
        let peer = &spec.members[(i + 1) % n.max(1)].node;
        let Some(r) = results.iter().find(|r| r.node == m.node) else {
            missing.push(m.node.clone());
            continue;
        };
        // Both ends of the pair: the sender's measurement and the receiver's own attestation
        // of what arrived (issue 36, item 3). A receiver that has not answered is waited for
        // (or named as silent at the deadline).
        let receiver = results.iter().find(|x| &x.node == peer);
        let problem = pair_problem(r, peer, spec, require_rdma)
            .or_else(|| receiver.and_then(|x| receipt_problem(r, x)));
        match problem {
            Some(p) => failed.push(p),
            None => {
                if r.rdma != Rdma::Measured {
                    unmeasured += 1;
                }
                if let Some(rtt) = r.rtt_micros {
                    worst_rtt = Some(worst_rtt.map_or(rtt, |w: f64| w.max(rtt)));
                }
            }
        }
    }
    if !missing.is_empty() && !past_deadline {
        return Verdict::Waiting;
    }
    if !failed.is_empty() {
        let mut message = format!(
            "gang RDMA pre-flight failed on {} of {n} pairs: {}",
            failed.len(),
            list(&failed)
        );
        if !missing.is_empty() {
            let _ = write!(message, "; no result from {}", list(&missing));
        }
        return Verdict::Retry {
            message,
            failed_pairs: failed.len(),
        };
    }
    if !missing.is_empty() {
        return Verdict::Retry {
            message: format!(
                "gang RDMA pre-flight timed out after {}: no result from {} of {n} members: {} \
                 (their agents are not running, have gang checks or peers off, or cannot \
                 create their FabricCheckResult)",
                humantime::format_duration(timeout),
                missing.len(),
                list(&missing)
            ),
            failed_pairs: 0,
        };
    }
    let mut message = format!("gang RDMA pre-flight passed: {n} pairs in a ring over {n} nodes");
    if let Some(w) = worst_rtt {
        let _ = write!(message, ", slowest median RTT {w:.1} µs");
    }
    if let Some(min) = spec.min_bandwidth_gbps {
        let _ = write!(message, ", every pair at least {min} Gbit/s");
    }
    if let Some(max) = spec.max_rtt_micros {
        let _ = write!(message, ", every median RTT at most {max} µs");
    }
    if unmeasured > 0 {
        let _ = write!(
            message,
            "; gang.require_rdma is false: {unmeasured} pairs answered over the side channel \
             only, without an RDMA measurement"
        );
    }
    Verdict::Ready(message)
}

/// Why the receiving end `receiver` does not attest the pair `sender` measured: no attestation,
/// one of another member, nothing verified, or no RDMA bytes where the sender claims RDMA.
fn receipt_problem(sender: &PairResult, receiver: &PairResult) -> Option<String> {
    let pair = format!("{} -> {}", sender.node, receiver.node);
    let Some(got) = &receiver.received else {
        return Some(format!(
            "{pair}: {} does not attest its receiving end (its answer has no `received`: an \
             agent older than issue 36, item 3?); a pair needs both ends",
            receiver.node
        ));
    };
    if got.peer != sender.node {
        return Some(format!(
            "{pair}: {} attests receiving from {}, not from {}",
            receiver.node, got.peer, sender.node
        ));
    }
    if !got.ok {
        let why = got.error.as_deref().unwrap_or("nothing verified");
        return Some(format!(
            "{pair}: the ends disagree: {} reports ok, {} received nothing verified ({why})",
            sender.node, receiver.node
        ));
    }
    if sender.rdma == Rdma::Measured && got.rdma != Rdma::Measured {
        return Some(format!(
            "{pair}: the ends disagree: {} reports an RDMA measurement, {} saw no RDMA bytes \
             from it (the side channel only)",
            sender.node, receiver.node
        ));
    }
    // Every rail the sender reports arrived verified at the receiver (issue 36, item 8).
    let verified = got
        .rails
        .iter()
        .filter(|x| x.ok && x.bytes.is_some())
        .count();
    if sender.rdma == Rdma::Measured && verified < sender.rails.len() {
        return Some(format!(
            "{pair}: the ends disagree: {} reports {} rails, {} verified the bytes of {verified}",
            sender.node,
            sender.rails.len(),
            receiver.node
        ));
    }
    None
}

/// Why one member's result is not good, naming the pair, the port and the error.
fn pair_problem(
    r: &PairResult,
    peer: &str,
    spec: &CheckSpec,
    require_rdma: bool,
) -> Option<String> {
    let port = match (&r.device, r.port) {
        (Some(d), Some(p)) => format!(" ({d} port {p})"),
        (Some(d), None) => format!(" ({d})"),
        _ => String::new(),
    };
    let pair = format!("{} -> {peer}{port}", r.node);
    if r.peer != peer {
        return Some(format!(
            "{pair}: measured {} instead of its ring neighbour",
            r.peer
        ));
    }
    if !r.ok {
        let error = r.error.as_deref().unwrap_or("failed (no error given)");
        return Some(format!("{pair}: {error}"));
    }
    if require_rdma && r.rdma != Rdma::Measured {
        return Some(format!(
            "{pair}: RDMA was not measured (unmeasured; gang.require_rdma is true)"
        ));
    }
    // Every rail, and the floor and ceiling on the slowest: for what was measured over RDMA
    // (issue 36, item 8; side-channel answers, allowed without gang.require_rdma, carry
    // neither).
    if let Some(bad) = r.rails.iter().find(|x| !x.ok) {
        let error = bad.error.as_deref().unwrap_or("failed (no error given)");
        return Some(format!(
            "{} -> {peer}: rail {} port {}: {error}",
            r.node, bad.device, bad.port
        ));
    }
    if r.rdma != Rdma::Measured {
        return None;
    }
    if let Some(min) = spec.min_bandwidth_gbps {
        match r.bandwidth_gbps {
            Some(b) if b >= min => {}
            Some(b) => return Some(format!("{pair}: bandwidth {b:.1} Gbit/s below {min}")),
            None => return Some(format!("{pair}: no bandwidth measured (asked for {min})")),
        }
    }
    if let Some(max) = spec.max_rtt_micros {
        match r.rtt_micros {
            Some(t) if t <= max => {}
            Some(t) => {
                return Some(format!(
                    "{pair}: median RTT {t:.1} µs above the ceiling {max} µs (gang.max_rtt_micros)"
                ));
            }
            None => return Some(format!("{pair}: no RTT measured (ceiling {max} µs)")),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::fabriccheck::{Member, Received};
    use serde_json::json;
    use std::time::Duration;

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

    /// Issue 36, item 11: without a hostname level a domain is a group of nodes (a pod may
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

    struct St {
        results: Vec<PairResult>,
    }

    fn spec(n: usize) -> CheckSpec {
        CheckSpec {
            members: (0..n)
                .map(|i| Member {
                    node: format!("n{i}"),
                    endpoint: format!("10.0.0.{i}:9465"),
                    ..Member::default()
                })
                .collect(),
            ..CheckSpec::default()
        }
    }

    fn result(i: usize, n: usize, ok: bool) -> PairResult {
        PairResult {
            node: format!("n{i}"),
            peer: format!("n{}", (i + 1) % n),
            ok,
            rdma: Rdma::Measured,
            device: Some("mlx5_0".into()),
            port: Some(1),
            rtt_micros: Some(10.0 + i as f64),
            error: (!ok).then(|| "timeout: no completion from n2 mlx5_0 port 1".into()),
            received: Some(Received {
                peer: format!("n{}", (i + n - 1) % n),
                ok: true,
                rdma: Rdma::Measured,
                ..Received::default()
            }),
            ..PairResult::default()
        }
    }

    /// Issue 36, item 3: a pair is vouched for by both its ends. The sender's `ok: true` is
    /// not enough when the receiver attests nothing, something else, a failure, or only a
    /// side-channel greeting where the sender claims RDMA.
    #[test]
    fn redteam_a_pair_needs_both_ends_to_agree() {
        let t = Duration::from_secs(20);
        let s = spec(2);
        let good = vec![result(0, 2, true), result(1, 2, true)];
        assert!(matches!(
            judge(&s, &good, false, true, t),
            Verdict::Ready(_)
        ));
        let retry = |rs: &[PairResult]| match judge(&s, rs, false, true, t) {
            Verdict::Retry {
                message,
                failed_pairs: 1,
            } => message,
            v => panic!("{v:?}"),
        };
        let mut rs = good.clone();
        rs[1].received = Some(Received {
            peer: "n0".into(),
            ok: false,
            error: Some("nothing received from n0 for this check".into()),
            ..Received::default()
        });
        let m = retry(&rs);
        assert!(
            m.contains("n0 -> n1: the ends disagree: n0 reports ok, n1 received nothing verified")
                && m.contains("nothing received from n0"),
            "{m}"
        );
        rs[1].received = None;
        assert!(retry(&rs).contains("n0 -> n1: n1 does not attest its receiving end"));
        rs[1].received = Some(Received {
            peer: "n7".into(),
            ok: true,
            ..Received::default()
        });
        assert!(retry(&rs).contains("n0 -> n1: n1 attests receiving from n7, not from n0"));
        rs[1].received = Some(Received {
            peer: "n0".into(),
            ok: true,
            rdma: Rdma::Unmeasured,
            ..Received::default()
        });
        assert!(retry(&rs).contains("n0 reports an RDMA measurement, n1 saw no RDMA bytes"));
    }

    #[test]
    fn judge_waits_then_decides_never_ready_on_timeout() {
        let t = Duration::from_secs(20);
        let s = spec(3);
        let mut st = St {
            results: vec![result(0, 3, true), result(1, 3, true)],
        };
        assert_eq!(judge(&s, &st.results, false, true, t), Verdict::Waiting);
        match judge(&s, &st.results, true, true, t) {
            Verdict::Retry {
                message,
                failed_pairs: 0,
            } => assert!(
                message.contains("timed out") && message.contains("n2"),
                "{message}"
            ),
            v => panic!("{v:?}"),
        }
        st.results.push(result(2, 3, true));
        match judge(&s, &st.results, false, true, t) {
            Verdict::Ready(m) => assert!(m.contains("3 pairs") && m.contains("12.0 µs"), "{m}"),
            v => panic!("{v:?}"),
        }
        st.results[1] = result(1, 3, false);
        match judge(&s, &st.results, false, true, t) {
            Verdict::Retry {
                message,
                failed_pairs: 1,
            } => assert!(
                message.contains("n1 -> n2 (mlx5_0 port 1): timeout"),
                "{message}"
            ),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn unmeasured_rdma_counts_only_without_require_rdma() {
        let t = Duration::from_secs(20);
        let s = spec(2);
        let mut st = St {
            results: vec![result(0, 2, true), result(1, 2, true)],
        };
        st.results[0].rdma = Rdma::Unmeasured;
        assert!(matches!(
            judge(&s, &st.results, false, true, t),
            Verdict::Retry {
                failed_pairs: 1,
                ..
            }
        ));
        match judge(&s, &st.results, false, false, t) {
            Verdict::Ready(m) => assert!(m.contains("require_rdma is false"), "{m}"),
            v => panic!("{v:?}"),
        }
        // The wrong neighbour, or too little bandwidth, is a failed pair.
        st.results[0].rdma = Rdma::Measured;
        st.results[1].peer = "n1".into();
        assert!(matches!(
            judge(&s, &st.results, false, true, t),
            Verdict::Retry {
                failed_pairs: 1,
                ..
            }
        ));
        let mut bw = spec(2);
        bw.min_bandwidth_gbps = Some(25.0);
        st.results[1].peer = "n0".into();
        st.results[0].bandwidth_gbps = Some(90.0);
        st.results[1].bandwidth_gbps = Some(9.5);
        match judge(&bw, &st.results, false, true, t) {
            Verdict::Retry { message, .. } => assert!(message.contains("9.5 Gbit/s below 25")),
            v => panic!("{v:?}"),
        }
    }

    /// Issue 36, item 10: the peers endpoint annotation is any text anyone who may patch the
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
