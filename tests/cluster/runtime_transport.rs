//! Runtime transport per pod against the real kube-apiserver: the shipped agent,
//! with the runtime-transport overlay's RBAC and admission policy installed, judges only the
//! pod that requests the RDMA resource; facts saying sockets set `fabricgate.io/TransportReady`
//! False/SocketsFallback through pods/status, an Event `TransportFallback` on the pod and on
//! its controller owner (a PyTorchJob), and the metrics; facts saying rdma set it True; steady state writes nothing; and
//! the agent's own token cannot set the condition on another node's pod nor touch anything
//! else of its own node's pod.
//!
//! The facts come through the agent's test seam `FABRICGATE_TEST_POD_FACTS` (src/transport/
//! sampler.rs, in test builds only): there is no kubelet here to run a pod, so no process holds QPs or moves
//! TCP. Everything after the sampler (the pods watch, judging, metrics, writes, the policy)
//! is the real path. The pod's controller owner is a PyTorchJob (Kubeflow's training
//! operator), an API this control plane does not serve: nothing here reconciles it. (A batch
//! Job would not do: once a Kueue test has started kube-controller-manager, the Job
//! controller releases a pod its selector does not match, taking the ownerReference away.
//! The real-node test, tests/node/runtime_transport.rs, has a real Job's pod.)

use crate::common::controlplane::{ControlPlane, client_from};
use crate::common::sysfs::FakeHca;
use crate::common::{AGENT_USER, Launch, control_plane, wait_until};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};
use std::path::Path;
use std::time::Duration;

const OWN: &str = "rt-own";
const OTHER: &str = "rt-other";
const NS: &str = "rt-jobs";
const PODS: &str = "/api/v1/namespaces/rt-jobs/pods";
const RESOURCE: &str = "rdma/hca_shared_devices_a";
/// The pods' transport at a glance, as docs/runtime-transport.md gives it.
const DOC_COLUMNS: &str = "custom-columns=POD:.metadata.name,NODE:.spec.nodeName,\
TRANSPORT:.status.conditions[?(@.type==\"fabricgate.io/TransportReady\")].status,\
REASON:.status.conditions[?(@.type==\"fabricgate.io/TransportReady\")].reason,\
WHY:.status.conditions[?(@.type==\"fabricgate.io/TransportReady\")].message";

fn overlay_file(name: &str) -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy/overlays/runtime-transport")
            .join(name),
    )
    .unwrap()
}

/// Create (server-side apply) `body` in `NS` and return it as stored. Retried while the
/// apiserver's ServiceAccount admission has not yet seen the namespace's new `default`.
fn create(cp: &ControlPlane, body: &Value, path: &str) -> Value {
    let args = [
        "apply",
        "--server-side",
        "--field-manager=test-admin",
        "-f",
        "-",
    ];
    let text = body.to_string();
    let mut last = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (ok, _, err) = cp.kubectl_as(&cp.admin_kubeconfig, &args, Some(&text));
        if ok {
            break;
        }
        last = err;
        assert!(
            std::time::Instant::now() < deadline,
            "create {text}: {last}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let _ = last;
    let name = body["metadata"]["name"].as_str().unwrap();
    cp.get_json(&format!("{path}/{name}")).unwrap()
}

fn pod(name: &str, node: &str, resource: &str, owner: Option<&Value>) -> Value {
    let mut meta = json!({"name": name, "namespace": NS});
    if let Some(job) = owner {
        meta["ownerReferences"] = json!([{
            "apiVersion": job["apiVersion"], "kind": job["kind"], "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"], "controller": true}]);
    }
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"nodeName": node, "automountServiceAccountToken": false, "containers": [{"name": "c", "image": "trainer:test",
            "resources": {"limits": {resource: "1"}, "requests": {resource: "1"}}}]}})
}

use crate::common::controlplane::WidenedRbac;

