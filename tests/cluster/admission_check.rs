//! `fabricgate admission-check` against the real kube-apiserver with Kueue's own CRDs
//! (`tests/common/kueue_crds.rs`). The test plays Kueue's scheduler (it writes a Workload's
//! quota reservation, its topology assignment and the check's `Pending` state, as Kueue
//! does) and each member node's agent (it fills that node's FabricCheckResult, which the
//! controller created empty, as the agent does). The controller runs as its own
//! process with the shipped ServiceAccount and RBAC (deploy/admission-check.yaml). The
//! end-to-end tests with Kueue itself running are the `kueue` tests.

use crate::common::controlplane::{AuditEvent, ControlPlane, Grant, rbac_grants};
use crate::common::{control_plane, http_get, kueue_crds, last_lines, poll_until, sample};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The namespace of the FabricChecks (gang.namespace) and of the controller's Role and Lease.
const NS: &str = "fabricgate";
/// deploy/admission-check.yaml's AdmissionCheck.
pub(crate) const CHECK: &str = "fabricgate-preflight";
const SA_USER: &str = "system:serviceaccount:fabricgate:fabricgate-admission-check";
const LEAF: &str = kueue_crds::LEAF_LABEL;
const MANIFEST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/admission-check.yaml");

pub(crate) struct Env {
    /// Kueue's manager is not running meanwhile: it would reconcile the Workloads these
    /// tests write by hand (`tests/common/kueue.rs`).
    _without_kueue: std::sync::RwLockReadGuard<'static, ()>,
    pub(crate) cp: &'static ControlPlane,
    kubeconfig: PathBuf,
    scratch: tempfile::TempDir,
}

/// Kueue's CRDs, the agents' namespace, the shipped manifest (its Deployment stays inert: no
/// kubelet runs it here) and a kubeconfig with the controller's ServiceAccount token.
pub(crate) fn setup() -> Option<Env> {
    let cp = control_plane()?;
    let without_kueue = crate::common::kueue::Kueue::without();
    kueue_crds::install(cp)?;
    cp.install_agent_rbac();
    kueue_crds::apply_admission_check(cp);
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("admission-check.kubeconfig");
    kueue_crds::admission_check_kubeconfig(cp, &kubeconfig);
    Some(Env {
        _without_kueue: without_kueue,
        cp,
        kubeconfig,
        scratch,
    })
}

pub(crate) struct Controller {
    child: Child,
    log: PathBuf,
    identity: String,
    metrics: String,
}

impl Controller {
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub(crate) fn wait(&self, what: &str, limit: Duration, f: impl FnMut() -> bool) -> Duration {
        poll_until(what, limit, Duration::from_millis(20), f, || {
            format!(
                "; log of {}:\n{}",
                self.identity,
                last_lines(&self.log(), 40)
            )
        })
    }

    pub(crate) fn metric(&self, series: &str) -> f64 {
        let (code, _, body) = http_get(&self.metrics, "/metrics", None);
        assert_eq!(code, 200, "{body}");
        sample(&body, series).unwrap_or_else(|| panic!("no {series} in:\n{body}"))
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `gang:` with `timeout`, RDMA required.
fn config(env: &Env, name: &str, timeout: &str) -> PathBuf {
    let path = env.scratch.path().join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!("gang:\n  namespace: {NS}\n  timeout: {timeout}\n  require_rdma: true\n"),
    )
    .unwrap();
    path
}

/// The controller, serving only `workload_ns`'s Workloads, electing on Lease `lease`.
pub(crate) fn start(
    env: &Env,
    identity: &str,
    lease: &str,
    workload_ns: &str,
    config: &Path,
) -> Controller {
    let log = env.scratch.path().join(format!("{identity}.log"));
    let metrics = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["admission-check", "--config"])
        .arg(config)
        .args(["--namespace", NS, "--lease-name", lease])
        .args(["--lease-duration", "3s", "--poll-interval", "300ms"])
        .args(["--identity", identity, "--workload-namespace", workload_ns])
        .args(["--metrics-addr", &metrics])
        .env("KUBECONFIG", &env.kubeconfig)
        .env("HOME", env.scratch.path())
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start fabricgate admission-check");
    let c = Controller {
        child,
        log,
        identity: identity.to_owned(),
        metrics,
    };
    c.wait("its /metrics", Duration::from_secs(10), || {
        crate::common::try_http_get(&c.metrics, "/healthz", None, Duration::from_secs(1)).is_some()
    });
    c
}

fn holder(cp: &ControlPlane, lease: &str) -> Option<String> {
    cp.get_json(&format!(
        "/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{lease}"
    ))?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_owned)
}

/// A GPU Node as its agent leaves it: validated (label, `FabricReady=True`, no taint) or
/// not (`FabricReady=False` `RdmaPortDown`, label false, the taint), with its peers endpoint.
pub(crate) fn gpu_node(cp: &ControlPlane, name: &str, leaf: &str, validated: bool) {
    let taints = if validated {
        json!([])
    } else {
        json!([{ "key": "fabricgate.io/unvalidated", "effect": "NoSchedule" }])
    };
    cp.create_node(
        name,
        json!({ LEAF: leaf, "fabricgate.io/ready": if validated { "true" } else { "false" } }),
        taints,
        json!({}),
    );
    set_fabric(cp, name, validated);
    // The address its agent's --peers-listen names, as the kubelet reports it.
    let ip = endpoint(name)
        .split(':')
        .next()
        .unwrap_or_default()
        .to_owned();
    cp.patch_node_status(
        name,
        &json!({ "status": { "addresses": [
            { "type": "InternalIP", "address": ip }, { "type": "Hostname", "address": name }] } }),
    );
    cp.kubectl(&[
        "annotate",
        "node",
        name,
        "--overwrite",
        &format!("fabricgate.io/peers-endpoint={}", endpoint(name)),
        // Its ports' addresses, as its agent publishes them (one malformed entry, dropped).
        &format!("fabricgate.io/peers-gids={},mlx5_9/1=garbage", gids(name)),
    ]);
}

/// The `fabricgate.io/peers-gids` entry Node `name`'s agent publishes.
fn gids(name: &str) -> String {
    format!(
        "mlx5_0/1=lid:{}",
        name.bytes().map(u32::from).sum::<u32>() % 1000 + 1
    )
}

/// The peers endpoint Node `name`'s agent publishes.
fn endpoint(name: &str) -> String {
    let host = name.bytes().map(u32::from).sum::<u32>() % 250 + 1;
    format!("10.9.0.{host}:9465")
}

pub(crate) fn set_fabric(cp: &ControlPlane, name: &str, validated: bool) {
    let now = "2026-12-01T00:00:00Z";
    let condition = if validated {
        json!({ "type": "FabricReady", "status": "True", "reason": "Validated",
                "message": "all requirements met", "lastHeartbeatTime": now,
                "lastTransitionTime": now })
    } else {
        json!({ "type": "FabricReady", "status": "False", "reason": "RdmaPortDown",
                "message": "mlx5_0 port 1 is DOWN", "lastHeartbeatTime": now,
                "lastTransitionTime": now })
    };
    // Merge by type with the kubelet's Ready condition (a strategic merge, as the agent's).
    cp.kubectl(&[
        "patch",
        "node",
        name,
        "--subresource=status",
        "--type=strategic",
        "-p",
        &json!({ "status": { "conditions": [condition] } }).to_string(),
    ]);
}

/// Validate `name` again, as its agent would once its port is back.
pub(crate) fn validate(cp: &ControlPlane, name: &str) {
    set_fabric(cp, name, true);
    cp.kubectl(&[
        "label",
        "node",
        name,
        "--overwrite",
        "fabricgate.io/ready=true",
    ]);
    cp.kubectl(&["taint", "node", name, "fabricgate.io/unvalidated-"]);
}

fn api(
    cp: &ControlPlane,
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
    ns: &str,
) -> Api<DynamicObject> {
    let ar =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    Api::namespaced_with(cp.admin(), ns, &ar)
}

pub(crate) fn workloads(cp: &ControlPlane, ns: &str) -> Api<DynamicObject> {
    api(cp, "kueue.x-k8s.io", "v1beta2", "Workload", "workloads", ns)
}

fn fabric_check_results(cp: &ControlPlane) -> Api<DynamicObject> {
    api(
        cp,
        "fabricgate.io",
        "v1alpha1",
        "FabricCheckResult",
        "fabriccheckresults",
        NS,
    )
}

