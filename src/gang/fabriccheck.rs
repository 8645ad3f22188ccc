//! The gang pre-flight's two resources (docs/gangs.md), as the controller and the agents both
//! read and write them:
//!
//! - `FabricCheck` (`fabricchecks.fabricgate.io`): the controller's question, the ring's members
//!   and a deadline; member `i` measures member `(i + 1) % n`;
//! - `FabricCheckResult` (`fabriccheckresults.fabricgate.io`): one member's answer, created
//!   empty by the controller with the check, one per member (so no agent can
//!   create answers, nor fill the namespace's quota), under the name `<check uid>.<node>`,
//!   labelled with the check's uid and owned by the check (garbage-collected with it); that
//!   member's agent fills it once (a merge patch of its spec).
//!
//! One object per answer, not entries in a shared status: N members writing one object
//! serialise on it (each write conflicts, is retried and re-applies N managers' fields), which
//! took 80 s for 64 members; N small writes do not contend.
//!
//! Plain serde types over `DynamicObject`s: neither side needs a generated client, and fields
//! added later are ignored on read.

use crate::text::fnv64;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ApiResource, DynamicObject};
use kube::core::GroupVersionKind;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

pub const GROUP: &str = "fabricgate.io";
pub const VERSION: &str = "v1alpha1";
pub const CHECK_KIND: &str = "FabricCheck";
pub const CHECK_PLURAL: &str = "fabricchecks";
pub const RESULT_KIND: &str = "FabricCheckResult";
pub const RESULT_PLURAL: &str = "fabriccheckresults";
/// Label of every result: the uid of the check it answers (a name may be too long for a label).
pub const CHECK_UID_LABEL: &str = "fabricgate.io/fabriccheck-uid";
/// The Node annotation each agent with `peers.enabled` writes: its responder's `host:port`.
pub const ENDPOINT_ANNOTATION: &str = "fabricgate.io/peers-endpoint";
/// The Node annotation each agent with `peers.enabled` writes beside the endpoint: the
/// addresses of its usable ports, comma-separated `device/port=<gid>` (RoCE: the GID its
/// sessions use) or `device/port=lid:<n>` (InfiniBand). Only the Node's own agent may write
/// it (the own-node admission policy): the controller copies it into each member of a check,
/// and the member that dials this Node holds the responder's ENDPOINT to it.
pub const GIDS_ANNOTATION: &str = "fabricgate.io/peers-gids";
/// Entries of [`GIDS_ANNOTATION`] taken (a node has a few ports).
pub const MAX_GIDS: usize = 64;

/// The well-formed entries of a [`GIDS_ANNOTATION`] value (at most [`MAX_GIDS`]).
pub fn gids_entries(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|e| {
            e.len() <= 80
                && e.split_once('=').is_some_and(|(port, addr)| {
                    port.contains('/')
                        && (fabricgate_probes::rdma::peer::parse_gid(addr).is_some()
                            || addr
                                .strip_prefix("lid:")
                                .is_some_and(|l| l.parse::<u16>().is_ok()))
                })
        })
        .take(MAX_GIDS)
        .map(str::to_owned)
        .collect()
}

/// The prefix of a FabricCheck's label for each of its members ([`member_label`]).
pub const MEMBER_LABEL_PREFIX: &str = "member.fabricgate.io/";

/// The label (key; its value is `"true"`) a FabricCheck carries for member `node`: each agent
/// watches only the checks labelled for its own Node, so a check is sent to its members'
/// watches and not to every agent of the pool (at 5,000 Nodes a 512-member check is tens of
/// kB, times 5,000 watchers). The Node's name when it is a valid label name (63 characters at
/// most: most are), else `fnv-` and a 64-bit FNV-1a of it. A hint for routing only: an agent
/// still measures only a check whose `spec.members` names its Node.
pub fn member_label(node: &str) -> String {
    if node.len() <= 63 && !node.is_empty() {
        return format!("{MEMBER_LABEL_PREFIX}{node}");
    }
    format!("{MEMBER_LABEL_PREFIX}fnv-{:016x}", fnv64(node))
}

