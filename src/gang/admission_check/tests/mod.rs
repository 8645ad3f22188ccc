//! Unit tests of the admission check: what should happen to a Workload (`step.rs`, pure),
//! table-tested, and a pass (`reconcile.rs`) against a scripted API server. The real
//! kube-apiserver with Kueue's CRDs runs the same paths in tests/cluster/admission_check.rs.
//! The fixtures here are shared by both.

mod api;
mod requeue;
mod step;

use super::model::{self, HOSTNAME_LABEL};
use super::watch::Stores;
use super::{CHECK_LABEL, CONTROLLER_NAME, CheckSettings, RESERVATION_ANNOTATION};
use crate::config::Config;
use crate::gang::fabriccheck::{
    self, CheckSpec, ENDPOINT_ANNOTATION, FabricCheck, Member, PairResult, Rdma, Received,
    WorkloadRef,
};
use crate::gang::settings::GangSettings;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::reflector::store::{Store, Writer};
use kube::runtime::watcher;
use serde_json::{Value, json};
use std::time::Duration;

const NS: &str = "team";
const WL: &str = "train";
const WL_UID: &str = "0a0a0a0a-0000-4000-8000-00000000000a";
const CHECK_UID: &str = "0c0c0c0c-0000-4000-8000-0000000000fc";
/// Our AdmissionCheck.
const OURS: &str = "fabric";
/// The quota reservation's time.
const RESERVED: &str = "2026-12-02T03:00:00Z";
/// `gang.namespace` by default.
const GANG_NS: &str = "fabricgate";

fn settings() -> CheckSettings {
    CheckSettings {
        config: Config::default(),
        gang: GangSettings::default(),
        namespace: GANG_NS.to_owned(),
        lease_name: "fabricgate-admission-check".to_owned(),
        lease_duration: Duration::from_secs(15),
        identity: "ac-0".to_owned(),
        poll_interval: Duration::from_secs(1),
        workload_namespace: None,
    }
}

/// The address of the `i`th Node, `gpu-<i>`.
fn ip(i: usize) -> String {
    format!("10.0.0.{}", i + 1)
}

fn host(i: usize) -> String {
    format!("gpu-{i}")
}

/// `gpu-<i>`, validated now (the agent's label, `FabricReady=True`, no taint), publishing its
/// peers endpoint at one of its own addresses.
fn node(i: usize) -> Node {
    serde_json::from_value(json!({
        "metadata": {
            "name": host(i),
            "labels": { "fabricgate.io/ready": "true", HOSTNAME_LABEL: host(i), "pool": "gpu" },
            "annotations": { ENDPOINT_ANNOTATION: format!("{}:9465", ip(i)) },
        },
        "status": {
            "conditions": [{ "type": "FabricReady", "status": "True", "reason": "Ready" }],
            "addresses": [{ "type": "InternalIP", "address": ip(i) }],
        },
    }))
    .expect("a Node")
}

/// `gpu-<i>` as its agent leaves it when a port goes down: tainted, `FabricReady=False`.
fn unvalidated(i: usize) -> Node {
    let mut n = node(i);
    let v: Value = json!({
        "spec": { "taints": [{ "key": "fabricgate.io/unvalidated", "effect": "NoSchedule" }] },
        "status": { "conditions": [{ "type": "FabricReady", "status": "False",
            "reason": "PortDown", "message": "mlx5_0 port 1 is DOWN" }],
            "addresses": [{ "type": "InternalIP", "address": ip(i) }] },
    });
    let bad: Node = serde_json::from_value(v).expect("a Node");
    n.spec = bad.spec;
    n.status = bad.status;
    n
}

/// The Workload at `rv`: quota reserved, its pod set `main` placed by TAS on `hosts`, our
/// check `Pending` (retried `retry_count` times before).
fn workload(rv: &str, hosts: &[String], retry_count: Option<i64>) -> DynamicObject {
    workload_with(
        rv,
        json!([{
            "name": "main", "count": hosts.len(), "flavors": { "nvidia.com/gpu": "gpu" },
            "topologyAssignment": { "levels": [HOSTNAME_LABEL], "slices": [{
                "domainCount": hosts.len(),
                "valuesPerLevel": [{ "individual": { "roots": hosts } }] }] },
        }]),
        retry_count,
    )
}

fn workload_with(rv: &str, pod_sets: Value, retry_count: Option<i64>) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": WL, "namespace": NS, "uid": WL_UID, "resourceVersion": rv },
        "status": {
            "conditions": [{ "type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                             "message": "", "lastTransitionTime": RESERVED }],
            "admission": { "clusterQueue": "cq", "podSetAssignments": pod_sets },
            "admissionChecks": [{ "name": OURS, "state": "Pending", "message": "",
                                  "lastTransitionTime": RESERVED, "retryCount": retry_count }],
        },
    }))
    .expect("a Workload")
}

