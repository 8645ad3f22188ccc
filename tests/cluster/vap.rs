//! The own-node ValidatingAdmissionPolicy (`fabricgate-own-node` of
//! `deploy/base/admission-policy.yaml`, as rendered into `daemonset.yaml`) decided by the real
//! kube-apiserver, case by case: every case is a server-side dry run (`?dryRun=All`) of one Node
//! change, made through the admin client as the identity the case names (impersonation headers:
//! the agent's ServiceAccount with or without the pod-bound token's node claim in `user.extra`,
//! the kubelet, a user), and asserts admitted — and what the Node would have become — or
//! refused, by the policy with the message of the validation that must refuse it, or by RBAC.
//! The impersonated identities have the RBAC they have for real (the agent's ClusterRole from
//! `deploy/base/rbac.yaml`; the kubelet's `system:node` role), plus, where a case says so, a
//! test group that grants what RBAC would otherwise refuse first, so that the policy alone is
//! seen to refuse it. Two cases repeat with a real pod-bound token: impersonation is decided
//! alike.
//!
//! Agent writes have the agent's own shapes (`src/node/mod.rs`): labels and conditions by forced
//! server-side apply (field manager `fabricgate`), the taint by JSON patch with a `test` of the
//! resourceVersion. The rest are merge or strategic merge patches, whichever says the change.
//!
//! What the real server imposes: the Node has no `providerID`, because the apiserver's own
//! validation (before validating admission) refuses changing a set one, as it does a set
//! `podCIDR`; so the policy's spec rule is shown on setting one. A DELETE whose body carries
//! options ignores `?dryRun`: the dry run goes in the body too.

use crate::common::controlplane::{ControlPlane, client_from};
use crate::common::{AGENT_USER, TAINT, control_plane, node_condition, wait_until};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// The Node of the agent's node claim, and another one.
const OWN: &str = "vap-own";
const OTHER: &str = "vap-other";
/// A group RBAC grants every Node verb (bound by this test only).
const NODE_EDITORS: &str = "fabricgate-test:node-editors";
/// A user outside fabricgate, in that group.
const USER: &str = "vap-test-user";
const KUBELET: &str = "system:node:vap-own";

/// The validations' messages, verbatim.
const ONLY_UPDATE: &str = "fabricgate may only update Nodes, never create or delete them";
const NO_CLAIM: &str = "the token has no authentication.kubernetes.io/node-name claim; \
                        fabricgate needs a pod-bound token on Kubernetes 1.30+";
const LABELS: &str = "fabricgate may change only labels under fabricgate.io/";
const METADATA: &str = "fabricgate may not change annotations (but its own \
                        fabricgate.io/peers-endpoint and fabricgate.io/peers-gids), finalizers \
                        or owner references";
const TAINTS: &str = "fabricgate may add or remove only its own taint fabricgate.io/unvalidated; \
                      other taints must stay as they are, in order";
const SPEC: &str = "fabricgate may not change the Node spec beyond its own taint";
const CONDITIONS: &str = "fabricgate may change only its own conditions (FabricReady, RDMAReady, \
                          LustreReady, GPUDirectReady)";
const STATUS: &str = "fabricgate may not change the Node status beyond its own conditions";