/// `fabricchecks.fabricgate.io/v1alpha1`.
pub fn checks() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, VERSION, CHECK_KIND),
        CHECK_PLURAL,
    )
}

/// `fabriccheckresults.fabricgate.io/v1alpha1`.
pub fn results() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, VERSION, RESULT_KIND),
        RESULT_PLURAL,
    )
}

/// The Workload a check was made for.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct WorkloadRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// One member of the ring.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Member {
    pub node: String,
    /// `host:port` of its agent's responder (its Node's [`ENDPOINT_ANNOTATION`]).
    pub endpoint: String,
    /// Its Node's [`GIDS_ANNOTATION`] entries: the ports its responder may give in ENDPOINT.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gids: Vec<String>,
}

/// `FabricCheck.spec` (immutable).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct CheckSpec {
    pub workload: WorkloadRef,
    /// Ring order.
    pub members: Vec<Member>,
    /// With it, a WRITE bandwidth burst too, on every rail, compared against it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_bandwidth_gbps: Option<f64>,
    /// With it, every rail's median RTT must stay below it (µs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rtt_micros: Option<f64>,
    /// RFC 3339; agents give up at it.
    pub deadline: String,
}

impl CheckSpec {
    /// The member `node` measures: `(i + 1) % n` for its index `i`. `None` when it is not a
    /// member, or the ring has fewer than two.
    pub fn next_after(&self, node: &str) -> Option<&Member> {
        let n = self.members.len();
        if n < 2 {
            return None;
        }
        let i = self.members.iter().position(|m| m.node == node)?;
        self.members.get((i + 1) % n)
    }

    /// The member that measures `node` (its ring predecessor). `None` when `node` is not a
    /// member, or the ring has fewer than two.
    pub fn previous_before(&self, node: &str) -> Option<&Member> {
        let n = self.members.len();
        if n < 2 {
            return None;
        }
        let i = self.members.iter().position(|m| m.node == node)?;
        self.members.get((i + n - 1) % n)
    }

    /// The deadline, `None` when it cannot be read.
    pub fn deadline(&self) -> Option<Timestamp> {
        self.deadline.parse().ok()
    }
}

/// A FabricCheck: its name, uid and spec.
#[derive(Debug, Clone, PartialEq)]
pub struct FabricCheck {
    pub name: String,
    pub uid: String,
    pub spec: CheckSpec,
}

impl FabricCheck {
    /// `None` for an object without a name, a uid or a readable spec (never a panic).
    pub fn from_dynamic(obj: &DynamicObject) -> Option<Self> {
        Some(Self {
            name: obj.metadata.name.clone()?,
            uid: obj.metadata.uid.clone()?,
            spec: serde_json::from_value(obj.data.get("spec")?.clone()).ok()?,
        })
    }
}

/// `rdma` of a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rdma {
    /// An RDMA exchange was made (or tried) from a local port.
    Measured,
    /// No usable local port (verbs off, fixture runs): only the side channel was tested.
    #[default]
    Unmeasured,
}

/// One member's measurement of its ring neighbour.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PairResult {
    pub node: String,
    pub peer: String,
    pub ok: bool,
    pub rdma: Rdma,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rtt_micros: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bandwidth_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub finished_at: String,
    /// This node's receiving end of the pair its ring predecessor measured: what its own
    /// responder saw of that member's sessions for this check. The
    /// controller requires both ends of every pair to agree. Absent in an older agent's answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub received: Option<Received>,
    /// Every usable local port (rail), measured to the peer's port of the same name (issue
    /// 36, item 8); `ok` only when all are. The fields above sum them up: the first failed
    /// rail's device, port and error, the slowest median RTT, the lowest bandwidth.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rails: Vec<RailResult>,
}