fn ensure_namespace(cp: &ControlPlane, ns: &str) {
    cp.apply(
        &json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": ns } }).to_string(),
    );
}

/// A Workload of one pod set of `nodes.len()` pods, as Kueue's Job integration makes it;
/// returns its uid.
pub(crate) fn create_workload(cp: &ControlPlane, ns: &str, name: &str, pods: usize) -> String {
    ensure_namespace(cp, ns);
    let wl = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": name, "namespace": ns },
        "spec": {
            "queueName": "gpu",
            "podSets": [{ "name": "main", "count": pods, "template": { "spec": {
                "restartPolicy": "Never",
                "containers": [{ "name": "worker", "image": "registry.example.com/train:1",
                    "resources": { "requests": { "cpu": "1" } } }] } } }],
        },
    });
    cp.apply(&wl.to_string());
    cp.get_json(&format!(
        "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/{name}"
    ))
    .expect("the Workload")["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Kueue's scheduler reserving quota at `when`, all `nodes` in leaf `leaf`, our check
/// `Pending` (`kueue_crds::reserve`).
/// Workload `name` in `ns`, one pod per node, its quota reserved on `nodes` of `leaf` at
/// `when`: the name of the FabricCheck controller `c` created for it (waited for).
fn reserved_gang(
    cp: &ControlPlane,
    c: &Controller,
    ns: &str,
    name: &str,
    leaf: &str,
    nodes: &[&str],
    when: &str,
) -> String {
    let uid = create_workload(cp, ns, name, nodes.len());
    reserve(cp, ns, name, leaf, nodes, when);
    let fc = fc_name(ns, name, &uid);
    c.wait("the FabricCheck", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some()
    });
    // Labelled for each member, whose agent watches only the checks labelled for its Node,
    // once every member's empty answer is there.
    c.wait("the FabricCheck labelled", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some_and(|check| labelled_for(&check, nodes))
    });
    let check = fabric_check(cp, &fc).expect("the FabricCheck");
    let uid = check["metadata"]["uid"].as_str().unwrap_or_default();
    assert_eq!(
        crate::common::fabriccheck_answers(cp, uid).len(),
        nodes.len(),
        "an empty answer per member before the members are asked"
    );
    fc
}

pub(crate) fn reserve(
    cp: &ControlPlane,
    ns: &str,
    name: &str,
    leaf: &str,
    nodes: &[&str],
    when: &str,
) {
    kueue_crds::reserve(cp, ns, name, CHECK, Some(leaf), nodes, when);
}

/// Our check's (state, message) on the Workload.
pub(crate) fn check_state(cp: &ControlPlane, ns: &str, name: &str) -> (String, String) {
    let wl = cp
        .get_json(&format!(
            "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/{name}"
        ))
        .expect("the Workload");
    crate::common::kueue_crds::check_entry(&wl, CHECK)
}

fn fc_name(ns: &str, name: &str, uid: &str) -> String {
    format!("{ns}.{name}.{}", &uid[..8])
}

fn fabric_check(cp: &ControlPlane, name: &str) -> Option<Value> {
    cp.get_json(&format!(
        "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{name}"
    ))
}

/// The merge patch with which member `result["node"]`'s agent fills its answer.
fn fill(result: &Value) -> Value {
    let mut spec = result.clone();
    if spec.get("finishedAt").is_none() {
        spec["finishedAt"] = "2026-12-02T03:00:07Z".into();
    }
    json!({ "spec": spec })
}

/// Whether FabricCheck `check` is labelled for the watch of each of `nodes`' agents.
fn labelled_for(check: &Value, nodes: &[&str]) -> bool {
    nodes.iter().all(|node| {
        let label = fabricgate::gang::fabriccheck::member_label(node);
        check["metadata"]["labels"][&label] == "true"
    })
}

/// Member `result["node"]`'s answer, filled as its agent fills it: once the check is labelled
/// for the member (the agent watches only such checks, labelled once the controller made
/// every member's empty answer), a merge patch of its empty answer.
fn answer(cp: &ControlPlane, fc: &str, result: Value) {
    let node = result["node"].as_str().unwrap();
    let t0 = Instant::now();
    let uid = loop {
        let check = fabric_check(cp, fc);
        if let Some(check) = &check
            && labelled_for(check, &[node])
        {
            break check["metadata"]["uid"].as_str().unwrap().to_owned();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "FabricCheck {fc} not labelled for {node} in 10 s: {check:#?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let name = format!("{uid}.{node}");
    if let Err(e) = cp.block_on(fabric_check_results(cp).patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(&fill(&result)),
    )) {
        panic!("fill {name} of FabricCheck {fc} labelled for {node}: {e}");
    }
}

/// [`answer`], when the FabricCheck and the answer are still there.
fn try_answer(cp: &ControlPlane, fc: &str, result: Value) {
    let Some(uid) =
        fabric_check(cp, fc).and_then(|f| f["metadata"]["uid"].as_str().map(str::to_owned))
    else {
        return;
    };
    let name = format!("{uid}.{}", result["node"].as_str().unwrap());
    let _ = cp.block_on(fabric_check_results(cp).patch(
        &name,
        &PatchParams::default(),
        &Patch::Merge(&fill(&result)),
    ));
}

/// A good answer of a member of a ring of two: its peer is also its predecessor.
fn good(node: &str, peer: &str) -> Value {
    good_from(node, peer, peer)
}

/// A good answer: `node` measured `peer`, and attests its receiving end of `prev`'s pair.
fn good_from(node: &str, peer: &str, prev: &str) -> Value {
    json!({ "node": node, "peer": peer, "ok": true, "rdma": "measured", "device": "mlx5_0",
            "port": 1, "rttMicros": 14.2, "bandwidthGbps": 92.1,
            "finishedAt": "2026-12-02T03:00:07Z",
            "received": { "peer": prev, "ok": true, "rdma": "measured",
                "rails": [{ "device": "mlx5_0", "port": 1, "ok": true, "bytes": 1024 }] } })
}

/// The Events recorded on Workload `name`.
pub(crate) fn workload_events(cp: &ControlPlane, ns: &str, name: &str) -> Vec<Value> {
    cp.get_json(&format!("/apis/events.k8s.io/v1/namespaces/{ns}/events"))
        .map(|l| l["items"].as_array().cloned().unwrap_or_default())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["regarding"]["kind"] == "Workload" && e["regarding"]["name"] == name)
        .collect()
}

