//! The blast-radius breaker against the real kube-apiserver: a pool of 10 Nodes (a label
//! selector, as the DaemonSet's nodeSelector), half of them already tainted; the agent of a
//! sixth failing node does not taint it and says why, and taints once the pool recovers.

use crate::common::sysfs::FakeHca;
use crate::common::{TAINT, TestNode, control_plane, wait_until};
use serde_json::json;
use std::time::Duration;

const POOL: &str = "fabricgate.io/test-pool";

#[test]
fn ten_nodes_at_one_half_the_sixth_failing_node_is_not_tainted_and_recovery_untaints() {
    let Some(cp) = control_plane() else { return };
    let names: Vec<String> = (0..10).map(|i| format!("breaker-{i}")).collect();
    // breaker-0..4: failing nodes their agents tainted; breaker-5..8 validated; breaker-9 is
    // this test's agent's node, registered with the taint as the docs recommend.
    for (i, name) in names.iter().enumerate() {
        // The GPU taint, as on the other test nodes: keeps the scheduler test's pods off.
        let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
        let taints = if i < 5 || i == 9 {
            json!([gpu, { "key": TAINT, "effect": "NoSchedule" }])
        } else {
            json!([gpu])
        };
        cp.create_node(name, json!({ POOL: "breaker" }), taints, json!({}));
    }
    // A node outside the pool, tainted: must not count.
    cp.create_node(
        "breaker-other-pool",
        json!({ POOL: "elsewhere" }),
        json!([{ "key": TAINT, "effect": "NoSchedule" }]),
        json!({}),
    );
    let node = TestNode {
        cp,
        name: names[9].clone(),
    };
    let hca = FakeHca::new(true);
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"{POOL}=breaker\"\n"),
    )
    .unwrap();
    let agent = node.start_agent(
        &hca,
        &[
            "--interval",
            "300ms",
            "--resync-interval",
            "1s",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    // 6 of 10 tainted, yet the agent untaints its validated node: the breaker never blocks
    // recovery.
    agent.wait("validation", Duration::from_secs(30), || node.ready());

    // The port fails: tainting would make 6 of 10 tainted, above 0.5.
    let events_before = node.events().len();
    hca.set_port(false);
    agent.wait("BreakerOpen", Duration::from_secs(10), || {
        node.has_reason("FabricReady", "BreakerOpen")
    });
    let fabric = node.condition("FabricReady").unwrap();
    assert_eq!(fabric["status"], "False");
    let message = fabric["message"].as_str().unwrap();
    assert!(message.contains("6 of 10"), "{message}");
    assert!(
        message.contains("PortDown"),
        "what would have tainted it: {message}"
    );
    assert!(
        message.contains("fabricgate.io/breaker-override"),
        "{message}"
    );
    // Held for several resyncs: still not tainted.
    std::thread::sleep(Duration::from_secs(2));
    assert!(!node.has_our_taint(), "{:?}", node.taints());
    assert_eq!(node.label("fabricgate.io/ready").as_deref(), Some("false"));
    let events = node.events();
    assert!(events.len() > events_before);
    let ev = events.last().unwrap();
    assert_eq!(ev["reason"], "FabricNotReady");
    assert!(ev["note"].as_str().unwrap().contains("BreakerOpen"), "{ev}");
    assert!(
        agent.log().contains("BLAST-RADIUS BREAKER OPEN"),
        "{}",
        agent.log()
    );

    // One failing node recovers (its agent untaints it): 5 of 10 is within the limit, and the
    // next resync taints this node.
    cp.kubectl(&["taint", "node", &names[0], &format!("{TAINT}:NoSchedule-")]);
    agent.wait("the taint", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    wait_until("reason PortDown", Duration::from_secs(5), || {
        node.has_reason("FabricReady", "PortDown")
    });

    // Recovery untaints normally, whatever the pool looks like.
    cp.kubectl(&["taint", "node", &names[5], &format!("{TAINT}=x:NoSchedule")]);
    cp.kubectl(&["taint", "node", &names[6], &format!("{TAINT}=x:NoSchedule")]);
    hca.set_port(true);
    agent.wait("recovery", Duration::from_secs(15), || node.ready());
    drop(agent);
}

/// The breaker's one read, measured with a pool of 500 Nodes: a label-selected list from the
/// API server's watch cache (`resourceVersion=0`), as the agent makes it. Prints the figures
/// (docs/failure-modes.md); asserts the list is the pool and only the pool.
#[test]
fn breaker_list_of_a_500_node_pool() {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Api, DeleteParams, ListParams, PostParams};
    let Some(cp) = control_plane() else { return };
    let nodes: Api<Node> = Api::all(cp.admin());
    let names: Vec<String> = (0..500).map(|i| format!("pool500-{i:03}")).collect();
    cp.block_on(async {
        for (i, name) in names.iter().enumerate() {
            let mut node: Node = serde_json::from_value(json!({
                "metadata": { "name": name, "labels": {
                    POOL: "p500", "kubernetes.io/hostname": name,
                    "nvidia.com/gpu.product": "H200",
                }},
                "spec": { "taints": if i % 10 == 0 {
                    json!([{ "key": TAINT, "effect": "NoSchedule" }])
                } else { json!([]) } },
            }))
            .unwrap();
            node.metadata.resource_version = None;
            let _ = nodes.create(&PostParams::default(), &node).await;
        }
    });
    let params = ListParams::default()
        .labels(&format!("{POOL}=p500"))
        .match_any();
    let mut times = Vec::new();
    let mut count = 0;
    let mut tainted = 0;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let list = cp.block_on(nodes.list(&params)).unwrap();
        times.push(started.elapsed());
        count = list.items.len();
        tainted = list
            .items
            .iter()
            .filter(|n| {
                n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|ts| ts.iter().any(|t| t.key == TAINT))
            })
            .count();
    }
    let bytes = serde_json::to_vec(&cp.get_json(&format!(
        "/api/v1/nodes?labelSelector={POOL}%3Dp500&resourceVersion=0"
    )))
    .unwrap()
    .len();
    times.sort();
    eprintln!(
        "breaker list of a 500-node pool: median {:?}, max {:?}, {} kB of JSON",
        times[2],
        times[4],
        bytes / 1024
    );
    assert_eq!(count, 500, "the list is exactly the pool");
    assert_eq!(tainted, 50);
    cp.block_on(async {
        for name in &names {
            let _ = nodes.delete(name, &DeleteParams::default()).await;
        }
    });
}

