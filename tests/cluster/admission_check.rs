//! `fabricgate admission-check` against the real kube-apiserver with Kueue's own CRDs
//! (`tests/common/kueue_crds.rs`). The test plays Kueue's scheduler (it writes a Workload's
//! quota reservation, its topology assignment and the check's `Pending` state, as Kueue
//! does) and each member node's agent (it creates that node's FabricCheckResult as the agent
//! does). The controller runs as its own
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
const CHECK: &str = "fabricgate-preflight";
const SA_USER: &str = "system:serviceaccount:fabricgate:fabricgate-admission-check";
const LEAF: &str = kueue_crds::LEAF_LABEL;
const MANIFEST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/admission-check.yaml");

struct Env {
    /// Kueue's manager is not running meanwhile: it would reconcile the Workloads these
    /// tests write by hand (`tests/common/kueue.rs`).
    _without_kueue: std::sync::RwLockReadGuard<'static, ()>,
    cp: &'static ControlPlane,
    kubeconfig: PathBuf,
    scratch: tempfile::TempDir,
}

/// Kueue's CRDs, the agents' namespace, the shipped manifest (its Deployment stays inert: no
/// kubelet runs it here) and a kubeconfig with the controller's ServiceAccount token.
fn setup() -> Option<Env> {
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

struct Controller {
    child: Child,
    log: PathBuf,
    identity: String,
    metrics: String,
}

impl Controller {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn wait(&self, what: &str, limit: Duration, f: impl FnMut() -> bool) -> Duration {
        poll_until(what, limit, Duration::from_millis(20), f, || {
            format!(
                "; log of {}:\n{}",
                self.identity,
                last_lines(&self.log(), 40)
            )
        })
    }

    fn metric(&self, series: &str) -> f64 {
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
fn start(env: &Env, identity: &str, lease: &str, workload_ns: &str, config: &Path) -> Controller {
    let log = env.scratch.path().join(format!("{identity}.log"));
    let metrics = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["admission-check", "--config"])
        .arg(config)
        .args(["--namespace", NS, "--lease-name", lease])
        .args(["--lease-duration", "3s", "--poll-interval", "300ms"])
        .args(["--identity", identity, "--workload-namespace", workload_ns])
        .args(["--metrics-listen", &metrics])
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
fn gpu_node(cp: &ControlPlane, name: &str, leaf: &str, validated: bool) {
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
    cp.kubectl(&[
        "annotate",
        "node",
        name,
        "--overwrite",
        &format!("fabricgate.io/peers-endpoint={}", endpoint(name)),
    ]);
}

/// The peers endpoint Node `name`'s agent publishes.
fn endpoint(name: &str) -> String {
    let host = name.bytes().map(u32::from).sum::<u32>() % 250 + 1;
    format!("10.9.0.{host}:9465")
}

fn set_fabric(cp: &ControlPlane, name: &str, validated: bool) {
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
fn validate(cp: &ControlPlane, name: &str) {
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

fn workloads(cp: &ControlPlane, ns: &str) -> Api<DynamicObject> {
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
fn create_workload(cp: &ControlPlane, ns: &str, name: &str, pods: usize) -> String {
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
fn reserve(cp: &ControlPlane, ns: &str, name: &str, leaf: &str, nodes: &[&str], when: &str) {
    kueue_crds::reserve(cp, ns, name, CHECK, Some(leaf), nodes, when);
}

/// Our check's (state, message) on the Workload.
fn check_state(cp: &ControlPlane, ns: &str, name: &str) -> (String, String) {
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

/// Member `node`'s answer, created as its agent creates it (its own FabricCheckResult).
fn answer(cp: &ControlPlane, fc: &str, result: Value) {
    let uid = fabric_check(cp, fc).expect("the FabricCheck")["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned();
    let obj: DynamicObject =
        serde_json::from_value(crate::common::fabriccheck_answer(fc, &uid, &result)).unwrap();
    cp.block_on(fabric_check_results(cp).create(&PostParams::default(), &obj))
        .expect("create a member's answer");
}

fn good(node: &str, peer: &str) -> Value {
    json!({ "node": node, "peer": peer, "ok": true, "rdma": "measured", "device": "mlx5_0",
            "port": 1, "rttMicros": 14.2, "finishedAt": "2026-12-02T03:00:07Z" })
}

/// The Events recorded on Workload `name`.
fn workload_events(cp: &ControlPlane, ns: &str, name: &str) -> Vec<Value> {
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
    assert_eq!(obj["spec"]["workload"]["uid"], uid.as_str());
    assert_eq!(obj["spec"]["workload"]["namespace"], ns);
    assert_eq!(obj["metadata"]["labels"]["fabricgate.io/check"], "gang");
    assert!(obj["spec"].get("minBandwidthGbps").is_none());
    let deadline: k8s_openapi::jiff::Timestamp =
        obj["spec"]["deadline"].as_str().unwrap().parse().unwrap();
    let ahead = deadline.duration_since(k8s_openapi::jiff::Timestamp::now());
    assert!(
        ahead.as_secs() > 10 && ahead.as_secs() <= 21,
        "deadline {deadline}: created + gang.timeout"
    );

    // Two of three answered: still Pending, also with a good answer from a node that is not
    // a member (the policy lets any agent create its own answer; the controller counts only
    // the members').
    answer(cp, &fc, good("ac-ring-0", "ac-ring-1"));
    answer(cp, &fc, good("ac-ring-1", "ac-ring-2"));
    answer(cp, &fc, good("ac-outsider", "ac-ring-0"));
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(check_state(cp, ns, "train").0, "Pending", "{}", c.log());
    let t1 = Instant::now();
    answer(cp, &fc, good("ac-ring-2", "ac-ring-0"));
    c.wait("Ready", Duration::from_secs(5), || {
        check_state(cp, ns, "train").0 == "Ready"
    });
    eprintln!("last result -> Ready: {:?}", t1.elapsed());
    let (_, message) = check_state(cp, ns, "train");
    assert!(message.contains("3 pairs"), "{message}");
    let check_uid = obj["metadata"]["uid"].as_str().unwrap().to_owned();
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
    let uid = create_workload(cp, ns, "pair", 2);
    reserve(
        cp,
        ns,
        "pair",
        "leaf-f",
        &["ac-fail-0", "ac-fail-1"],
        "2026-12-02T03:10:00Z",
    );
    let fc = fc_name(ns, "pair", &uid);
    c.wait("the FabricCheck", Duration::from_secs(10), || {
        fabric_check(cp, &fc).is_some()
    });
    answer(cp, &fc, good("ac-fail-0", "ac-fail-1"));
    let error = "timeout: no RDMA WRITE completion from ac-fail-0 (10.9.0.9:9465) within 2s";
    answer(
        cp,
        &fc,
        json!({ "node": "ac-fail-1", "peer": "ac-fail-0", "ok": false, "rdma": "measured",
                "device": "mlx5_1", "port": 1, "error": error }),
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
        &["delete", "fabricchecks.fabricgate.io", "-n", NS],
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
        &["create", "fabriccheckresults.fabricgate.io", "-n", NS],
        &["patch", "fabriccheckresults.fabricgate.io", "-n", NS],
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

/// Kueue without Topology Aware Scheduling: no nodes are assigned, so only node validation
/// can be checked: at least `count` Nodes of the flavor's `nodeLabels` validated, and the
/// message says the RDMA pre-flight did not run.
#[test]
fn admission_check_without_topology_checks_the_flavors_nodes_only() {
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
    let config = config(&env, "notas", "5s");
    let c = start(&env, "ac-notas-a", "ac-test-notas", ns, &config);
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