/// The agent of `node` with runtime transport on (window 5 s, `extra` added to `runtime:`), the
/// pods' facts read from `facts` through the test seam; the agent and its kubeconfig.
fn agent_with_facts(
    cp: &ControlPlane,
    hca: &FakeHca,
    node: &str,
    facts: &Path,
    extra: &str,
) -> (crate::common::agent::Agent, std::path::PathBuf) {
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!(
            "kubernetes:\n  rdma_resources: [\"{RESOURCE}\"]\nruntime:\n  enabled: true\n  \
             window: 5s\n{extra}"
        ),
    )
    .unwrap();
    let kubeconfig = cp.agent_kubeconfig(node, None);
    let (sysfs, proc_root) = (hca.sysfs_root(), hca.proc_root());
    let facts_env = facts.to_str().unwrap().to_owned();
    let env = [("FABRICGATE_TEST_POD_FACTS", facts_env.as_str())];
    let args = ["--interval", "1s", "--config", config.to_str().unwrap()];
    let agent = Launch::at(node, &sysfs, &proc_root, hca.scratch())
        .kubeconfig(Some(&kubeconfig))
        .args(&args)
        .env(&env)
        .known_addr()
        .start();
    (agent, kubeconfig)
}

fn condition(cp: &ControlPlane, name: &str) -> Option<(String, String)> {
    let p = cp.get_json(&format!("/api/v1/namespaces/{NS}/pods/{name}"))?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "fabricgate.io/TransportReady")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

fn fallback_events(cp: &ControlPlane, kind: &str, name: &str) -> Vec<Value> {
    let list = cp
        .get_json(&format!("/apis/events.k8s.io/v1/namespaces/{NS}/events"))
        .unwrap();
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["reason"] == "TransportFallback"
                && e["regarding"]["kind"] == kind
                && e["regarding"]["name"] == name
        })
        .cloned()
        .collect()
}

/// A strategic merge patch of the status of pod `ns/pod` as an agent (its pod-bound token in
/// `kubeconfig`): the agent's own request shape (`transport::writer`), no GET first. Ok, or the
/// error's code and message.
pub(crate) fn patch_as_agent(
    cp: &ControlPlane,
    kubeconfig: &Path,
    ns: &str,
    pod: &str,
    patch: &Value,
) -> Result<(), String> {
    cp.block_on(async {
        let pods: Api<Pod> = Api::namespaced(client_from(kubeconfig).await, ns);
        pods.patch_status(pod, &PatchParams::default(), &Patch::Strategic(patch))
            .await
            .map(|_| ())
            .map_err(|e| match e {
                kube::Error::Api(s) => format!("{} {}", s.code, s.message),
                e => e.to_string(),
            })
    })
}

