//! Native gangs on Kubernetes 1.37's own scheduler: a `PodGroup`
//! (`scheduling.k8s.io/v1beta1`, feature gates `GenericWorkload` and
//! `TopologyAwareWorkloadScheduling`) of 3 workers, all in one value of the operator's leaf
//! label, each requiring `fabricgate.io/ready In ["true"]` as docs/deploy.md tells users
//! without the webhook. Six Nodes in two leaves, each with a real agent over a fixture tree
//! writing the marks: the gang stays pending whole while no leaf has 3 validated nodes, a node
//! that fails while it waits is not chosen, it is bound whole to the first leaf that has 3,
//! and a node that fails after binding is tainted with its condition saying why.

use crate::common::sysfs::FakeHca;
use crate::common::{TAINT, TestNode, control_plane, start_agent, wait_until};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const NS: &str = "gang";
const LEAF: &str = "network.topology.nvidia.com/leaf";
/// A resource only this test's Nodes have, so the other tests' pods (which the same scheduler
/// places) never land on them, nor the gang on theirs.
const RDMA_RESOURCE: &str = "rdma/gang_test";
const WORKERS: usize = 3;

fn worker(i: usize) -> Value {
    gang_worker(
        NS,
        "llm",
        &format!("worker-{i}"),
        Claims::Resource(RDMA_RESOURCE),
    )
}

/// How a gang worker asks for its HCAs.
enum Claims<'a> {
    /// A device plugin's extended resource.
    Resource(&'a str),
    /// A DRA ResourceClaim of that name, on a Node of this leaf.
    Dra { claim: &'a str, leaf: &'a str },
}

fn gang_worker(ns: &str, group: &str, name: &str, claims: Claims) -> Value {
    let mut terms =
        vec![json!({ "key": "fabricgate.io/ready", "operator": "In", "values": ["true"] })];
    let mut container = json!({ "name": "worker", "image": "pytorch:test" });
    let mut pod_claims = json!([]);
    match claims {
        Claims::Resource(resource) => {
            container["resources"] = json!({
                "requests": { "cpu": "1", resource: "1" },
                "limits": { resource: "1" },
            });
        }
        Claims::Dra { claim, leaf } => {
            terms.push(json!({ "key": LEAF, "operator": "In", "values": [leaf] }));
            container["resources"] =
                json!({ "requests": { "cpu": "1" }, "claims": [{ "name": "hca" }] });
            pod_claims = json!([{ "name": "hca", "resourceClaimName": claim }]);
        }
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": ns, "labels": { "job": group } },
        "spec": {
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "schedulingGroup": { "podGroupName": group },
            "affinity": { "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{ "matchExpressions": terms }],
            }}},
            "resourceClaims": pod_claims,
            "containers": [container],
        },
    })
}

/// A PodGroup of `min_count` whose pods must share one value of the leaf label.
fn pod_group(ns: &str, name: &str, min_count: usize) -> String {
    format!(
        "apiVersion: scheduling.k8s.io/v1beta1\nkind: PodGroup\nmetadata:\n  name: {name}\n  \
         namespace: {ns}\nspec:\n  schedulingPolicy:\n    gang:\n      minCount: {min_count}\n  \
         schedulingConstraints:\n    topology:\n      - key: {LEAF}\n"
    )
}

fn bound(cp: &crate::common::controlplane::ControlPlane) -> Vec<Option<String>> {
    (0..WORKERS)
        .map(|i| {
            cp.get_json(&format!("/api/v1/namespaces/{NS}/pods/worker-{i}"))
                .and_then(|p| p["spec"]["nodeName"].as_str().map(str::to_owned))
        })
        .collect()
}

