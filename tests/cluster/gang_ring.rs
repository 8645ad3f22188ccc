//! The agents' half of the gang pre-flight (issue 25, item 2; docs/gangs.md) on the real
//! apiserver: real agents with `peers.enabled` (responders on loopback, distinct ports, one
//! pool key, `--verbs off`, so `rdma: unmeasured` and the authenticated side channel decides)
//! advertise `fabricgate.io/peers-endpoint` on their Nodes and answer a `FabricCheck` in ring
//! order, each writing only its own `status.results` entry through its pod-bound token; a
//! member whose peer's responder is down writes `ok: false` naming the peer. The red-team test
//! shows the admission policy `fabricgate-fabriccheck-results` keeps every agent to its own
//! entry and off the spec.
//!
//! The CRD is applied here (the schema of docs/gangs.md) until the admission-check controller's
//! `deploy/admission-check.yaml` carries it.

use crate::common::controlplane::{ControlPlane, client_from};
use crate::common::sysfs::FakeHca;
use crate::common::{Agent, TestNode, control_plane, start_agent, wait_until};
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

const NS: &str = "fabricgate";
pub(crate) const KEY: &str = "6b1f0c3e9a2d4f5b8c7e6d5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c\n";
const ENDPOINT: &str = "fabricgate.io/peers-endpoint";

/// `fabricchecks.fabricgate.io`, as docs/gangs.md describes it (also used by tests/vm/gang_vm.rs).
pub(crate) const CRD: &str = include_str!("fabriccheck-crd.yaml");

fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("fabricgate.io", "v1alpha1", "FabricCheck"),
        "fabricchecks",
    )
}

/// The CRD and the agents' RBAC and policies, once; waits until the CRD is served.
pub(crate) fn install(cp: &ControlPlane) {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        cp.install_agent_rbac();
        cp.apply(CRD);
        wait_until(
            "the FabricCheck CRD served",
            Duration::from_secs(60),
            || {
                cp.kubectl_as(
                    &cp.admin_kubeconfig,
                    &["get", "fabricchecks", "-n", NS],
                    None,
                )
                .0
            },
        );
    });
}

/// A FabricCheck of `members` (node, endpoint), created by admin, deadline `secs` from now.
pub(crate) fn create_check(cp: &ControlPlane, name: &str, members: &[(String, String)], secs: i64) {
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
}

pub(crate) fn results(cp: &ControlPlane, name: &str) -> Vec<Value> {
    cp.get_json(&format!(
        "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{name}"
    ))
    .and_then(|c| c["status"]["results"].as_array().cloned())
    .unwrap_or_default()
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
fn peer_agent(node: &TestNode, hca: &FakeHca, key: &PathBuf, port: u16) -> Agent {
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
    start_agent(
        &node.name,
        hca,
        Some(&kubeconfig),
        &[
            "--interval",
            "500ms",
            "--config",
            cfg.to_str().unwrap(),
            "--peers-listen",
            &format!("127.0.0.1:{port}"),
        ],
    )
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
    }
    // Each entry is its own agent's: the field manager fabricgate-gang/<node>.
    let obj = cp
        .get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/team.ring-good.00000001"
        ))
        .unwrap();
    let managers: Vec<&str> = obj["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["subresource"] == "status")
        .filter_map(|m| m["manager"].as_str())
        .collect();
    for name in names {
        assert!(
            managers.contains(&format!("fabricgate-gang/{name}").as_str()),
            "{managers:?}"
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
    let rv = |n: &str| {
        cp.get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{n}"
        ))
        .unwrap()["metadata"]["resourceVersion"]
            .clone()
    };
    let before = rv("team.ring-dead.00000002");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(rv("team.ring-dead.00000002"), before, "no repeats");
    // The agents' Nodes are not judged by any of it.
    for node in &nodes[..2] {
        assert!(node.ready(), "{}", node.name);
    }
    drop(agents);
}

