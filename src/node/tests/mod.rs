//! Unit tests of the Node's marks: the plan (pure), and the Reconciler and its breaker against a
//! scripted API server (`scripted`). The fixtures here are shared by all three.

mod breaker;
mod plan;
mod reconciler;
pub(crate) mod scripted;

use crate::config::Config;
use crate::node::plan as plan_of;
use crate::policy::{self, Condition, PartVerdict, RdmaVerdict, Verdict};
use k8s_openapi::api::core::v1::{Node, NodeCondition, NodeSpec, NodeStatus, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;

const KEY: &str = "fabricgate.io/unvalidated";

fn verdict(ready: bool) -> Verdict {
    let config = Config::default();
    let part = PartVerdict {
        ready,
        findings: Vec::new(),
        warnings: Vec::new(),
    };
    let cond = |t: &str, ok: &str| Condition {
        type_: t.into(),
        status: if ready { "True" } else { "False" }.into(),
        reason: if ready { ok.into() } else { "PortDown".into() },
        message: if ready {
            "ok".into()
        } else {
            "mlx5_0 port 1 down".into()
        },
    };
    Verdict {
        ready,
        rdma: RdmaVerdict {
            part: part.clone(),
            usable_ports: u32::from(ready),
            required_ports: 1,
            min_rate_gbps: None,
            link_layer: None,
        },
        placement: part,
        labels: [("fabricgate.io/ready".to_owned(), ready.to_string())].into(),
        taints: if ready {
            vec![]
        } else {
            vec![policy::unvalidated_taint(&config)]
        },
        conditions: vec![
            cond("FabricReady", "FabricValidated"),
            cond("RDMAReady", "RDMAPortsActive"),
        ],
        keep_taint: false,
        device_taints: Vec::new(),
        checks: Default::default(),
    }
}

fn taint(key: &str) -> Taint {
    Taint {
        key: key.into(),
        effect: "NoSchedule".into(),
        ..Taint::default()
    }
}

fn node(labels: &[(&str, &str)], taints: Vec<Taint>, conds: Vec<NodeCondition>) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some("n".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).into(), (*v).into()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: Some(taints),
            ..NodeSpec::default()
        }),
        status: Some(NodeStatus {
            conditions: Some(conds),
            ..NodeStatus::default()
        }),
    }
}

fn applied(v: &Verdict, now: &Timestamp) -> Vec<NodeCondition> {
    plan_of(&node(&[], vec![], vec![]), v, KEY, now)
        .conditions
        .unwrap()
}
