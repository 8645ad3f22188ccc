//! The Helm chart on the real node, with Helm itself (`.ci/helm.sh`): `helm install` → the node
//! validated, the guard and the admission check running; `helm upgrade` turning runtime
//! transport on, then DRA (the privileged agent, admitted by the privileged-agent policy as the
//! DaemonSet controller's), rolls the agent out without ever leaving the validated node
//! unvalidated;
//! `helm uninstall` →
//! the chart's cleanup hook leaves no fabricgate mark on the Node, and Helm prints what it
//! removed. The values are the node's, as tests/node/deploy.rs makes daemonset.yaml the
//! node's: the image (no registry), the apiserver's address (no kube-proxy), verbs off and the
//! fixture sysfs (no RDMA in the host kernel), no Lustre mount.

use super::deploy;
use super::harness::{NODE_IP, RealNode, wait_for};
use super::images;
use super::scenarios::{TAINT, marks_left, validated, wait_validated};
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn helm_binary() -> Result<PathBuf, String> {
    let path = std::env::var_os("FABRICGATE_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/fabricgate-controlplane/bin/helm"));
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "no helm at {} (.ci/helm.sh builds it)",
            path.display()
        ))
    }
}

/// `helm ARGS` in the node's namespaces, as admin; its output, or the error with it.
fn helm(node: &RealNode, args: &[&str]) -> Result<String, String> {
    let home = node.dir.join("helm-home");
    std::fs::create_dir_all(&home).map_err(|e| e.to_string())?;
    let out = node
        .nsenter(&helm_binary()?.display().to_string())
        .args(args)
        .arg(format!(
            "--kubeconfig={}/admin.kubeconfig",
            node.dir.display()
        ))
        .env("HOME", &home)
        .output()
        .map_err(|e| format!("helm: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(text)
    } else {
        Err(format!("helm {}: {text}", args.join(" ")))
    }
}

/// The values for this node (a JSON values file).
fn node_values(node: &RealNode) -> Result<Value, String> {
    let d = node.dir.display().to_string();
    let shipped =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset.yaml"))
            .map_err(|e| e.to_string())?;
    let cm = serde_norway::Deserializer::from_str(&shipped)
        .map(|doc| Value::deserialize(doc).unwrap_or(Value::Null))
        .find(|d| d["metadata"]["name"] == "fabricgate-requirements")
        .ok_or("daemonset.yaml has no fabricgate-requirements")?;
    let mut requirements: Value = serde_norway::from_str(
        cm["data"]["requirements.yaml"]
            .as_str()
            .ok_or("no requirements.yaml")?,
    )
    .map_err(|e| e.to_string())?;
    requirements["lustre"]["mounts"] = json!([]);
    let (repository, tag) = images::AGENT
        .rsplit_once(':')
        .ok_or("image without a tag")?;
    let api = json!([
        { "name": "KUBERNETES_SERVICE_HOST", "value": NODE_IP },
        { "name": "KUBERNETES_SERVICE_PORT", "value": "6443" },
    ]);
    // No RDMA in this kernel: the privileged agent (DRA on) mounts an empty folder as the
    // host's /dev/infiniband, as verbs are off.
    let dev = node.dir.join("dev-infiniband");
    std::fs::create_dir_all(&dev).map_err(|e| format!("mkdir {}: {e}", dev.display()))?;
    // One node, in the pool: the guard and the admission check run on it.
    let anywhere = json!({ "nodeAffinity": {} });
    Ok(json!({
        "image": { "repository": repository, "tag": tag, "pullPolicy": "Never" },
        "requirements": requirements,
        "agent": {
            "verbs": "off",
            "hostPaths": {
                "sys": format!("{d}/fixture/sys"),
                "lustre": format!("{d}/lustre"),
                "devInfiniband": dev.display().to_string(),
            },
            "extraEnv": api,
        },
        "guard": { "affinity": anywhere, "extraEnv": api },
        "admissionCheck": { "enabled": true, "affinity": anywhere, "extraEnv": api },
    }))
}

fn ready_pods(node: &RealNode, selector: &str) -> usize {
    node.get_json(&["pods", "-n", "fabricgate", "-l", selector])
        .and_then(|p| p["items"].as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|p| {
            p["metadata"]["deletionTimestamp"].is_null()
                && p["status"]["conditions"].as_array().is_some_and(|c| {
                    c.iter()
                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                })
        })
        .count()
}

/// Install, upgrade, uninstall with Helm; the Node clean after.
pub fn install_upgrade_uninstall(node: &RealNode) -> Result<(), String> {
    // What kubectl applied before (deploy_agent; the previous scenario may have removed it):
    // Helm installs objects it owns.
    let mut all = deploy::webhook(images::AGENT, "x")?;
    all.push_str("\n---\n");
    all.push_str(&deploy::guard(images::AGENT)?);
    all.push_str("\n---\n");
    all.push_str(&deploy::daemonset(node, images::AGENT)?);
    node.kubectl_stdin(
        &["delete", "--ignore-not-found", "--wait=true", "-f", "-"],
        Some(&all),
    )?;
    wait_for(
        "the namespace fabricgate gone",
        Duration::from_secs(120),
        || node.kubectl(&["get", "namespace", "fabricgate"]).is_err(),
    )?;
    // The Node unvalidated, as a new node registers (a run of this scenario alone finds the
    // marks of the kubectl-applied agent): the chart's agent has to validate it.
    node.kubectl(&[
        "taint",
        "node",
        &node.name,
        &format!("{TAINT}=:NoSchedule"),
        "--overwrite",
    ])?;
    node.kubectl(&["label", "node", &node.name, "fabricgate.io/ready-"])?;
    // Kueue's CRDs: the admission check's AdmissionCheck object is one of Kueue's kinds.
    let crd_dir = Path::new("/opt/fabricgate-controlplane/kueue/crd");
    for entry in std::fs::read_dir(crd_dir).map_err(|e| format!("{}: {e}", crd_dir.display()))? {
        let path = entry.map_err(|e| e.to_string())?.path();
        node.apply(&std::fs::read_to_string(&path).map_err(|e| e.to_string())?)?;
    }
    let values = node.dir.join("helm-values.json");
    std::fs::write(&values, node_values(node)?.to_string()).map_err(|e| e.to_string())?;
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/fabricgate");
    let chart = chart.display().to_string();
    let values = values.display().to_string();

    let t = Instant::now();
    let out = helm(
        node,
        &[
            "install",
            "fabricgate",
            &chart,
            "--namespace",
            "fabricgate",
            "--create-namespace",
            "-f",
            &values,
            "--wait",
            "--timeout",
            "4m",
        ],
    )?;
    println!("helm install:\n{out}");
    wait_validated(node, Duration::from_secs(120))?;
    println!("figure: helm install -> node validated: {:?}", t.elapsed());
    println!(
        "kubectl get nodes:\n{}",
        node.kubectl(&[
            "get",
            "nodes",
            "-l",
            "nvidia.com/gpu.present=true",
            "-L",
            "fabricgate.io/ready",
            "-L",
            "fabricgate.io/rdma.rate-gbps",
        ])?
    );
    for (what, selector) in [
        ("guard", "app.kubernetes.io/name=fabricgate-guard"),
        (
            "admission check",
            "app.kubernetes.io/name=fabricgate-admission-check",
        ),
    ] {
        wait_for(
            &format!("2 {what} pods Ready"),
            Duration::from_secs(120),
            || ready_pods(node, selector) == 2,
        )?;
    }

    // Upgrade: runtime transport on (host PID namespace, capabilities, pods RBAC,
    // runtime.enabled) and a shorter interval; the validated node is never tainted meanwhile.
    upgrade_keeps_validated(
        node,
        &[
            &chart,
            "-f",
            &values,
            "--set",
            "runtimeTransport.enabled=true,agent.interval=5s",
        ],
        "runtime transport on",
        |pod| pod["spec"]["hostPID"] == true,
    )?;
    let n = node.node().ok_or("no Node")?;
    if !validated(&n) {
        return Err(format!(
            "not validated after the upgrade: {}",
            n["spec"]["taints"]
        ));
    }
    let cm = node
        .get_json(&["configmap", "-n", "fabricgate", "fabricgate-requirements"])
        .ok_or("no requirements ConfigMap")?;
    let req: Value = serde_norway::from_str(cm["data"]["requirements.yaml"].as_str().unwrap_or(""))
        .map_err(|e| e.to_string())?;
    if req["runtime"]["enabled"] != true {
        return Err(format!("runtime.enabled not set by the upgrade: {req}"));
    }
    // Upgrade: DRA on (agent.deviceAccess privileged, the kubelet's plugin registry mounted),
    // runtime transport kept. The chart now installs the privileged-agent policy, and the real
    // apiserver admits the privileged agent pod only because the DaemonSet controller (its own
    // service account, as kubeadm runs kube-controller-manager) creates it; the validated node
    // is never tainted meanwhile.
    upgrade_keeps_validated(
        node,
        &[
            &chart,
            "-f",
            &values,
            "--set",
            "runtimeTransport.enabled=true,agent.interval=5s,agent.deviceAccess=privileged,\
             dra.enabled=true",
        ],
        "DRA on",
        |pod| {
            pod["spec"]["containers"][0]["securityContext"]["privileged"] == true
                && pod["spec"]["volumes"]
                    .as_array()
                    .is_some_and(|v| v.iter().any(|v| v["name"] == "plugins-registry"))
        },
    )?;
    let policy = node.kubectl(&[
        "get",
        "validatingadmissionpolicy",
        "fabricgate-privileged-agent-only",
        "-o",
        "name",
    ])?;
    if policy.trim().is_empty() {
        return Err("the privileged-agent policy is not installed with DRA on".into());
    }
    // The policy is in force: a privileged pod created by anyone else is refused.
    let refused = node.apply(
        &json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": "not-the-agent", "namespace": "fabricgate" },
            "spec": { "containers": [{ "name": "c", "image": images::AGENT,
                "securityContext": { "privileged": true } }] },
        })
        .to_string(),
    );
    match refused {
        Err(e) if e.contains("only the fabricgate DaemonSet may run pods with host access") => {}
        other => {
            let _ = node.kubectl(&["delete", "pod", "-n", "fabricgate", "not-the-agent"]);
            return Err(format!(
                "a privileged pod by the admin was not refused by the policy: {other:?}"
            ));
        }
    }

    // Uninstall: the cleanup hook waits for the agent and the guard to go, then removes
    // every mark; Helm prints its output.
    let t = Instant::now();
    let out = helm(
        node,
        &[
            "uninstall",
            "fabricgate",
            "--namespace",
            "fabricgate",
            "--wait",
            "--timeout",
            "4m",
        ],
    )?;
    println!("helm uninstall:\n{out}");
    println!(
        "figure: helm uninstall (cleanup hook included): {:?}",
        t.elapsed()
    );
    if !out.contains("fabricgate cleanup: 1 of 1 Nodes had fabricgate marks") {
        return Err(format!(
            "helm uninstall did not print the cleanup's summary:\n{out}"
        ));
    }
    // The taint's key starts with "fabricgate": a taint left is a mark left.
    let (left, n) = marks_left(node)?;
    if !left.is_empty() {
        return Err(format!(
            "after helm uninstall the Node still has {left:?}: {n:#}"
        ));
    }
    // Nothing of the release or its hooks is left in the namespace or the cluster.
    let pods = node.kubectl(&[
        "get",
        "pods,jobs,serviceaccounts",
        "-n",
        "fabricgate",
        "-o",
        "name",
    ])?;
    let ours: Vec<&str> = pods.lines().filter(|l| !l.ends_with("/default")).collect();
    if !ours.is_empty() {
        return Err(format!("left in the namespace: {ours:?}"));
    }
    let cluster = node.kubectl(&[
        "get",
        "clusterroles,clusterrolebindings,validatingadmissionpolicies",
        "-o",
        "name",
    ])?;
    let ours: Vec<&str> = cluster
        .lines()
        .filter(|l| l.contains("fabricgate"))
        .collect();
    if !ours.is_empty() {
        return Err(format!("left in the cluster: {ours:?}"));
    }
    Ok(())
}

