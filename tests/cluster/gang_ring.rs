//! The agents' half of the gang pre-flight (docs/gangs.md) on the real
//! apiserver: real agents with `peers.enabled` (responders on loopback, distinct ports, one
//! pool key, `--verbs off`, so `rdma: unmeasured` and the authenticated side channel decides)
//! advertise `fabricgate.io/peers-endpoint` on their Nodes and answer a `FabricCheck` in ring
//! order, each filling only its own `FabricCheckResult` (created empty with the check, as the
//! controller does) through its pod-bound token; a member
//! whose peer's responder is down answers `ok: false` naming the peer. The red-team test shows
//! the admission policy `fabricgate-fabriccheck-results` and RBAC keep every agent to its own
//! answer, filled once, off the FabricCheck, and unable to create answers.
//!
//! The CRDs are the ones `deploy/admission-check.yaml` ships (`common::fabriccheck_crds`).

use crate::common::agent::Launch;
use crate::common::controlplane::{ControlPlane, client_from};
use crate::common::sysfs::FakeHca;
use crate::common::{Agent, TestNode, control_plane, wait_until};
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

const NS: &str = "fabricgate";
pub(crate) const KEY: &str = "6b1f0c3e9a2d4f5b8c7e6d5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c\n";
const ENDPOINT: &str = "fabricgate.io/peers-endpoint";

fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("fabricgate.io", "v1alpha1", "FabricCheck"),
        "fabricchecks",
    )
}

fn result_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("fabricgate.io", "v1alpha1", "FabricCheckResult"),
        "fabriccheckresults",
    )
}

/// The CRD and the agents' RBAC and policies, once; waits until the CRD is served.
pub(crate) fn install(cp: &ControlPlane) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        cp.install_agent_rbac();
        cp.apply(&crate::common::fabriccheck_crds());
        for plural in ["fabricchecks", "fabriccheckresults"] {
            wait_until(
                &format!("the {plural} CRD served"),
                Duration::from_secs(60),
                || {
                    cp.kubectl_as(&cp.admin_kubeconfig, &["get", plural, "-n", NS], None)
                        .0
                },
            );
        }
    });
}

/// A FabricCheck of `members` (node, endpoint), deadline `secs` from now, made by admin as
/// fabricgate admission-check makes it (`objects::create_check`): the check, then each
/// member's empty answer (`fabriccheck::empty_result_object`), then the member labels the
/// agents watch.
pub(crate) fn create_check(cp: &ControlPlane, name: &str, members: &[(String, String)], secs: i64) {
    use fabricgate::gang::fabriccheck::{self, FabricCheck};
    let deadline = k8s_openapi::jiff::Timestamp::from_second(
        k8s_openapi::jiff::Timestamp::now().as_second() + secs,
    )
    .unwrap()
    .to_string();
    let body = json!({
        "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheck",
        "metadata": { "name": name, "namespace": NS,
                      "labels": { "app.kubernetes.io/name": "fabricgate",
                                  "fabricgate.io/check": "gang" } },
        "spec": {
            "workload": { "namespace": "team", "name": name, "uid": "0000" },
            "members": members.iter().map(|(n, e)| json!({ "node": n, "endpoint": e }))
                .collect::<Vec<_>>(),
            "deadline": deadline,
        },
    });
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            NS,
            "delete",
            "fabriccheck",
            name,
            "--ignore-not-found",
        ],
        None,
    );
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["create", "-f", "-"],
        Some(&body.to_string()),
    );
    assert!(ok, "create FabricCheck {name}: {err}");
    let check = FabricCheck {
        name: name.to_owned(),
        uid: check_uid(cp, name).expect("the FabricCheck's uid"),
        spec: serde_json::from_value(body["spec"].clone()).unwrap(),
    };
    let answers: Api<DynamicObject> = Api::namespaced_with(cp.admin(), NS, &result_resource());
    let mut labels = serde_json::Map::new();
    for (node, _) in members {
        let peer = &check
            .spec
            .next_after(node)
            .expect("a ring of two or more")
            .node;
        let empty: DynamicObject =
            serde_json::from_value(fabriccheck::empty_result_object(&check, node, peer)).unwrap();
        cp.block_on(answers.create(&PostParams::default(), &empty))
            .unwrap_or_else(|e| panic!("create {node}'s empty answer: {e}"));
        labels.insert(fabriccheck::member_label(node), json!("true"));
    }
    let checks: Api<DynamicObject> = Api::namespaced_with(cp.admin(), NS, &resource());
    cp.block_on(checks.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(&json!({ "metadata": { "labels": labels } })),
    ))
    .expect("label the members");
}

/// The uid of FabricCheck `name`, `None` while it does not exist.
pub(crate) fn check_uid(cp: &ControlPlane, name: &str) -> Option<String> {
    cp.get_json(&format!(
        "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{name}"
    ))
    .and_then(|c| c["metadata"]["uid"].as_str().map(str::to_owned))
}

/// The FabricCheckResult objects answering check `name` (by its uid label), whole.
pub(crate) fn result_objects(cp: &ControlPlane, name: &str) -> Vec<Value> {
    check_uid(cp, name).map_or_else(Vec::new, |uid| crate::common::fabriccheck_answers(cp, &uid))
}

/// The answers to check `name`: the spec of each result object its member filled (the
/// controller's empty ones left out).
pub(crate) fn results(cp: &ControlPlane, name: &str) -> Vec<Value> {
    result_objects(cp, name)
        .into_iter()
        .map(|o| o["spec"].clone())
        .filter(|spec| spec.get("ok").is_some())
        .collect()
}