#[test]
fn a_judged_pod_on_sockets_gets_the_condition_events_and_metric_and_nothing_else_is_touched() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let _widened = WidenedRbac::apply(cp);
    cp.apply(&overlay_file("pod-transport-policy.yaml"));
    cp.create_node(OWN, json!({}), json!([]), json!({}));
    cp.create_node(OTHER, json!({}), json!([]), json!({}));
    cp.create_namespace(NS);
    let job = json!({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "llm", "namespace": NS, "uid": "6d1f0c6e-3b5a-4f0e-9a57-2c1b8e9d4f10"}});
    let trainer = create(cp, &pod("trainer", OWN, RESOURCE, Some(&job)), PODS);
    let web = create(cp, &pod("web", OWN, "cpu", None), PODS);
    let far = create(cp, &pod("far", OTHER, RESOURCE, None), PODS);
    let uid = |p: &Value| p["metadata"]["uid"].as_str().unwrap().to_owned();

    let hca = FakeHca::new(true);
    let facts = hca.scratch().join("pod-facts");
    let sockets = format!(
        "{} sockets 41000000000 10.0.0.2 ib0\n{} sockets 41000000000 10.0.0.2 ib0\n",
        uid(&trainer),
        uid(&web)
    );
    std::fs::write(&facts, &sockets).unwrap();
    let (agent, kubeconfig) = agent_with_facts(cp, &hca, OWN, &facts, "");

    let took = wait_until(
        "the trainer's condition False/SocketsFallback",
        Duration::from_secs(60),
        || condition(cp, "trainer") == Some(("False".into(), "SocketsFallback".into())),
    );
    println!("figure: sockets facts -> condition False within {took:?} (window 5s)");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while fallback_events(cp, "Pod", "trainer").len() != 1
        || fallback_events(cp, "PyTorchJob", "llm").len() != 1
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the Events on the pod and its Job: {:#?}\nthe pod's metadata: {}\nagent log:\n{}",
            (
                fallback_events(cp, "Pod", "trainer"),
                fallback_events(cp, "PyTorchJob", "llm")
            ),
            cp.get_json(&format!("{PODS}/trainer"))
                .map(|p| p["metadata"].clone())
                .unwrap_or_default(),
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let on_job = &fallback_events(cp, "PyTorchJob", "llm")[0];
    let note = on_job["note"].as_str().unwrap();
    assert!(
        note.starts_with(&format!("pod {NS}/trainer is on sockets: ")),
        "{note}"
    );
    assert!(note.contains("ib0"), "the note names the facts: {note}");
    // What docs/runtime-transport.md ("Check it on a cluster") tells a person to run.
    let table = cp.kubectl(&["-n", NS, "get", "pods", "-o", DOC_COLUMNS]);
    let row = table
        .lines()
        .find(|l| l.starts_with("trainer "))
        .unwrap_or_default();
    assert!(
        row.contains("False") && row.contains("SocketsFallback") && row.contains("via ib0"),
        "{table}"
    );
    let events = cp.kubectl(&[
        "-n",
        NS,
        "get",
        "events",
        "--field-selector",
        "reason=TransportFallback",
    ]);
    assert_eq!(events.lines().count(), 3, "a header and 2 Events: {events}");
    println!("kubectl -n {NS} get pods -o {DOC_COLUMNS}\n{table}");
    println!("kubectl -n {NS} get events --field-selector reason=TransportFallback\n{events}");
    let (_, metrics) = agent.get("/metrics").unwrap();
    assert!(
        metrics.contains(&format!(
            "fabricgate_pod_transport{{namespace=\"{NS}\",pod=\"trainer\",transport=\"sockets\"}} 1"
        )),
        "{metrics}"
    );
    assert!(metrics.contains(&format!(
        "fabricgate_pod_owner_info{{namespace=\"{NS}\",pod=\"trainer\",owner_kind=\"PyTorchJob\",owner_name=\"llm\"}} 1"
    )));
    assert!(
        !metrics.contains("pod=\"web\""),
        "an unrelated pod is never judged"
    );
    assert_eq!(
        condition(cp, "web"),
        None,
        "an unrelated pod is never judged"
    );
    assert_eq!(condition(cp, "far"), None);

    // Steady state: two more windows, not one write by the agent.
    let mark = cp.audit_mark();
    std::thread::sleep(Duration::from_secs(11));
    let writes: Vec<_> = cp
        .audit_since(mark)
        .into_iter()
        // Other tests' agents share the user and write their Nodes' Events: this namespace only.
        .filter(|e| e.user == AGENT_USER && e.namespace == NS)
        .filter(|e| !matches!(e.verb.as_str(), "get" | "list" | "watch"))
        .collect();
    assert!(writes.is_empty(), "steady state wrote: {writes:?}");
    println!("figure: 0 pod/event writes over 2 steady windows");
    assert_eq!(
        fallback_events(cp, "Pod", "trainer").len(),
        1,
        "one Event per transition"
    );

    // On RDMA: True.
    std::fs::write(&facts, format!("{} rdma mlx5_0\n", uid(&trainer))).unwrap();
    wait_until(
        "the trainer's condition True",
        Duration::from_secs(30),
        || condition(cp, "trainer").is_some_and(|(s, _)| s == "True"),
    );

    // The policy: another node's pod, another condition, another status field: 403.
    let set = |s: &str| {
        json!({"status": {"conditions": [{"type": "fabricgate.io/TransportReady",
        "status": s, "reason": "SocketsFallback"}]}})
    };
    let refused = |pod: &str, patch: &Value, why: &str| {
        let e = patch_as_agent(cp, &kubeconfig, NS, pod, patch).unwrap_err();
        assert!(
            e.starts_with("403 ") && e.contains(why),
            "{pod} {patch}: {e}"
        );
    };
    refused(
        "far",
        &set("False"),
        "may not modify pod far of node rt-other",
    );
    refused(
        "trainer",
        &json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
        "may change only its own pod condition",
    );
    refused(
        "trainer",
        &json!({"status": {"phase": "Failed"}}),
        "may not change the pod status beyond its own condition",
    );
    patch_as_agent(cp, &kubeconfig, NS, "trainer", &set("False"))
        .expect("its own condition on its own node's pod is allowed");
    // The agent's patch carries the pod's UID (transport::pods::condition_patch): the pod it judged,
    // deleted and recreated under the same name, refuses it, and the new pod starts clean.
    let with_uid = |uid: &str| {
        let mut p = set("False");
        p["metadata"] = json!({"uid": uid});
        p
    };
    patch_as_agent(cp, &kubeconfig, NS, "trainer", &with_uid(&uid(&trainer)))
        .expect("the pod's own UID passes the policy");
    std::fs::write(&facts, "").unwrap();
    cp.kubectl(&[
        "-n",
        NS,
        "delete",
        "pod",
        "trainer",
        "--grace-period=0",
        "--force",
    ]);
    let again = create(cp, &pod("trainer", OWN, RESOURCE, Some(&job)), PODS);
    assert_ne!(uid(&again), uid(&trainer));
    let e = patch_as_agent(cp, &kubeconfig, NS, "trainer", &with_uid(&uid(&trainer)))
        .expect_err("a patch for the deleted pod refused on its namesake");
    // The real apiserver's answer: 422, "metadata.uid: ... field is immutable".
    assert!(e.starts_with("422 ") && e.contains("metadata.uid"), "{e}");
    assert_eq!(
        condition(cp, "trainer"),
        None,
        "the recreated pod starts clean"
    );
    let _ = uid(&far);
    let _ = web;
    drop(agent);
}

