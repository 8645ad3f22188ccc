//! The security model of `daemonset.yaml`, on the real apiserver: its Namespace,
//! ServiceAccount, ClusterRole(+Binding) and ValidatingAdmissionPolicy(+Binding) applied, and a
//! token of the agent's ServiceAccount bound to a Pod on `sec-a` (the node-name claim the
//! policy checks). With it the agent's own writes to `sec-a` succeed; everything else is
//! denied, by the policy (with its message) or by RBAC. And the ClusterRole grants exactly
//! what a full agent run uses according to the audit log.

use crate::common::controlplane::{AuditEvent, ControlPlane, Grant, client_from, rbac_grants};
use crate::common::sysfs::FakeHca;
use crate::common::{AGENT_USER, TAINT, TestNode, control_plane, start_agent, wait_until};
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::time::Duration;

/// The code and message of a denied request, or `None` when it succeeded.
fn denial<T>(r: Result<T, kube::Error>) -> Option<(u16, String)> {
    match r {
        Ok(_) => None,
        Err(kube::Error::Api(s)) => Some((s.code, s.message)),
        Err(e) => panic!("not an API answer: {e}"),
    }
}

fn ssa() -> PatchParams {
    PatchParams::apply("fabricgate").force()
}

fn json_patch(ops: Value) -> Patch<()> {
    Patch::Json(serde_json::from_value(ops).expect("JSON patch"))
}

/// The policy is enforced once the apiserver has loaded it: until then a write the policy
/// denies goes through. Wait until a label outside the prefix is refused.
fn wait_policy_loaded(cp: &ControlPlane, nodes: &Api<Node>, node: &str) {
    wait_until(
        "the admission policy to be enforced",
        Duration::from_secs(60),
        || {
            let body = json!({ "metadata": { "labels": { "probe.example.com/policy": "x" } } });
            let r = cp.block_on(nodes.patch(node, &PatchParams::default(), &Patch::Merge(&body)));
            match denial(r) {
                Some((403, _)) => true,
                Some(other) => panic!("unexpected answer while waiting for the policy: {other:?}"),
                None => {
                    // It went through before the policy was active: undo it as admin.
                    cp.kubectl(&["label", "node", node, "probe.example.com/policy-"]);
                    false
                }
            }
        },
    );
}

