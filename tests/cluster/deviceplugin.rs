//! Device-plugin liveness (`kubernetes.rdma_resources`) against the real kube-apiserver: the
//! test drops and restores the resource's allocatable on the Node's status subresource, as the
//! kubelet does when a device plugin's endpoint goes away and comes back.

use crate::support::sysfs::FakeHca;
use crate::{TAINT, TestNode, control_plane, start_agent, wait_until};
use serde_json::json;
use std::time::{Duration, Instant};

const RESOURCE: &str = "rdma/hca_shared_devices_a";

fn set_allocatable(node: &TestNode, value: &str) {
    let patch = json!({ "status": { "allocatable": { RESOURCE: value } } }).to_string();
    node.cp.kubectl(&[
        "patch",
        "node",
        &node.name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch,
    ]);
}

#[test]
fn plugin_resource_gone_from_allocatable_fails_the_node_within_one_interval_and_recovers() {
    let Some(cp) = control_plane() else { return };
    let name = "plugin-flip";
    cp.create_node(
        name,
        json!({}),
        // The GPU taint, as on the other test nodes: keeps the scheduler test's pods off.
        json!([
            { "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" },
            { "key": TAINT, "effect": "NoSchedule" },
        ]),
        json!({ RESOURCE: "1000" }),
    );
    let node = TestNode {
        cp,
        name: name.to_owned(),
    };
    let hca = FakeHca::new(true);
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("kubernetes:\n  rdma_resources: [\"{RESOURCE}\"]\n"),
    )
    .unwrap();
    let kubeconfig = node.agent_kubeconfig(None);
    let interval = Duration::from_millis(500);
    let agent = start_agent(
        &node.name,
        &hca,
        Some(&kubeconfig),
        &["--interval", "500ms", "--config", config.to_str().unwrap()],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());

    // The plugin's endpoint goes away: the kubelet zeroes allocatable (capacity stays).
    set_allocatable(&node, "0");
    let took = wait_until("the taint", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    assert!(
        took < interval + Duration::from_millis(1500),
        "allocatable 0 to taint took {took:?}"
    );
    eprintln!("allocatable 0 -> taint on the real apiserver: {took:?} (interval {interval:?})");
    wait_until("the condition", Duration::from_secs(5), || {
        node.condition("FabricReady")
            .is_some_and(|c| c["status"] == "False")
    });
    let fabric = node.condition("FabricReady").unwrap();
    assert_eq!(fabric["reason"], "DevicePluginUnavailable", "{fabric}");
    let message = fabric["message"].as_str().unwrap();
    assert!(message.contains(RESOURCE), "{message}");
    assert!(message.contains("allocatable 0"), "{message}");
    let rdma = node.condition("RDMAReady").unwrap();
    assert_eq!(rdma["reason"], "DevicePluginUnavailable", "{rdma}");
    assert_eq!(node.label("fabricgate.io/ready").as_deref(), Some("false"));
    // The hardware itself is fine: the port still counts.
    assert_eq!(
        node.label("fabricgate.io/rdma.active-ports").as_deref(),
        Some("1")
    );

    // The plugin registers again: ready after recover_after (3) good probes, not at once.
    set_allocatable(&node, "1000");
    let back = Instant::now();
    wait_until("untaint", Duration::from_secs(15), || !node.has_our_taint());
    let took = back.elapsed();
    assert!(
        took >= interval * 2 - Duration::from_millis(200),
        "untainted after {took:?}: sooner than the hysteresis allows"
    );
    assert_eq!(node.condition("FabricReady").unwrap()["status"], "True");

    // A resource the Node does not have at all (the plugin never registered).
    set_allocatable(&node, "1000");
    let patch = json!([
        { "op": "remove", "path": "/status/capacity/rdma~1hca_shared_devices_a" },
        { "op": "remove", "path": "/status/allocatable/rdma~1hca_shared_devices_a" },
    ])
    .to_string();
    cp.kubectl(&[
        "patch",
        "node",
        name,
        "--subresource=status",
        "--type=json",
        "-p",
        &patch,
    ]);
    wait_until("taint again", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    wait_until("not in capacity", Duration::from_secs(5), || {
        node.condition("FabricReady").is_some_and(|c| {
            c["reason"] == "DevicePluginUnavailable"
                && c["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("not in the Node's status.capacity"))
        })
    });
    drop(agent);
}
