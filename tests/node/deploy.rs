//! The shipped manifests as the real node runs them. Each change to `daemonset.yaml` is one
//! exact text replacement, checked to apply once, so a change to the manifest that moves one of
//! these lines fails here instead of silently testing something else. The changes (also in
//! docs/testing.md, "The real node"):
//! - the image: `localhost/fabricgate:TAG` with `imagePullPolicy: Never` (no registry);
//! - `KUBERNETES_SERVICE_HOST`/`_PORT` set to the node's API server (there is no kube-proxy);
//! - `--verbs=off` and the `host-sys` hostPath pointing at a fixture sysfs tree (the host
//!   kernel has no RDMA; `tests/fixtures/ndr-8x400-healthy`, which meets the shipped rdma
//!   requirements);
//! - the `lustre` hostPath in the run directory, a shared mount (HostToContainer propagation
//!   needs one), and `lustre.mounts: []` (no Lustre here);
//! - deploy/guard.yaml: the image, `KUBERNETES_SERVICE_HOST`/`_PORT` as above, and no node
//!   affinity (a one-node cluster: the shipped guard keeps off the GPU nodes it guards).

use super::harness::{NODE_IP, RealNode};
use std::path::Path;

fn replace_once(text: &str, from: &str, to: &str, what: &str) -> Result<String, String> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => Err(format!(
            "{what}: `{from}` occurs {n} times (want exactly 1)"
        )),
    }
}

fn repo(path: &str) -> Result<String, String> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&p).map_err(|e| format!("read {}: {e}", p.display()))
}

pub const SHIPPED_IMAGE: &str = "registry.example.com/fabricgate/fabricgate:0.1.0";

/// daemonset.yaml for this node, the agent image `image`.
pub fn daemonset(node: &RealNode, image: &str) -> Result<String, String> {
    let d = node.dir.display().to_string();
    let mut t = repo("daemonset.yaml")?;
    t = replace_once(
        &t,
        &format!("        image: {SHIPPED_IMAGE}\n        imagePullPolicy: IfNotPresent\n"),
        &format!("        image: {image}\n        imagePullPolicy: Never\n"),
        "daemonset image",
    )?;
    t = replace_once(
        &t,
        "        - name: SYSFS_PATH\n          value: /host/sys\n",
        &format!(
            "        - name: SYSFS_PATH\n          value: /host/sys\n        - name: KUBERNETES_SERVICE_HOST\n          \
             value: \"{NODE_IP}\"\n        - name: KUBERNETES_SERVICE_PORT\n          value: \"6443\"\n"
        ),
        "apiserver address",
    )?;
    t = replace_once(
        &t,
        "        - --verbs=required\n",
        "        - --verbs=off\n",
        "verbs",
    )?;
    t = replace_once(
        &t,
        "      - hostPath:\n          path: /sys\n",
        &format!("      - hostPath:\n          path: {d}/fixture/sys\n"),
        "host-sys",
    )?;
    t = replace_once(
        &t,
        "      - hostPath:\n          path: /lustre\n",
        &format!("      - hostPath:\n          path: {d}/lustre\n"),
        "lustre",
    )?;
    t = replace_once(
        &t,
        "      mounts:\n        - /lustre/scratch\n",
        "      mounts: []\n",
        "lustre.mounts",
    )?;
    Ok(t)
}

/// deploy/guard.yaml for this node.
pub fn guard(image: &str) -> Result<String, String> {
    let mut t = repo("deploy/guard.yaml")?;
    t = replace_once(
        &t,
        &format!("          image: {SHIPPED_IMAGE}\n"),
        &format!("          image: {image}\n          imagePullPolicy: Never\n"),
        "guard image",
    )?;
    t = replace_once(
        &t,
        "          env:\n            - name: POD_NAME\n",
        &format!(
            "          env:\n            - name: KUBERNETES_SERVICE_HOST\n              value: \"{NODE_IP}\"\n            \
             - name: KUBERNETES_SERVICE_PORT\n              value: \"6443\"\n            - name: POD_NAME\n"
        ),
        "guard apiserver address",
    )?;
    let start = t
        .find("      affinity:\n")
        .ok_or("guard.yaml: no affinity block")?;
    let end = t[start..]
        .find("      containers:\n")
        .ok_or("guard.yaml: no containers after affinity")?;
    t.replace_range(start..start + end, "");
    Ok(t)
}