/// A tenant opting its pod out by a label: `app.kubernetes.io/name: fabricgate` (and the
/// agent's component label) on a training pod of its own namespace, moving its traffic over
/// sockets. It is judged like any other: the condition `False/SocketsFallback` and the metric.
/// fabricgate's own pod (in its namespace, controlled by its DaemonSet) is still never judged,
/// though its facts say sockets too. Before, the label alone kept the tenant's pod from every
/// condition, Event, metric, eviction and requeue.
#[test]
fn redteam_a_tenant_pod_labelled_fabricgate_is_judged_like_any_other() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let _widened = WidenedRbac::apply(cp);
    cp.apply(&overlay_file("pod-transport-policy.yaml"));
    let (node, ns) = ("rt-impostor", "rt-tenant");
    cp.create_node(node, json!({}), json!([]), json!({}));
    cp.create_namespace(ns);
    let mut impostor = pod("impostor", node, RESOURCE, None);
    impostor["metadata"]["namespace"] = json!(ns);
    impostor["metadata"]["labels"] = json!({
        "app.kubernetes.io/name": "fabricgate", "app.kubernetes.io/component": "agent"});
    let impostor = create(cp, &impostor, &format!("/api/v1/namespaces/{ns}/pods"));
    // The agent's own: a pod of a DaemonSet in fabricgate's namespace (a real DaemonSet
    // object, selecting no Node, so that no controller deletes or replaces the pod).
    let ds = create(
        cp,
        &json!({"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "fabricgate-redteam", "namespace": "fabricgate"},
            "spec": {"selector": {"matchLabels": {"app": "fg-redteam-own"}},
                "template": {"metadata": {"labels": {"app": "fg-redteam-own"}},
                    "spec": {"nodeSelector": {"fabricgate.io/no-such-node": "true"},
                        "containers": [{"name": "agent", "image": "fabricgate:test"}]}}}}),
        "/apis/apps/v1/namespaces/fabricgate/daemonsets",
    );
    let mut own = pod("own-agent", node, RESOURCE, Some(&ds));
    own["metadata"]["namespace"] = json!("fabricgate");
    own["metadata"]["labels"] = json!({"app": "fg-redteam-own"});
    // No ServiceAccount controller runs here: the namespace has only the agent's.
    own["spec"]["serviceAccountName"] = json!("fabricgate");
    let own = create(cp, &own, "/api/v1/namespaces/fabricgate/pods");
    let uid = |p: &Value| p["metadata"]["uid"].as_str().unwrap().to_owned();

    let hca = FakeHca::new(true);
    let facts = hca.scratch().join("pod-facts");
    std::fs::write(
        &facts,
        format!(
            "{} sockets 41000000000 10.0.0.2 ib0\n{} sockets 41000000000 10.0.0.2 ib0\n",
            uid(&impostor),
            uid(&own)
        ),
    )
    .unwrap();
    let (agent, _) = agent_with_facts(cp, &hca, node, &facts, "");
    let own_condition = || {
        cp.get_json("/api/v1/namespaces/fabricgate/pods/own-agent")
            .and_then(|p| {
                p["status"]["conditions"].as_array().map(|cs| {
                    cs.iter()
                        .any(|c| c["type"] == "fabricgate.io/TransportReady")
                })
            })
            .unwrap_or(false)
    };
    let pod_condition = || {
        cp.get_json(&format!("/api/v1/namespaces/{ns}/pods/impostor"))
            .and_then(|p| {
                p["status"]["conditions"].as_array().and_then(|cs| {
                    cs.iter()
                        .find(|c| c["type"] == "fabricgate.io/TransportReady")
                        .map(|c| format!("{}/{}", c["status"], c["reason"]))
                })
            })
    };
    crate::common::wait::poll_until(
        "the labelled tenant pod judged on sockets",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || pod_condition().as_deref() == Some("\"False\"/\"SocketsFallback\""),
        || agent.log(),
    );
    let (_, metrics) = agent.get("/metrics").unwrap();
    assert!(
        metrics.contains(&format!(
            "fabricgate_pod_transport{{namespace=\"{ns}\",pod=\"impostor\",transport=\"sockets\"}} 1"
        )),
        "{metrics}"
    );
    assert!(!own_condition(), "the agent's own pod is never judged");
    assert!(!metrics.contains("pod=\"own-agent\""), "{metrics}");
    drop(agent);
    cp.kubectl(&[
        "-n",
        "fabricgate",
        "delete",
        "pod",
        "own-agent",
        "--force",
        "--grace-period=0",
    ]);
    cp.kubectl(&[
        "-n",
        "fabricgate",
        "delete",
        "daemonset",
        "fabricgate-redteam",
    ]);
}

