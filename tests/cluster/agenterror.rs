//! The agent's own trouble on the real apiserver: requirements written for other hardware (RDMA
//! devices exist, none matches `rdma.devices`) are `AgentError`, never a hardware reason, and
//! with the default `node.on_agent_error: taint` the node fails closed; fixing the requirements
//! recovers it normally.

use crate::common::sysfs::FakeHca;
use crate::common::{TestNode, control_plane, start_agent, wait_until};
use std::time::Duration;

#[test]
fn requirements_for_other_hardware_are_an_agent_error_and_fail_closed() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-error-mismatch");
    let hca = FakeHca::new(true);
    let config = hca.scratch().join("requirements.yaml");
    // Written for a Broadcom pool; this node has mlx5_0.
    std::fs::write(&config, "rdma:\n  devices: \"bnxt_re*\"\n").unwrap();
    let kubeconfig = node.agent_kubeconfig(None);
    let agent = start_agent(
        &node.name,
        &hca,
        Some(&kubeconfig),
        &["--interval", "300ms", "--config", config.to_str().unwrap()],
    );
    agent.wait("the AgentError condition", Duration::from_secs(30), || {
        node.has_reason("RDMAReady", "AgentError")
    });
    wait_until("the taint (fail closed)", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    let fabric = node.condition("FabricReady").unwrap();
    assert_eq!(fabric["status"], "False");
    assert_eq!(fabric["reason"], "AgentError", "{fabric}");
    let message = fabric["message"].as_str().unwrap();
    assert!(
        message.contains("written for other hardware") && message.contains("mlx5_0"),
        "{message}"
    );
    assert!(!message.contains("NoRDMADevices"), "{message}");
    drop(agent);

    // The requirements fixed: validated as usual.
    std::fs::write(&config, "rdma:\n  devices: \"mlx5_*\"\n").unwrap();
    let agent = start_agent(
        &node.name,
        &hca,
        Some(&kubeconfig),
        &["--interval", "300ms", "--config", config.to_str().unwrap()],
    );
    agent.wait("recovery", Duration::from_secs(30), || node.ready());
    drop(agent);
}