/// A correlated burst: eight agents of one pool lose their ports at the same instant, with
/// `max_new_per_window: 3`. Each sees almost none of the others' taints in its list (they
/// decide within the same list latency); the ledger's compare-and-swap keeps the cap exact:
/// three tainted, five held with `BreakerOpen`.
#[test]
fn a_burst_of_eight_failures_taints_exactly_max_new_per_window() {
    let Some(cp) = control_plane() else { return };
    let names: Vec<String> = (0..8).map(|i| format!("burst-{i}")).collect();
    for name in &names {
        let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
        cp.create_node(
            name,
            json!({ POOL: "burst" }),
            json!([gpu, { "key": TAINT, "effect": "NoSchedule" }]),
            json!({}),
        );
    }
    let nodes: Vec<TestNode> = names
        .iter()
        .map(|n| TestNode {
            cp,
            name: n.clone(),
        })
        .collect();
    let hcas: Vec<FakeHca> = (0..8).map(|_| FakeHca::new(true)).collect();
    let agents: Vec<_> = nodes
        .iter()
        .zip(&hcas)
        .map(|(node, hca)| {
            let config = hca.scratch().join("requirements.yaml");
            std::fs::write(
                &config,
                format!(
                    "node:\n  recover_after: 1\n  pool_selector: \"{POOL}=burst\"\n  breaker:\n    \
                     max_new_per_window: 3\n    window: 10m\n"
                ),
            )
            .unwrap();
            node.start_agent(
                hca,
                &["--interval", "300ms", "--config", config.to_str().unwrap()],
            )
        })
        .collect();
    for (agent, node) in agents.iter().zip(&nodes) {
        agent.wait("validation", Duration::from_secs(60), || node.ready());
    }
    for hca in &hcas {
        hca.set_port(false);
    }
    let decided = |n: &TestNode| n.has_our_taint() || n.has_reason("FabricReady", "BreakerOpen");
    wait_until(
        "every failing node decided",
        Duration::from_secs(30),
        || nodes.iter().all(decided),
    );
    // Held nodes re-check on every resync; give a wrong extra taint the time to appear.
    std::thread::sleep(Duration::from_secs(2));
    let tainted = nodes.iter().filter(|n| n.has_our_taint()).count();
    let held: Vec<String> = nodes
        .iter()
        .filter(|n| !n.has_our_taint())
        .map(|n| n.condition("FabricReady").unwrap()["message"].to_string())
        .collect();
    assert_eq!(tainted, 3, "held: {held:#?}");
    assert!(
        held.iter()
            .all(|m| m.contains("node.breaker.max_new_per_window 3")),
        "{held:#?}"
    );
    drop(agents);
}