/// `fabricgate check --pods` with `--kubeconfig` reads the cluster: the pods of its node are
/// named, and their peers are the pods of their jobs on other nodes, as the agent judges them.
/// A cluster that cannot be read falls back to "any address not on this node" and says why.
/// (The fixture procfs's pod process has no network namespace to list, so the pod is
/// `unknown`; the peer rule on real sockets is the agent's, on the real node.)
#[test]
fn check_pods_asks_the_cluster_for_the_pods_jobs_and_says_when_it_cannot() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let _widened = WidenedRbac::apply(cp);
    let ns = "rt-check";
    cp.create_namespace(ns);
    let path = format!("/api/v1/namespaces/{ns}/pods");
    let member = |name: &str, node: &str| {
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns,
                "labels": {"batch.kubernetes.io/job-name": "j"}},
            "spec": {"nodeName": node, "automountServiceAccountToken": false,
                "containers": [{"name": "c", "image": "trainer:test"}]}})
    };
    let here = create(cp, &member("j-0", "chk-a"), &path);
    create(cp, &member("j-1", "chk-b"), &path);
    let uid = here["metadata"]["uid"].as_str().unwrap().to_owned();

    let dir = tempfile::tempdir().unwrap();
    let proc = dir.path().join("proc");
    std::fs::create_dir_all(proc.join("2")).unwrap();
    std::fs::write(proc.join("2/comm"), "kthreadd\n").unwrap();
    std::fs::create_dir_all(proc.join("140/ns")).unwrap();
    std::fs::write(
        proc.join("140/cgroup"),
        format!("4:memory:/kubepods/besteffort/pod{uid}/3f5e1c0a9b8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f\n"),
    )
    .unwrap();
    std::fs::write(proc.join("140/ns/net"), "").unwrap();
    std::fs::create_dir_all(proc.join("self")).unwrap();
    std::fs::copy(
        crate::common::fixture("ndr-8x400-healthy/proc/self/mountinfo"),
        proc.join("self/mountinfo"),
    )
    .unwrap();
    let sys = crate::common::fixture("ndr-8x400-healthy/sys");
    let check = |kubeconfig: &Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fabricgate"))
            .args([
                "check",
                "--verbs",
                "off",
                "--format",
                "json",
                "--pods-window",
                "100ms",
            ])
            .arg("--sysfs-root")
            .arg(&sys)
            .arg("--proc-root")
            .arg(&proc)
            .args(["--node-name", "chk-a", "--kubeconfig"])
            .arg(kubeconfig)
            .output()
            .unwrap();
        let doc: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        doc
    };
    let doc = check(&cp.agent_kubeconfig("chk-a", None));
    let pod = &doc["pods"][0];
    assert_eq!(pod["uid"], uid.as_str(), "{doc:#}");
    assert_eq!(
        (pod["namespace"].as_str(), pod["name"].as_str()),
        (Some(ns), Some("j-0"))
    );
    let peers = doc["pods_sample"]["peers"].as_str().unwrap_or_default();
    assert!(
        peers.starts_with("peers from the cluster") && peers.contains("on node chk-a"),
        "{doc:#}"
    );
    // A kubeconfig whose server answers nothing: said, and the fallback rule named.
    let dead = dir.path().join("dead.kubeconfig");
    cp.write_kubeconfig(&dead, "https://127.0.0.1:9", "x");
    let doc = check(&dead);
    let peers = doc["pods_sample"]["peers"].as_str().unwrap_or_default();
    assert!(
        peers.starts_with("cannot read the cluster")
            && peers.contains("any address not on this node"),
        "{doc:#}"
    );
    assert_eq!(doc["pods"][0]["name"], "", "{doc:#}");
}