/// With its own pod-bound token, a member's agent may write its own entry, but not another
/// node's, nor its own when its node is not a member, nor the spec (through the status
/// subresource or the object).
#[test]
fn redteam_an_agent_writes_only_its_own_fabriccheck_result() {
    let Some(cp) = control_plane() else { return };
    install(cp);
    let names = ["rt-ring-0", "rt-ring-1", "rt-ring-out"];
    for name in names {
        TestNode::seeded(cp, name);
    }
    let check = "team.rt-ring.00000003";
    let members: Vec<(String, String)> = names[..2]
        .iter()
        .map(|n| ((*n).to_owned(), "127.0.0.1:9".to_owned()))
        .collect();
    create_check(cp, check, &members, 600);
    let client = |n: &str| cp.block_on(client_from(&cp.agent_kubeconfig(n, None)));
    let member: Api<DynamicObject> = Api::namespaced_with(client(names[0]), NS, &resource());
    let outsider: Api<DynamicObject> = Api::namespaced_with(client(names[2]), NS, &resource());
    let entry = |node: &str, ok: bool| {
        json!({
            "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheck",
            "metadata": { "name": check },
            "status": { "results": [{ "node": node, "peer": "x", "ok": ok,
                "rdma": "measured", "finishedAt": "2026-12-02T03:00:07Z" }] },
        })
    };
    let write = |api: &Api<DynamicObject>, as_node: &str, body: &Value| -> (u16, String) {
        let pp = PatchParams::apply(&format!("fabricgate-gang/{as_node}")).force();
        match cp.block_on(api.patch_status(check, &pp, &Patch::Apply(body))) {
            Ok(_) => (200, String::new()),
            Err(kube::Error::Api(e)) => (e.code, e.message),
            Err(e) => panic!("not an API answer: {e}"),
        }
    };
    // Another member's entry (forged as ok): refused by the policy once it is loaded.
    wait_until(
        "the policy refuses another node's entry",
        Duration::from_secs(60),
        || write(&member, names[0], &entry(names[1], true)).0 == 403,
    );
    let (code, msg) = write(&member, names[0], &entry(names[1], true));
    assert_eq!(code, 403);
    assert!(
        msg.contains("ValidatingAdmissionPolicy 'fabricgate-fabriccheck-results'")
            && msg.contains("may write only its own result rt-ring-0"),
        "{msg}"
    );
    // Its own: admitted.
    assert_eq!(
        write(&member, names[0], &entry(names[0], false)),
        (200, String::new())
    );
    // A node that is not a member: refused, even for its own entry.
    let (code, msg) = write(&outsider, names[2], &entry(names[2], true));
    assert_eq!(code, 403, "{msg}");
    assert!(msg.contains("is not a member of FabricCheck"), "{msg}");
    // The spec through the status subresource: never changed (the policy refuses, or the
    // apiserver drops it).
    let mut forged = entry(names[0], false);
    forged["spec"] = json!({ "members": [{ "node": names[0] }, { "node": names[2] }],
                             "deadline": "2030-01-01T00:00:00Z" });
    let _ = write(&member, names[0], &forged);
    // The object itself: RBAC refuses.
    let spec_patch = json!({ "spec": { "members": [{ "node": names[0] }, { "node": names[2] }] } });
    let err = cp
        .block_on(member.patch(check, &PatchParams::default(), &Patch::Merge(&spec_patch)))
        .expect_err("the agent may not patch a FabricCheck");
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 403),
        "{err}"
    );
    let obj = cp
        .get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{check}"
        ))
        .unwrap();
    let nodes: Vec<&str> = obj["spec"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["node"].as_str())
        .collect();
    assert_eq!(nodes, names[..2], "the spec stayed");
    let results = obj["status"]["results"].as_array().unwrap();
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0]["node"], names[0]);
    assert_eq!(results[0]["ok"], false, "its own, as it wrote it");
}