#[derive(Clone, Copy)]
enum Who {
    /// The agent's ServiceAccount, with this node claim (or none), and nothing but its own RBAC.
    Agent(Option<&'static str>),
    /// The same, claiming `OWN`, also in `NODE_EDITORS`: RBAC lets everything through.
    AgentAlsoNodeEditor,
    /// The agent with a real token bound to a Pod on `OWN` (no impersonation).
    AgentToken,
    /// The kubelet of `OWN`.
    Kubelet,
    /// A user in `NODE_EDITORS`.
    User,
}

/// A Node write in one of the patch types the apiserver takes.
enum Change {
    /// Forced server-side apply as field manager `fabricgate`.
    Apply(Value),
    Merge(Value),
    Strategic(Value),
    Json(Value),
}

enum Op {
    /// A patch of the Node (`status`: of its status subresource), computed from the stored Node.
    Patch {
        status: bool,
        change: fn(&Value) -> Change,
    },
    Create,
    Delete,
}

enum Expect {
    /// Admitted, and the Node the dry run returns passes this check (given the stored Node).
    Admitted(fn(&Value, &Value) -> bool),
    /// Refused by the policy with this message.
    Policy(&'static str),
    /// Refused by RBAC (the policy is never asked).
    Rbac,
}

struct Case {
    what: &'static str,
    who: Who,
    node: &'static str,
    op: Op,
    expect: Expect,
}

fn patch(what: &'static str, change: fn(&Value) -> Change, expect: Expect) -> Case {
    Case {
        what,
        who: Who::Agent(Some(OWN)),
        node: OWN,
        op: Op::Patch {
            status: false,
            change,
        },
        expect,
    }
}

fn status(what: &'static str, change: fn(&Value) -> Change, expect: Expect) -> Case {
    Case {
        op: Op::Patch {
            status: true,
            change,
        },
        ..patch(what, change, expect)
    }
}

/// A create or delete of Node `node`.
fn node_case(what: &'static str, who: Who, node: &'static str, op: Op, expect: Expect) -> Case {
    Case {
        what,
        who,
        node,
        op,
        expect,
    }
}

/// The agent's label apply: `fabricgate.io/ready` (which it owns on the stored Node) and `more`.
fn labels_apply(node: &str, ready: &str, more: &[(&str, &str)]) -> Change {
    let mut labels = serde_json::Map::new();
    labels.insert("fabricgate.io/ready".into(), json!(ready));
    for (k, v) in more {
        labels.insert((*k).into(), json!(v));
    }
    Change::Apply(json!({ "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": node, "labels": labels } }))
}

/// The agent's condition apply on the status subresource.
fn conditions_apply(conditions: Value) -> Change {
    Change::Apply(
        json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": OWN },
        "status": { "conditions": conditions } }),
    )
}

/// The agent's taint write: all taints replaced, guarded by the stored resourceVersion.
fn taints_patch(node: &Value, taints: Value) -> Change {
    Change::Json(json!([
        { "op": "test", "path": "/metadata/resourceVersion",
          "value": node["metadata"]["resourceVersion"] },
        { "op": "add", "path": "/spec/taints", "value": taints },
    ]))
}