fn result_of<'a>(results: &'a [Value], node: &str) -> Option<&'a Value> {
    results.iter().find(|r| r["node"] == node)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// An agent for `node` with peers on, its responder on 127.0.0.1:`port`.
fn peer_agent(node: &TestNode, hca: &FakeHca, key: &Path, port: u16) -> Agent {
    peer_agent_at(node, hca, key, &format!("127.0.0.1:{port}"))
}

/// An agent for `node` with peers on, its responder on `listen`.
fn peer_agent_at(node: &TestNode, hca: &FakeHca, key: &Path, listen: &str) -> Agent {
    peer_agent_env(node, hca, key, listen, &[])
}

/// [`peer_agent_at`], with `env` (a failpoint) in its environment.
fn peer_agent_env(
    node: &TestNode,
    hca: &FakeHca,
    key: &Path,
    listen: &str,
    env: &[(&str, &str)],
) -> Agent {
    let cfg = hca.scratch().join("fabricgate.yaml");
    std::fs::write(
        &cfg,
        format!(
            "peers:\n  enabled: true\n  listen: \"127.0.0.1:9\"\n  interval: 60s\n  \
             timeout: 2s\n  key_file: {}\n",
            key.display()
        ),
    )
    .unwrap();
    let kubeconfig = node.agent_kubeconfig(None);
    let (sysfs, proc_root) = (hca.sysfs_root(), hca.proc_root());
    Launch::at(&node.name, &sysfs, &proc_root, hca.scratch())
        .kubeconfig(Some(&kubeconfig))
        .args(&[
            "--interval",
            "500ms",
            "--config",
            cfg.to_str().unwrap(),
            "--peers-listen",
            listen,
        ])
        .env(env)
        .start()
}

/// Peers agents on seeded Nodes, validated and advertising their endpoints. Fields drop in
/// order: the agents before the trees they probe.
struct AdvertisedPeers {
    agents: Vec<Agent>,
    hcas: Vec<FakeHca>,
    nodes: Vec<TestNode>,
    endpoints: Vec<String>,
}

impl AdvertisedPeers {
    /// One agent per name, with the pool's key, its responder at `listen(i)` and `env(i)` in
    /// its environment; returns once every Node is validated and advertises that endpoint.
    fn start(
        cp: &'static ControlPlane,
        key_name: &str,
        names: &[&str],
        listen: impl Fn(usize) -> String,
        env: impl Fn(usize) -> &'static [(&'static str, &'static str)],
    ) -> Self {
        install(cp);
        let key = cp.path(key_name);
        std::fs::write(&key, KEY).unwrap();
        let mut peers = AdvertisedPeers {
            agents: Vec::new(),
            hcas: Vec::new(),
            nodes: Vec::new(),
            endpoints: Vec::new(),
        };
        for (i, name) in names.iter().enumerate() {
            let node = TestNode::seeded(cp, name);
            let hca = FakeHca::new(true);
            let at = listen(i);
            peers
                .agents
                .push(peer_agent_env(&node, &hca, &key, &at, env(i)));
            peers.endpoints.push(at);
            peers.nodes.push(node);
            peers.hcas.push(hca);
        }
        for (node, ep) in peers.nodes.iter().zip(&peers.endpoints) {
            wait_until(
                &format!("{} validated and advertised", node.name),
                Duration::from_secs(60),
                || node.ready() && node.json()["metadata"]["annotations"][ENDPOINT] == ep.as_str(),
            );
        }
        peers
    }

    /// The ring's members, as a FabricCheck names them.
    fn members(&self) -> Vec<(String, String)> {
        self.nodes
            .iter()
            .zip(&self.endpoints)
            .map(|(n, e)| (n.name.clone(), e.clone()))
            .collect()
    }
}