/// The FabricCheck of a Workload: every member in name order with its endpoint.
fn members(fc: &Value) -> Vec<(String, String)> {
    fc["spec"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["node"].as_str().unwrap().to_owned(),
                m["endpoint"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[test]
fn admission_check_retries_an_unvalidated_node_then_a_good_ring_is_ready() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-ring";
    for (i, name) in ["ac-ring-0", "ac-ring-1", "ac-ring-2"].iter().enumerate() {
        gpu_node(cp, name, "leaf-r", i != 1);
    }
    let config = config(&env, "ring", "20s");
    let c = start(&env, "ac-ring-a", "ac-test-ring", ns, &config);
    c.wait("the Lease", Duration::from_secs(10), || {
        holder(cp, "ac-test-ring").as_deref() == Some("ac-ring-a")
    });

    // Quota reserved on the three nodes, one of which lost its port: Retry, naming it and
    // its reason, with an Event; no FabricCheck is made.
    let uid = create_workload(cp, ns, "train", 3);
    let t0 = Instant::now();
    reserve(
        cp,
        ns,
        "train",
        "leaf-r",
        &["ac-ring-2", "ac-ring-0", "ac-ring-1"],
        "2026-12-02T03:00:00Z",
    );
    c.wait("Retry", Duration::from_secs(10), || {
        check_state(cp, ns, "train").0 == "Retry"
    });
    eprintln!(
        "quota reserved -> Retry (node unvalidated): {:?}",
        t0.elapsed()
    );
    let (_, message) = check_state(cp, ns, "train");
    assert!(
        message.contains("ac-ring-1") && message.contains("RdmaPortDown"),
        "{message}"
    );
    assert!(!message.contains("ac-ring-0"), "{message}");
    let fc = fc_name(ns, "train", &uid);
    assert!(
        fabric_check(cp, &fc).is_none(),
        "no pre-flight on an unvalidated gang"
    );
    c.wait("the Retry Event", Duration::from_secs(5), || {
        workload_events(cp, ns, "train")
            .iter()
            .any(|e| e["reason"] == "FabricPreflightRetry" && e["type"] == "Warning")
    });

    // The node validates again; Kueue re-reserves (after a Retry it evicts and requeues).
    validate(cp, "ac-ring-1");
    reserve(
        cp,
        ns,
        "train",
        "leaf-r",
        &["ac-ring-2", "ac-ring-0", "ac-ring-1"],
        "2026-12-02T03:00:05Z",
    );
    c.wait("the FabricCheck", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some()
    });
    let obj = fabric_check(cp, &fc).unwrap();
    let want: Vec<(String, String)> = ["ac-ring-0", "ac-ring-1", "ac-ring-2"]
        .iter()
        .map(|n| ((*n).to_owned(), endpoint(n)))
        .collect();
    assert_eq!(
        members(&obj),
        want,
        "the ring in name order, with each Node's endpoint"
    );
    // And the addresses each Node publishes of its ports, well-formed entries only: the
    // dialling member holds the responder's ENDPOINT to them.
    for m in obj["spec"]["members"].as_array().unwrap() {
        let node = m["node"].as_str().unwrap();
        assert_eq!(m["gids"], json!([gids(node)]), "{m}");
    }
    assert_eq!(obj["spec"]["workload"]["uid"], uid.as_str());
    assert_eq!(obj["spec"]["workload"]["namespace"], ns);
    assert_eq!(obj["metadata"]["labels"]["fabricgate.io/check"], "gang");
    // The shipped floor and ceiling.
    assert_eq!(obj["spec"]["minBandwidthGbps"], 25.0);
    assert_eq!(obj["spec"]["maxRttMicros"], 50.0);
    let deadline: k8s_openapi::jiff::Timestamp =
        obj["spec"]["deadline"].as_str().unwrap().parse().unwrap();
    let ahead = deadline.duration_since(k8s_openapi::jiff::Timestamp::now());
    assert!(
        ahead.as_secs() > 10 && ahead.as_secs() <= 21,
        "deadline {deadline}: created + gang.timeout"
    );

    // Each member's empty answer, made by the controller (the agents only fill
    // them), then the check labelled for the members' watches.
    let check_uid = obj["metadata"]["uid"].as_str().unwrap().to_owned();
    c.wait("the members labelled", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some_and(|o| {
            want.iter().all(|(n, _)| {
                o["metadata"]["labels"][fabricgate::gang::fabriccheck::member_label(n)] == "true"
            })
        })
    });
    let empty = crate::common::fabriccheck_answers(cp, &check_uid);
    assert_eq!(empty.len(), 3, "{empty:?}");
    for (i, (node, _)) in want.iter().enumerate() {
        let a = empty
            .iter()
            .find(|a| a["spec"]["node"] == node.as_str())
            .unwrap_or_else(|| panic!("no answer for {node}: {empty:?}"));
        assert_eq!(a["metadata"]["name"], format!("{check_uid}.{node}"));
        assert_eq!(
            a["spec"],
            json!({ "check": fc, "checkUID": check_uid, "node": node,
                    "peer": want[(i + 1) % 3].0 }),
            "empty, for the member to fill"
        );
        assert_eq!(
            a["metadata"]["ownerReferences"][0]["uid"],
            check_uid.as_str()
        );
        assert_eq!(
            a["metadata"]["labels"]["fabricgate.io/fabriccheck-uid"],
            check_uid.as_str()
        );
    }
    // Two of three answered: still Pending, also with a good answer from a node that is not
    // a member (only the controller and system:masters may create one; the controller counts
    // only the members').
    answer(cp, &fc, good_from("ac-ring-0", "ac-ring-1", "ac-ring-2"));
    answer(cp, &fc, good_from("ac-ring-1", "ac-ring-2", "ac-ring-0"));
    let outsider: DynamicObject = serde_json::from_value(crate::common::fabriccheck_answer(
        &fc,
        &check_uid,
        &good("ac-outsider", "ac-ring-0"),
    ))
    .unwrap();
    cp.block_on(fabric_check_results(cp).create(&PostParams::default(), &outsider))
        .expect("an admin's answer for a node that is not a member");
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(check_state(cp, ns, "train").0, "Pending", "{}", c.log());
    let t1 = Instant::now();
    answer(cp, &fc, good_from("ac-ring-2", "ac-ring-0", "ac-ring-1"));
    c.wait("Ready", Duration::from_secs(5), || {
        check_state(cp, ns, "train").0 == "Ready"
    });
    eprintln!("last result -> Ready: {:?}", t1.elapsed());
    let (_, message) = check_state(cp, ns, "train");
    assert!(message.contains("3 pairs"), "{message}");
    c.wait("the FabricCheck deleted", Duration::from_secs(5), || {
        fabric_check(cp, &fc).is_none()
    });
    c.wait(
        "its answers deleted with it",
        Duration::from_secs(5),
        || crate::common::fabriccheck_answers(cp, &check_uid).is_empty(),
    );
    // The entry is ours, by server-side apply; Kueue's fields are untouched.
    let wl = cp
        .get_json(&format!(
            "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/train"
        ))
        .unwrap();
    assert_eq!(wl["status"]["admission"]["clusterQueue"], "gpu");
    let managers: Vec<&str> = wl["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert!(
        managers.contains(&"fabricgate-admission-check"),
        "{managers:?}"
    );
    assert_eq!(
        c.metric("fabricgate_admission_checks_total{result=\"ready\"}"),
        1.0
    );
    assert_eq!(
        c.metric("fabricgate_admission_checks_total{result=\"retry\"}"),
        1.0
    );
    assert_eq!(c.metric("fabricgate_gang_pair_failures_total"), 0.0);
}

#[test]
fn admission_check_retries_a_failed_pair_and_a_timeout_never_ready() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-fail";
    gpu_node(cp, "ac-fail-0", "leaf-f", true);
    gpu_node(cp, "ac-fail-1", "leaf-f", true);
    let config = config(&env, "fail", "3s");
    let c = start(&env, "ac-fail-a", "ac-test-fail", ns, &config);

    // One pair fails: Retry naming the pair, the port and the error.
    let fc = reserved_gang(
        cp,
        &c,
        ns,
        "pair",
        "leaf-f",
        &["ac-fail-0", "ac-fail-1"],
        "2026-12-02T03:10:00Z",
    );
    answer(cp, &fc, good("ac-fail-0", "ac-fail-1"));
    let error = "timeout: no RDMA WRITE completion from ac-fail-0 (10.9.0.9:9465) within 2s";
    answer(
        cp,
        &fc,
        json!({ "node": "ac-fail-1", "peer": "ac-fail-0", "ok": false, "rdma": "measured",
                "device": "mlx5_1", "port": 1, "error": error,
                "received": { "peer": "ac-fail-0", "ok": true, "rdma": "measured" } }),
    );
    c.wait("Retry", Duration::from_secs(5), || {
        check_state(cp, ns, "pair").0 == "Retry"
    });
    let (_, message) = check_state(cp, ns, "pair");
    assert!(
        message.contains("ac-fail-1 -> ac-fail-0 (mlx5_1 port 1)") && message.contains(error),
        "{message}"
    );
    c.wait("the FabricCheck deleted", Duration::from_secs(5), || {
        fabric_check(cp, &fc).is_none()
    });
    assert_eq!(c.metric("fabricgate_gang_pair_failures_total"), 1.0);
    c.wait("the Retry Event", Duration::from_secs(5), || {
        workload_events(cp, ns, "pair").iter().any(|e| {
            e["reason"] == "FabricPreflightRetry"
                && e["note"].as_str().unwrap_or("").contains("mlx5_1")
        })
    });

    // One member never answers: Retry at the deadline (gang.timeout 3s), naming it; the
    // state is never Ready on the way.
    let uid = create_workload(cp, ns, "silent", 2);
    let t0 = Instant::now();
    reserve(
        cp,
        ns,
        "silent",
        "leaf-f",
        &["ac-fail-0", "ac-fail-1"],
        "2026-12-02T03:10:10Z",
    );
    let fc = fc_name(ns, "silent", &uid);
    c.wait("the FabricCheck", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some()
    });
    answer(cp, &fc, good("ac-fail-0", "ac-fail-1"));
    let mut seen = BTreeSet::new();
    c.wait("Retry after the deadline", Duration::from_secs(10), || {
        let (state, _) = check_state(cp, ns, "silent");
        seen.insert(state.clone());
        state == "Retry"
    });
    let took = t0.elapsed();
    eprintln!("quota reserved -> Retry on timeout (gang.timeout 3s): {took:?}");
    assert!(!seen.contains("Ready"), "{seen:?}");
    assert!(
        took >= Duration::from_secs(3),
        "decided before the deadline: {took:?}"
    );
    let (_, message) = check_state(cp, ns, "silent");
    assert!(
        message.contains("timed out")
            && message.contains("ac-fail-1")
            && !message.contains("ac-fail-0,"),
        "{message}"
    );
    c.wait("the FabricCheck deleted", Duration::from_secs(5), || {
        fabric_check(cp, &fc).is_none()
    });
    assert_eq!(
        c.metric("fabricgate_admission_checks_total{result=\"retry\"}"),
        2.0
    );
    assert_eq!(
        c.metric("fabricgate_admission_checks_total{result=\"ready\"}"),
        0.0
    );
}

