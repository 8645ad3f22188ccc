//! `fabricgate guard` against the real kube-apiserver: two replicas elect a leader on a
//! Lease; the test plays the kubelet, setting the agent pods' Ready condition on the status
//! subresource (and deleting a pod as a node drain or crash would).

use crate::{TestNode, control_plane, signal, wait_until};
use serde::Deserialize;
use serde_json::json;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The namespace of deploy/guard.yaml's Role: the agent pods and the Lease live there.
const NS: &str = "fabricgate";
const GUARD_USER: &str = "system:serviceaccount:fabricgate:fabricgate-guard";
const POOL: &str = "fabricgate.io/test-pool";
const APP: &str = "fg-agent-test";

struct Guard {
    child: Child,
    log: std::path::PathBuf,
    identity: String,
}

impl Guard {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_guard(identity: &str, config: &Path, kubeconfig: &Path, scratch: &Path) -> Guard {
    let log = scratch.join(format!("{identity}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["guard", "--config"])
        .arg(config)
        .args([
            "--namespace",
            NS,
            "--pod-selector",
            &format!("app={APP}"),
            "--stale-after",
            "3s",
            "--poll-interval",
            "300ms",
            "--lease-duration",
            "3s",
            "--identity",
            identity,
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("HOME", scratch)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("guard log"))
        .spawn()
        .expect("start fabricgate guard");
    Guard {
        child,
        log,
        identity: identity.to_owned(),
    }
}

fn pod_name(node: &str) -> String {
    format!("agent-{node}")
}

fn set_ready(cp: &crate::support::controlplane::ControlPlane, node: &str, ready: bool) {
    let patch = json!({ "status": { "phase": "Running", "conditions": [
        { "type": "Ready", "status": if ready { "True" } else { "False" } },
    ]}})
    .to_string();
    cp.kubectl(&[
        "-n",
        NS,
        "patch",
        "pod",
        &pod_name(node),
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch,
    ]);
}

fn holder(cp: &crate::support::controlplane::ControlPlane) -> Option<String> {
    cp.get_json(&format!(
        "/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/fabricgate-guard"
    ))?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_owned)
}

#[test]
fn guard_taints_nodes_whose_agent_is_gone_only_the_leader_acts_and_failover_works() {
    let Some(cp) = control_plane() else { return };
    // The namespace and the agent's ServiceAccount, as daemonset.yaml installs them.
    cp.install_agent_rbac();
    let names: Vec<String> = (0..6).map(|i| format!("guard-{i}")).collect();
    for name in &names {
        cp.create_node(
            name,
            json!({ POOL: "guard" }),
            json!([{ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" }]),
            json!({}),
        );
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": pod_name(name), "namespace": NS, "labels": { "app": APP } },
            "spec": {
                "nodeName": name,
                "serviceAccountName": "fabricgate",
                "automountServiceAccountToken": false,
                "containers": [{ "name": "agent", "image": "fabricgate:test" }],
            },
        });
        let _ = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &[
                "-n",
                NS,
                "delete",
                "pod",
                &pod_name(name),
                "--ignore-not-found",
                "--grace-period=0",
                "--force",
            ],
            None,
        );
        let (ok, _, err) = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &["create", "-f", "-"],
            Some(&pod.to_string()),
        );
        assert!(ok, "create pod: {err}");
        set_ready(cp, name, true);
    }
    let node = |i: usize| TestNode {
        cp,
        name: names[i].clone(),
    };
    // The shipped manifest, applied: the guards run with its ServiceAccount and RBAC (its
    // Deployment stays inert: no controller manager runs here).
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/guard.yaml");
    cp.kubectl(&["apply", "-f", manifest]);
    let token = cp.kubectl(&["-n", NS, "create", "token", "fabricgate-guard"]);
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let mark = cp.audit_mark();
    let config = scratch.path().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"{POOL}=guard\"\n"),
    )
    .unwrap();
    let a = start_guard("guard-a", &config, &kubeconfig, scratch.path());
    let b = start_guard("guard-b", &config, &kubeconfig, scratch.path());
    wait_until("a leader", Duration::from_secs(20), || holder(cp).is_some());
    let leader = holder(cp).unwrap();
    let (leader_guard, follower) = if leader == a.identity { (a, b) } else { (b, a) };

