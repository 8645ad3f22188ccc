//! The kustomize overlays of `deploy/` (a deployment that works as shipped),
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

const OVERLAYS: [&str; 6] = [
    "shared-device",
    "privileged",
    "dra",
    "shared-device-runtime-transport",
    "privileged-runtime-transport",
    "dra-runtime-transport",
];

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
        cp.assert_dry_run_accepts(&file, docs.len(), overlay);

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
            // The privileged overlay plus the kubelet's plugin registry, read-only, and what
            // reading the pods' claims needs: the host PID namespace, pods and claims read.
            "dra" => {
                assert!(privileged && host_dev, "{c}");
                let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
                assert_eq!(ds["spec"]["template"]["spec"]["hostPID"], true);
                assert!(docs.iter().any(|d| d["kind"] == "ClusterRole"
                    && d["metadata"]["name"] == "fabricgate-agent-dra-claims"));
                assert!(extended.is_empty(), "{extended:?}");
                let registry = c["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| m["mountPath"] == "/var/lib/kubelet/plugins_registry")
                    .cloned()
                    .unwrap_or_default();
                assert_eq!(registry["readOnly"], true, "{c}");
            }
            // The runtime-transport component on the privileged overlay: host PID namespace,
            // the capabilities it names, the pods RBAC and both policies.
            "privileged-runtime-transport" => {
                assert!(privileged && host_dev, "{c}");
                let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
                assert_eq!(ds["spec"]["template"]["spec"]["hostPID"], true);
                let caps = c["securityContext"]["capabilities"]["add"].to_string();
                for cap in ["IPC_LOCK", "SYS_PTRACE", "SYS_ADMIN"] {
                    assert!(caps.contains(cap), "{caps}");
                }
                // Measured not needed (docs/runtime-transport.md, "What it needs").
                assert!(!caps.contains("NET_ADMIN"), "{caps}");
                for policy in [
                    "fabricgate-privileged-agent-only",
                    "fabricgate-own-node-pods",
                ] {
                    assert!(
                        docs.iter().any(|d| d["kind"] == "ValidatingAdmissionPolicy"
                            && d["metadata"]["name"] == policy),
                        "{policy}"
                    );
                }
                assert!(docs.iter().any(|d| d["kind"] == "ClusterRole"
                    && d["metadata"]["name"] == "fabricgate-agent-pods"));
            }
            // The component on the default overlay and on the DRA one: the same additions,
            // the device access of the overlay below it.
            "shared-device-runtime-transport" | "dra-runtime-transport" => {
                assert_eq!(privileged, overlay == "dra-runtime-transport", "{c}");
                let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
                assert_eq!(ds["spec"]["template"]["spec"]["hostPID"], true);
                let caps = c["securityContext"]["capabilities"]["add"].to_string();
                for cap in ["IPC_LOCK", "SYS_PTRACE", "SYS_ADMIN"] {
                    assert!(caps.contains(cap), "{caps}");
                }
                assert!(docs.iter().any(|d| d["kind"] == "ClusterRole"
                    && d["metadata"]["name"] == "fabricgate-agent-pods"));
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
            "labels": {"app.kubernetes.io/name": "fabricgate", "app.kubernetes.io/component": "agent"},
            "ownerReferences": [daemonset_owner()],
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
    create_pod_as(cp, user, &pod)
}

/// The controller reference the DaemonSet controller puts on the agent's pods.
fn daemonset_owner() -> Value {
    serde_json::json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet", "name": "fabricgate",
        "uid": "00000000-0000-0000-0000-00000000da7a",
        "controller": true, "blockOwnerDeletion": true,
    })
}

/// `pod` created by `user` (server-side dry run, past RBAC so that what refuses is the
/// admission policy); (allowed, stderr).
fn create_pod_as(cp: &ControlPlane, user: &str, pod: &Value) -> (bool, String) {
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "create",
            "--dry-run=server",
            &format!("--as={user}"),
            "--as-group=system:masters",
            "-f",
            "-",
        ],
        Some(&pod.to_string()),
    );
    (ok, err)
}

/// Install the privileged overlay's policy and binding; wait until it is enforced.
fn install_privileged_policy(cp: &ControlPlane) {
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
}