#[test]
fn admission_check_leader_fails_over_keeps_the_check_active_and_uses_only_its_grants() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-lease";
    let mark = cp.audit_mark();
    gpu_node(cp, "ac-lease-0", "leaf-l", true);
    gpu_node(cp, "ac-lease-1", "leaf-l", true);
    let config = config(&env, "lease", "10s");
    let lease = "ac-test-lease";
    let a = start(&env, "ac-lease-a", lease, ns, &config);
    let b = start(&env, "ac-lease-b", lease, ns, &config);
    a.wait("a leader", Duration::from_secs(10), || {
        holder(cp, lease).is_some()
    });
    let leader = holder(cp, lease).unwrap();
    let (mut first, second) = if leader == a.identity { (a, b) } else { (b, a) };

    // The AdmissionCheck is Active (Kueue leaves a ClusterQueue inactive without it).
    let active = || {
        cp.get_json(&format!(
            "/apis/kueue.x-k8s.io/v1beta2/admissionchecks/{CHECK}"
        ))
        .and_then(|ac| {
            ac["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == "Active").cloned())
        })
    };
    first.wait("Active=True", Duration::from_secs(10), || {
        active().is_some_and(|c| c["status"] == "True")
    });

    // The leader takes a gang to Ready ...
    let run = |c: &Controller, name: &str, when: &str| {
        let uid = create_workload(cp, ns, name, 2);
        reserve(cp, ns, name, "leaf-l", &["ac-lease-1", "ac-lease-0"], when);
        let fc = fc_name(ns, name, &uid);
        c.wait("the FabricCheck", Duration::from_secs(15), || {
            fabric_check(cp, &fc).is_some()
        });
        answer(cp, &fc, good("ac-lease-0", "ac-lease-1"));
        answer(cp, &fc, good("ac-lease-1", "ac-lease-0"));
        c.wait("Ready", Duration::from_secs(5), || {
            check_state(cp, ns, name).0 == "Ready"
        });
    };
    run(&first, "before", "2026-12-02T03:20:00Z");
    assert!(
        !second.log().contains("gang pre-flight started"),
        "the follower acted: {}",
        second.log()
    );
    // ... dies; the other takes the Lease once it expires (3s) and carries on, with a
    // FabricCheck the dead leader had created.
    let uid = create_workload(cp, ns, "during", 2);
    reserve(
        cp,
        ns,
        "during",
        "leaf-l",
        &["ac-lease-0", "ac-lease-1"],
        "2026-12-02T03:20:10Z",
    );
    let fc = fc_name(ns, "during", &uid);
    first.wait("the FabricCheck", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some()
    });
    let _ = first.child.kill();
    let _ = first.child.wait();
    let t0 = Instant::now();
    second.wait("the Lease taken over", Duration::from_secs(10), || {
        holder(cp, lease).as_deref() == Some(second.identity.as_str())
    });
    eprintln!("leader killed -> Lease taken over: {:?}", t0.elapsed());
    answer(cp, &fc, good("ac-lease-0", "ac-lease-1"));
    answer(cp, &fc, good("ac-lease-1", "ac-lease-0"));
    second.wait("Ready from the new leader", Duration::from_secs(10), || {
        check_state(cp, ns, "during").0 == "Ready"
    });
    run(&second, "after", "2026-12-02T03:20:20Z");

    // Least privilege, from the audit log: every request of the controllers was within
    // deploy/admission-check.yaml's grants, and none was refused.
    let requests: Vec<AuditEvent> = cp
        .audit_since(mark)
        .into_iter()
        .filter(|e| e.user == SA_USER)
        .collect();
    let refused: Vec<_> = requests.iter().filter(|e| e.code == 403).collect();
    assert!(refused.is_empty(), "refused: {refused:#?}");
    let used: BTreeSet<Grant> = requests.iter().map(AuditEvent::grant).collect();
    let manifest = std::fs::read_to_string(MANIFEST).unwrap();
    let granted = rbac_grants(&manifest, |d| {
        d["kind"] == "ClusterRole" || d["kind"] == "Role"
    });
    let beyond: Vec<_> = used.difference(&granted).collect();
    assert!(beyond.is_empty(), "used beyond the grants: {beyond:?}");
    // And the ServiceAccount cannot do what it does not need.
    let can = |args: &[&str]| -> bool {
        let mut argv = vec!["auth", "can-i"];
        argv.extend_from_slice(args);
        argv.extend_from_slice(&["--as", SA_USER]);
        let (_, out, _) = cp.kubectl_as(&cp.admin_kubeconfig, &argv, None);
        out.trim() == "yes"
    };
    for allowed in [
        &[
            "patch",
            "workloads.kueue.x-k8s.io",
            "--subresource=status",
            "-n",
            ns,
        ][..],
        &["create", "fabricchecks.fabricgate.io", "-n", NS],
        &["patch", "fabricchecks.fabricgate.io", "-n", NS],
        &["delete", "fabricchecks.fabricgate.io", "-n", NS],
        // Each member's empty answer; only the agents fill them.
        &["create", "fabriccheckresults.fabricgate.io", "-n", NS],
        &[
            "deletecollection",
            "fabriccheckresults.fabricgate.io",
            "-n",
            NS,
        ],
        &["watch", "fabriccheckresults.fabricgate.io", "-n", NS],
        &["watch", "nodes"],
    ] {
        assert!(can(allowed), "cannot {allowed:?}");
    }
    for denied in [
        &["patch", "workloads.kueue.x-k8s.io", "-n", ns][..],
        &[
            "update",
            "workloads.kueue.x-k8s.io",
            "--subresource=status",
            "-n",
            ns,
        ],
        &["delete", "workloads.kueue.x-k8s.io", "-n", ns],
        &[
            "patch",
            "fabricchecks.fabricgate.io",
            "--subresource=status",
            "-n",
            NS,
        ],
        &["update", "fabricchecks.fabricgate.io", "-n", NS],
        &["patch", "fabriccheckresults.fabricgate.io", "-n", NS],
        &["update", "fabriccheckresults.fabricgate.io", "-n", NS],
        &["create", "fabricchecks.fabricgate.io", "-n", "default"],
        &["patch", "nodes"],
        &["create", "pods", "-n", ns],
        &["get", "secrets", "-n", NS],
        &["patch", "clusterqueues.kueue.x-k8s.io"],
        &["update", "leases.coordination.k8s.io", "-n", "kube-system"],
    ] {
        assert!(!can(denied), "can {denied:?}");
    }
}