#[test]
fn a_native_gang_waits_whole_for_a_leaf_of_validated_nodes_and_binds_there() {
    let Some(cp) = control_plane() else { return };
    // leaf-1: g1-0, g1-1 healthy, g1-2 port down; leaf-2 the same. Four validated nodes,
    // but no leaf with three: a gang of three fits nowhere.
    let layout = [
        ("g1-0", "leaf-1", true),
        ("g1-1", "leaf-1", true),
        ("g1-2", "leaf-1", false),
        ("g2-0", "leaf-2", true),
        ("g2-1", "leaf-2", true),
        ("g2-2", "leaf-2", false),
    ];
    let mut nodes = Vec::new();
    let mut hcas = Vec::new();
    let mut agents = Vec::new();
    for (name, leaf, up) in layout {
        cp.create_node(
            name,
            json!({ LEAF: leaf }),
            json!([{ "key": TAINT, "effect": "NoSchedule" }]),
            json!({ RDMA_RESOURCE: "1" }),
        );
        let node = TestNode {
            cp,
            name: name.to_owned(),
        };
        let hca = FakeHca::new(up);
        let kubeconfig = node.agent_kubeconfig(None);
        agents.push(start_agent(
            name,
            &hca,
            Some(&kubeconfig),
            &["--interval", "500ms"],
        ));
        nodes.push(node);
        hcas.push(hca);
    }
    let by_name = |n: &str| layout.iter().position(|(name, _, _)| *name == n).unwrap();
    wait_until(
        "the healthy nodes validated",
        Duration::from_secs(60),
        || {
            layout.iter().zip(&nodes).all(|((_, _, up), n)| {
                if *up {
                    n.ready()
                } else {
                    n.has_reason("FabricReady", "PortDown")
                }
            })
        },
    );

    cp.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n---\napiVersion: v1\n\
         kind: ServiceAccount\nmetadata:\n  name: default\n  namespace: {NS}\n---\n{}",
        pod_group(NS, "llm", WORKERS)
    ));
    cp.start_scheduler();
    for i in 0..WORKERS {
        let (ok, _, err) = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &["create", "-f", "-"],
            Some(&worker(i).to_string()),
        );
        assert!(ok, "create worker-{i}: {err}");
    }

    // Whole or nothing: for 10 s not one worker is bound, though four nodes are validated.
    let waiting = Instant::now();
    while waiting.elapsed() < Duration::from_secs(10) {
        let b = bound(cp);
        assert!(
            b.iter().all(Option::is_none),
            "part of the gang was bound: {b:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // While it waits, g1-1 fails; g1-2 and g2-2 are repaired. leaf-1 then has two validated
    // nodes (g1-0, g1-2), leaf-2 three: the gang goes to leaf-2, never to the failed g1-1.
    hcas[by_name("g1-1")].set_port(false);
    wait_until("g1-1 tainted", Duration::from_secs(30), || {
        nodes[by_name("g1-1")].has_our_taint()
    });
    let repaired = Instant::now();
    hcas[by_name("g1-2")].set_port(true);
    hcas[by_name("g2-2")].set_port(true);
    wait_until("the gang bound", Duration::from_secs(90), || {
        bound(cp).iter().all(Option::is_some)
    });
    let bound_after = repaired.elapsed();
    let mut on: Vec<String> = bound(cp).into_iter().flatten().collect();
    on.sort();
    assert_eq!(on, ["g2-0", "g2-1", "g2-2"], "bound whole, to leaf-2");
    eprintln!("gang: repair -> all {WORKERS} workers bound to leaf-2 in {bound_after:?}");

    // A node that fails after binding: tainted, its condition says why; the workers stay
    // (NoSchedule), and the operator finds them on the failed node.
    hcas[by_name("g2-1")].set_port(false);
    let failed = &nodes[by_name("g2-1")];
    wait_until("g2-1 tainted PortDown", Duration::from_secs(30), || {
        failed.has_our_taint() && failed.has_reason("FabricReady", "PortDown")
    });
    assert_eq!(
        failed.label("fabricgate.io/ready").as_deref(),
        Some("false")
    );
    let on_failed = cp.kubectl(&[
        "-n",
        NS,
        "get",
        "pods",
        "--field-selector=spec.nodeName=g2-1",
        "-o",
        "name",
    ]);
    assert_eq!(on_failed.lines().count(), 1, "{on_failed}");
    drop(agents);
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["delete", "namespace", NS, "--wait=false"],
        None,
    );
}

