//! `placement.required_labels` on the real apiserver: the agent keeps a Node that lacks an
//! operator-provided topology label tainted and says which label, and validates it as soon as
//! the label is there (the watch of its Node shows the change).

use crate::common::sysfs::FakeHca;
use crate::common::{TestNode, control_plane};
use serde_json::json;
use std::time::Duration;

const RACK: &str = "cloud.example.com/rack";

#[test]
fn a_missing_topology_label_keeps_the_node_tainted_until_it_is_set() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode {
        cp,
        name: "placement-a".into(),
    };
    cp.create_node(
        &node.name,
        json!({ "topology.kubernetes.io/zone": "z1" }),
        json!([{ "key": crate::common::TAINT, "effect": "NoSchedule" }]),
        json!({}),
    );
    let hca = FakeHca::new(true);
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!(
            "node:\n  recover_after: 1\nplacement:\n  required_labels: \
             [topology.kubernetes.io/zone, {RACK}]\n"
        ),
    )
    .unwrap();
    let agent = node.start_agent(
        &hca,
        &["--interval", "50ms", "--config", config.to_str().unwrap()],
    );
    agent.wait("the placement finding", Duration::from_secs(30), || {
        node.has_reason("FabricReady", "PlacementLabelsMissing")
    });
    let cond = node.condition("FabricReady").unwrap();
    assert_eq!(cond["status"], "False");
    let message = cond["message"].as_str().unwrap();
    assert!(message.contains(RACK), "{message}");
    assert!(
        !message.contains("topology.kubernetes.io/zone"),
        "{message}"
    );
    assert!(node.has_our_taint());
    assert_eq!(node.label("fabricgate.io/ready").as_deref(), Some("false"));
    // The fabric itself is fine: RDMAReady stays True.
    assert_eq!(node.condition("RDMAReady").unwrap()["status"], "True");

    // The operator labels the Node; the watch shows it and the agent validates it.
    cp.kubectl(&["label", "node", &node.name, &format!("{RACK}=r07")]);
    let took = agent.wait(
        "validation after labelling",
        Duration::from_secs(20),
        || {
            node.condition("FabricReady")
                .is_some_and(|c| c["status"] == "True")
                && !node.has_our_taint()
        },
    );
    eprintln!("label set -> validated after {took:?}");
    assert_eq!(node.label("fabricgate.io/ready").as_deref(), Some("true"));
    assert_eq!(
        node.label(RACK).as_deref(),
        Some("r07"),
        "the operator's label stays"
    );
}