/// A leader killed between creating a FabricCheck and labelling it for its members (CI,
/// 2026-12-05: the failover test's leader died in that moment, and the agents' answers had
/// nowhere to go) leaves a check no agent was asked: the next leader makes it again, with a
/// whole gang.timeout, and the gang is Ready on the members' answers to it.
#[test]
fn admission_check_a_check_its_dead_leader_never_labelled_is_made_again() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-half";
    let nodes = ["ac-half-0", "ac-half-1"];
    for node in nodes {
        gpu_node(cp, node, "leaf-h", true);
    }
    let config = config(&env, "half", "20s");
    let lease = "ac-half-lease";
    let mut first = start(&env, "ac-half-a", lease, ns, &config);
    let uid = create_workload(cp, ns, "gang", 2);
    reserve(cp, ns, "gang", "leaf-h", &nodes, "2026-12-02T03:30:00Z");
    let fc = fc_name(ns, "gang", &uid);
    first.wait("the FabricCheck made", Duration::from_secs(15), || {
        fabric_check(cp, &fc).is_some_and(|c| labelled_for(&c, &nodes))
    });
    let _ = first.child.kill();
    let _ = first.child.wait();
    // What the leader leaves when killed just after its create: the check alone, no member
    // asked.
    let old = fabric_check(cp, &fc).expect("the FabricCheck");
    let old_uid = old["metadata"]["uid"].as_str().unwrap().to_owned();
    cp.block_on(fabric_check_results(cp).delete_collection(
        &kube::api::DeleteParams::default(),
        &kube::api::ListParams::default().labels(&format!(
            "{}={old_uid}",
            fabricgate::gang::fabriccheck::CHECK_UID_LABEL
        )),
    ))
    .expect("delete the answers");
    let unlabel: serde_json::Map<String, Value> = nodes
        .iter()
        .map(|n| (fabricgate::gang::fabriccheck::member_label(n), Value::Null))
        .collect();
    cp.block_on(
        api(
            cp,
            "fabricgate.io",
            "v1alpha1",
            "FabricCheck",
            "fabricchecks",
            NS,
        )
        .patch(
            &fc,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "metadata": { "labels": unlabel } })),
        ),
    )
    .expect("unlabel the FabricCheck");
    assert!(crate::common::fabriccheck_answers(cp, &old_uid).is_empty());
    let left = fabric_check(cp, &fc).unwrap();
    assert!(
        nodes.iter().all(|n| left["metadata"]["labels"]
            [&fabricgate::gang::fabriccheck::member_label(n)]
            .is_null()),
        "{left:#}"
    );

    let second = start(&env, "ac-half-b", lease, ns, &config);
    let t0 = Instant::now();
    second.wait(
        "the FabricCheck made again",
        Duration::from_secs(15),
        || {
            fabric_check(cp, &fc).is_some_and(|c| {
                c["metadata"]["uid"] != old_uid.as_str() && labelled_for(&c, &nodes)
            })
        },
    );
    eprintln!(
        "figure: half-made FabricCheck made again by the new leader {:?} after it started",
        t0.elapsed()
    );
    let new = fabric_check(cp, &fc).unwrap();
    let new_uid = new["metadata"]["uid"].as_str().unwrap();
    assert_eq!(
        crate::common::fabriccheck_answers(cp, new_uid).len(),
        2,
        "an empty answer per member"
    );
    assert_ne!(
        new["spec"]["deadline"], old["spec"]["deadline"],
        "a whole gang.timeout again"
    );
    assert!(second.log().contains("is made again"), "{}", second.log());
    answer(cp, &fc, good("ac-half-0", "ac-half-1"));
    answer(cp, &fc, good("ac-half-1", "ac-half-0"));
    second.wait("Ready", Duration::from_secs(10), || {
        check_state(cp, ns, "gang").0 == "Ready"
    });
}

/// Kueue without Topology Aware Scheduling: no nodes are assigned, so no ring can be tested.
/// Before: such a pod set was `Ready` on node validation alone. Now, with
/// `gang.require_topology` (the default), it is `Retry` saying why, and no FabricCheck is
/// made; with `gang.require_topology: false`, only node validation is checked: at least
/// `count` Nodes of the flavor's `nodeLabels` validated, and the message says the RDMA
/// pre-flight did not run.
#[test]
fn redteam_a_pod_set_without_topology_is_not_ready_unless_allowed() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-notas";
    let pool = "fabricgate.io/test-flavor";
    for (i, name) in ["ac-notas-0", "ac-notas-1", "ac-notas-2"]
        .iter()
        .enumerate()
    {
        gpu_node(cp, name, "leaf-n", i != 2);
        cp.kubectl(&[
            "label",
            "node",
            name,
            "--overwrite",
            &format!("{pool}=notas"),
        ]);
    }
    cp.apply(
        &json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
            "metadata": { "name": "ac-notas" },
            "spec": { "nodeLabels": { pool: "notas" } },
        })
        .to_string(),
    );
    let reserve_flavor = |name: &str, pods: usize, when: &str| {
        let body = json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": { "name": name, "namespace": ns },
            "status": {
                "conditions": [{ "type": "QuotaReserved", "status": "True",
                    "reason": "QuotaReserved", "message": "Quota reserved in ClusterQueue gpu",
                    "lastTransitionTime": when }],
                "admission": { "clusterQueue": "gpu", "podSetAssignments": [{
                    "name": "main", "flavors": { "cpu": "ac-notas" }, "count": pods,
                    "resourceUsage": { "cpu": pods.to_string() } }] },
                "admissionChecks": [{ "name": CHECK, "state": "Pending", "message": "",
                    "lastTransitionTime": when }],
            },
        });
        cp.block_on(workloads(cp, ns).patch_status(
            name,
            &PatchParams::apply("kueue-admission").force(),
            &Patch::Apply(&body),
        ))
        .expect("reserve quota");
    };
    // The default: not Ready, whatever the nodes.
    let strict = start(
        &env,
        "ac-notas-strict",
        "ac-test-notas-strict",
        ns,
        &config(&env, "notas-strict", "5s"),
    );
    let uid = create_workload(cp, ns, "bare", 2);
    reserve_flavor("bare", 2, "2026-12-02T03:29:50Z");
    strict.wait("Retry", Duration::from_secs(10), || {
        check_state(cp, ns, "bare").0 == "Retry"
    });
    let (_, message) = check_state(cp, ns, "bare");
    assert!(
        message.contains("pod set main has no topology assignment")
            && message.contains("gang.require_topology is true")
            && message.contains("attempt 1 of gang.max_attempts"),
        "{message}"
    );
    assert_eq!(check_entry_json(cp, ns, "bare")["requeueAfterSeconds"], 5);
    assert!(fabric_check(cp, &fc_name(ns, "bare", &uid)).is_none());
    drop(strict);

    // Allowed: node validation alone.
    let config = config_with(&env, "notas", "5s", "  require_topology: false\n");
    let c = start(&env, "ac-notas-a", "ac-test-notas", ns, &config);
    // Two of the flavor's three nodes are validated: enough for two pods ...
    create_workload(cp, ns, "two", 2);
    reserve_flavor("two", 2, "2026-12-02T03:30:00Z");
    c.wait("Ready", Duration::from_secs(10), || {
        check_state(cp, ns, "two").0 == "Ready"
    });
    let (_, message) = check_state(cp, ns, "two");
    assert!(
        message.contains("no topology assignment")
            && message.contains("2 of 3 nodes of flavor ac-notas validated")
            && message.contains("did not run"),
        "{message}"
    );
    // ... not for three: Retry, naming the unvalidated one.
    create_workload(cp, ns, "three", 3);
    reserve_flavor("three", 3, "2026-12-02T03:30:10Z");
    c.wait("Retry", Duration::from_secs(10), || {
        check_state(cp, ns, "three").0 == "Retry"
    });
    let (_, message) = check_state(cp, ns, "three");
    assert!(
        message.contains("2 of the 3 nodes of flavor ac-notas are validated")
            && message.contains("ac-notas-2: FabricReady=False (RdmaPortDown"),
        "{message}"
    );
}

/// Our check's entry on the Workload, whole (state, message, `requeueAfterSeconds`, ...).
pub(crate) fn check_entry_json(cp: &ControlPlane, ns: &str, name: &str) -> Value {
    let wl = cp
        .get_json(&format!(
            "/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/{name}"
        ))
        .expect("the Workload");
    wl["status"]["admissionChecks"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == CHECK)
        .cloned()
        .unwrap_or(Value::Null)
}

/// A config with `extra` lines under `gang:` (RDMA required, `timeout`).
pub(crate) fn config_with(env: &Env, name: &str, timeout: &str, extra: &str) -> PathBuf {
    let path = env.scratch.path().join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!("gang:\n  namespace: {NS}\n  timeout: {timeout}\n  require_rdma: true\n{extra}"),
    )
    .unwrap();
    path
}