#[test]
fn agents_answer_a_fabriccheck_in_ring_order_and_name_a_dead_peer() {
    let Some(cp) = control_plane() else { return };
    install(cp);
    let key = cp.path("ring-peers.key");
    std::fs::write(&key, KEY).unwrap();
    let names = ["ring-0", "ring-1", "ring-2"];
    let mut nodes = Vec::new();
    let mut hcas = Vec::new();
    let mut agents = Vec::new();
    let mut ports = Vec::new();
    for name in names {
        let node = TestNode::seeded(cp, name);
        let hca = FakeHca::new(true);
        let port = free_port();
        agents.push(Some(peer_agent(&node, &hca, &key, port)));
        nodes.push(node);
        hcas.push(hca);
        ports.push(port);
    }
    // Every Node advertises its responder, as --peers-listen gives it.
    for (node, port) in nodes.iter().zip(&ports) {
        wait_until(
            &format!("{} advertises its endpoint", node.name),
            Duration::from_secs(60),
            || node.json()["metadata"]["annotations"][ENDPOINT] == format!("127.0.0.1:{port}"),
        );
    }
    // Drift is undone: the annotation comes back after an admin removes it.
    cp.kubectl(&["annotate", "node", names[0], &format!("{ENDPOINT}-")]);
    wait_until("the endpoint rewritten", Duration::from_secs(30), || {
        nodes[0].json()["metadata"]["annotations"][ENDPOINT] == format!("127.0.0.1:{}", ports[0])
    });
    // Written only on change: once every Node is validated and advertised, no Node writes
    // at all (waiting for validation first: a busy machine may still be publishing it).
    for node in &nodes {
        wait_until(
            &format!("{} validated", node.name),
            Duration::from_secs(60),
            || node.ready(),
        );
    }
    std::thread::sleep(Duration::from_secs(1));
    let mark = cp.audit_mark();
    std::thread::sleep(Duration::from_secs(2));
    for node in &nodes {
        let writes = node.agent_writes(mark);
        assert!(writes.is_empty(), "{}: {writes:?}", node.name);
    }
    let members: Vec<(String, String)> = nodes
        .iter()
        .map(|n| {
            let ep = n.json()["metadata"]["annotations"][ENDPOINT]
                .as_str()
                .unwrap()
                .to_owned();
            (n.name.clone(), ep)
        })
        .collect();

    create_check(cp, "team.ring-good.00000001", &members, 30);
    wait_until("every member's result", Duration::from_secs(30), || {
        results(cp, "team.ring-good.00000001").len() == 3
    });
    let got = results(cp, "team.ring-good.00000001");
    for (i, name) in names.iter().enumerate() {
        let r = result_of(&got, name).unwrap();
        assert_eq!(r["peer"], names[(i + 1) % 3], "{r}");
        assert_eq!(r["ok"], true, "{r}");
        assert_eq!(r["rdma"], "unmeasured", "--verbs off: {r}");
        assert!(r["finishedAt"].is_string(), "{r}");
        // Its receiving end: its predecessor greeted it for this check.
        let rec = &r["received"];
        assert_eq!(rec["peer"], names[(i + 2) % 3], "{r}");
        assert_eq!(
            (&rec["ok"], &rec["rdma"]),
            (&json!(true), &json!("unmeasured")),
            "{r}"
        );
    }
    // Each agent lists and watches only the checks labelled for its own Node: a check goes to
    // its members' watches, not to every agent of the pool.
    let reads: Vec<_> = cp
        .audit()
        .into_iter()
        .filter(|e| e.resource == "fabricchecks" && (e.verb == "list" || e.verb == "watch"))
        .collect();
    for node in &nodes {
        let selector = format!("labelSelector=member.fabricgate.io%2F{}", node.name);
        let of_node: Vec<_> = reads.iter().filter(|e| e.claim_node == node.name).collect();
        // (A watch is audited when it ends; its list is there at once.)
        assert!(!of_node.is_empty(), "{}: no list of the checks", node.name);
        for e in of_node {
            assert!(e.request_uri.contains(&selector), "{}: {e:?}", node.name);
        }
    }
    // Each answer is its own agent's: named <check uid>.<node>, owned by the check, its
    // measurement filled under the field manager fabricgate-gang/<node>.
    let uid = check_uid(cp, "team.ring-good.00000001").unwrap();
    for obj in result_objects(cp, "team.ring-good.00000001") {
        let node = obj["spec"]["node"].as_str().unwrap().to_owned();
        assert_eq!(obj["metadata"]["name"], format!("{uid}.{node}"), "{obj}");
        assert_eq!(obj["metadata"]["ownerReferences"][0]["uid"], uid.as_str());
        let filler = obj["metadata"]["managedFields"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["fieldsV1"]["f:spec"].get("f:ok").is_some())
            .unwrap_or_else(|| panic!("no manager of spec.ok: {obj}"));
        assert_eq!(
            (&filler["manager"], &filler["operation"]),
            (&json!(format!("fabricgate-gang/{node}")), &json!("Update")),
            "{obj}"
        );
    }

    // Auditable with kubectl: one line per answer, with the node, peer, ok and rdma columns.
    let (ok, table, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "get",
            "fcr",
            "-n",
            NS,
            "-l",
            &format!("fabricgate.io/fabriccheck-uid={uid}"),
        ],
        None,
    );
    assert!(ok, "{err}");
    eprintln!("kubectl get fcr:\n{table}");
    let lines: Vec<&str> = table.lines().collect();
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header[..5],
        ["NAME", "NODE", "PEER", "OK", "RDMA"],
        "{table}"
    );
    for (i, name) in names.iter().enumerate() {
        let row: Vec<&str> = lines
            .iter()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|r| r.get(1) == Some(name))
            .unwrap_or_else(|| panic!("no line for {name}:\n{table}"));
        assert_eq!(
            row[2..5],
            [names[(i + 1) % 3], "true", "unmeasured"],
            "{table}"
        );
    }

    // ring-2's agent is gone: ring-1 (which measures ring-2) says so, naming it; ring-0 still
    // reaches ring-1; ring-2 answers nothing.
    if let Some(a) = agents[2].take() {
        drop(a);
    }
    create_check(cp, "team.ring-dead.00000002", &members, 20);
    wait_until(
        "the two live members' results",
        Duration::from_secs(30),
        || results(cp, "team.ring-dead.00000002").len() == 2,
    );
    let got = results(cp, "team.ring-dead.00000002");
    let r1 = result_of(&got, "ring-1").unwrap();
    assert_eq!(r1["ok"], false, "{r1}");
    assert_eq!(r1["peer"], "ring-2", "{r1}");
    let err = r1["error"].as_str().unwrap();
    assert!(
        err.starts_with(&format!("connect: peer ring-2 (127.0.0.1:{})", ports[2])),
        "{err}"
    );
    assert_eq!(result_of(&got, "ring-0").unwrap()["ok"], true, "{got:?}");
    // One exchange per check: nothing is written again.
    let versions = || -> Vec<Value> {
        result_objects(cp, "team.ring-dead.00000002")
            .iter()
            .map(|o| o["metadata"]["resourceVersion"].clone())
            .collect()
    };
    let before = versions();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(versions(), before, "no repeats");
    // The agents' Nodes are not judged by any of it.
    for node in &nodes[..2] {
        assert!(node.ready(), "{}", node.name);
    }
    drop(agents);
}