    // Healthy agents: nothing happens for well over stale_after.
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        (0..6).all(|i| !node(i).has_our_taint()),
        "no agent problem, no taint"
    );

    // The agent pod on guard-1 is deleted; the one on guard-2 turns NotReady.
    cp.kubectl(&[
        "-n",
        NS,
        "delete",
        "pod",
        &pod_name(&names[1]),
        "--grace-period=0",
        "--force",
    ]);
    set_ready(cp, &names[2], false);
    let t0 = Instant::now();
    for i in [1, 2] {
        wait_until("the guard's taint", Duration::from_secs(3 + 5), || {
            node(i).has_our_taint()
        });
        wait_until("FabricReady", Duration::from_secs(5), || {
            node(i).condition("FabricReady").is_some()
        });
        let fabric = node(i).condition("FabricReady").expect("FabricReady");
        assert_eq!(fabric["status"], "False");
        assert_eq!(fabric["reason"], "AgentNotRunning", "{fabric}");
    }
    eprintln!(
        "agent gone -> guard taint: {:?} (stale_after 3s)",
        t0.elapsed()
    );
    assert!(
        leader_guard.log().contains("guard-1"),
        "{}",
        leader_guard.log()
    );
    assert!(
        !follower.log().contains("guard-1"),
        "the follower acted: {}",
        follower.log()
    );

    // The guard never untaints: the agent pod on guard-2 is Ready again, the taint stays.
    set_ready(cp, &names[2], true);
    std::thread::sleep(Duration::from_secs(2));
    assert!(node(2).has_our_taint());

    // Failover: the leader dies without releasing; the follower takes the Lease and acts.
    let mut dead = leader_guard;
    signal(&dead.child, "KILL");
    let _ = dead.child.wait();
    set_ready(cp, &names[3], false);
    let t0 = Instant::now();
    wait_until(
        "the new leader's taint",
        Duration::from_secs(3 + 3 + 5),
        || node(3).has_our_taint(),
    );
    eprintln!("failover + stale_after -> taint: {:?}", t0.elapsed());
    assert_eq!(holder(cp).as_deref(), Some(follower.identity.as_str()));
    wait_until("AgentNotRunning", Duration::from_secs(5), || {
        node(3)
            .condition("FabricReady")
            .is_some_and(|c| c["reason"] == "AgentNotRunning")
    });
    assert!(
        (0..6)
            .filter(|&i| i != 1 && i != 2 && i != 3)
            .all(|i| !node(i).has_our_taint())
    );
    // A clean stop releases the Lease.
    signal(&follower.child, "TERM");
    wait_until("the Lease released", Duration::from_secs(10), || {
        holder(cp).is_none()
    });
    drop(follower);

    // Least privilege, from the audit log: the guards used exactly what deploy/guard.yaml
    // grants, and nothing they asked for was refused.
    let requests: Vec<_> = cp
        .audit_since(mark)
        .into_iter()
        .filter(|e| e.user == GUARD_USER)
        .collect();
    let refused: Vec<_> = requests.iter().filter(|e| e.code == 403).collect();
    assert!(refused.is_empty(), "refused: {refused:#?}");
    let used: BTreeSet<(String, String, String)> = requests
        .iter()
        .map(|e| {
            let resource = if e.subresource.is_empty() {
                e.resource.clone()
            } else {
                format!("{}/{}", e.resource, e.subresource)
            };
            (e.api_group.clone(), resource, e.verb.clone())
        })
        .collect();
    assert_eq!(used, granted(), "audit log vs deploy/guard.yaml");
}

/// (apiGroup, resource, verb) the guard's ClusterRole and Role grant.
fn granted() -> BTreeSet<(String, String, String)> {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/guard.yaml")).unwrap();
    let mut out = BTreeSet::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let v = serde_json::Value::deserialize(doc).unwrap();
        if v["kind"] != "ClusterRole" && v["kind"] != "Role" {
            continue;
        }
        for rule in v["rules"].as_array().unwrap() {
            for g in rule["apiGroups"].as_array().unwrap() {
                for r in rule["resources"].as_array().unwrap() {
                    for verb in rule["verbs"].as_array().unwrap() {
                        out.insert((
                            g.as_str().unwrap().to_owned(),
                            r.as_str().unwrap().to_owned(),
                            verb.as_str().unwrap().to_owned(),
                        ));
                    }
                }
            }
        }
    }
    out
}