/// One rail of a pair: a local port measured to the peer's matching port.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct RailResult {
    pub device: String,
    pub port: u8,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rtt_micros: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bandwidth_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The receiving end of a pair, as its receiver's responder saw it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Received {
    /// The member whose sessions these were (this node's ring predecessor).
    pub peer: String,
    /// It arrived: bytes verified in this node's buffer (`rdma: measured`), or, without RDMA,
    /// an authenticated greeting naming the check (`rdma: unmeasured`).
    pub ok: bool,
    pub rdma: Rdma,
    /// Each session the predecessor made, by this node's port that served it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rails: Vec<ReceivedRail>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One session of the predecessor's, on this node's port `device`/`port`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ReceivedRail {
    pub device: String,
    pub port: u8,
    pub ok: bool,
    /// Bytes of this node's buffer that matched the sender's digest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `FabricCheckResult.spec` (immutable): which check it answers, and the measurement.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", default)]
pub struct ResultSpec {
    pub check: String,
    #[serde(rename = "checkUID")]
    pub check_uid: String,
    #[serde(flatten)]
    pub result: PairResult,
}

/// Whether `uid` has the shape of a Kubernetes object uid (a UUID in its lower-case text
/// form, 36 characters), as a FabricCheck's is: no other `checkUID` is an answer's.
pub fn is_uid(uid: &str) -> bool {
    let b = uid.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_digit() || (b'a'..=b'f').contains(c),
        })
}

/// The name of `node`'s answer to the check `check_uid` (the admission policy requires exactly
/// this name, so each node has at most one answer per check).
pub fn result_name(check_uid: &str, node: &str) -> String {
    format!("{check_uid}.{node}")
}

/// The empty `FabricCheckResult` the controller creates for member `node` of `check`, which
/// measures `peer`: everything but the measurement, which only `node`'s agent fills (and only
/// once: the CRD and the admission policies hold both).
pub fn empty_result_object(check: &FabricCheck, node: &str, peer: &str) -> Value {
    json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": RESULT_KIND,
        "metadata": {
            "name": result_name(&check.uid, node),
            "labels": {
                "app.kubernetes.io/name": "fabricgate",
                CHECK_UID_LABEL: check.uid,
            },
            "ownerReferences": [{
                "apiVersion": format!("{GROUP}/{VERSION}"),
                "kind": CHECK_KIND,
                "name": check.name,
                "uid": check.uid,
            }],
        },
        "spec": {
            "check": check.name,
            "checkUID": check.uid,
            "node": node,
            "peer": peer,
        },
    })
}

/// The merge patch with which `result.node`'s agent fills its answer to `check` (the object
/// [`empty_result_object`] created).
pub fn result_fill(check: &FabricCheck, result: &PairResult) -> Value {
    json!({
        "spec": ResultSpec {
            check: check.name.clone(),
            check_uid: check.uid.clone(),
            result: result.clone(),
        },
    })
}

/// Whether a result object carries its member's answer (`spec.ok`, which the CRD requires
/// with `rdma` and `finishedAt`), not only the controller's empty room for it.
pub fn is_answered(obj: &DynamicObject) -> bool {
    obj.data
        .get("spec")
        .is_some_and(|s| s.get("ok").is_some_and(Value::is_boolean))
}

