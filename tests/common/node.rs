//! A Node as the agent marks it: its taint keys, our taint, its conditions, read from the JSON
//! the apiserver returns, and [`TestNode`], one Node of a test on the shared control plane.

use super::controlplane::{AuditEvent, ControlPlane};
use super::sysfs::FakeHca;
use super::{Agent, start_agent};
use serde_json::{Value, json};
use std::path::PathBuf;

/// The agent's taint key (its default).
pub const TAINT: &str = "fabricgate.io/unvalidated";
/// The agent's user, as RBAC and the audit log name it.
pub const AGENT_USER: &str = "system:serviceaccount:fabricgate:fabricgate";

/// Make `config` (the admin's) act as Node `node`'s agent: its ServiceAccount and the node
/// claim of its pod-bound token, impersonated, so the agent's RBAC and admission policies
/// decide (the audit log still names the admin as the impersonator).
pub fn impersonate_agent(config: &mut kube::Config, node: &str) {
    config.auth_info.impersonate = Some(AGENT_USER.to_owned());
    config.auth_info.impersonate_groups = Some(vec![
        "system:serviceaccounts".to_owned(),
        "system:serviceaccounts:fabricgate".to_owned(),
        "system:authenticated".to_owned(),
    ]);
    config.auth_info.impersonate_user_extra = Some(
        [(
            "authentication.kubernetes.io/node-name".to_owned(),
            vec![node.to_owned()],
        )]
        .into(),
    );
}

/// The shared control plane, or `None` after a `SKIP:` line (a failure under CI).
pub fn control_plane() -> Option<&'static ControlPlane> {
    ControlPlane::shared()
}

/// The keys of `node`'s taints.
pub fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t["key"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `node` carries our taint ([`TAINT`]).
pub fn has_taint(node: &Value) -> bool {
    taint_keys(node).iter().any(|k| k == TAINT)
}

/// The condition of type `type_` among a Node's `status.conditions`.
pub fn node_condition<'a>(node: &'a Value, type_: &str) -> Option<&'a Value> {
    condition_in(&node["status"]["conditions"], type_)
}

/// The condition of type `type_` in a list of conditions (a Node's, or the `conditions` of a
/// `check --format json` report).
pub fn condition_in<'a>(conditions: &'a Value, type_: &str) -> Option<&'a Value> {
    conditions.as_array()?.iter().find(|c| c["type"] == type_)
}

/// One Node of a test on the shared control plane.
pub struct TestNode {
    pub cp: &'static ControlPlane,
    pub name: String,
}

impl TestNode {
    /// Register `name` as the docs recommend (with our taint), plus what other owners put
    /// there: a label, a GPU taint, the kubelet's Ready condition.
    pub fn seeded(cp: &'static ControlPlane, name: &str) -> TestNode {
        cp.create_node(
            name,
            json!({ "team": "ml" }),
            json!([
                { "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" },
                { "key": TAINT, "effect": "NoSchedule" },
            ]),
            json!({}),
        );
        TestNode {
            cp,
            name: name.to_owned(),
        }
    }

    pub fn json(&self) -> Value {
        self.cp
            .node(&self.name)
            .unwrap_or_else(|| panic!("node {} is gone", self.name))
    }

    pub fn taints(&self) -> Vec<String> {
        taint_keys(&self.json())
    }

    pub fn has_our_taint(&self) -> bool {
        has_taint(&self.json())
    }

    pub fn label(&self, key: &str) -> Option<String> {
        self.json()["metadata"]["labels"][key]
            .as_str()
            .map(str::to_owned)
    }

    pub fn condition(&self, type_: &str) -> Option<Value> {
        node_condition(&self.json(), type_).cloned()
    }

    pub fn events(&self) -> Vec<Value> {
        self.cp.node_events(&self.name)
    }

    /// Validated, and the Event for it recorded (the last write of a transition).
    pub fn ready(&self) -> bool {
        let node = self.json();
        !has_taint(&node)
            && node["metadata"]["labels"]["fabricgate.io/ready"] == "true"
            && self
                .events()
                .last()
                .is_some_and(|e| e["reason"] == "FabricReady")
    }

    /// An agent for this Node over a one-HCA tree whose port is `up`, with its pod-bound
    /// token, talking to `server` (a fault proxy) or the apiserver itself. The agent is
    /// dropped (killed) before the tree when both go out of scope together.
    pub fn run_agent(&self, up: bool, server: Option<&str>, extra: &[&str]) -> (FakeHca, Agent) {
        let hca = FakeHca::new(up);
        let kubeconfig = self.agent_kubeconfig(server);
        let agent = start_agent(&self.name, &hca, Some(&kubeconfig), extra);
        (hca, agent)
    }

    /// An agent for this Node over `hca`, with its pod-bound token, talking to the apiserver
    /// itself.
    pub fn start_agent(&self, hca: &FakeHca, extra: &[&str]) -> Agent {
        let kubeconfig = self.agent_kubeconfig(None);
        start_agent(&self.name, hca, Some(&kubeconfig), extra)
    }

    /// Whether this Node has condition `type_` with reason `reason`.
    pub fn has_reason(&self, type_: &str, reason: &str) -> bool {
        self.condition(type_).is_some_and(|c| c["reason"] == reason)
    }

    /// A kubeconfig of this Node's agent (pod-bound token), to the apiserver or `server`.
    pub fn agent_kubeconfig(&self, server: Option<&str>) -> PathBuf {
        self.cp.agent_kubeconfig(&self.name, server)
    }

    /// Requests this Node's agent made since `mark` (attributed by its token's node claim).
    pub fn agent_requests(&self, mark: usize) -> Vec<AuditEvent> {
        self.cp
            .audit_since(mark)
            .into_iter()
            .filter(|e| e.user == AGENT_USER && e.claim_node == self.name)
            .collect()
    }

    /// Successful writes among them.
    pub fn agent_writes(&self, mark: usize) -> Vec<AuditEvent> {
        self.agent_requests(mark)
            .into_iter()
            .filter(|e| e.is_write() && e.code < 300)
            .collect()
    }

    /// Successful taint writes: JSON patches of the Node (the label apply is forced SSA).
    pub fn taint_writes(&self, mark: usize) -> usize {
        self.agent_writes(mark)
            .iter()
            .filter(|e| {
                e.verb == "patch"
                    && e.resource == "nodes"
                    && e.subresource.is_empty()
                    && !e.request_uri.contains("force=")
            })
            .count()
    }
}