/// Seeded Nodes `names` (the RBAC installed) and FabricCheck `check` of them, at an endpoint
/// nobody dials; its uid.
fn seeded_check(cp: &'static ControlPlane, names: &[&str], check: &str) -> String {
    install(cp);
    for name in names {
        TestNode::seeded(cp, name);
    }
    let members: Vec<(String, String)> = names
        .iter()
        .map(|n| ((*n).to_owned(), "127.0.0.1:9".to_owned()))
        .collect();
    create_check(cp, check, &members, 600);
    check_uid(cp, check).expect("the FabricCheck's uid")
}

/// With its own pod-bound token, an agent may fill its own answer to a check once (the
/// empty one the controller created), and nothing else: not create an answer, not fill
/// another node's, not change its own answer's labels or owner, not change it once filled,
/// not delete an answer, not write to the FabricCheck.
#[test]
fn redteam_an_agent_fills_only_its_own_fabriccheck_result_once() {
    let Some(cp) = control_plane() else { return };
    let names = ["rt-ring-0", "rt-ring-1"];
    let check = "team.rt-ring.00000003";
    let uid = seeded_check(cp, &names, check);
    let client = cp.block_on(client_from(&cp.agent_kubeconfig(names[0], None)));
    let checks: Api<DynamicObject> = Api::namespaced_with(client.clone(), NS, &resource());
    let answers: Api<DynamicObject> = Api::namespaced_with(client, NS, &result_resource());
    let own_name = format!("{uid}.{}", names[0]);
    let other_name = format!("{uid}.{}", names[1]);
    // The measurement, as the agent fills it.
    let fill = |ok: bool| {
        json!({ "spec": { "ok": ok, "rdma": "measured",
                                            "finishedAt": "2026-12-02T03:00:07Z" } })
    };
    let patch_with = |name: &str, body: &Value, pp: &PatchParams| -> (u16, String) {
        match cp.block_on(answers.patch(name, pp, &Patch::Merge(body))) {
            Ok(_) => (200, String::new()),
            Err(kube::Error::Api(e)) => (e.code, e.message),
            Err(e) => panic!("not an API answer: {e}"),
        }
    };
    let patch = |name: &str, body: &Value| patch_with(name, body, &PatchParams::default());
    // Another member's answer (forged as ok): refused by the policy once it is loaded
    // (admission runs on a server-side dry run too, which leaves nothing filled).
    wait_until(
        "the policy refuses filling another node's answer",
        Duration::from_secs(60),
        || patch_with(&other_name, &fill(true), &PatchParams::default().dry_run()).0 == 403,
    );
    let (code, msg) = patch(&other_name, &fill(true));
    assert_eq!(code, 403);
    assert!(
        msg.contains("ValidatingAdmissionPolicy 'fabricgate-fabriccheck-results'")
            && msg.contains("may fill only its own answer"),
        "{msg}"
    );
    // Its own, dropping the check's label or changing its owner (so that it outlives the
    // check, or hides from the controller): refused.
    let mut unlabelled = fill(true);
    unlabelled["metadata"] = json!({ "labels": { "fabricgate.io/fabriccheck-uid": null } });
    let (code, msg) = patch(&own_name, &unlabelled);
    assert_eq!(code, 403, "{msg}");
    assert!(msg.contains("fills only the spec of its answer"), "{msg}");
    let mut orphaned = fill(true);
    orphaned["metadata"] = json!({ "ownerReferences": [] });
    assert_eq!(patch(&own_name, &orphaned).0, 403);
    // Creating an answer at all, even its own as the controller would: refused (RBAC).
    let mut own: DynamicObject = serde_json::from_value(crate::common::fabriccheck_answer(
        check,
        &uid,
        &json!({ "node": names[0], "peer": names[1], "ok": true, "rdma": "measured" }),
    ))
    .unwrap();
    own.metadata.name = Some(format!("{uid}.{}-again", names[0]));
    let created = cp.block_on(answers.create(&PostParams::default(), &own));
    assert!(
        matches!(&created, Err(kube::Error::Api(e)) if e.code == 403),
        "{created:?}"
    );
    // Its own: filled, once.
    assert_eq!(patch(&own_name, &fill(false)), (200, String::new()));
    let (code, msg) = patch(&own_name, &fill(true));
    assert!(
        (code == 422 || code == 403) && msg.contains("filled once"),
        "one answer per node and check: {code} {msg}"
    );
    // Never deleted by the agent, never the FabricCheck.
    for err in [
        cp.block_on(answers.delete(&own_name, &DeleteParams::default()))
            .map(|_| ())
            .expect_err("the agent may not delete an answer"),
        cp.block_on(checks.patch(
            check,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "spec": { "members": [{ "node": names[0] }] } })),
        ))
        .map(|_| ())
        .expect_err("the agent may not patch a FabricCheck"),
        cp.block_on(checks.patch_status(
            check,
            &PatchParams::default(),
            &Patch::Merge(&json!({ "status": { "results": [] } })),
        ))
        .map(|_| ())
        .expect_err("the agent may not write a FabricCheck's status"),
    ] {
        assert!(
            matches!(err, kube::Error::Api(ref e) if e.code == 403 || e.code == 404),
            "{err}"
        );
    }
    let got = results(cp, check);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["node"], names[0]);
    assert_eq!(got[0]["ok"], false, "its own, as it filled it");
    assert_eq!(
        result_objects(cp, check).len(),
        2,
        "the controller's two answers, no more"
    );
    let obj = cp
        .get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{check}"
        ))
        .unwrap();
    assert_eq!(
        obj["spec"]["members"].as_array().unwrap().len(),
        2,
        "the spec stayed"
    );
}