/// A `Retry` used to carry no `requeueAfterSeconds`, so Kueue reserved again
/// at once (TAS picking the same nodes, a StrictFIFO queue blocked behind the gang), forever.
/// Now the delay doubles with Kueue's `retryCount` (the Kueue CRD accepts the field: the
/// write is validated against Kueue v0.19's own schema) and the Workload is `Rejected` after
/// `gang.max_attempts` failures.
#[test]
fn redteam_a_failing_gang_is_retried_with_backoff_then_rejected() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-backoff";
    gpu_node(cp, "ac-backoff-0", "leaf-bo", true);
    gpu_node(cp, "ac-backoff-1", "leaf-bo", true);
    gpu_node(cp, "ac-backoff-2", "leaf-bo", false);
    let config = config_with(
        &env,
        "backoff",
        "5s",
        "  retry_backoff: 3s\n  retry_backoff_max: 20s\n  max_attempts: 4\n",
    );
    let c = start(&env, "ac-backoff-a", "ac-test-backoff", ns, &config);
    let nodes = ["ac-backoff-0", "ac-backoff-1"];
    let reserve = |name: &str, nodes: &[&str], when: &str, retries: Option<u32>| {
        kueue_crds::reserve_retried(cp, ns, name, CHECK, Some("leaf-bo"), nodes, when, retries);
    };
    let fail_pair = |uid: &str, name: &str| {
        let fc = fc_name(ns, name, uid);
        c.wait("the FabricCheck", Duration::from_secs(10), || {
            fabric_check(cp, &fc).is_some()
        });
        answer(cp, &fc, good("ac-backoff-0", "ac-backoff-1"));
        answer(
            cp,
            &fc,
            json!({ "node": "ac-backoff-1", "peer": "ac-backoff-0", "ok": false,
                    "rdma": "measured", "device": "mlx5_0", "port": 1,
                    "error": "timeout: no RDMA WRITE completion within 2s" }),
        );
    };

    // First failure (no retryCount yet): Retry, Kueue to wait gang.retry_backoff.
    let uid = create_workload(cp, ns, "flaky", 2);
    reserve("flaky", &nodes, "2026-12-02T04:00:00Z", None);
    fail_pair(&uid, "flaky");
    c.wait("Retry", Duration::from_secs(10), || {
        check_state(cp, ns, "flaky").0 == "Retry"
    });
    let entry = check_entry_json(cp, ns, "flaky");
    assert_eq!(entry["requeueAfterSeconds"], 3, "{entry}");
    let message = entry["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("ac-backoff-1 -> ac-backoff-0") && message.contains("attempt 1 of"),
        "{message}"
    );

    // Kueue counted two retries: the third failure waits 3 s × 2² = 12 s. An unvalidated node
    // (no pre-flight) backs off the same way.
    reserve(
        "flaky",
        &["ac-backoff-0", "ac-backoff-2"],
        "2026-12-02T04:00:10Z",
        Some(2),
    );
    c.wait(
        "Retry on the unvalidated node",
        Duration::from_secs(10),
        || {
            let e = check_entry_json(cp, ns, "flaky");
            e["state"] == "Retry" && e["message"].as_str().unwrap_or("").contains("ac-backoff-2")
        },
    );
    let entry = check_entry_json(cp, ns, "flaky");
    assert_eq!(entry["requeueAfterSeconds"], 12, "{entry}");

    // The fourth failure (retryCount 3, gang.max_attempts 4): Rejected, no more retries, an
    // Event, the metric.
    reserve("flaky", &nodes, "2026-12-02T04:00:20Z", Some(3));
    fail_pair(&uid, "flaky");
    c.wait("Rejected", Duration::from_secs(10), || {
        check_state(cp, ns, "flaky").0 == "Rejected"
    });
    let entry = check_entry_json(cp, ns, "flaky");
    assert!(entry.get("requeueAfterSeconds").is_none(), "{entry}");
    let message = entry["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("failed 4 times (gang.max_attempts 4)")
            && message.contains("ac-backoff-1 -> ac-backoff-0"),
        "{message}"
    );
    c.wait("the Rejected Event", Duration::from_secs(5), || {
        workload_events(cp, ns, "flaky")
            .iter()
            .any(|e| e["reason"] == "FabricPreflightRejected" && e["type"] == "Warning")
    });
    assert_eq!(
        c.metric("fabricgate_admission_checks_total{result=\"rejected\"}"),
        1.0
    );
    assert_eq!(
        c.metric("fabricgate_admission_checks_total{result=\"retry\"}"),
        2.0
    );
}

/// A FabricCheck was reused when the Workload's uid and the reservation time
/// (to the second) matched, without comparing its members with the new assignment: a gang
/// evicted and placed again within the second on other nodes was released on the old nodes'
/// answers. Now the members are compared, and a check of other nodes is replaced.
#[test]
fn redteam_a_stale_check_is_not_reused_for_other_nodes() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-stale";
    for name in ["ac-stale-0", "ac-stale-1", "ac-stale-2", "ac-stale-3"] {
        gpu_node(cp, name, "leaf-st", true);
    }
    let config = config(&env, "stale", "20s");
    let c = start(&env, "ac-stale-a", "ac-test-stale", ns, &config);
    let uid = create_workload(cp, ns, "moved", 2);
    let when = "2026-12-02T04:10:00Z";
    reserve(
        cp,
        ns,
        "moved",
        "leaf-st",
        &["ac-stale-0", "ac-stale-1"],
        when,
    );
    let fc = fc_name(ns, "moved", &uid);
    c.wait("the FabricCheck", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some()
    });
    let old_uid = fabric_check(cp, &fc).unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned();
    // Placed again, in the same second, on two other nodes.
    reserve(
        cp,
        ns,
        "moved",
        "leaf-st",
        &["ac-stale-2", "ac-stale-3"],
        when,
    );
    std::thread::sleep(Duration::from_millis(300));
    // The old members answer the old check (their answers are good).
    if fabric_check(cp, &fc).is_some_and(|f| f["metadata"]["uid"] == old_uid.as_str()) {
        try_answer(cp, &fc, good("ac-stale-0", "ac-stale-1"));
        try_answer(cp, &fc, good("ac-stale-1", "ac-stale-0"));
    }
    c.wait(
        "a FabricCheck of the new nodes",
        Duration::from_secs(10),
        || {
            fabric_check(cp, &fc).is_some_and(|f| {
                f["metadata"]["uid"] != old_uid.as_str()
                    && members(&f).iter().map(|m| m.0.as_str()).collect::<Vec<_>>()
                        == ["ac-stale-2", "ac-stale-3"]
            })
        },
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        check_state(cp, ns, "moved").0,
        "Pending",
        "released on another gang's answers: {}",
        c.log()
    );
    answer(cp, &fc, good("ac-stale-2", "ac-stale-3"));
    answer(cp, &fc, good("ac-stale-3", "ac-stale-2"));
    c.wait("Ready", Duration::from_secs(10), || {
        check_state(cp, ns, "moved").0 == "Ready"
    });
}

/// The peers endpoint annotation was put into the FabricCheck as written
/// (any host and port: the members' agents dialled it, and their errors quoting it went into
/// the tenant's Workload status). Now only one of the Node's own `status.addresses` at the
/// configured peers port is accepted; another value is a `Retry` naming the node, never the
/// value.
#[test]
fn redteam_a_peers_endpoint_not_of_the_node_is_refused_and_not_echoed() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-endpoint";
    for name in ["ac-ep-0", "ac-ep-1", "ac-ep-2"] {
        gpu_node(cp, name, "leaf-ep", true);
    }
    let config = config(&env, "endpoint", "20s");
    let c = start(&env, "ac-ep-a", "ac-test-endpoint", ns, &config);
    let bad = [
        ("ac-ep-1", "169.254.169.254:9465".to_owned()),
        (
            "ac-ep-2",
            format!(
                "{}:22 <b>fabric verified, contact evil.example</b>",
                endpoint("ac-ep-2").split(':').next().unwrap()
            ),
        ),
    ];
    for (node, value) in &bad {
        cp.kubectl(&[
            "annotate",
            "node",
            node,
            "--overwrite",
            &format!("fabricgate.io/peers-endpoint={value}"),
        ]);
    }
    let uid = create_workload(cp, ns, "ep", 3);
    reserve(
        cp,
        ns,
        "ep",
        "leaf-ep",
        &["ac-ep-0", "ac-ep-1", "ac-ep-2"],
        "2026-12-02T04:20:00Z",
    );
    c.wait("Retry", Duration::from_secs(10), || {
        check_state(cp, ns, "ep").0 == "Retry"
    });
    let (_, message) = check_state(cp, ns, "ep");
    assert!(
        message.contains("2 assigned nodes publish a peers endpoint")
            && message.contains("ac-ep-1, ac-ep-2")
            && message.contains("status.addresses"),
        "{message}"
    );
    for needle in ["169.254.169.254", "evil.example", "<b>", ":22"] {
        assert!(!message.contains(needle), "{needle} echoed: {message}");
    }
    assert!(
        fabric_check(cp, &fc_name(ns, "ep", &uid)).is_none(),
        "no pre-flight dials a foreign endpoint"
    );
    // Each agent writes its own address back: the pre-flight runs.
    for (node, _) in &bad {
        cp.kubectl(&[
            "annotate",
            "node",
            node,
            "--overwrite",
            &format!("fabricgate.io/peers-endpoint={}", endpoint(node)),
        ]);
    }
    reserve(
        cp,
        ns,
        "ep",
        "leaf-ep",
        &["ac-ep-0", "ac-ep-1", "ac-ep-2"],
        "2026-12-02T04:20:10Z",
    );
    c.wait("the FabricCheck", Duration::from_secs(10), || {
        fabric_check(cp, &fc_name(ns, "ep", &uid)).is_some()
    });
}