#[test]
fn privileged_overlay_admits_privilege_only_for_the_agent_daemonset() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    install_privileged_policy(cp);
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
        err.contains("only the fabricgate DaemonSet may run pods with host access or privilege")
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
    assert!(
        !ok && err.contains("with host access or privilege"),
        "{err}"
    );
}

/// The pod of the attack: no `privileged`, but the host's root file system, PID and network
/// namespaces and `SYS_ADMIN` (root on the node as surely).
fn host_root_pod(labels: Value, owner: Option<Value>) -> Value {
    let mut pod = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "generateName": "rt-host-", "namespace": "fabricgate", "labels": labels },
        "spec": {
            "serviceAccountName": "fabricgate",
            "automountServiceAccountToken": false,
            "hostPID": true,
            "hostNetwork": true,
            "containers": [{
                "name": "shell", "image": "busybox",
                "securityContext": { "capabilities": { "add": ["SYS_ADMIN"] } },
                "volumeMounts": [{ "name": "host", "mountPath": "/host" }],
            }],
            "volumes": [{ "name": "host", "hostPath": { "path": "/" } }],
        },
    });
    if let Some(o) = owner {
        pod["metadata"]["ownerReferences"] = serde_json::json!([o]);
    }
    pod
}

/// The privileged overlay's policy looked only at `privileged`; a pod with hostPath
/// `/`, hostPID, hostNetwork and `SYS_ADMIN` was admitted in the agent's namespace. Now each
/// of those is the DaemonSet's alone: the plain pod is refused (by anyone but the DaemonSet
/// controller creating a pod of the DaemonSet), each way onto the host on its own too, and
/// the rendered DaemonSet's own pod template is admitted.
#[test]
fn redteam_privileged_overlay_admits_host_access_only_for_the_daemonsets_own_pods() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    install_privileged_policy(cp);
    let admin = "fabricgate-test-admin";
    let agent_labels = serde_json::json!({
        "app.kubernetes.io/name": "fabricgate", "app.kubernetes.io/component": "agent",
    });
    let attack = host_root_pod(serde_json::json!({ "app": "x" }), None);
    let started = Instant::now();
    let err = loop {
        let (ok, err) = create_pod_as(cp, admin, &attack);
        if !ok {
            break err;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the host-root pod by {admin} is still admitted"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        err.contains("with host access or privilege") && err.contains(admin),
        "{err}"
    );

    let controller = "system:serviceaccount:kube-system:daemon-set-controller";
    // Refused, each: the attack pod dressed as the agent, by a user; by the controller but not
    // of the DaemonSet; and each way onto the host alone.
    let dressed = host_root_pod(agent_labels.clone(), Some(daemonset_owner()));
    let not_owned = host_root_pod(agent_labels.clone(), None);
    let mut other_owner = daemonset_owner();
    other_owner["name"] = "not-fabricgate".into();
    let other_ds = host_root_pod(agent_labels.clone(), Some(other_owner));
    let mut webhook_labels = agent_labels.clone();
    webhook_labels["app.kubernetes.io/component"] = "webhook".into();
    let not_agent = host_root_pod(webhook_labels, Some(daemonset_owner()));
    let refused: Vec<(&str, &str, Value)> = vec![
        ("agent-dressed, by a user", admin, dressed),
        (
            "by the controller, no controller reference",
            controller,
            not_owned,
        ),
        ("by the controller, another DaemonSet", controller, other_ds),
        (
            "by the controller, not the agent label",
            controller,
            not_agent,
        ),
    ];
    let single = |f: fn(&mut Value)| {
        let mut p = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "generateName": "rt-one-", "namespace": "fabricgate" },
            // The ServiceAccount exists (no controller manager creates `default` here).
            "spec": { "serviceAccountName": "fabricgate", "automountServiceAccountToken": false,
                "containers": [{ "name": "c", "image": "busybox" }] },
        });
        f(&mut p);
        p
    };
    let singles: Vec<(&str, Value)> = vec![
        (
            "hostPath /",
            single(|p| {
                p["spec"]["volumes"] =
                    serde_json::json!([{ "name": "h", "hostPath": { "path": "/" } }]);
            }),
        ),
        ("hostPID", single(|p| p["spec"]["hostPID"] = true.into())),
        (
            "hostNetwork",
            single(|p| p["spec"]["hostNetwork"] = true.into()),
        ),
        ("hostIPC", single(|p| p["spec"]["hostIPC"] = true.into())),
        (
            "SYS_ADMIN",
            single(|p| {
                p["spec"]["containers"][0]["securityContext"] =
                    serde_json::json!({ "capabilities": { "add": ["SYS_ADMIN"] } });
            }),
        ),
        (
            "privileged init container",
            single(|p| {
                p["spec"]["initContainers"] = serde_json::json!([{ "name": "i", "image": "busybox",
                "securityContext": { "privileged": true } }]);
            }),
        ),
    ];
    let mut wrong = Vec::new();
    for (what, user, pod) in &refused {
        let (ok, err) = create_pod_as(cp, user, pod);
        if ok || !err.contains("with host access or privilege") {
            wrong.push(format!("{what}: admitted or refused otherwise: {err}"));
        }
    }
    for (what, pod) in &singles {
        let (ok, err) = create_pod_as(cp, admin, pod);
        if ok || !err.contains("with host access or privilege") {
            wrong.push(format!(
                "{what} alone: admitted or refused otherwise: {err}"
            ));
        }
    }
    // A plain pod is none of the policy's business.
    let plain = single(|_| {});
    let (ok, err) = create_pod_as(cp, admin, &plain);
    if !ok {
        wrong.push(format!("a plain pod was refused: {err}"));
    }
    // The rendered DaemonSet's own pod template, as the controller creates it: admitted.
    let docs = documents(&render(cp, "privileged"));
    let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    let template = &ds["spec"]["template"];
    let mut metadata = template["metadata"].clone();
    metadata["generateName"] = "fabricgate-".into();
    metadata["namespace"] = "fabricgate".into();
    metadata["ownerReferences"] = serde_json::json!([daemonset_owner()]);
    let mut spec = template["spec"].clone();
    spec["nodeName"] = "rt-privileged-node".into();
    let own = serde_json::json!({ "apiVersion": "v1", "kind": "Pod", "metadata": metadata,
        "spec": spec });
    assert!(
        own["spec"]["hostNetwork"] == true,
        "the template has host access: {own}"
    );
    let (ok, err) = create_pod_as(cp, controller, &own);
    if !ok {
        wrong.push(format!("the DaemonSet's own pod was refused: {err}"));
    }
    // The same template from anyone else: refused.
    let (ok, _) = create_pod_as(cp, admin, &own);
    if ok {
        wrong.push("the DaemonSet's pod template created by a user was admitted".to_owned());
    }
    // `kubectl debug --profile=sysadmin` into a pod there: a privileged ephemeral container is
    // refused, a plain one is not (a real pod, never scheduled; the patches are dry runs).
    let target = "rt-ephemeral-target";
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            "fabricgate",
            "delete",
            "pod",
            target,
            "--ignore-not-found",
            "--grace-period=0",
            "--force",
        ],
        None,
    );
    let mut pod = single(|_| {});
    pod["metadata"] = serde_json::json!({ "name": target, "namespace": "fabricgate" });
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["create", "-f", "-"],
        Some(&pod.to_string()),
    );
    assert!(ok, "create {target}: {err}");
    let debug = |privileged: bool| {
        let patch = serde_json::json!({ "spec": { "ephemeralContainers": [{
            "name": if privileged { "debug-root" } else { "debug" }, "image": "busybox",
            "securityContext": { "privileged": privileged } }] } });
        cp.kubectl_as(
            &cp.admin_kubeconfig,
            &[
                "-n",
                "fabricgate",
                "patch",
                "pod",
                target,
                "--subresource=ephemeralcontainers",
                "--type=strategic",
                "--dry-run=server",
                &format!("--as={admin}"),
                "--as-group=system:masters",
                "-p",
                &patch.to_string(),
            ],
            None,
        )
    };
    let (ok, _, err) = debug(true);
    if ok || !err.contains("no privileged or capability-adding ephemeral container") {
        wrong.push(format!(
            "a privileged ephemeral container: admitted or refused otherwise: {err}"
        ));
    }
    let (ok, _, err) = debug(false);
    if !ok {
        wrong.push(format!("a plain ephemeral container was refused: {err}"));
    }
    cp.kubectl(&[
        "-n",
        "fabricgate",
        "delete",
        "pod",
        target,
        "--grace-period=0",
        "--force",
    ]);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