fn taints_of(node: &Value) -> Vec<Value> {
    node["spec"]["taints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn label<'a>(node: &'a Value, key: &str) -> Option<&'a str> {
    node["metadata"]["labels"][key].as_str()
}

fn gpu_taint() -> Value {
    json!({ "key": "nvidia.com/gpu", "effect": "NoSchedule" })
}

fn maintenance_taint() -> Value {
    json!({ "key": "example.com/maintenance", "value": "soon", "effect": "PreferNoSchedule" })
}

/// Every case: the 26 of the policy's former offline simulator, each as the request the
/// apiserver really gets, and more identities and request shapes around them.
fn cases() -> Vec<Case> {
    vec![
        // ---- the agent on its own Node: what it does is admitted ----
        patch(
            "own labels set",
            |_| labels_apply(OWN, "true", &[("fabricgate.io/rdma.rate-gbps", "400")]),
            Expect::Admitted(|_, n| {
                label(n, "fabricgate.io/ready") == Some("true")
                    && label(n, "fabricgate.io/rdma.rate-gbps") == Some("400")
            }),
        ),
        patch(
            "own label removed (left out of the agent's apply)",
            |_| {
                Change::Apply(json!({ "apiVersion": "v1", "kind": "Node",
                    "metadata": { "name": OWN, "labels": { "fabricgate.io/rdma.rate-gbps": "400" } } }))
            },
            Expect::Admitted(|_, n| {
                label(n, "fabricgate.io/ready").is_none()
                    && label(n, "fabricgate.io/rdma.rate-gbps") == Some("400")
            }),
        ),
        patch(
            "own taint removed",
            |n| taints_patch(n, json!([gpu_taint(), maintenance_taint()])),
            Expect::Admitted(|_, n| taints_of(n) == [gpu_taint(), maintenance_taint()]),
        ),
        patch(
            "own taint re-added with NoExecute",
            |n| {
                taints_patch(
                    n,
                    json!([gpu_taint(), maintenance_taint(), { "key": TAINT, "effect": "NoExecute" }]),
                )
            },
            Expect::Admitted(|_, n| {
                taints_of(n).last() == Some(&json!({ "key": TAINT, "effect": "NoExecute" }))
            }),
        ),
        patch(
            "no change at all",
            |_| labels_apply(OWN, "false", &[]),
            Expect::Admitted(|old, n| {
                n["metadata"]["labels"] == old["metadata"]["labels"]
                    && n["spec"] == old["spec"]
                    && n["metadata"]["resourceVersion"] == old["metadata"]["resourceVersion"]
            }),
        ),
        // ---- the agent on its own Node: anything else is refused ----
        patch(
            "foreign label changed",
            |_| {
                Change::Merge(
                    json!({ "metadata": { "labels": { "nvidia.com/gpu.present": "false" } } }),
                )
            },
            Expect::Policy(LABELS),
        ),
        patch(
            "foreign label added (in the agent's own apply)",
            |_| {
                labels_apply(
                    OWN,
                    "false",
                    &[("node-role.kubernetes.io/control-plane", "")],
                )
            },
            Expect::Policy(LABELS),
        ),
        patch(
            "foreign label removed",
            |_| {
                Change::Merge(
                    json!({ "metadata": { "labels": { "kubernetes.io/hostname": null } } }),
                )
            },
            Expect::Policy(LABELS),
        ),
        patch(
            "look-alike prefix",
            |_| labels_apply(OWN, "false", &[("fabricgate.io.evil/ready", "true")]),
            Expect::Policy(LABELS),
        ),
        patch(
            "foreign taint removed",
            |n| {
                taints_patch(
                    n,
                    json!([{ "key": TAINT, "effect": "NoSchedule" }, maintenance_taint()]),
                )
            },
            Expect::Policy(TAINTS),
        ),
        patch(
            "foreign taint added",
            |n| {
                let mut t = taints_of(n);
                t.push(json!({ "key": "evil", "effect": "NoExecute" }));
                taints_patch(n, Value::Array(t))
            },
            Expect::Policy(TAINTS),
        ),
        patch(
            "foreign taints reordered",
            |n| {
                let mut t = taints_of(n);
                t.reverse();
                taints_patch(n, Value::Array(t))
            },
            Expect::Policy(TAINTS),
        ),
        patch(
            "node cordoned",
            |_| Change::Merge(json!({ "spec": { "unschedulable": true } })),
            Expect::Policy(SPEC),
        ),
        patch(
            "providerID set",
            |_| Change::Merge(json!({ "spec": { "providerID": "kind://docker/kind/vap-own" } })),
            Expect::Policy(SPEC),
        ),
        patch(
            "annotation added",
            |_| Change::Merge(json!({ "metadata": { "annotations": { "a": "b" } } })),
            Expect::Policy(METADATA),
        ),
        patch(
            "own peers-endpoint annotation applied",
            |_| {
                Change::Apply(json!({ "apiVersion": "v1", "kind": "Node",
                    "metadata": { "name": OWN, "labels": { "fabricgate.io/ready": "true" },
                        "annotations": { "fabricgate.io/peers-endpoint": "10.0.9.1:9465" } } }))
            },
            Expect::Admitted(|_, n| {
                n["metadata"]["annotations"]["fabricgate.io/peers-endpoint"] == "10.0.9.1:9465"
            }),
        ),
        patch(
            "own peers-gids annotation applied",
            |_| {
                Change::Apply(json!({ "apiVersion": "v1", "kind": "Node",
                    "metadata": { "name": OWN, "labels": { "fabricgate.io/ready": "true" },
                        "annotations": { "fabricgate.io/peers-endpoint": "10.0.9.1:9465",
                            "fabricgate.io/peers-gids": "mlx5_0/1=lid:7" } } }))
            },
            Expect::Admitted(|_, n| {
                n["metadata"]["annotations"]["fabricgate.io/peers-gids"] == "mlx5_0/1=lid:7"
            }),
        ),
        patch(
            "another fabricgate.io annotation added",
            |_| {
                Change::Merge(
                    json!({ "metadata": { "annotations": { "fabricgate.io/other": "x" } } }),
                )
            },
            Expect::Policy(METADATA),
        ),
        patch(
            "finalizer added",
            |_| Change::Merge(json!({ "metadata": { "finalizers": ["example.com/hold"] } })),
            Expect::Policy(METADATA),
        ),
        // ---- the agent on its own Node's status ----
        status(
            "own condition updated",
            |_| {
                conditions_apply(json!([{ "type": "FabricReady", "status": "True",
                    "reason": "Validated", "message": "ok" }]))
            },
            Expect::Admitted(|_, n| {
                node_condition(n, "FabricReady").is_some_and(|c| c["status"] == "True")
            }),
        ),
        status(
            "own conditions added",
            |_| {
                conditions_apply(json!([
                    { "type": "FabricReady", "status": "False", "reason": "PortDown" },
                    { "type": "RDMAReady", "status": "True", "reason": "Ok" },
                    { "type": "LustreReady", "status": "False", "reason": "Hung" },
                ]))
            },
            Expect::Admitted(|_, n| {
                node_condition(n, "RDMAReady").is_some()
                    && node_condition(n, "LustreReady").is_some()
            }),
        ),
        status(
            "kubelet's Ready condition changed",
            |_| {
                Change::Strategic(
                    json!({ "status": { "conditions": [{ "type": "Ready", "status": "False" }] } }),
                )
            },
            Expect::Policy(CONDITIONS),
        ),
        status(
            "foreign condition added",
            |_| {
                Change::Strategic(
                    json!({ "status": { "conditions": [{ "type": "GPUReady", "status": "True" }] } }),
                )
            },
            Expect::Policy(CONDITIONS),
        ),
        status(
            "capacity changed",
            |_| Change::Merge(json!({ "status": { "capacity": { "nvidia.com/gpu": "0" } } })),
            Expect::Policy(STATUS),
        ),
        status(
            "label changed through the status subresource",
            |_| {
                Change::Merge(
                    json!({ "metadata": { "labels": { "kubernetes.io/hostname": "x" } } }),
                )
            },
            Expect::Policy(LABELS),
        ),
        // ---- another Node, no claim, create and delete ----
        Case {
            node: OTHER,
            ..patch(
                "another node",
                |_| labels_apply(OTHER, "true", &[]),
                Expect::Policy("fabricgate on node vap-own may not modify node vap-other"),
            )
        },
        Case {
            node: OTHER,
            ..status(
                "another node's condition",
                |_| {
                    Change::Apply(json!({ "apiVersion": "v1", "kind": "Node",
                        "metadata": { "name": OTHER },
                        "status": { "conditions": [{ "type": "FabricReady", "status": "True" }] } }))
                },
                Expect::Policy("fabricgate on node vap-own may not modify node vap-other"),
            )
        },
        Case {
            who: Who::Agent(None),
            ..patch(
                "token without node claim",
                |_| labels_apply(OWN, "true", &[]),
                Expect::Policy(NO_CLAIM),
            )
        },
        node_case(
            "own node deleted (RBAC)",
            Who::Agent(Some(OWN)),
            OWN,
            Op::Delete,
            Expect::Rbac,
        ),
        node_case(
            "own node deleted (RBAC allows it)",
            Who::AgentAlsoNodeEditor,
            OWN,
            Op::Delete,
            Expect::Policy(ONLY_UPDATE),
        ),
        node_case(
            "node created (RBAC)",
            Who::Agent(Some(OWN)),
            "vap-new",
            Op::Create,
            Expect::Rbac,
        ),
        node_case(
            "node created (RBAC allows it)",
            Who::AgentAlsoNodeEditor,
            "vap-new",
            Op::Create,
            Expect::Policy(ONLY_UPDATE),
        ),
        // ---- other identities: not this policy's business ----
        Case {
            who: Who::Kubelet,
            ..patch(
                "the kubelet is not restricted by this policy",
                |n| taints_patch(n, json!([])),
                Expect::Admitted(|_, n| taints_of(n).is_empty()),
            )
        },
        Case {
            who: Who::Kubelet,
            ..status(
                "the kubelet's Ready condition",
                |_| {
                    Change::Strategic(
                        json!({ "status": { "conditions": [{ "type": "Ready", "status": "False" }] } }),
                    )
                },
                Expect::Admitted(|_, n| {
                    node_condition(n, "Ready").is_some_and(|c| c["status"] == "False")
                }),
            )
        },
        Case {
            who: Who::User,
            ..patch(
                "a user is not restricted by this policy",
                |_| {
                    Change::Merge(
                        json!({ "metadata": { "labels": { "nvidia.com/gpu.present": "false" } } }),
                    )
                },
                Expect::Admitted(|_, n| label(n, "nvidia.com/gpu.present") == Some("false")),
            )
        },
        Case {
            who: Who::Agent(Some(OTHER)),
            node: OTHER,
            ..patch(
                "the agent of the other node on its node",
                |_| labels_apply(OTHER, "true", &[]),
                Expect::Admitted(|_, n| label(n, "fabricgate.io/ready") == Some("true")),
            )
        },
        // ---- a real pod-bound token decides alike ----
        Case {
            who: Who::AgentToken,
            ..patch(
                "own labels set (real token)",
                |_| labels_apply(OWN, "true", &[]),
                Expect::Admitted(|_, n| label(n, "fabricgate.io/ready") == Some("true")),
            )
        },
        Case {
            who: Who::AgentToken,
            ..patch(
                "foreign label changed (real token)",
                |_| {
                    Change::Merge(
                        json!({ "metadata": { "labels": { "nvidia.com/gpu.present": "false" } } }),
                    )
                },
                Expect::Policy(LABELS),
            )
        },
    ]
}

/// A Node as a kubelet on a GPU node registers it, with fabricgate's label and condition owned
/// by field manager `fabricgate` (as the agent leaves them), and another owner's taint and
/// annotation.
fn create_node(cp: &ControlPlane, name: &str) -> Value {
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["delete", "node", name, "--ignore-not-found", "--wait=false"],
        None,
    );
    let node = json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {
            "name": name,
            "labels": { "kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true" },
            "annotations": { "node.alpha.kubernetes.io/ttl": "0" },
        },
        "spec": {
            "podCIDR": "10.244.3.0/24",
            "podCIDRs": ["10.244.3.0/24"],
            "taints": [gpu_taint(), { "key": TAINT, "effect": "NoSchedule" }, maintenance_taint()],
        },
    });
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["create", "-f", "-"],
        Some(&node.to_string()),
    );
    assert!(ok, "create node {name}: {err}");
    let status = json!({ "status": {
        "capacity": { "cpu": "96", "memory": "2113531496Ki", "pods": "110", "nvidia.com/gpu": "8" },
        "allocatable": { "cpu": "95", "memory": "2100000000Ki", "pods": "110", "nvidia.com/gpu": "8" },
        "conditions": [
            { "type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory" },
            { "type": "Ready", "status": "True", "reason": "KubeletReady" },
        ],
        "addresses": [{ "type": "InternalIP", "address": "10.0.0.3" }],
        "daemonEndpoints": { "kubeletEndpoint": { "Port": 10250 } },
        "nodeInfo": { "kubeletVersion": "v1.37.0", "machineID": "abc", "systemUUID": "abc",
            "bootID": "abc", "kernelVersion": "6.1", "osImage": "Debian", "operatingSystem": "linux",
            "architecture": "amd64", "containerRuntimeVersion": "containerd://2.0",
            "kubeProxyVersion": "" },
    }});
    cp.patch_node_status(name, &status);
    // What the agent owns, written as it writes it.
    let nodes: Api<Node> = Api::all(cp.admin());
    let pp = PatchParams::apply("fabricgate").force();
    let labels = json!({ "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "fabricgate.io/ready": "false" } } });
    cp.block_on(nodes.patch(name, &pp, &Patch::Apply(&labels)))
        .unwrap_or_else(|e| panic!("{name}: the agent's label: {e}"));
    let conditions = json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": name },
        "status": { "conditions": [{ "type": "FabricReady", "status": "False",
            "reason": "PortDown", "message": "port 1 down" }] } });
    cp.block_on(nodes.patch_status(name, &pp, &Patch::Apply(&conditions)))
        .unwrap_or_else(|e| panic!("{name}: the agent's condition: {e}"));
    cp.node(name)
        .unwrap_or_else(|| panic!("node {name} is gone"))
}