/// The fixture sysfs tree under the run directory (`fixture/sys`), copied so a test may
/// change it.
pub fn install_fixture(node: &RealNode, name: &str) -> Result<(), String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let dest = node.dir.join("fixture");
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::create_dir_all(&dest).map_err(|e| e.to_string())?;
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(src.join("sys"))
        .arg(&dest)
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() {
        return Err(format!("cp -a {} failed", src.display()));
    }
    Ok(())
}

/// deploy/webhook.yaml for this node: the image (also `FABRICGATE_IMAGE`, the preflight init
/// container's), `imagePullPolicy: Never`, and `caBundle` in both webhooks (what
/// cert-manager's CA injector would write) for the serving certificate the harness puts in
/// the Secret `fabricgate-webhook-tls`.
pub fn webhook(image: &str, ca_pem: &str) -> Result<String, String> {
    let mut t = repo("deploy/webhook.yaml")?;
    t = replace_once(
        &t,
        &format!("          image: {SHIPPED_IMAGE}\n          imagePullPolicy: IfNotPresent\n"),
        &format!("          image: {image}\n          imagePullPolicy: Never\n"),
        "webhook image",
    )?;
    t = replace_once(
        &t,
        &format!("              value: {SHIPPED_IMAGE}\n"),
        &format!("              value: {image}\n"),
        "FABRICGATE_IMAGE",
    )?;
    let from = "    clientConfig:\n      service:\n";
    let n = t.matches(from).count();
    if n != 2 {
        return Err(format!("webhook.yaml: {n} clientConfig blocks (want 2)"));
    }
    let b64 = base64(ca_pem.as_bytes());
    t = t.replace(
        from,
        &format!("    clientConfig:\n      caBundle: {b64}\n      service:\n"),
    );
    Ok(t)
}

pub fn base64(data: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(A[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// daemonset.yaml for this node (agent image `image`, `runtime` added to its requirements
/// as the YAML lines `runtime`, unindented) with the component
/// `deploy/overlays/runtime-transport`, without the privileged overlay's `privileged: true`
/// (so the component's capability list is what the agent has). Rendered by the real `kubectl
/// kustomize` from copies of the shipped files under the run directory. The privileged-agent
/// policy belongs to the privileged overlay, not to this component, so it is not applied here
/// (the Helm scenario applies it with DRA, tests/node/helm.rs).
pub fn runtime_transport(node: &RealNode, image: &str, runtime: &str) -> Result<String, String> {
    let mut t = daemonset(node, image)?;
    let indented: String = runtime.lines().map(|l| format!("    {l}\n")).collect();
    t = replace_once(
        &t,
        "    kubernetes:\n      rdma_resources: [\"rdma/hca_shared_devices_a\"]\n",
        &format!(
            "    kubernetes:\n      rdma_resources: [\"rdma/hca_shared_devices_a\"]\n{indented}"
        ),
        "requirements runtime",
    )?;
    let dir = node.dir.join("runtime-transport-kustomize");
    let component = dir.join("runtime-transport");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&component)
        .map_err(|e| format!("mkdir {}: {e}", component.display()))?;
    let write = |path: &Path, text: &str| {
        std::fs::write(path, text).map_err(|e| format!("write {}: {e}", path.display()))
    };
    for file in [
        "kustomization.yaml",
        "rbac.yaml",
        "pod-transport-policy.yaml",
    ] {
        write(
            &component.join(file),
            &repo(&format!("deploy/overlays/runtime-transport/{file}"))?,
        )?;
    }
    write(&dir.join("daemonset.yaml"), &t)?;
    write(
        &dir.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n  - daemonset.yaml\ncomponents:\n  - runtime-transport\n",
    )?;
    node.kubectl(&["kustomize", &dir.display().to_string()])
}

/// The objects the runtime-transport composition adds beyond daemonset.yaml (to delete).
pub const RUNTIME_TRANSPORT_EXTRA: &[(&str, &str)] = &[
    ("clusterrolebinding", "fabricgate-agent-pods"),
    ("clusterrole", "fabricgate-agent-pods"),
    (
        "validatingadmissionpolicybinding",
        "fabricgate-own-node-pods",
    ),
    ("validatingadmissionpolicy", "fabricgate-own-node-pods"),
];
