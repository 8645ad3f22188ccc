//! Device-plugin liveness (`kubernetes.rdma_resources`) against the real kube-apiserver: the
//! test drops and restores the resource's allocatable on the Node's status subresource, as the
//! kubelet does when a device plugin's endpoint goes away and comes back.

use crate::common::controlplane::ControlPlane;
use crate::common::sysfs::FakeHca;
use crate::common::{TAINT, TestNode, control_plane, wait_until};
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

/// A tainted GPU Node whose device plugin advertises 1000 units of [`RESOURCE`].
fn plugin_node(cp: &'static ControlPlane, name: &str) -> TestNode {
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
    TestNode {
        cp,
        name: name.to_owned(),
    }
}

#[test]
fn plugin_resource_gone_from_allocatable_fails_the_node_within_one_interval_and_recovers() {
    let Some(cp) = control_plane() else { return };
    let name = "plugin-flip";
    let node = plugin_node(cp, name);
    let hca = FakeHca::new(true);
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("kubernetes:\n  rdma_resources: [\"{RESOURCE}\"]\n"),
    )
    .unwrap();
    let interval = Duration::from_millis(500);
    let agent = node.start_agent(
        &hca,
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

/// The host side of the plugin: its socket under the kubelet's device-plugins directory, and
/// the `/dev/infiniband` nodes it hands out (here the agent's `--dev-root`). A 10-HCA node
/// (`tests/fixtures/pod-4of8`, every device node present at first).
#[test]
fn plugin_socket_gone_or_an_incomplete_device_set_fails_the_node_and_recovers() {
    let Some(cp) = control_plane() else { return };
    let name = "plugin-host";
    let node = plugin_node(cp, name);
    let dir = tempfile::tempdir().unwrap();
    let fixture = crate::common::fixture("pod-4of8");
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(fixture.join("sys"))
        .arg(fixture.join("dev"))
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    let dev = dir.path().join("dev/infiniband");
    for n in 4..10 {
        std::fs::write(dev.join(format!("uverbs{n}")), "").unwrap();
    }
    let proc_root = dir.path().join("proc/self");
    std::fs::create_dir_all(&proc_root).unwrap();
    std::fs::write(
        proc_root.join("mountinfo"),
        "21 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n",
    )
    .unwrap();
    let plugins = dir.path().join("device-plugins");
    std::fs::create_dir(&plugins).unwrap();
    let socket = plugins.join("rdma-shared.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let config = dir.path().join("requirements.yaml");
    std::fs::write(
        &config,
        format!(
            "kubernetes:\n  rdma_resources: [\"{RESOURCE}\"]\n  device_plugin_dir: {}\n  \
             device_plugin_sockets: [rdma-shared.sock]\n",
            plugins.display()
        ),
    )
    .unwrap();
    let kubeconfig = node.agent_kubeconfig(None);
    let agent = crate::common::start_agent_at(
        name,
        &dir.path().join("sys"),
        &dir.path().join("proc"),
        dir.path(),
        Some(&kubeconfig),
        &[
            "--interval",
            "300ms",
            "--config",
            config.to_str().unwrap(),
            "--dev-root",
            dir.path().join("dev").to_str().unwrap(),
        ],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    let reason_with = |needle: &str| {
        node.condition("FabricReady").is_some_and(|c| {
            c["status"] == "False"
                && c["reason"] == "DevicePluginUnavailable"
                && c["message"].as_str().is_some_and(|m| m.contains(needle))
        })
    };

    // The plugin stops: its socket goes away.
    drop(listener);
    std::fs::remove_file(&socket).unwrap();
    agent.wait("the socket finding", Duration::from_secs(10), || {
        node.has_our_taint() && reason_with("rdma-shared.sock is not registered")
    });
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    agent.wait("recovery", Duration::from_secs(15), || node.ready());

    // The plugin restarted before the driver created uverbs7: an incomplete set.
    std::fs::remove_file(dev.join("uverbs7")).unwrap();
    agent.wait("the device-set finding", Duration::from_secs(10), || {
        node.has_our_taint() && reason_with("infiniband/uverbs7 (mlx5_7)")
    });
    let rdma = node.condition("RDMAReady").unwrap();
    assert_eq!(rdma["reason"], "DevicePluginUnavailable", "{rdma}");
    std::fs::write(dev.join("uverbs7"), "").unwrap();
    agent.wait("recovery", Duration::from_secs(15), || node.ready());
    drop(listener);
    drop(agent);
}
