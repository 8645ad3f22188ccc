//! The kustomize overlays of `deploy/` (issue 15, "a deployment that works as shipped"),
//! rendered by Kubernetes' own `kubectl kustomize` and checked against the real apiserver:
//! `daemonset.yaml` is exactly the rendered default, every overlay passes both schemas and a
//! server-side dry run, and the privileged overlay's admission policy confines privilege to the
//! agent's DaemonSet.

use crate::common::control_plane;
use crate::common::controlplane::ControlPlane;
use crate::common::{repo_root, require_tool};
use serde::Deserialize;
use serde_json::Value;
use std::time::{Duration, Instant};

const OVERLAYS: [&str; 2] = ["shared-device", "privileged"];

fn render(cp: &ControlPlane, overlay: &str) -> String {
    let dir = repo_root().join("deploy/overlays").join(overlay);
    cp.kubectl(&["kustomize", dir.to_str().unwrap()])
}

fn documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn agent_container(docs: &[Value]) -> Value {
    let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    ds["spec"]["template"]["spec"]["containers"][0].clone()
}

#[test]
fn daemonset_yaml_is_the_rendered_default_overlay() {
    let Some(cp) = control_plane() else { return };
    let header = std::fs::read_to_string(repo_root().join("deploy/rendered-header.txt")).unwrap();
    let shipped = std::fs::read_to_string(repo_root().join("daemonset.yaml")).unwrap();
    let rendered = format!("{header}{}", render(cp, "shared-device"));
    assert!(
        shipped == rendered,
        "daemonset.yaml is not the rendered deploy/overlays/shared-device: run deploy/render.sh"
    );
}

#[test]
fn every_overlay_passes_both_schemas_and_a_server_side_dry_run() {
    let Some(cp) = control_plane() else { return };
    let Some(kv) = require_tool("kubernetes-validate", "pip install kubernetes-validate") else {
        return;
    };
    // The namespace and service account exist, as after a first install.
    cp.install_agent_rbac();
    for overlay in OVERLAYS {
        let text = render(cp, overlay);
        let docs = documents(&text);
        let file = cp.path(&format!("overlay-{overlay}.yaml"));
        std::fs::write(&file, &text).unwrap();
        crate::common::assert_valid_for_both_schemas(&kv, &file, docs.len());
        let (ok, out, err) = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &["apply", "--dry-run=server", "-f", file.to_str().unwrap()],
            None,
        );
        assert!(ok, "{overlay}: server-side dry run refused:\n{out}{err}");
        assert_eq!(
            out.lines().count(),
            docs.len(),
            "{overlay}: every object accepted:\n{out}"
        );

        let c = agent_container(&docs);
        let privileged = c["securityContext"]["privileged"] == true;
        let host_dev = docs
            .iter()
            .filter(|d| d["kind"] == "DaemonSet")
            .flat_map(|d| {
                d["spec"]["template"]["spec"]["volumes"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .any(|v| v["hostPath"]["path"] == "/dev/infiniband");
        let extended: Vec<String> = c["resources"]["limits"]
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| k.contains('/'))
            .cloned()
            .collect();
        match overlay {
            // The devices come from the shared plugin resource, and only from it.
            "shared-device" => {
                assert!(!privileged && !host_dev, "{c}");
                assert_eq!(extended, ["rdma/hca_shared_devices_a"]);
            }
            // Privileged with the host's /dev/infiniband, claiming no device at all (a full
            // node never keeps a restarted agent from starting), and guarded by its policy.
            "privileged" => {
                assert!(privileged && host_dev, "{c}");
                assert!(extended.is_empty(), "{extended:?}");
                assert!(docs.iter().any(|d| d["kind"] == "ValidatingAdmissionPolicy"
                    && d["metadata"]["name"] == "fabricgate-privileged-agent-only"));
            }
            _ => unreachable!(),
        }
    }
}

/// A privileged pod in namespace fabricgate, as `user` creates it (server-side dry run: the
/// admission chain runs, nothing is stored); (allowed, stderr).
fn try_privileged_pod(cp: &ControlPlane, user: &str, service_account: &str) -> (bool, String) {
    let pod = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "fabricgate-",
            "namespace": "fabricgate",
            "labels": {"app.kubernetes.io/name": "fabricgate"},
        },
        "spec": {
            "serviceAccountName": service_account,
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "agent",
                "image": "registry.example.com/fabricgate/fabricgate:0.1.0",
                "securityContext": {"privileged": true},
            }],
        },
    });
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "create",
            "--dry-run=server",
            &format!("--as={user}"),
            // Past RBAC, so that what refuses is the admission policy.
            "--as-group=system:masters",
            "-f",
            "-",
        ],
        Some(&pod.to_string()),
    );
    (ok, err)
}

#[test]
fn privileged_overlay_admits_privilege_only_for_the_agent_daemonset() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let docs = documents(&render(cp, "privileged"));
    let policy: Vec<String> = docs
        .iter()
        .filter(|d| {
            d["metadata"]["name"] == "fabricgate-privileged-agent-only"
                && d["kind"]
                    .as_str()
                    .unwrap()
                    .starts_with("ValidatingAdmissionPolicy")
        })
        .map(|d| serde_json::to_string(d).unwrap())
        .collect();
    assert_eq!(policy.len(), 2, "the policy and its binding");
    cp.apply(&policy.join("\n---\n"));
    // The apiserver enforces a new policy once its informer has it: wait for the first denial.
    let admin = "fabricgate-test-admin";
    let started = Instant::now();
    let err = loop {
        let (ok, err) = try_privileged_pod(cp, admin, "fabricgate");
        if !ok {
            break err;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "a privileged pod by {admin} is still admitted"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        err.contains("only the fabricgate DaemonSet may run privileged containers")
            && err.contains(admin),
        "{err}"
    );
    // The DaemonSet controller creating the agent's pod is admitted.
    let controller = "system:serviceaccount:kube-system:daemon-set-controller";
    let (ok, err) = try_privileged_pod(cp, controller, "fabricgate");
    assert!(ok, "the agent's own pod was refused: {err}");
    // ... but not a privileged pod of another service account, even from the controller.
    cp.apply(
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: other\n  namespace: fabricgate\n",
    );
    let (ok, err) = try_privileged_pod(cp, controller, "other");
    assert!(!ok && err.contains("may run privileged"), "{err}");
}
