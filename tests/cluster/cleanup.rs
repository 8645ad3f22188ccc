//! `deploy/cleanup-nodes.sh` with Kubernetes' own kubectl against the real apiserver: after an
//! agent marked a Node, the script removes exactly fabricgate's labels, taint and conditions,
//! and nothing of anyone else's.

use crate::common::sysfs::FakeHca;
use crate::common::{TAINT, TestNode, control_plane};
use std::process::Command;

use std::time::Duration;

#[test]
fn cleanup_script_removes_only_what_fabricgate_owns() {
    let Some(cp) = control_plane() else { return };
    if crate::common::require_tool("jq", "apt-get install jq").is_none() {
        return;
    }
    let node = TestNode::seeded(cp, "cleanup-a");
    let clean = TestNode::seeded(cp, "cleanup-b");
    cp.kubectl(&["taint", "node", &clean.name, &format!("{TAINT}-")]);
    let hca = FakeHca::new(false);
    let agent = node.start_agent(&hca, &["--interval", "100ms"]);
    agent.wait("the agent's marks", Duration::from_secs(30), || {
        node.condition("LustreReady").is_some() && node.label("fabricgate.io/ready").is_some()
    });
    let (status, _) = agent.stop();
    assert!(status.success());
    let before = node.json();
    let before_clean = clean.json();

    // `kubectl` on PATH is Kubernetes' own, as admin.
    let bin = hca.scratch().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let kubectl = bin.join("kubectl");
    std::fs::write(
        &kubectl,
        format!(
            "#!/bin/sh\nexec {} kubectl --kubeconfig={} \"$@\"\n",
            std::env::var("FABRICGATE_CONTROLPLANE")
                .unwrap_or_else(|_| crate::common::controlplane::DEFAULT_BINARY.to_owned()),
            cp.admin_kubeconfig.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &kubectl,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let out = Command::new("bash")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/cleanup-nodes.sh"))
        .args([&node.name, &clean.name])
        .env(
            "PATH",
            format!(
                "{}:{}",
                bin.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .env("HOME", hca.scratch())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let after = crate::cleanup::assert_only_others_marks_left(&node);
    assert_ne!(
        before["metadata"]["resourceVersion"],
        after["metadata"]["resourceVersion"]
    );
    // The node with nothing of ours was not written at all.
    assert_eq!(
        clean.json()["metadata"]["resourceVersion"],
        before_clean["metadata"]["resourceVersion"]
    );
}

/// The Node seeded by `TestNode::seeded`, after a removal: none of fabricgate's labels, taint
/// or conditions left, and everything of others' (the `team` label, the GPU taint, the
/// kubelet's `Ready`) kept. The Node as read.
pub(crate) fn assert_only_others_marks_left(node: &TestNode) -> serde_json::Value {
    let after = node.json();
    let labels = after["metadata"]["labels"].as_object().unwrap();
    assert!(
        labels.keys().all(|k| !k.starts_with("fabricgate.io/")),
        "{labels:?}"
    );
    assert_eq!(labels["team"], "ml");
    assert_eq!(node.taints(), vec!["nvidia.com/gpu"]);
    let types: Vec<&str> = after["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["type"].as_str())
        .collect();
    assert_eq!(types, vec!["Ready"], "only the kubelet's condition is left");
    after
}