/// The test's RBAC: `NODE_EDITORS` may do anything to Nodes, and the kubelet of `OWN` has the
/// `system:node` role (what the Node authorizer grants a real kubelet on its own Node).
fn install_test_rbac(cp: &ControlPlane) {
    cp.apply(&format!(
        r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{ name: fabricgate-test-node-editor }}
rules:
  - apiGroups: [""]
    resources: [nodes, nodes/status]
    verbs: [get, list, create, update, patch, delete]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{ name: fabricgate-test-node-editor }}
roleRef: {{ apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: fabricgate-test-node-editor }}
subjects: [{{ apiGroup: rbac.authorization.k8s.io, kind: Group, name: "{NODE_EDITORS}" }}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{ name: fabricgate-test-kubelet-vap-own }}
roleRef: {{ apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node" }}
subjects: [{{ apiGroup: rbac.authorization.k8s.io, kind: User, name: "{KUBELET}" }}]
"#
    ));
}

/// Percent-encode an extra key for its `Impersonate-Extra-` header (`/` is not a token char).
fn extra_header(key: &str) -> String {
    format!(
        "Impersonate-Extra-{}",
        key.replace('%', "%25").replace('/', "%2F")
    )
}

/// The impersonation headers of `who` (none for the real token).
fn impersonation(who: Who, node_uid: &str) -> Vec<(String, String)> {
    let sa_groups = [
        "system:serviceaccounts",
        "system:serviceaccounts:fabricgate",
        "system:authenticated",
    ];
    let mut h: Vec<(String, String)> = Vec::new();
    let mut groups: Vec<&str> = Vec::new();
    match who {
        Who::AgentToken => return h,
        Who::Agent(claim) => {
            h.push(("Impersonate-User".into(), AGENT_USER.into()));
            groups.extend(sa_groups);
            if let Some(node) = claim {
                // As a token bound to a Pod on `node` carries them (the uid only when the Node
                // exists, as here for `OWN`).
                h.push((
                    extra_header("authentication.kubernetes.io/node-name"),
                    node.into(),
                ));
                if node == OWN {
                    h.push((
                        extra_header("authentication.kubernetes.io/node-uid"),
                        node_uid.into(),
                    ));
                }
            }
        }
        Who::AgentAlsoNodeEditor => {
            h = impersonation(Who::Agent(Some(OWN)), node_uid);
            h.push(("Impersonate-Group".into(), NODE_EDITORS.into()));
            return h;
        }
        Who::Kubelet => {
            h.push(("Impersonate-User".into(), KUBELET.into()));
            groups.extend(["system:nodes", "system:authenticated"]);
        }
        Who::User => {
            h.push(("Impersonate-User".into(), USER.into()));
            groups.extend([NODE_EDITORS, "system:authenticated"]);
        }
    }
    for g in groups {
        h.push(("Impersonate-Group".into(), g.into()));
    }
    h
}