/// `helm upgrade fabricgate ARGS --wait` while the Node is read every 200 ms: the agent rolls
/// out (its one pod Ready and `changed`), and the validated Node is never seen otherwise, up
/// to two of the new agent's probes after.
fn upgrade_keeps_validated(
    node: &RealNode,
    args: &[&str],
    what: &str,
    changed: fn(&Value) -> bool,
) -> Result<(), String> {
    let stop = AtomicBool::new(false);
    let marks: std::sync::Mutex<Vec<String>> = std::sync::Mutex::default();
    let t = Instant::now();
    let (upgraded, rolled) = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if let Some(n) = node.node()
                    && !validated(&n)
                {
                    marks.lock().unwrap().push(format!(
                        "labels {} taints {}",
                        n["metadata"]["labels"], n["spec"]["taints"]
                    ));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let mut full = vec!["upgrade", "fabricgate", "--namespace", "fabricgate"];
        full.extend_from_slice(args);
        full.extend_from_slice(&["--wait", "--timeout", "4m"]);
        let upgraded = helm(node, &full);
        let rolled = upgraded.clone().and_then(|_| {
            wait_for(
                &format!("the agent Ready with {what}"),
                Duration::from_secs(120),
                || {
                    node.get_json(&[
                        "pods",
                        "-n",
                        "fabricgate",
                        "-l",
                        "app.kubernetes.io/component=agent",
                    ])
                    .and_then(|p| p["items"].as_array().cloned())
                    .is_some_and(|items| {
                        items.len() == 1
                            && changed(&items[0])
                            && items[0]["status"]["conditions"]
                                .as_array()
                                .is_some_and(|c| {
                                    c.iter()
                                        .any(|c| c["type"] == "Ready" && c["status"] == "True")
                                })
                    })
                },
            )
        });
        // Two of the new agent's probes after its rollout.
        std::thread::sleep(Duration::from_secs(10));
        stop.store(true, Ordering::Relaxed);
        (upgraded, rolled)
    });
    let out = upgraded?;
    rolled.map_err(|e| format!("{e}\n{}", super::scenarios::agent_logs(node)))?;
    println!("helm upgrade ({what}):\n{out}");
    println!(
        "figure: helm upgrade ({what}) rolled out in {:?}",
        t.elapsed()
    );
    let seen = marks.into_inner().unwrap_or_default();
    if !seen.is_empty() {
        return Err(format!(
            "the upgrade ({what}) left the node not validated {} times: {:?}",
            seen.len(),
            seen.first()
        ));
    }
    Ok(())
}