/// Before: an agent's token could create FabricCheckResults for checks
/// that do not exist (any uid-shaped `checkUID`, an owner that is not there) or that do not
/// list its node: 200 of ~77 kB each in 2.8 s, so the shared ResourceQuota (4,096) filled in
/// about a minute, after which every member's answer was refused and every gang pre-flight
/// timed out. Now only the controller creates answers, one per member of a check it made;
/// the agent may only fill its own. Its flood is refused, the room stays as it was, and a
/// real gang pre-flight still completes.
#[test]
fn redteam_an_agent_cannot_fill_the_answers_room() {
    let Some(cp) = control_plane() else { return };
    let names = ["rt-room-0", "rt-room-1"];
    let peers = AdvertisedPeers::start(
        cp,
        "room-peers.key",
        &names,
        |_| format!("127.0.0.1:{}", free_port()),
        |_| &[],
    );
    // A real check that does not list the rogue's node.
    TestNode::seeded(cp, "rt-room-rogue");
    let other = "team.rt-room-other.00000008";
    create_check(
        cp,
        other,
        &[
            ("rt-room-x".to_owned(), "127.0.0.1:9".to_owned()),
            ("rt-room-y".to_owned(), "127.0.0.1:9".to_owned()),
        ],
        600,
    );
    let other_uid = check_uid(cp, other).unwrap();
    let client = cp.block_on(client_from(&cp.agent_kubeconfig("rt-room-rogue", None)));
    let answers: Api<DynamicObject> = Api::namespaced_with(client, NS, &result_resource());
    // The rogue's answers in the namespace (other tests' checks come and go meanwhile).
    let rogues = || {
        cp.get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabriccheckresults"
        ))
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|a| a["spec"]["node"] == "rt-room-rogue")
        .count()
    };
    assert_eq!(rogues(), 0);
    // ~77 kB each, as in the red team: 64 rails with 1 KiB errors.
    let error = "e".repeat(1000);
    let rails: Vec<Value> = (0..64)
        .map(|i| {
            json!({ "device": format!("mlx5_{i}"), "port": 1, "ok": false,
                         "error": error })
        })
        .collect();
    let rogue = |i: usize| -> DynamicObject {
        // The first to the real check that does not list it (one name per node and check),
        // the others to checks that do not exist; each named, labelled and owned as the
        // policy once asked, for its own node.
        let (check, uid) = if i == 0 {
            (other.to_owned(), other_uid.clone())
        } else {
            (
                format!("team.nowhere.{i:08}"),
                format!("0ddba11a-0000-4000-8000-{i:012x}"),
            )
        };
        serde_json::from_value(crate::common::fabriccheck_answer(
            &check,
            &uid,
            &json!({ "node": "rt-room-rogue", "peer": "x", "ok": true, "rdma": "measured",
                     "rails": rails }),
        ))
        .unwrap()
    };
    let t0 = std::time::Instant::now();
    let codes: Vec<u16> = cp.block_on(async {
        use futures::StreamExt;
        futures::stream::iter(0..200usize)
            .map(|i| {
                let (answers, obj) = (answers.clone(), rogue(i));
                async move {
                    match answers.create(&PostParams::default(), &obj).await {
                        Ok(_) => 201,
                        Err(kube::Error::Api(e)) => e.code,
                        Err(_) => 0,
                    }
                }
            })
            .buffer_unordered(16)
            .collect()
            .await
    });
    let created = codes.iter().filter(|c| **c == 201).count();
    eprintln!(
        "rogue agent: {created} of 200 answers created in {:?} (codes {:?})",
        t0.elapsed(),
        codes.iter().collect::<std::collections::BTreeSet<_>>()
    );
    assert_eq!(created, 0, "the rogue agent created answers");
    assert!(codes.iter().all(|c| *c == 403), "{codes:?}");
    // Nor may it fill the real check's answers (not its node's), once the policy is loaded
    // (a server-side dry run is admitted or refused as the write would be).
    let fill_other = |pp: &PatchParams| {
        cp.block_on(answers.patch(
            &format!("{other_uid}.rt-room-x"),
            pp,
            &Patch::Merge(&json!({ "spec": { "ok": true, "rdma": "measured",
                                             "finishedAt": "2026-12-05T00:00:00Z" } })),
        ))
    };
    wait_until("the policy loaded", Duration::from_secs(60), || {
        matches!(fill_other(&PatchParams::default().dry_run()),
                 Err(kube::Error::Api(e)) if e.code == 403)
    });
    let filled = fill_other(&PatchParams::default());
    assert!(
        matches!(&filled, Err(kube::Error::Api(e)) if e.code == 403),
        "the rogue filled another node's answer: {filled:?}"
    );
    assert_eq!(rogues(), 0, "the room is as it was");
    assert!(
        results(cp, other).is_empty(),
        "no answer to the check it is not in"
    );
    assert_eq!(
        result_objects(cp, other).len(),
        2,
        "its members' two, empty"
    );
    // A real gang pre-flight still completes: each member fills its own answer.
    let check = "team.rt-room.00000009";
    create_check(cp, check, &peers.members(), 30);
    wait_until("both members' answers", Duration::from_secs(30), || {
        results(cp, check).len() == 2
    });
    for r in results(cp, check) {
        assert_eq!(r["ok"], true, "{r}");
    }
    drop(peers);
}