/// The user RBAC sees for `who`.
fn username(who: Who) -> &'static str {
    match who {
        Who::Agent(_) | Who::AgentAlsoNodeEditor | Who::AgentToken => AGENT_USER,
        Who::Kubelet => KUBELET,
        Who::User => USER,
    }
}

/// The dry-run request of `case` against the stored Node `stored`.
fn request(case: &Case, stored: &Value, node_uid: &str) -> http::Request<Vec<u8>> {
    let base = "/api/v1/nodes";
    let (method, uri, content_type, body) = match &case.op {
        Op::Patch { status, change } => {
            let sub = if *status { "/status" } else { "" };
            let (ct, query, body) = match change(stored) {
                Change::Apply(b) => (
                    "application/apply-patch+yaml",
                    "&fieldManager=fabricgate&force=true",
                    b,
                ),
                Change::Merge(b) => ("application/merge-patch+json", "", b),
                Change::Strategic(b) => ("application/strategic-merge-patch+json", "", b),
                Change::Json(b) => ("application/json-patch+json", "", b),
            };
            (
                http::Method::PATCH,
                format!("{base}/{}{sub}?dryRun=All{query}", case.node),
                ct,
                body,
            )
        }
        Op::Create => (
            http::Method::POST,
            format!("{base}?dryRun=All"),
            "application/json",
            json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": case.node } }),
        ),
        // A DELETE with a body takes its options from the body alone (`?dryRun` would be
        // ignored and the Node deleted): the dry run goes in both.
        Op::Delete => (
            http::Method::DELETE,
            format!("{base}/{}?dryRun=All", case.node),
            "application/json",
            json!({ "apiVersion": "v1", "kind": "DeleteOptions", "dryRun": ["All"] }),
        ),
    };
    let mut req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header(http::header::CONTENT_TYPE, content_type);
    for (k, v) in impersonation(case.who, node_uid) {
        req = req.header(k, v);
    }
    req.body(serde_json::to_vec(&body).expect("request body"))
        .expect("request")
}