/// The controller's resident memory, KiB.
fn rss_kib(c: &Controller) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/status", c.child.id()))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Any `checkUID`, no limit on their number, and every labelled answer held
/// in the controller's cache (a 256Mi container) let whoever may create a FabricCheckResult
/// (every agent) run the controller out of memory. Now the CRD takes only a uid-shaped
/// `checkUID`, the controller keeps only answers to live checks (a gang is still judged on
/// its members' answers), and the shipped ResourceQuota bounds their count. (Now no agent
/// may create an answer at all, only the controller and system:masters: the
/// flood here is an admin's.)
#[test]
fn redteam_an_answer_flood_neither_fills_the_controller_nor_is_unbounded() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-flood";
    gpu_node(cp, "ac-flood-0", "leaf-fl", true);
    gpu_node(cp, "ac-flood-1", "leaf-fl", true);
    let config = config(&env, "flood", "20s");
    let c = start(&env, "ac-flood-a", "ac-test-flood", ns, &config);
    c.wait("the Lease", Duration::from_secs(10), || {
        holder(cp, "ac-test-flood").as_deref() == Some("ac-flood-a")
    });
    let results = fabric_check_results(cp);
    let flood_answer = |uid: &str, i: usize, error: &str| -> DynamicObject {
        let mut v = crate::common::fabriccheck_answer(
            &format!("{ns}.flood.{i}"),
            uid,
            &json!({ "node": format!("flood-{i}"), "peer": "x", "ok": true, "rdma": "measured",
                     "error": error }),
        );
        v["metadata"]["labels"]["fabricgate.io/test-flood"] = json!(ns);
        serde_json::from_value(v).unwrap()
    };

    // Not a uid: refused by the CRD's schema.
    let e = cp
        .block_on(results.create(&PostParams::default(), &flood_answer("flood-0", 0, "")))
        .unwrap_err();
    assert!(
        matches!(&e, kube::Error::Api(a) if a.code == 422 && a.message.contains("checkUID")),
        "{e}"
    );

    // 1500 answers of 4 KiB each to checks that do not exist.
    std::thread::sleep(Duration::from_secs(1));
    let before = rss_kib(&c);
    let error = "e".repeat(4000);
    let t0 = Instant::now();
    let created = cp.block_on(async {
        use futures::StreamExt;
        futures::stream::iter(0..1500usize)
            .map(|i| {
                let obj = flood_answer(&format!("f100d000-0000-4000-8000-{i:012x}"), i, &error);
                let results = results.clone();
                async move { results.create(&PostParams::default(), &obj).await.is_ok() }
            })
            .buffer_unordered(16)
            .filter(|ok| futures::future::ready(*ok))
            .count()
            .await
    });
    eprintln!("flood: {created} answers created in {:?}", t0.elapsed());
    assert_eq!(created, 1500);
    std::thread::sleep(Duration::from_secs(3));
    let after = rss_kib(&c);
    eprintln!("controller RSS {before} KiB -> {after} KiB after 1500 answers of 4 KiB to no check");
    assert!(
        after < before + 6 * 1024,
        "the controller holds the flood: {before} KiB -> {after} KiB"
    );
    // (the other tests' live checks share the namespace: their few answers are kept)
    let cached = c.metric("fabricgate_gang_answers_cached");
    assert!(cached < 100.0, "{cached} answers cached");

    // A gang is still judged on its members' answers.
    let fc = reserved_gang(
        cp,
        &c,
        ns,
        "real",
        "leaf-fl",
        &["ac-flood-0", "ac-flood-1"],
        "2026-12-02T04:30:00Z",
    );
    answer(cp, &fc, good("ac-flood-0", "ac-flood-1"));
    answer(cp, &fc, good("ac-flood-1", "ac-flood-0"));
    c.wait("Ready", Duration::from_secs(10), || {
        check_state(cp, ns, "real").0 == "Ready"
    });
    let lp = kube::api::ListParams::default().labels(&format!("fabricgate.io/test-flood={ns}"));
    cp.block_on(results.delete_collection(&kube::api::DeleteParams::default(), &lp))
        .expect("delete the flood");

    // The shipped ResourceQuota, in a namespace of its own (the shared control plane runs no
    // quota controller: the test plays it, counting what is there, as it would).
    let quota_ns = "ac-quota";
    ensure_namespace(cp, quota_ns);
    let manifest = std::fs::read_to_string(MANIFEST).unwrap();
    let quota = manifest
        .split("\n---")
        .find(|d| d.contains("\nkind: ResourceQuota"))
        .expect("deploy/admission-check.yaml ships a ResourceQuota");
    let mut quota: Value = serde_norway::from_str(quota).unwrap();
    let key = "count/fabriccheckresults.fabricgate.io";
    let hard: u64 = quota["spec"]["hard"][key]
        .as_str()
        .and_then(|h| h.parse().ok())
        .expect("a count of FabricCheckResults");
    assert!((256..=65536).contains(&hard), "{hard}");
    quota["metadata"]["namespace"] = json!(quota_ns);
    cp.apply(&quota.to_string());
    let quota_name = quota["metadata"]["name"].as_str().unwrap().to_owned();
    // As if `hard - 2` answers were there (creating thousands would only slow the suite).
    cp.kubectl(&[
        "-n",
        quota_ns,
        "patch",
        "resourcequota",
        &quota_name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &json!({ "status": { "hard": { key: hard.to_string() },
                             "used": { key: (hard - 2).to_string() } } })
        .to_string(),
    ]);
    let in_quota: Api<DynamicObject> = api(
        cp,
        "fabricgate.io",
        "v1alpha1",
        "FabricCheckResult",
        "fabriccheckresults",
        quota_ns,
    );
    let mut codes = Vec::new();
    for i in 0..3usize {
        let mut obj = flood_answer(&format!("f100d000-0000-4000-9000-{i:012x}"), i, "");
        obj.metadata.namespace = Some(quota_ns.to_owned());
        codes.push(
            match cp.block_on(in_quota.create(&PostParams::default(), &obj)) {
                Ok(_) => 201,
                Err(kube::Error::Api(e)) => {
                    assert!(e.message.contains("exceeded quota"), "{}", e.message);
                    e.code
                }
                Err(e) => panic!("{e}"),
            },
        );
    }
    assert_eq!(
        codes,
        [201, 201, 403],
        "the quota's {hard} answers, no more"
    );
}

/// The members were judged once, before the pre-flight; one whose agent
/// turned it `FabricReady=False` while the ring was measured was released with the gang on
/// its (earlier) good answer. Now it gives `Retry`, naming it, as docs/gangs.md says.
#[test]
fn redteam_a_member_failing_during_the_check_gives_retry() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-during";
    gpu_node(cp, "ac-during-0", "leaf-du", true);
    gpu_node(cp, "ac-during-1", "leaf-du", true);
    let config = config(&env, "during", "20s");
    let c = start(&env, "ac-during-a", "ac-test-during", ns, &config);
    let fc = reserved_gang(
        cp,
        &c,
        ns,
        "gang",
        "leaf-du",
        &["ac-during-0", "ac-during-1"],
        "2026-12-02T04:40:00Z",
    );
    answer(cp, &fc, good("ac-during-1", "ac-during-0"));
    // Its agent sees a port go down (the condition first; label and taint follow).
    set_fabric(cp, "ac-during-1", false);
    std::thread::sleep(Duration::from_millis(300));
    // (the check may be decided and gone already)
    try_answer(cp, &fc, good("ac-during-0", "ac-during-1"));
    c.wait("decided", Duration::from_secs(10), || {
        check_state(cp, ns, "gang").0 != "Pending"
    });
    let (state, message) = check_state(cp, ns, "gang");
    assert_eq!(state, "Retry", "{message}");
    assert!(
        message.contains("ac-during-1: FabricReady=False (RdmaPortDown")
            && message.contains("no longer validated"),
        "{message}"
    );
}

