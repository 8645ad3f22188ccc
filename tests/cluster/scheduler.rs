//! The mission in one test: three GPU Nodes, one agent each over fixture trees, `gpu-b` with
//! a port down; a three-pod training job that requires `fabricgate.io/ready=true` and does not
//! tolerate the taint. The real kube-scheduler binds two pods to `gpu-a` and `gpu-c`; the third
//! stays Pending, the scheduler naming the taint. Repair `gpu-b`: after the hysteresis the agent
//! untaints and the pod is bound there.

use crate::common::sysfs::FakeHca;
use crate::common::{TAINT, TestNode, control_plane, start_agent, wait_until};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const RDMA_RESOURCE: &str = "rdma/hca_shared_devices_a";

fn pod(name: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": "training",
                      "labels": { "job": "llm-pretrain" } },
        "spec": {
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 0,
            "affinity": { "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{ "matchExpressions": [
                    { "key": "fabricgate.io/ready", "operator": "In", "values": ["true"] },
                ]}],
            }}},
            "containers": [{
                "name": "worker", "image": "pytorch:test",
                "resources": {
                    "requests": { "cpu": "1", RDMA_RESOURCE: "1" },
                    "limits": { RDMA_RESOURCE: "1" },
                },
            }],
        },
    })
}

fn bound_to(cp: &crate::common::controlplane::ControlPlane, pod: &str) -> Option<String> {
    cp.get_json(&format!("/api/v1/namespaces/training/pods/{pod}"))?["spec"]["nodeName"]
        .as_str()
        .map(str::to_owned)
}

#[test]
fn the_scheduler_keeps_the_job_off_the_broken_node_until_it_is_repaired() {
    let Some(cp) = control_plane() else { return };
    // One RDMA device per node, so each node takes one worker.
    let mut nodes = Vec::new();
    let mut hcas = Vec::new();
    let mut agents = Vec::new();
    for (name, up) in [("gpu-a", true), ("gpu-b", false), ("gpu-c", true)] {
        cp.create_node(
            name,
            json!({ "nvidia.com/gpu.product": "H200" }),
            json!([{ "key": TAINT, "effect": "NoSchedule" }]),
            json!({ RDMA_RESOURCE: "1", "nvidia.com/gpu": "8" }),
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
    wait_until("gpu-a and gpu-c validated", Duration::from_secs(30), || {
        nodes[0].ready() && nodes[2].ready()
    });
    wait_until("gpu-b described", Duration::from_secs(30), || {
        nodes[1].has_reason("FabricReady", "PortDown")
    });
    assert!(nodes[1].has_our_taint());

    cp.apply(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: training\n---\n\
         apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: default\n  namespace: training\n",
    );
    cp.start_scheduler();
    for i in 0..3 {
        let (ok, _, err) = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &["create", "-f", "-"],
            Some(&pod(&format!("worker-{i}")).to_string()),
        );
        assert!(ok, "create worker-{i}: {err}");
    }
    wait_until("two workers bound", Duration::from_secs(60), || {
        (0..3)
            .filter(|i| bound_to(cp, &format!("worker-{i}")).is_some())
            .count()
            == 2
    });
    let bound: Vec<Option<String>> = (0..3)
        .map(|i| bound_to(cp, &format!("worker-{i}")))
        .collect();
    let mut on: Vec<&str> = bound.iter().flatten().map(String::as_str).collect();
    on.sort_unstable();
    assert_eq!(on, vec!["gpu-a", "gpu-c"], "{bound:?}");
    let pending = (0..3)
        .find(|i| bound[*i].is_none())
        .map(|i| format!("worker-{i}"))
        .unwrap();
    let mut why = String::new();
    wait_until("the scheduler's reason", Duration::from_secs(30), || {
        let p = cp
            .get_json(&format!("/api/v1/namespaces/training/pods/{pending}"))
            .unwrap();
        let cond = p["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "PodScheduled")
            .cloned();
        match cond {
            Some(c) if c["reason"] == "Unschedulable" => {
                why = c["message"].as_str().unwrap_or_default().to_owned();
                true
            }
            _ => false,
        }
    });
    assert_eq!(
        cp.get_json(&format!("/api/v1/namespaces/training/pods/{pending}"))
            .unwrap()["status"]["phase"],
        "Pending"
    );
    // Kubernetes 1.37's scheduler counts nodes per reason without naming the taint's key;
    // gpu-a and gpu-c are full, and gpu-b is the one node with the RDMA resource left, kept
    // off by its taint (the label affinity is checked after the taint).
    assert!(
        why.contains("untolerated taint") && why.contains("Insufficient rdma/hca_shared_devices_a"),
        "the scheduler says the taint keeps it off: {why}"
    );
    assert_eq!(nodes[1].taints(), vec![TAINT]);
    eprintln!("scheduler: {pending} Pending: {why}");

    // What an operator sees, from the real server (README).
    let get = cp.kubectl(&[
        "get",
        "nodes",
        "gpu-a",
        "gpu-b",
        "gpu-c",
        "-L",
        "fabricgate.io/ready,fabricgate.io/rdma.active-ports",
    ]);
    let row = |n: &str| {
        get.lines()
            .find(|l| l.starts_with(n))
            .unwrap_or_default()
            .split_whitespace()
            .collect::<Vec<_>>()
    };
    assert_eq!(
        row("gpu-a").iter().rev().take(2).collect::<Vec<_>>(),
        [&"1", &"true"]
    );
    assert_eq!(
        row("gpu-b").iter().rev().take(2).collect::<Vec<_>>(),
        [&"0", &"false"]
    );
    let describe = cp.kubectl(&["describe", "node", "gpu-b"]);
    assert!(
        describe.contains("Taints:             fabricgate.io/unvalidated:NoSchedule"),
        "{describe}"
    );
    assert!(
        describe
            .lines()
            .any(|l| l.trim_start().starts_with("FabricReady")
                && l.contains("False")
                && l.contains("PortDown")),
        "{describe}"
    );
    let _ = std::fs::write(cp.path("kubectl-get-nodes.txt"), &get);
    let _ = std::fs::write(cp.path("kubectl-describe-gpu-b.txt"), &describe);

    // Repair gpu-b: recover_after (3) good probes later the agent untaints, and the
    // scheduler binds the pending worker there.
    let repaired = Instant::now();
    hcas[1].set_port(true);
    wait_until("gpu-b untainted", Duration::from_secs(30), || {
        !nodes[1].has_our_taint()
    });
    let untainted = repaired.elapsed();
    wait_until("the pending worker bound", Duration::from_secs(60), || {
        bound_to(cp, &pending).is_some()
    });
    let bound_after = repaired.elapsed();
    assert_eq!(bound_to(cp, &pending).as_deref(), Some("gpu-b"));
    eprintln!(
        "repair -> untaint {untainted:?}, repair -> {pending} bound to gpu-b {bound_after:?} \
         (--interval 500ms, recover_after 3)"
    );
    let _ = std::fs::write(
        cp.path("scheduler-figures.txt"),
        format!("untaint {untainted:?}\nbound {bound_after:?}\n"),
    );
    drop(agents);
}