/// Tenant pods (127.0.0.2 to 127.0.0.5, two connections each) keep idle
/// connections to a member's peers port, each reconnecting the moment it is cut, for the whole
/// check. Before: the first two alone took the responder's 4 slots at accept, before
/// authentication, so the member's ring predecessor was told BUSY until the check's deadline
/// (`timeout: ... busy or starting until the check's deadline`) and every gang on that node
/// failed. Now unauthenticated connections wait in a pool of their own (which these four fill),
/// never in a session slot, and the live check's predecessor, connecting from its node's
/// address, has places the strangers cannot take: its answer is `ok`.
#[test]
fn redteam_idle_strangers_cannot_keep_a_gangs_predecessor_out() {
    use std::io::Read;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let Some(cp) = control_plane() else { return };
    let names = ["rt-hold-0", "rt-hold-1"];
    // Each agent on its own loopback address, as each node has its own IP.
    let listen = |i: usize| {
        let ip = format!("127.0.0.{}", 41 + i);
        let port = std::net::TcpListener::bind(format!("{ip}:0"))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        format!("{ip}:{port}")
    };
    let peers = AdvertisedPeers::start(cp, "hold-peers.key", &names, listen, |_| &[]);
    // rt-hold-1's responder, measured by rt-hold-0 (its predecessor), is held.
    let victim: std::net::SocketAddr = peers.endpoints[1].parse().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let held = Arc::new(AtomicUsize::new(0));
    let mut attackers = Vec::new();
    for src in [
        [127, 0, 0, 2],
        [127, 0, 0, 3],
        [127, 0, 0, 4],
        [127, 0, 0, 5],
    ] {
        for _ in 0..2 {
            let (stop, held) = (Arc::clone(&stop), Arc::clone(&held));
            attackers.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut s) = crate::common::connect_from(src, victim) else {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    };
                    held.fetch_add(1, Ordering::Relaxed);
                    // Idle until the responder hangs up (or says BUSY), then at once again.
                    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
                    let mut buf = [0u8; 256];
                    while !stop.load(Ordering::Relaxed) {
                        match s.read(&mut buf) {
                            Ok(0) => break,
                            Ok(_) => {}
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) => {}
                            Err(_) => break,
                        }
                    }
                    // Told BUSY or cut: again soon (not in a tight loop, for the test box).
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let members = peers.members();
    let check = "team.rt-hold.00000004";
    let started = std::time::Instant::now();
    create_check(cp, check, &members, 15);
    wait_until("both members' results", Duration::from_secs(40), || {
        results(cp, check).len() == 2
    });
    let answered = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for a in attackers {
        let _ = a.join();
    }
    let got = results(cp, check);
    let r0 = result_of(&got, names[0]).unwrap();
    eprintln!(
        "figure: {} idle connections from 4 addresses; {} answered in {answered:?}: {r0}",
        held.load(Ordering::Relaxed),
        names[0]
    );
    assert_eq!(r0["peer"], names[1], "{r0}");
    assert_eq!(
        r0["ok"], true,
        "the held member's predecessor got through: {r0}"
    );
    assert_eq!(result_of(&got, names[1]).unwrap()["ok"], true, "{got:?}");
    drop(peers);
}

/// An agent whose clock is ahead of the API server's by more than
/// `gang.timeout` (the `clock-ahead` failpoint: 15 minutes). Before: it read every check as
/// past its deadline and answered none, so the check timed out and every gang with its node
/// failed. Now deadlines are read against the API server's clock (the `Date` of a list of one
/// FabricCheck): it answers, and its answer is `ok`.
#[test]
fn redteam_an_agent_whose_clock_is_ahead_still_answers() {
    let Some(cp) = control_plane() else { return };
    let names = ["rt-clock-0", "rt-clock-1"];
    let env = |i: usize| -> &'static [(&'static str, &'static str)] {
        if i == 0 {
            &[("FABRICGATE_FAILPOINT", "clock-ahead")]
        } else {
            &[]
        }
    };
    let peers = AdvertisedPeers::start(
        cp,
        "clock-peers.key",
        &names,
        |_| format!("127.0.0.1:{}", free_port()),
        env,
    );
    let members = peers.members();
    let check = "team.rt-clock.00000005";
    create_check(cp, check, &members, 10);
    // Until the deadline has surely passed: an answer that never comes is the failure.
    let answered = (0..60).any(|_| {
        if results(cp, check).len() == 2 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(250));
        false
    });
    let got = results(cp, check);
    assert!(answered, "both members answer: {got:?}");
    let r0 = result_of(&got, names[0]).unwrap();
    assert_eq!(
        r0["ok"], true,
        "the agent ahead of time measured its peer: {r0}"
    );
    assert_eq!(result_of(&got, names[1]).unwrap()["ok"], true, "{got:?}");
    drop(peers);
}