/// A Topology without a hostname level. Kueue then assigns domains (here a
/// leaf), not nodes, and a pod may land on any node of the domain. Before: the controller took
/// every Node of the domain as the gang (3 nodes for 2 pods, a FabricCheck over all of them:
/// the ring tested nodes the gang may not use, and not the nodes it will). Now `Retry` saying
/// that the Topology needs `kubernetes.io/hostname` as its lowest level; no FabricCheck.
#[test]
fn redteam_a_topology_without_a_hostname_level_is_not_a_gang() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-rack";
    for name in ["ac-rack-0", "ac-rack-1", "ac-rack-2"] {
        gpu_node(cp, name, "leaf-rack", true);
    }
    let c = start(
        &env,
        "ac-rack-a",
        "ac-test-rack",
        ns,
        &config(&env, "rack", "5s"),
    );
    let uid = create_workload(cp, ns, "racked", 2);
    let when = "2026-12-02T03:40:00Z";
    let body = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": "racked", "namespace": ns },
        "status": {
            "conditions": [{ "type": "QuotaReserved", "status": "True",
                "reason": "QuotaReserved", "message": "Quota reserved in ClusterQueue gpu",
                "lastTransitionTime": when }],
            "admission": { "clusterQueue": "gpu", "podSetAssignments": [{
                "name": "main", "flavors": { "cpu": "gpu" }, "count": 2,
                "resourceUsage": { "cpu": "2" },
                "topologyAssignment": { "levels": [LEAF],
                    "slices": [{ "domainCount": 1,
                        "valuesPerLevel": [{ "universal": "leaf-rack" }],
                        "podCounts": { "universal": 2 } }] } }] },
            "admissionChecks": [{ "name": CHECK, "state": "Pending", "message": "",
                "lastTransitionTime": when }],
        },
    });
    cp.block_on(workloads(cp, ns).patch_status(
        "racked",
        &PatchParams::apply("kueue-admission").force(),
        &Patch::Apply(&body),
    ))
    .expect("reserve quota");
    c.wait("Retry", Duration::from_secs(10), || {
        check_state(cp, ns, "racked").0 == "Retry"
    });
    let (_, message) = check_state(cp, ns, "racked");
    assert!(
        message.contains("pod set main")
            && message.contains("kubernetes.io/hostname")
            && message.contains("lowest level"),
        "{message}"
    );
    assert!(
        fabric_check(cp, &fc_name(ns, "racked", &uid)).is_none(),
        "no ring over the leaf's nodes"
    );
}

/// A compromised agent vouches for a broken link. Answers are
/// self-reported, and the pair a -> b was attested by a alone: its `ok: true` released the
/// gang whatever b saw. Now each member also attests its receiving end (what its own
/// responder saw of its predecessor's sessions for the check), and the controller requires
/// both ends of every pair to agree: b received nothing verified from a, so `Retry` naming
/// the pair.
#[test]
fn redteam_a_pair_vouched_for_by_one_end_only_is_not_ready() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-oneend";
    gpu_node(cp, "ac-oneend-0", "leaf-oe", true);
    gpu_node(cp, "ac-oneend-1", "leaf-oe", true);
    let config = config(&env, "oneend", "20s");
    let c = start(&env, "ac-oneend-a", "ac-test-oneend", ns, &config);
    let fc = reserved_gang(
        cp,
        &c,
        ns,
        "gang",
        "leaf-oe",
        &["ac-oneend-0", "ac-oneend-1"],
        "2026-12-02T04:50:00Z",
    );
    // ac-oneend-0's agent lies: ok, measured, for a link that carried nothing.
    answer(cp, &fc, good("ac-oneend-0", "ac-oneend-1"));
    // ac-oneend-1's honest agent: its own pair is fine, but nothing of ac-oneend-0's arrived.
    let mut honest = good("ac-oneend-1", "ac-oneend-0");
    honest["received"] = json!({ "peer": "ac-oneend-0", "ok": false, "rdma": "unmeasured",
        "error": "nothing received from ac-oneend-0 for this check" });
    answer(cp, &fc, honest);
    c.wait("decided", Duration::from_secs(10), || {
        check_state(cp, ns, "gang").0 != "Pending"
    });
    let (state, message) = check_state(cp, ns, "gang");
    assert_eq!(state, "Retry", "{message}");
    assert!(
        message.contains("failed on 1 of 2 pairs: ac-oneend-0 -> ac-oneend-1")
            && message.contains("the ends disagree")
            && message.contains("nothing received from ac-oneend-0"),
        "{message}"
    );
    drop(c);
}

/// "ok" proved little by default: one rail, 16 × 64-byte WRITEs, no
/// bandwidth, no RTT ceiling. Before: a pair answering `ok` over one rail at a 900 µs median
/// RTT and no bandwidth burst was `Ready`, and the FabricCheck asked for no minimum. Now the
/// check carries the shipped floor (`gang.min_bandwidth_gbps` 25) and ceiling
/// (`gang.max_rtt_micros` 50), a pair outside them is `Retry`, and so is one whose rails did
/// not all pass.
#[test]
fn redteam_ok_needs_every_rail_bandwidth_and_an_rtt_ceiling() {
    let Some(env) = setup() else { return };
    let cp = env.cp;
    let ns = "ac-rails";
    gpu_node(cp, "ac-rails-0", "leaf-rl", true);
    gpu_node(cp, "ac-rails-1", "leaf-rl", true);
    let config = config(&env, "rails", "20s");
    let c = start(&env, "ac-rails-a", "ac-test-rails", ns, &config);
    let nodes = ["ac-rails-0", "ac-rails-1"];
    let fc = reserved_gang(
        cp,
        &c,
        ns,
        "slow",
        "leaf-rl",
        &nodes,
        "2026-12-02T05:00:00Z",
    );
    let spec = fabric_check(cp, &fc).unwrap()["spec"].clone();
    assert_eq!(
        (
            spec["minBandwidthGbps"].as_f64(),
            spec["maxRttMicros"].as_f64()
        ),
        (Some(25.0), Some(50.0)),
        "the shipped floor and ceiling: {spec}"
    );
    // A slow path: 900 µs median, no burst run.
    for (node, peer) in [(nodes[0], nodes[1]), (nodes[1], nodes[0])] {
        let mut a = good(node, peer);
        a["rttMicros"] = json!(900.0);
        a.as_object_mut().unwrap().remove("bandwidthGbps");
        answer(cp, &fc, a);
    }
    c.wait("decided", Duration::from_secs(10), || {
        check_state(cp, ns, "slow").0 != "Pending"
    });
    let (state, message) = check_state(cp, ns, "slow");
    assert_eq!(state, "Retry", "{message}");
    assert!(
        message.contains("failed on 2 of 2 pairs") && message.contains("no bandwidth measured"),
        "{message}"
    );

    // Fast on its first rail, its second rail failed: not ok, naming the rail.
    let fc = reserved_gang(
        cp,
        &c,
        ns,
        "rail",
        "leaf-rl",
        &nodes,
        "2026-12-02T05:00:10Z",
    );
    let rails = json!([
        { "device": "mlx5_0", "port": 1, "ok": true, "rttMicros": 3.0, "bandwidthGbps": 92.1 },
        { "device": "mlx5_1", "port": 1, "ok": false, "rttMicros": 3.0,
          "error": "timeout: no RDMA WRITE completion" }]);
    let mut a = good(nodes[0], nodes[1]);
    a["rails"] = rails;
    answer(cp, &fc, a);
    answer(cp, &fc, good(nodes[1], nodes[0]));
    c.wait("decided", Duration::from_secs(10), || {
        check_state(cp, ns, "rail").0 != "Pending"
    });
    let (state, message) = check_state(cp, ns, "rail");
    assert_eq!(state, "Retry", "{message}");
    assert!(
        message.contains("ac-rails-0 -> ac-rails-1: rail mlx5_1 port 1: timeout"),
        "{message}"
    );
    drop(c);
}