/// One window of bulk TCP (a peer streaming into a member's TCPStore, a checkpoint restore
/// before NCCL starts) is not a fallback: with `runtime.confirm_windows: 2` the pod's condition
/// says "not yet confirmed" and never turns `False`, so nothing that acts on `False` (the gang
/// requeue, `kueue_requeues_a_gang_whose_member_pod_is_on_sockets`; the guard's eviction) ever
/// sees it; no `TransportFallback` Event is written.
#[test]
fn one_unconfirmed_window_of_sockets_never_turns_the_condition_false() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let _widened = WidenedRbac::apply(cp);
    cp.apply(&overlay_file("pod-transport-policy.yaml"));
    let node = "rt-confirm";
    cp.create_node(node, json!({}), json!([]), json!({}));
    let ns = "rt-confirm";
    cp.create_namespace(ns);
    let path = format!("/api/v1/namespaces/{ns}/pods");
    let mut body = pod("member", node, RESOURCE, None);
    body["metadata"]["namespace"] = json!(ns);
    let member = create(cp, &body, &path);
    let uid = member["metadata"]["uid"].as_str().unwrap().to_owned();
    let hca = FakeHca::new(true);
    let facts = hca.scratch().join("pod-facts");
    std::fs::write(&facts, format!("{uid} sockets 41000000000 10.0.0.2 eth0\n")).unwrap();
    let (agent, _) = agent_with_facts(cp, &hca, node, &facts, "  confirm_windows: 2\n");
    let message = |cp: &ControlPlane| transport_condition(cp, ns, "member");
    wait_until(
        "the first window: sockets, not yet confirmed",
        Duration::from_secs(30),
        || message(cp).is_some_and(|m| m.contains("on sockets for 1 of 2 windows")),
    );
    // The window's burst ends: the pod moves nothing from now on.
    std::fs::write(&facts, format!("{uid} sockets 0 10.0.0.2 eth0\n")).unwrap();
    let shown = message(cp).unwrap_or_default();
    assert!(
        shown.starts_with("Unknown/NoInterNodeTraffic: "),
        "a first window shows nothing to act on: {shown}"
    );
    // Three more windows: never False.
    let until = std::time::Instant::now() + Duration::from_secs(16);
    while std::time::Instant::now() < until {
        let now = message(cp).unwrap_or_default();
        assert!(
            !now.starts_with("False/"),
            "turned False on one window: {now}\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let events = cp
        .get_json(&format!("/apis/events.k8s.io/v1/namespaces/{ns}/events"))
        .unwrap();
    assert!(
        !events["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["reason"] == "TransportFallback"),
        "{events:#}"
    );
    let (_, metrics) = agent.get("/metrics").unwrap();
    assert!(
        metrics.contains(&format!(
            "fabricgate_pod_transport{{namespace=\"{ns}\",pod=\"member\",transport=\"sockets\"}} 0"
        )),
        "{metrics}"
    );
    drop(agent);
}

/// Pod `ns/pod`'s `fabricgate.io/TransportReady` as `status/reason: message`; `None` before
/// the agent set it.
pub(crate) fn transport_condition(cp: &ControlPlane, ns: &str, pod: &str) -> Option<String> {
    let p = cp.get_json(&format!("/api/v1/namespaces/{ns}/pods/{pod}"))?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "fabricgate.io/TransportReady")
        .map(|c| {
            format!(
                "{}/{}: {}",
                c["status"].as_str().unwrap_or_default(),
                c["reason"].as_str().unwrap_or_default(),
                c["message"].as_str().unwrap_or_default()
            )
        })
}