/// Answers writable by any account with create
/// rights. The controller cannot tell a forged `ok: true` from a member's answer, so RBAC
/// alone (a Role granting `create` or `patch` on fabriccheckresults in the agents' namespace,
/// to a user, a CI bot, a namespace admin's helper) decided who may pass a gang. Before: such
/// an account created an `ok: true` answer for a member (201). Now the policy
/// `fabricgate-fabriccheck-results-writers` lets only the controller's service account create
/// answers, and only empty, and no one but the agents fill one (system:masters excepted, as
/// break-glass).
#[test]
fn redteam_only_the_agents_fill_answers_whatever_rbac_grants() {
    let Some(cp) = control_plane() else { return };
    let names = ["rt-writer-0", "rt-writer-1"];
    let check = "team.rt-writer.00000006";
    let uid = seeded_check(cp, &names, check);
    // RBAC grants an ordinary user create and patch on the answers (get: kubectl's patch
    // reads first).
    cp.apply(
        &json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": { "name": "rt-answer-writer", "namespace": NS },
            "rules": [{ "apiGroups": ["fabricgate.io"], "resources": ["fabriccheckresults"],
                        "verbs": ["create", "get", "patch"] }],
        })
        .to_string(),
    );
    cp.apply(
        &json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": { "name": "rt-answer-writer", "namespace": NS },
            "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                         "name": "rt-answer-writer" },
            "subjects": [{ "apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                           "name": "mallory" }],
        })
        .to_string(),
    );
    // An answer named for `node` (the controller made `node`'s already, so another name),
    // answered or empty.
    let forged = |node: &str, answered: bool| {
        let mut spec = json!({ "check": check, "checkUID": uid, "node": node,
                               "peer": names[1] });
        if answered {
            spec["ok"] = json!(true);
            spec["rdma"] = json!("measured");
            spec["finishedAt"] = json!("2026-12-03T07:30:00Z");
        }
        json!({
            "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheckResult",
            "metadata": { "name": format!("{uid}.{node}-forged"), "namespace": NS,
                "labels": { "fabricgate.io/fabriccheck-uid": uid },
                "ownerReferences": [{ "apiVersion": "fabricgate.io/v1alpha1",
                    "kind": "FabricCheck", "name": check, "uid": uid }] },
            "spec": spec,
        })
        .to_string()
    };
    let as_mallory = |args: &[&str], stdin: Option<&str>| {
        let mut argv = args.to_vec();
        argv.push("--as=mallory");
        cp.kubectl_as(&cp.admin_kubeconfig, &argv, stdin)
    };
    for verb in ["create", "patch"] {
        let (ok, _, err) = as_mallory(
            &[
                "auth",
                "can-i",
                verb,
                "fabriccheckresults.fabricgate.io",
                "-n",
                NS,
            ],
            None,
        );
        assert!(ok, "RBAC grants mallory {verb}: {err}");
    }
    // Admission runs on a server-side dry run too: wait until the policy is loaded without
    // leaving an answer behind, then for real.
    let forged_answer = forged(names[0], true);
    wait_until(
        "the policy loaded (a dry run refused)",
        Duration::from_secs(60),
        || {
            !as_mallory(
                &["create", "-f", "-", "--dry-run=server"],
                Some(&forged_answer),
            )
            .0
        },
    );
    for answered in [true, false] {
        let (ok, _, err) = as_mallory(&["create", "-f", "-"], Some(&forged(names[0], answered)));
        assert!(!ok, "mallory's answer (answered: {answered}) was admitted");
        assert!(
            err.contains("fabricgate-fabriccheck-results-writers")
                && err.contains("only fabricgate admission-check")
                && err.contains("mallory may not"),
            "{err}"
        );
    }
    // Nor may mallory fill the member's empty answer the controller made.
    let fill = json!({ "spec": { "ok": true, "rdma": "measured",
                                 "finishedAt": "2026-12-03T07:30:00Z" } })
    .to_string();
    let own = format!("{uid}.{}", names[0]);
    let (ok, _, err) = as_mallory(
        &[
            "-n",
            NS,
            "patch",
            "fabriccheckresults.fabricgate.io",
            &own,
            "--type=merge",
            "-p",
            &fill,
        ],
        None,
    );
    assert!(!ok, "mallory filled an answer");
    assert!(
        err.contains("fabricgate-fabriccheck-results-writers")
            && err.contains("mallory may not change an answer"),
        "{err}"
    );
    assert!(results(cp, check).is_empty(), "no forged answer");
    assert_eq!(result_objects(cp, check).len(), 2, "no answer created");
    // system:masters (break-glass, and the tests that play the agents) still may.
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            NS,
            "patch",
            "fabriccheckresults.fabricgate.io",
            &format!("{uid}.{}", names[1]),
            "--type=merge",
            "-p",
            &fill,
        ],
        None,
    );
    assert!(ok, "{err}");
    assert_eq!(results(cp, check).len(), 1);
}

/// One fleet-wide peer key. Whoever holds it (any node's agent, anything on
/// a compromised node) can run a responder. Before: one that answered WELCOME as no node (the
/// name check was skipped when empty) was taken for whatever Node was dialled, and the member
/// answered `ok: true` for a peer whose agent never spoke. Now WELCOME must name the Node
/// dialled, and each agent publishes its ports' addresses (`fabricgate.io/peers-gids`) on its
/// own Node, where only it may write them, for the dialling member to hold ENDPOINT to.
#[test]
fn redteam_a_responder_that_is_not_the_dialled_node_is_not_believed() {
    use fabricgate_probes::rdma::peer::{Identity, KeyRing, Keys, LocalPort, Responder};
    let Some(cp) = control_plane() else { return };
    let names = ["rt-imp-0"];
    let peers = AdvertisedPeers::start(
        cp,
        "imp-peers.key",
        &names,
        |_| format!("127.0.0.1:{}", free_port()),
        |_| &[],
    );
    // rt-imp-1's endpoint is answered by an impersonator holding the pool's key, first as no
    // node, then as a third node's name.
    TestNode::seeded(cp, "rt-imp-1");
    let keys = Keys::parse(KEY).expect("the pool key");
    for (i, name) in ["", "rt-imp-9"].iter().enumerate() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let fake = Responder::start(
            listener,
            Identity {
                node_name: (*name).to_owned(),
                group: String::new(),
            },
            std::sync::Arc::new(KeyRing::fixed(keys.clone())),
            fabricgate_probes::Roots::default(),
            Duration::from_secs(10),
        )
        .unwrap();
        fake.set_ports(vec![LocalPort {
            device: "mlx5_0".into(),
            port: 1,
            gid_index: None,
        }]);
        let mut members = peers.members();
        members.push(("rt-imp-1".to_owned(), fake.local_addr().to_string()));
        let check = format!("team.rt-imp.0000000{i}");
        create_check(cp, &check, &members, 20);
        wait_until("rt-imp-0's answer", Duration::from_secs(20), || {
            result_of(&results(cp, &check), "rt-imp-0").is_some()
        });
        let got = results(cp, &check);
        let r = result_of(&got, "rt-imp-0").unwrap();
        assert_eq!(r["ok"], false, "an impersonator is not rt-imp-1: {r}");
        let err = r["error"].as_str().unwrap_or_default();
        let answered = if name.is_empty() {
            "no node".to_owned()
        } else {
            format!("node {name}")
        };
        assert!(
            err.starts_with("verification: peer rt-imp-1 (")
                && err.contains(&format!("answered as {answered}")),
            "{err}"
        );
    }
    // The agent publishes its usable port's address on its own Node (the fixture's IB LID).
    wait_until(
        "rt-imp-0 publishes its ports",
        Duration::from_secs(30),
        || {
            peers.nodes[0].json()["metadata"]["annotations"]["fabricgate.io/peers-gids"]
                == "mlx5_0/1=lid:7"
        },
    );
    drop(peers);
}