/// The answer a result object carries; `None` when its spec cannot be read.
pub fn result_from_dynamic(obj: &DynamicObject) -> Option<ResultSpec> {
    serde_json::from_value(obj.data.get("spec")?.clone()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A label name: 63 characters at most, alphanumerics at both ends, `-_.` inside.
    fn valid_label_name(name: &str) -> bool {
        let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
        name.len() <= 63
            && ends(name.chars().next())
            && ends(name.chars().last())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    }

    #[test]
    fn every_node_name_has_a_valid_member_label_of_its_own() {
        let long = format!("gpu-{}.cluster.internal", "a".repeat(200));
        let longer = format!("{long}x");
        for node in ["gpu-001", "ip-10-0-3-17.ec2.internal", &long, &longer] {
            let label = member_label(node);
            let name = label.strip_prefix(MEMBER_LABEL_PREFIX).expect("our prefix");
            assert!(valid_label_name(name), "{label}");
            assert_eq!(member_label(node), label, "the same for the same node");
        }
        assert_eq!(member_label("gpu-001"), "member.fabricgate.io/gpu-001");
        assert_ne!(member_label(&long), member_label(&longer));
        assert_ne!(member_label("gpu-001"), member_label("gpu-002"));
    }

    #[test]
    fn an_empty_answer_filled_round_trips_and_names_its_check() {
        let check = FabricCheck {
            name: "team.job.01234567".into(),
            uid: "0f1e2d3c-aaaa-bbbb-cccc-000000000001".into(),
            spec: CheckSpec::default(),
        };
        let r = PairResult {
            node: "gpu-a".into(),
            peer: "gpu-b".into(),
            ok: false,
            rdma: Rdma::Measured,
            device: Some("mlx5_0".into()),
            port: Some(1),
            error: Some("connect: timed out".into()),
            finished_at: "2026-12-02T03:00:01Z".into(),
            ..PairResult::default()
        };
        let mut v = empty_result_object(&check, "gpu-a", "gpu-b");
        assert_eq!(
            v["metadata"]["name"],
            "0f1e2d3c-aaaa-bbbb-cccc-000000000001.gpu-a"
        );
        assert_eq!(v["metadata"]["labels"][CHECK_UID_LABEL], check.uid);
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], check.uid);
        assert_eq!(
            v["spec"],
            json!({ "check": check.name, "checkUID": check.uid, "node": "gpu-a",
                    "peer": "gpu-b" })
        );
        let empty: DynamicObject = serde_json::from_value(v.clone()).unwrap();
        assert!(!is_answered(&empty), "the controller's room is no answer");
        let fill = result_fill(&check, &r);
        assert_eq!(fill["spec"]["checkUID"], check.uid);
        assert_eq!(fill["spec"]["rdma"], "measured");
        assert!(fill["spec"].get("rttMicros").is_none(), "absent, not 0");
        // The merge patch keeps the controller's fields as they were.
        for field in ["check", "checkUID", "node", "peer"] {
            assert_eq!(fill["spec"][field], v["spec"][field], "{field}");
        }
        v["spec"] = fill["spec"].clone();
        let obj: DynamicObject = serde_json::from_value(v).unwrap();
        assert!(is_answered(&obj));
        let back = result_from_dynamic(&obj).unwrap();
        assert_eq!(back.result, r);
        assert_eq!(back.check, check.name);
    }

    /// Only a uid-shaped `checkUID` names a check (the CRD's pattern too).
    #[test]
    fn redteam_only_a_uid_shaped_check_uid_is_an_answer() {
        assert!(is_uid("0f1e2d3c-aaaa-bbbb-cccc-000000000001"));
        for bad in [
            "",
            "x",
            "0F1E2D3C-AAAA-BBBB-CCCC-000000000001",
            "0f1e2d3c-aaaa-bbbb-cccc-0000000000011",
            "0f1e2d3caaaaabbbbbcccc-000000000001",
            "0f1e2d3c-aaaa-bbbb-cccc-00000000000g",
            &"a".repeat(64),
        ] {
            assert!(!is_uid(bad), "{bad}");
        }
    }

    #[test]
    fn the_ring_closes_and_strangers_have_no_neighbour() {
        let spec = CheckSpec {
            members: ["a", "b", "c"]
                .iter()
                .map(|n| Member {
                    node: (*n).into(),
                    endpoint: String::new(),
                    ..Member::default()
                })
                .collect(),
            ..CheckSpec::default()
        };
        let next = |n| spec.next_after(n).map(|m| m.node.as_str());
        assert_eq!(next("a"), Some("b"));
        assert_eq!(next("c"), Some("a"));
        assert_eq!(next("d"), None);
        let prev = |n| spec.previous_before(n).map(|m| m.node.as_str());
        assert_eq!(prev("a"), Some("c"));
        assert_eq!(prev("b"), Some("a"));
        assert_eq!(prev("d"), None);
        let alone = CheckSpec {
            members: spec.members[..1].to_vec(),
            ..CheckSpec::default()
        };
        assert_eq!(alone.next_after("a"), None);
    }
}