/// Our AdmissionCheck, `Active` for its generation.
fn admission_check(active: bool) -> DynamicObject {
    let status = if active {
        json!({ "conditions": [{ "type": "Active", "status": "True", "observedGeneration": 1 }] })
    } else {
        json!({})
    };
    serde_json::from_value(json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
        "metadata": { "name": OURS, "generation": 1 },
        "spec": { "controllerName": CONTROLLER_NAME },
        "status": status,
    }))
    .expect("an AdmissionCheck")
}

/// The ring over `gpu-0` .. `gpu-<n-1>` the check creates, due at `deadline`.
fn ring(n: usize, deadline: &str) -> CheckSpec {
    let gang = settings().gang;
    CheckSpec {
        workload: WorkloadRef {
            namespace: NS.to_owned(),
            name: WL.to_owned(),
            uid: WL_UID.to_owned(),
        },
        members: (0..n)
            .map(|i| Member {
                node: host(i),
                endpoint: format!("{}:9465", ip(i)),
                gids: Vec::new(),
            })
            .collect(),
        min_bandwidth_gbps: gang.min_bandwidth_gbps,
        max_rtt_micros: gang.max_rtt_micros,
        deadline: deadline.to_owned(),
    }
}

fn check_name() -> String {
    model::fabric_check_name(NS, WL, WL_UID)
}

/// The FabricCheck in flight for `spec`, made for the reservation `reservation`: labelled
/// for each member's watch.
fn check(spec: &CheckSpec, reservation: &str) -> DynamicObject {
    let mut fc = half_made(spec, reservation);
    for m in &spec.members {
        kube::ResourceExt::labels_mut(&mut fc)
            .insert(fabriccheck::member_label(&m.node), "true".to_owned());
    }
    fc
}

/// The FabricCheck for `spec` as its maker created it, before it labelled it for the members
/// (no agent asked yet).
fn half_made(spec: &CheckSpec, reservation: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheck",
        "metadata": { "name": check_name(), "namespace": GANG_NS, "uid": CHECK_UID,
                      "labels": { CHECK_LABEL.0: CHECK_LABEL.1 },
                      "annotations": { RESERVATION_ANNOTATION: reservation } },
        "spec": spec,
    }))
    .expect("a FabricCheck")
}

/// Member `i`'s answer to the check of `spec`: its pair to the next member measured over
/// RDMA (`ok` or not), and the previous member's pair received.
fn answer(spec: &CheckSpec, i: usize, ok: bool) -> DynamicObject {
    let n = spec.members.len();
    let result = PairResult {
        node: host(i),
        peer: host((i + 1) % n),
        ok,
        rdma: Rdma::Measured,
        device: Some("mlx5_0".to_owned()),
        port: Some(1),
        rtt_micros: Some(4.0 + i as f64),
        bandwidth_gbps: Some(180.0),
        error: (!ok).then(|| "timeout: no completion".to_owned()),
        received: Some(Received {
            peer: host((i + n - 1) % n),
            ok: true,
            rdma: Rdma::Measured,
            ..Received::default()
        }),
        ..PairResult::default()
    };
    let check = FabricCheck {
        name: check_name(),
        uid: CHECK_UID.to_owned(),
        spec: spec.clone(),
    };
    let mut v = fabriccheck::empty_result_object(&check, &result.node, &result.peer);
    v["spec"] = fabriccheck::result_fill(&check, &result)["spec"].clone();
    let mut obj: DynamicObject = serde_json::from_value(v).expect("an answer");
    obj.metadata.namespace = Some(GANG_NS.to_owned());
    obj
}

/// What the leader's stores hold.
#[derive(Default)]
struct Cache {
    workloads: Vec<DynamicObject>,
    nodes: Vec<Node>,
    checks: Vec<DynamicObject>,
    results: Vec<DynamicObject>,
    admission_checks: Vec<DynamicObject>,
    flavors: Vec<DynamicObject>,
    pods: Vec<Pod>,
}

fn store<K>(dyntype: K::DynamicType, objects: Vec<K>) -> Store<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone,
{
    let mut writer = Writer::new(dyntype);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::Apply(o));
    }
    writer.as_reader()
}

impl Cache {
    fn stores(self) -> Stores {
        let dynamic = |ar: ApiResource, objects| store::<DynamicObject>(ar, objects);
        Stores {
            workloads: dynamic(model::workloads(), self.workloads),
            nodes: store((), self.nodes),
            checks: dynamic(fabriccheck::checks(), self.checks),
            results: dynamic(fabriccheck::results(), self.results),
            admission_checks: dynamic(model::admission_checks(), self.admission_checks),
            flavors: dynamic(model::resource_flavors(), self.flavors),
            pods: store((), self.pods),
            created: Default::default(),
        }
    }
}