/// What the apiserver answered: the would-be object, or the refusal's (code, message).
type Answer = Result<Value, (u16, String)>;

fn send(cp: &ControlPlane, client: &kube::Client, req: http::Request<Vec<u8>>) -> Answer {
    match cp.block_on(client.request::<Value>(req)) {
        Ok(v) => Ok(v),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => panic!("not an API answer: {e}"),
    }
}

fn refused_by_policy(answer: &Answer) -> bool {
    matches!(answer, Err((_, m)) if m.contains("ValidatingAdmissionPolicy 'fabricgate-own-node'"))
}

fn refused_by_rbac(answer: &Answer) -> bool {
    matches!(answer, Err((403, m)) if m.contains(" cannot ") && !m.contains("ValidatingAdmissionPolicy"))
}

fn policy_refusal(message: &str) -> String {
    format!(
        "ValidatingAdmissionPolicy 'fabricgate-own-node' with binding 'fabricgate-own-node' \
         denied request: {message}"
    )
}

/// `None` when `answer` is what `case` expects, else why not.
fn verdict(case: &Case, stored: &Value, answer: &Answer) -> Option<String> {
    let verb = match case.op {
        Op::Patch { .. } => "patch",
        Op::Create => "create",
        Op::Delete => "delete",
    };
    let ok = match (&case.expect, answer) {
        (Expect::Admitted(check), Ok(object)) => check(stored, object),
        (Expect::Policy(message), Err((403, got))) => got.ends_with(&policy_refusal(message)),
        (Expect::Rbac, Err((403, got))) => {
            got.contains(&format!(
                "User \"{}\" cannot {verb} resource \"nodes\"",
                username(case.who)
            )) && !got.contains("ValidatingAdmissionPolicy")
        }
        _ => false,
    };
    if ok {
        return None;
    }
    let want = match &case.expect {
        Expect::Admitted(_) => "admitted (with the intended change)".to_owned(),
        Expect::Policy(m) => format!("refused by the policy: {m}"),
        Expect::Rbac => "refused by RBAC".to_owned(),
    };
    let got = match answer {
        Ok(object) => format!(
            "admitted; would be: labels {} taints {} conditions {}",
            object["metadata"]["labels"], object["spec"]["taints"], object["status"]["conditions"]
        ),
        Err((code, message)) => format!("{code}: {message}"),
    };
    Some(format!("{}: expected {want}; got {got}", case.what))
}