/// A compromised agent vouches for a broken link. Its node's pod-bound token
/// may fill its own answer, and the pair it measures was attested by it alone: an `ok: true`
/// for a link that never carried a byte passed. Here rt-forge-0 is compromised: something
/// holding the pool's key answers at its endpoint as rt-forge-0 (so its successor's own pair
/// passes), and its answer is forged with its token, without measuring anything. Now its
/// successor rt-forge-1 (a real agent) attests its receiving end: nothing arrived from
/// rt-forge-0 for the check, and the controller's judgement names the pair.
#[test]
fn redteam_a_forged_answer_is_not_attested_by_its_receiver() {
    use fabricgate::gang::fabriccheck::{CheckSpec, ResultSpec};
    use fabricgate_probes::rdma::peer::{Identity, KeyRing, Keys, LocalPort, Responder};
    let Some(cp) = control_plane() else { return };
    let peers = AdvertisedPeers::start(
        cp,
        "forge-peers.key",
        &["rt-forge-1"],
        |_| format!("127.0.0.1:{}", free_port()),
        |_| &[],
    );
    TestNode::seeded(cp, "rt-forge-0");
    let fake = Responder::start(
        std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
        Identity {
            node_name: "rt-forge-0".to_owned(),
            group: String::new(),
        },
        std::sync::Arc::new(KeyRing::fixed(Keys::parse(KEY).expect("the pool key"))),
        fabricgate_probes::Roots::default(),
        Duration::from_secs(10),
    )
    .unwrap();
    fake.set_ports(vec![LocalPort {
        device: "mlx5_0".into(),
        port: 1,
        gid_index: None,
    }]);
    let mut members = vec![("rt-forge-0".to_owned(), fake.local_addr().to_string())];
    members.extend(peers.members());
    let check = "team.rt-forge.00000007";
    create_check(cp, check, &members, 10);
    let uid = check_uid(cp, check).unwrap();
    // The forged answer, with rt-forge-0's own token: ok, and its receiving end ok too.
    let client = cp.block_on(client_from(&cp.agent_kubeconfig("rt-forge-0", None)));
    let answers: Api<DynamicObject> = Api::namespaced_with(client, NS, &result_resource());
    let forged = json!({ "spec": { "ok": true, "rdma": "unmeasured",
                 "finishedAt": "2026-12-03T10:00:00Z",
                 "received": { "peer": "rt-forge-1", "ok": true, "rdma": "unmeasured" } } });
    cp.block_on(answers.patch(
        &format!("{uid}.rt-forge-0"),
        &PatchParams::default(),
        &Patch::Merge(&forged),
    ))
    .expect("a node may fill its own answer");
    wait_until("rt-forge-1's answer", Duration::from_secs(20), || {
        result_of(&results(cp, check), "rt-forge-1").is_some()
    });
    let got = results(cp, check);
    let honest = result_of(&got, "rt-forge-1").unwrap();
    assert_eq!(honest["ok"], true, "its own pair is fine: {honest}");
    assert_eq!(
        (&honest["received"]["peer"], &honest["received"]["ok"]),
        (&json!("rt-forge-0"), &json!(false)),
        "nothing arrived from rt-forge-0: {honest}"
    );
    // The controller's judgement of these two answers names the pair.
    let spec: CheckSpec = serde_json::from_value(
        cp.get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{check}"
        ))
        .unwrap()["spec"]
            .clone(),
    )
    .unwrap();
    let answers: Vec<_> = got
        .iter()
        .map(|a| {
            serde_json::from_value::<ResultSpec>(a.clone())
                .unwrap()
                .result
        })
        .collect();
    match fabricgate::gang::admission_check::assess_ring(
        &spec,
        &answers,
        false,
        false,
        Duration::from_secs(10),
    ) {
        fabricgate::gang::admission_check::RingOutcome::Failed {
            message,
            failed_pairs: 1,
        } => assert!(
            message.contains("rt-forge-0 -> rt-forge-1: the ends disagree"),
            "{message}"
        ),
        v => panic!("a forged answer passed: {v:?}"),
    }
    drop(peers);
}