/// The gang path on a DRA cluster: a native gang of three whose workers each claim
/// three HCAs through a ResourceClaim, over four validated nodes of one leaf whose agents keep
/// a DeviceTaintRule per bad HCA (`taint_scope: device`, two of four ports required): dg-0's
/// mlx5_0 and dg-1's mlx5_3 bad, dg-3 with two bad HCAs (one untainted HCA short of a
/// worker), dg-2 healthy. The scheduler binds the gang whole to dg-0, dg-1 and dg-2 and
/// allocates every claim on the worker's own node, never a tainted device: without the rules
/// it would take dg-0's first three (mlx5_0 among them) and could use dg-3.
#[test]
fn a_native_gang_claiming_hcas_through_dra_gets_only_untainted_devices() {
    use crate::dra::{DraNode, allocated_devices, delete_pods, device_name, setup_claims};
    let Some(cp) = control_plane() else { return };
    setup_claims(cp);
    let leaf = "leaf-dra";
    let bad: [&[usize]; 4] = [&[0], &[3], &[], &[0, 1]];
    let nodes: Vec<DraNode> = (0..4)
        .map(|i| DraNode::with(cp, &format!("dg-{i}"), json!({ LEAF: leaf }), 2, ""))
        .collect();
    let agents: Vec<_> = nodes
        .iter()
        .map(|n| {
            n.publish_slice(&[0, 1, 2, 3]);
            n.start_agent("500ms")
        })
        .collect();
    for (n, bad) in nodes.iter().zip(bad) {
        for hca in bad {
            n.port_state(*hca, false);
        }
    }
    wait_until(
        "each bad HCA's rule, every node validated",
        Duration::from_secs(60),
        || {
            nodes
                .iter()
                .zip(bad)
                .all(|(n, bad)| n.node.ready() && n.rules().len() == bad.len())
        },
    );

    let ns = crate::dra::NS;
    cp.apply(&pod_group(ns, "llm-dra", WORKERS));
    let workers: Vec<String> = (0..WORKERS).map(|i| format!("gang-dra-{i}")).collect();
    for w in &workers {
        cp.apply(
            &json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": { "name": w, "namespace": ns },
                "spec": { "devices": { "requests": [{ "name": "hca", "exactly": {
                    "deviceClassName": "dra.net", "allocationMode": "ExactCount", "count": 3,
                    "selectors": [{ "cel": { "expression": "device.attributes[\"dra.net\"].rdma == true" } }],
                }}]}},
            })
            .to_string(),
        );
        let pod = gang_worker(ns, "llm-dra", w, Claims::Dra { claim: w, leaf });
        let (ok, _, err) = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &["create", "-f", "-"],
            Some(&pod.to_string()),
        );
        assert!(ok, "create {w}: {err}");
    }
    let node_of = |w: &str| {
        cp.get_json(&format!("/api/v1/namespaces/{ns}/pods/{w}"))
            .and_then(|p| p["spec"]["nodeName"].as_str().map(str::to_owned))
    };
    wait_until("the DRA gang bound", Duration::from_secs(60), || {
        workers.iter().all(|w| node_of(w).is_some())
    });
    let mut on: Vec<String> = workers.iter().filter_map(|w| node_of(w)).collect();
    on.sort();
    assert_eq!(on, ["dg-0", "dg-1", "dg-2"], "bound whole, never to dg-3");
    for w in &workers {
        let node = node_of(w).unwrap();
        let i: usize = node["dg-".len()..].parse().unwrap();
        let claim = cp
            .get_json(&format!(
                "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{w}"
            ))
            .unwrap();
        let results = claim["status"]["allocation"]["devices"]["results"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            results.iter().all(|r| r["pool"] == node.as_str()),
            "{w} on {node}: devices of another pool: {results:?}"
        );
        let mut got = allocated_devices(cp, w).unwrap_or_default();
        got.sort();
        let want: Vec<String> = (0..4)
            .filter(|h| !bad[i].contains(h))
            .map(device_name)
            .take(3)
            .collect();
        if bad[i].is_empty() {
            assert_eq!(got.len(), 3, "{w} on {node}: {got:?}");
        } else {
            assert_eq!(got, want, "{w} on {node}: only untainted devices");
        }
    }
    delete_pods(cp, &workers.iter().map(String::as_str).collect::<Vec<_>>());
    drop(agents);
}