#[test]
fn admission_policy_confines_the_agent_to_its_own_nodes_own_fields() {
    let Some(cp) = control_plane() else { return };
    let started = Instant::now();
    cp.install_agent_rbac();
    install_test_rbac(cp);
    let own = create_node(cp, OWN);
    let other = create_node(cp, OTHER);
    let uid = own["metadata"]["uid"]
        .as_str()
        .expect("node uid")
        .to_owned();
    let admin = cp.admin();
    let agent = cp.block_on(client_from(&cp.agent_kubeconfig(OWN, None)));
    let cases = cases();
    assert_eq!(
        cases.len(),
        38,
        "a case was added or removed: update this and the docs"
    );
    let run = |case: &Case| -> (Value, Answer) {
        let stored = if case.node == OTHER {
            other.clone()
        } else {
            own.clone()
        };
        let client = if matches!(case.who, Who::AgentToken) {
            &agent
        } else {
            &admin
        };
        let answer = send(cp, client, request(case, &stored, &uid));
        (stored, answer)
    };

    // The policy and the test's RBAC are enforced only once the apiserver has loaded them.
    // The policy is loaded when it refuses a write that breaks all of its update rules at once
    // (so that this wait holds with any one rule taken out, and the table below says which
    // cases that lets through); the RBAC when the identities it grants are not refused by it.
    let everything_at_once = node_case(
        "another node's foreign label, annotation and spec",
        Who::Agent(Some(OWN)),
        OTHER,
        Op::Patch {
            status: false,
            change: |_| {
                Change::Merge(json!({
                    "metadata": { "labels": { "team": "x" }, "annotations": { "a": "b" } },
                    "spec": { "unschedulable": true },
                }))
            },
        },
        Expect::Rbac,
    );
    let granted: Vec<&Case> = cases
        .iter()
        .filter(|c| matches!(c.who, Who::Kubelet | Who::User | Who::AgentAlsoNodeEditor))
        .collect();
    assert_eq!(granted.len(), 5);
    wait_until(
        "the policy to refuse a write that breaks all its update rules \
         (is it bound with validationActions: [Deny]?)",
        Duration::from_secs(60),
        || refused_by_policy(&run(&everything_at_once).1),
    );
    wait_until(
        "the test's RBAC to be in force",
        Duration::from_secs(30),
        || granted.iter().all(|c| !refused_by_rbac(&run(c).1)),
    );

    let mut wrong = Vec::new();
    for case in &cases {
        let (stored, answer) = run(case);
        if let Some(why) = verdict(case, &stored, &answer) {
            wrong.push(why);
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} cases decided otherwise:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
    // Dry runs only: nothing changed.
    for stored in [&own, &other] {
        let name = stored["metadata"]["name"].as_str().unwrap_or_default();
        let now = cp
            .node(name)
            .unwrap_or_else(|| panic!("a dry run deleted {name}"));
        assert_eq!(
            now["metadata"]["resourceVersion"], stored["metadata"]["resourceVersion"],
            "a dry run changed {name}"
        );
    }
    assert!(cp.node("vap-new").is_none(), "a dry run created vap-new");
    eprintln!(
        "{} admission cases decided by the apiserver in {:?}",
        cases.len(),
        started.elapsed()
    );
}