#[test]
fn the_agent_may_change_only_its_own_marks_on_its_own_node() {
    let Some(cp) = control_plane() else { return };
    let a = TestNode::seeded(cp, "sec-a");
    let b = TestNode::seeded(cp, "sec-b");
    let kubeconfig = a.agent_kubeconfig(None);
    let client = cp.block_on(client_from(&kubeconfig));
    let nodes: Api<Node> = Api::all(client.clone());
    wait_policy_loaded(cp, &nodes, &a.name);

    // What the agent does, on its own Node: allowed.
    let labels = json!({ "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": a.name, "labels": { "fabricgate.io/ready": "false" } } });
    assert_eq!(
        denial(cp.block_on(nodes.patch(&a.name, &ssa(), &Patch::Apply(&labels)))),
        None,
        "labels by SSA on the own node"
    );
    let rv = a.json()["metadata"]["resourceVersion"].clone();
    let taints = json!([
        { "op": "test", "path": "/metadata/resourceVersion", "value": rv },
        { "op": "add", "path": "/spec/taints", "value": [
            { "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" },
            { "key": TAINT, "effect": "NoExecute" } ] },
    ]);
    assert_eq!(
        denial(cp.block_on(nodes.patch(&a.name, &PatchParams::default(), &json_patch(taints)))),
        None,
        "its own taint by JSON patch"
    );
    let conditions = json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": a.name },
        "status": { "conditions": [{ "type": "FabricReady", "status": "False",
            "reason": "PortDown", "message": "test",
            "lastTransitionTime": "2026-11-30T00:00:00Z" }] } });
    assert_eq!(
        denial(cp.block_on(nodes.patch_status(&a.name, &ssa(), &Patch::Apply(&conditions)))),
        None,
        "its own conditions by SSA on status"
    );
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let event: Event = serde_json::from_value(json!({
        "metadata": { "generateName": "sec-a-", "namespace": "default" },
        "eventTime": "2026-11-30T00:00:00.000000Z",
        "action": "Invalidated", "reason": "FabricNotReady", "type": "Warning", "note": "test",
        "regarding": { "apiVersion": "v1", "kind": "Node", "name": a.name },
        "reportingController": "fabricgate.io/agent", "reportingInstance": "fabricgate-sec-a",
    }))
    .unwrap();
    assert_eq!(
        denial(cp.block_on(events.create(&PostParams::default(), &event))),
        None,
        "an Event"
    );

    // The same writes on another node: denied by the policy, naming both nodes.
    let other = json!({ "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": b.name, "labels": { "fabricgate.io/ready": "false" } } });
    let (code, msg) = denial(cp.block_on(nodes.patch(&b.name, &ssa(), &Patch::Apply(&other))))
        .expect("writing another node is denied");
    assert_eq!(code, 403);
    assert!(
        msg.contains("fabricgate on node sec-a may not modify node sec-b"),
        "{msg}"
    );
    let other_status = json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": b.name },
        "status": { "conditions": [{ "type": "FabricReady", "status": "False",
            "reason": "PortDown", "message": "test" }] } });
    let (code, msg) =
        denial(cp.block_on(nodes.patch_status(&b.name, &ssa(), &Patch::Apply(&other_status))))
            .expect("another node's status is denied");
    assert_eq!(code, 403);
    assert!(msg.contains("may not modify node sec-b"), "{msg}");

    // A label outside the prefix, another taint, another condition, on its own node.
    let foreign_label = json!({ "metadata": { "labels": { "team": "hacked" } } });
    let (code, msg) = denial(cp.block_on(nodes.patch(
        &a.name,
        &PatchParams::default(),
        &Patch::Merge(&foreign_label),
    )))
    .expect("a foreign label is denied");
    assert_eq!(code, 403);
    assert!(
        msg.contains("fabricgate may change only labels under fabricgate.io/"),
        "{msg}"
    );
    let rv = a.json()["metadata"]["resourceVersion"].clone();
    let foreign_taint = json!([
        { "op": "test", "path": "/metadata/resourceVersion", "value": rv },
        { "op": "add", "path": "/spec/taints/-", "value": { "key": "example.com/evil", "effect": "NoSchedule" } },
    ]);
    let (code, msg) = denial(cp.block_on(nodes.patch(
        &a.name,
        &PatchParams::default(),
        &json_patch(foreign_taint),
    )))
    .expect("another taint is denied");
    assert_eq!(code, 403);
    assert!(
        msg.contains("fabricgate may add or remove only its own taint fabricgate.io/unvalidated"),
        "{msg}"
    );
    let foreign_condition = json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": a.name },
        "status": { "conditions": [{ "type": "Ready", "status": "False",
            "reason": "Hacked", "message": "test" }] } });
    let (code, msg) = denial(cp.block_on(nodes.patch_status(
        &a.name,
        &PatchParams::apply("fabricgate-evil").force(),
        &Patch::Apply(&foreign_condition),
    )))
    .expect("another condition is denied");
    assert_eq!(code, 403);
    assert!(
        msg.contains("fabricgate may change only its own conditions"),
        "{msg}"
    );
    let unschedulable = json!({ "spec": { "unschedulable": true } });
    let (code, msg) = denial(cp.block_on(nodes.patch(
        &a.name,
        &PatchParams::default(),
        &Patch::Merge(&unschedulable),
    )))
    .expect("cordoning is denied");
    assert_eq!(code, 403);
    assert!(msg.contains("may not change the Node spec"), "{msg}");

    // Creating and deleting Nodes: RBAC grants neither verb, so RBAC refuses them before
    // admission (the policy would too).
    let new_node: Node =
        serde_json::from_value(json!({ "metadata": { "name": "sec-new" } })).unwrap();
    let (code, msg) = denial(cp.block_on(nodes.create(&PostParams::default(), &new_node)))
        .expect("creating a Node is denied");
    assert_eq!(code, 403, "{msg}");
    assert!(msg.contains(AGENT_USER), "{msg}");
    let (code, msg) = denial(cp.block_on(nodes.delete(&b.name, &Default::default())))
        .expect("deleting a Node is denied");
    assert_eq!(code, 403, "{msg}");
    assert!(cp.node(&b.name).is_some());

    // Secrets: RBAC.
    let secrets: Api<Secret> = Api::namespaced(client, "fabricgate");
    let (code, msg) =
        denial(cp.block_on(secrets.list(&Default::default()))).expect("reading Secrets is denied");
    assert_eq!(code, 403);
    assert!(msg.contains("cannot list resource \"secrets\""), "{msg}");

    // Nothing of the denied writes landed.
    let n = a.json();
    assert_eq!(n["metadata"]["labels"]["team"], "ml");
    assert_eq!(n["spec"]["unschedulable"], Value::Null);
    assert_eq!(a.condition("Ready").unwrap()["status"], "True");
}

