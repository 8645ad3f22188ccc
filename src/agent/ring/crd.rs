//! The `FabricCheck` resource as the agent reads and writes it (the interface is fixed in
//! docs/gangs.md): the controller names the members in ring order, each member's agent
//! measures the next one and writes only its own entry of `status.results`.
//!
//! Plain serde types over [`DynamicObject`]: the agent needs no generated client, and what it
//! does not know (fields the controller adds later) it leaves alone.

use k8s_openapi::jiff::Timestamp;
use kube::api::DynamicObject;
use kube::core::{ApiResource, GroupVersionKind};
use serde::{Deserialize, Serialize};

pub const GROUP: &str = "fabricgate.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "FabricCheck";
pub const PLURAL: &str = "fabricchecks";
/// The Node annotation each agent with `peers.enabled` writes: its responder's address.
pub const ENDPOINT_ANNOTATION: &str = "fabricgate.io/peers-endpoint";
/// Field manager of an agent's result: `fabricgate-gang/<node>`.
pub const FIELD_MANAGER_PREFIX: &str = "fabricgate-gang/";

/// The API resource `fabricchecks.fabricgate.io/v1alpha1`.
pub fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// One member of the ring.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct Member {
    pub node: String,
    /// `ip:port` of its agent's responder (from its Node's [`ENDPOINT_ANNOTATION`]).
    #[serde(default)]
    pub endpoint: String,
}

/// What the controller asks.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    /// Ring order: member `i` measures member `(i + 1) % n`.
    #[serde(default)]
    pub members: Vec<Member>,
    /// With it, a WRITE bandwidth burst too, compared against it.
    #[serde(default)]
    pub min_bandwidth_gbps: Option<f64>,
    /// RFC 3339; agents give up at it.
    #[serde(default)]
    pub deadline: String,
}

/// `rdma` of a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rdma {
    /// An RDMA exchange was made (or tried) from a local port.
    Measured,
    /// No usable local port (verbs off, fixture runs): only the side channel was tested.
    Unmeasured,
}

/// One member's entry of `status.results` (a map keyed by `node`).
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PairResult {
    pub node: String,
    pub peer: String,
    pub ok: bool,
    pub rdma: Rdma,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u8>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtt_micros: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_gbps: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub finished_at: String,
}

/// A FabricCheck as the agent sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct FabricCheck {
    pub name: String,
    pub uid: String,
    pub spec: Spec,
    /// Nodes that already wrote their entry.
    pub answered: Vec<String>,
}

impl FabricCheck {
    /// `None` for an object without a name or a spec the agent can read (logged by the
    /// caller; never a panic).
    pub fn from_dynamic(obj: &DynamicObject) -> Option<Self> {
        let name = obj.metadata.name.clone()?;
        let uid = obj.metadata.uid.clone().unwrap_or_default();
        let spec: Spec = serde_json::from_value(obj.data.get("spec")?.clone()).ok()?;
        let answered = obj
            .data
            .get("status")
            .and_then(|s| s.get("results"))
            .and_then(|r| r.as_array())
            .into_iter()
            .flatten()
            .filter_map(|r| r.get("node").and_then(|n| n.as_str()).map(str::to_owned))
            .collect();
        Some(Self {
            name,
            uid,
            spec,
            answered,
        })
    }

    /// The member this node measures: `(i + 1) % n` for our index `i`. `None` when we are not
    /// a member, or the ring has fewer than two.
    pub fn next_after(&self, node: &str) -> Option<&Member> {
        let n = self.spec.members.len();
        if n < 2 {
            return None;
        }
        let i = self.spec.members.iter().position(|m| m.node == node)?;
        self.spec.members.get((i + 1) % n)
    }

    /// The deadline, `None` when it cannot be read (then the check is not answered).
    pub fn deadline(&self) -> Option<Timestamp> {
        self.spec.deadline.parse().ok()
    }
}