/// (apiGroup, resource[/subresource], verb) the ClusterRole in `daemonset.yaml` grants.
fn granted() -> BTreeSet<Grant> {
    let manifest = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset.yaml"),
    )
    .unwrap();
    rbac_grants(&manifest, |d| {
        (d["kind"] == "ClusterRole" || d["kind"] == "Role")
            && d["metadata"]["name"] == "fabricgate-agent"
    })
}

/// [`granted`] with what the DRA overlay adds (`deploy/overlays/dra/claims-rbac.yaml`: this
/// node's pods, their ResourceClaims).
fn granted_with_dra() -> BTreeSet<Grant> {
    let claims = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy/overlays/dra/claims-rbac.yaml"),
    )
    .unwrap();
    let mut all = granted();
    all.extend(rbac_grants(&claims, |d| d["kind"] == "ClusterRole"));
    all
}

/// A full agent run with DRA, as the DRA overlay deploys it — validate, fail, recover, drift
/// undone, a pod of the node naming a ResourceClaim, restart, stop — and the audit log's
/// account of what it used: the ClusterRoles grant exactly that, no more.
#[test]
fn the_cluster_role_grants_exactly_what_a_full_agent_run_uses() {
    let Some(cp) = control_plane() else { return };
    // The DRA overlay's own grants, bound while this run holds the agent's RBAC alone.
    let _dra = crate::common::controlplane::WidenedRbac::apply_dra_claims(cp);
    let node = TestNode::seeded(cp, "sec-full-run");
    let hca = FakeHca::new(true);
    let kubeconfig = node.agent_kubeconfig(None);
    // With a pool, as daemonset.yaml configures it: the breaker lists the pool's Nodes. With
    // peers, so that it answers a gang pre-flight too (the FabricChecks it lists and watches,
    // the FabricCheckResult it fills).
    crate::gang_ring::install(cp);
    let config = hca.scratch().join("requirements.yaml");
    let key = hca.scratch().join("peers.key");
    std::fs::write(&key, crate::gang_ring::KEY).unwrap();
    // With a DRA driver (docs/dra.md): it watches its ResourceSlices and keeps a
    // DeviceTaintRule while the HCA is bad.
    let registry = hca.scratch().join("plugins_registry");
    std::fs::create_dir_all(&registry).unwrap();
    let _plugin =
        std::os::unix::net::UnixListener::bind(registry.join("dra.net-reg.sock")).unwrap();
    cp.apply(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": { "name": "sec-full-run-dra.net" },
            "spec": { "driver": "dra.net", "nodeName": "sec-full-run",
                "pool": { "name": "sec-full-run", "generation": 1, "resourceSliceCount": 1 },
                "devices": [{ "name": "pci-0000-00-02-0", "attributes": {
                    "dra.net/rdma": { "bool": true },
                    "dra.net/rdmaDevice": { "string": "mlx5_0" } } }] },
        })
        .to_string(),
    );
    std::fs::write(
        &config,
        format!(
            "node:\n  pool_selector: \"kubernetes.io/hostname=sec-full-run\"\npeers:\n  \
             enabled: true\n  listen: \"127.0.0.1:0\"\n  interval: 60s\n  key_file: {}\n\
             kubernetes:\n  dra:\n    drivers: [{{name: dra.net}}]\n    registry_dir: {}\n",
            key.display(),
            registry.display()
        ),
    )
    .unwrap();
    let mark = cp.audit_mark();
    let agent = start_agent(
        &node.name,
        &hca,
        Some(&kubeconfig),
        &[
            "--interval",
            "200ms",
            "--resync-interval",
            "1s",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    // A pod of this node naming a claim: the agent reads the claim (DRA's in-use HCAs). (No
    // service-account controller runs here: the pod's account is made by hand.)
    cp.apply(
        &json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": { "name": "sec-full-run", "namespace": "default" },
        })
        .to_string(),
    );
    cp.apply(
        &json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "sec-full-run-claimer", "namespace": "default" },
            "spec": { "nodeName": "sec-full-run", "serviceAccountName": "sec-full-run",
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 0,
                "containers": [{ "name": "c", "image": "registry.example.com/train:1",
                    "resources": { "claims": [{ "name": "hca" }] } }],
                "resourceClaims": [{ "name": "hca", "resourceClaimName": "sec-full-run-hca" }] },
        })
        .to_string(),
    );
    let check = "team.sec-full-run.00000004";
    crate::gang_ring::create_check(
        cp,
        check,
        &[
            (node.name.clone(), "127.0.0.1:1".to_owned()),
            ("sec-full-run-peer".to_owned(), "127.0.0.1:9".to_owned()),
        ],
        30,
    );
    wait_until("its FabricCheckResult", Duration::from_secs(30), || {
        !crate::gang_ring::results(cp, check).is_empty()
    });
    hca.set_port(false);
    let rules = || {
        cp.get_json("/apis/resource.k8s.io/v1/devicetaintrules")
            .and_then(|l| l["items"].as_array().cloned())
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r["spec"]["deviceSelector"]["pool"] == "sec-full-run")
            .count()
    };
    wait_until(
        "the taint and the device's rule",
        Duration::from_secs(10),
        || node.has_our_taint() && rules() == 1,
    );
    // Edited by hand: put back by server-side apply (a patch).
    let rule = cp
        .get_json("/apis/resource.k8s.io/v1/devicetaintrules")
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .find(|r| r["spec"]["deviceSelector"]["pool"] == "sec-full-run")
        .map(|r| {
            r["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .unwrap_or_default();
    cp.kubectl(&[
        "patch",
        "devicetaintrule",
        &rule,
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/spec/taint/value","value":"Edited"}]"#,
    ]);
    wait_until("the rule put back", Duration::from_secs(10), || {
        cp.get_json(&format!("/apis/resource.k8s.io/v1/devicetaintrules/{rule}"))
            .is_some_and(|r| r["spec"]["taint"]["value"] != "Edited")
    });
    hca.set_port(true);
    wait_until("recovery", Duration::from_secs(15), || {
        node.ready() && rules() == 0
    });
    cp.kubectl(&["label", "node", &node.name, "fabricgate.io/ready-"]);
    wait_until("drift undone", Duration::from_secs(10), || {
        node.label("fabricgate.io/ready").as_deref() == Some("true")
    });
    let (status, _) = agent.stop();
    assert!(status.success());
    // The restart (a new pod-bound token, as a new agent pod gets).
    let agent = node.start_agent(&hca, &["--interval", "200ms"]);
    std::thread::sleep(Duration::from_secs(2));
    drop(agent);
    cp.kubectl(&[
        "delete",
        "pod",
        "sec-full-run-claimer",
        "-n",
        "default",
        "--ignore-not-found",
        "--grace-period=0",
        "--force",
    ]);

    let used: BTreeSet<Grant> = node
        .agent_requests(mark)
        .iter()
        .map(AuditEvent::grant)
        .collect();
    let forbidden: Vec<_> = node
        .agent_requests(mark)
        .into_iter()
        .filter(|e| e.code == 403)
        .collect();
    assert!(
        forbidden.is_empty(),
        "the agent was refused: {forbidden:#?}"
    );
    eprintln!("verbs and resources the agent used (audit log): {used:?}");
    assert_eq!(
        granted_with_dra(),
        used,
        "the ClusterRoles must grant exactly what the agent uses"
    );
}

/// The agent could create Events in every namespace (a ClusterRole). It writes them
/// to one: `EVENT_NAMESPACE` (`default`, where Events about Nodes go). With its real pod-bound
/// token, the apiserver's own answer (`SelfSubjectAccessReview`) and a real create: allowed
/// there, refused in every other namespace, and never the core/v1 Events it does not use.
#[test]
fn redteam_the_agent_creates_events_only_where_it_writes_them() {
    use k8s_openapi::api::authorization::v1::SelfSubjectAccessReview;
    let Some(cp) = control_plane() else { return };
    let _base = crate::common::controlplane::base_agent_rbac();
    let node = TestNode::seeded(cp, "rt-events");
    let client = cp.block_on(client_from(&node.agent_kubeconfig(None)));
    let allowed = |group: &str, namespace: &str| -> bool {
        let review: SelfSubjectAccessReview = serde_json::from_value(json!({
            "spec": { "resourceAttributes": { "group": group, "resource": "events",
                "verb": "create", "namespace": namespace } },
        }))
        .unwrap();
        let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
        let answer = cp
            .block_on(api.create(&PostParams::default(), &review))
            .expect("SelfSubjectAccessReview");
        answer.status.is_some_and(|s| s.allowed)
    };
    let home = fabricgate::node::EVENT_NAMESPACE;
    wait_until("the agent's RBAC in force", Duration::from_secs(30), || {
        allowed("events.k8s.io", home)
    });
    let elsewhere = ["kube-system", "fabricgate", "kube-public", "team-a"];
    for ns in elsewhere {
        assert!(
            !allowed("events.k8s.io", ns),
            "Events may be created in {ns}"
        );
    }
    for ns in [home, "kube-system"] {
        assert!(!allowed("", ns), "core/v1 Events may be created in {ns}");
    }
    let event = |ns: &str| -> Event {
        serde_json::from_value(json!({
            "metadata": { "generateName": "rt-events-", "namespace": ns },
            "eventTime": "2026-11-30T00:00:00.000000Z",
            "action": "Invalidated", "reason": "FabricNotReady", "type": "Warning",
            "note": "red team",
            "regarding": { "apiVersion": "v1", "kind": "Node", "name": node.name },
            "reportingController": "fabricgate.io/agent",
            "reportingInstance": "fabricgate-rt-events",
        }))
        .unwrap()
    };
    let create = |ns: &str| {
        let events: Api<Event> = Api::namespaced(client.clone(), ns);
        denial(cp.block_on(events.create(&PostParams::default(), &event(ns))))
    };
    assert_eq!(create(home), None, "an Event where the agent writes them");
    for ns in ["kube-system", "fabricgate"] {
        let (code, msg) = create(ns).unwrap_or_else(|| panic!("an Event in {ns} was created"));
        assert_eq!(code, 403, "{msg}");
        assert!(msg.contains("cannot create resource \"events\""), "{msg}");
    }
}
