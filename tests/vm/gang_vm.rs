//! The gang pre-flight's RDMA half on real kernels (issue 25, item 3): a 2-node gang, one
//! Soft-RoCE VM per node (tests/vm/run-pair.sh with FG_HOST_NET=1, tests/vm/gang-scenarios.sh),
//! each VM's agent on the host's real kube-apiserver with its Node's pod-bound token. The host
//! asks `FabricCheck`s of the ring a -> b -> a as the admission-check controller does (its
//! controller is not in this tree yet: the test creates the checks itself, with the spec the
//! controller writes, and reads the results the controller would judge):
//! - link up: both pairs `ok`, `rdma: measured` over rxe0, with RTT and a WRITE burst;
//! - b's eth0 (rxe0's netdev) down after both validated, before the check: a's result is
//!   `ok: false` naming b and its endpoint (the controller's `Retry` naming the pair).
//!
//! Run: `cargo test --test vm gang_vm`. Outside CI the test skips, saying why, when qemu or
//! the kernel package is unavailable; with CI=true a missing prerequisite is a failure.

use crate::common;
use crate::common::controlplane::ControlPlane;

use serde_json::{Value, json};
use std::path::Path;
use std::time::{Duration, Instant};

const NS: &str = "fabricgate";
const NODE_A: &str = "gang-vm-a";
const NODE_B: &str = "gang-vm-b";
const ENDPOINT: &str = "fabricgate.io/peers-endpoint";
const CRD: &str = include_str!("../cluster/fabriccheck-crd.yaml");

fn check_path(name: &str) -> String {
    format!("/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{name}")
}

fn create_check(cp: &ControlPlane, name: &str, members: &[(&str, String)], secs: i64) {
    let now = k8s_openapi::jiff::Timestamp::now().as_second();
    let deadline = k8s_openapi::jiff::Timestamp::from_second(now + secs)
        .unwrap()
        .to_string();
    let body = json!({
        "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheck",
        "metadata": { "name": name, "namespace": NS,
                      "labels": { "app.kubernetes.io/name": "fabricgate",
                                  "fabricgate.io/check": "gang" } },
        "spec": {
            "workload": { "namespace": "team", "name": name, "uid": "0000" },
            "members": members.iter().map(|(n, e)| json!({ "node": n, "endpoint": e }))
                .collect::<Vec<_>>(),
            // rxe under emulation moves a few MB/s: the floor only shows the burst is judged.
            "minBandwidthGbps": 0.0001,
            "deadline": deadline,
        },
    });
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            NS,
            "delete",
            "fabriccheck",
            name,
            "--ignore-not-found",
        ],
        None,
    );
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["create", "-f", "-"],
        Some(&body.to_string()),
    );
    assert!(ok, "create FabricCheck {name}: {err}");
}

fn results(cp: &ControlPlane, name: &str) -> Vec<Value> {
    cp.get_json(&check_path(name))
        .and_then(|c| c["status"]["results"].as_array().cloned())
        .unwrap_or_default()
}

fn result_of(results: &[Value], node: &str) -> Option<Value> {
    results.iter().find(|r| r["node"] == node).cloned()
}

/// Poll `f` every 250 ms for `limit`, failing early when a guest aborted.
fn poll<T>(sync: &Path, what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        for role in ["a", "b"] {
            assert!(
                !sync.join(format!("{role}.abort")).exists(),
                "VM {role} aborted while the host waited for {what}"
            );
        }
        assert!(start.elapsed() < limit, "no {what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn ready(cp: &ControlPlane, node: &str) -> Option<String> {
    let n = cp.node(node)?;
    let tainted = n["spec"]["taints"]
        .as_array()
        .is_some_and(|ts| ts.iter().any(|t| t["key"] == common::TAINT));
    if tainted || n["metadata"]["labels"]["fabricgate.io/ready"] != "true" {
        return None;
    }
    n["metadata"]["annotations"][ENDPOINT]
        .as_str()
        .map(str::to_owned)
}

#[test]
fn a_two_vm_gang_passes_the_rdma_preflight_and_a_cut_link_fails_the_pair() {
    if let Some(why) = common::vm_prerequisites_missing() {
        common::require(false, &why, "run .ci/vm.sh");
        return;
    }
    let Some(cp) = ControlPlane::shared() else {
        common::require(false, "no control plane binary", "run .ci/controlplane.sh");
        return;
    };
    cp.install_agent_rbac();
    cp.apply(CRD);
    for node in [NODE_A, NODE_B] {
        cp.create_node(
            node,
            json!({}),
            json!([{ "key": common::TAINT, "effect": "NoSchedule" }]),
            json!({}),
        );
    }
    let _slot = common::vm_slot();
    let (mut cmd, out) = common::vm_command("run-pair.sh", 1200, "gang-vm", "gang-scenarios.sh");
    // The guests reach the apiserver at 10.0.3.2 (their user network's host address, which
    // the serving certificate names), each with its own Node's pod-bound token.
    for (node, var) in [(NODE_A, "FG_KUBECONFIG_A"), (NODE_B, "FG_KUBECONFIG_B")] {
        let kubeconfig = out.join(format!("{node}.kubeconfig"));
        cp.write_kubeconfig(
            &kubeconfig,
            &format!("https://10.0.3.2:{}", cp.port),
            &cp.agent_token(node),
        );
        cmd.env(var, &kubeconfig);
    }
    let mut child = cmd
        .env("FG_HOST_NET", "1")
        .env("FG_NODE_A", NODE_A)
        .env("FG_NODE_B", NODE_B)
        .spawn()
        .expect("run tests/vm/run-pair.sh");
    let sync = out.join("sync");
    let host = |name: &str| std::fs::write(sync.join(format!("host.{name}")), b"").unwrap();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let started = Instant::now();
        let (ep_a, ep_b) = poll(
            &sync,
            "both Nodes validated",
            Duration::from_secs(900),
            || Some((ready(cp, NODE_A)?, ready(cp, NODE_B)?)),
        );
        let validated = started.elapsed();
        assert_eq!(
            (ep_a.as_str(), ep_b.as_str()),
            ("169.254.78.1:9465", "169.254.78.2:9465"),
            "each advertises its --peers-listen"
        );
        let members = [(NODE_A, ep_a), (NODE_B, ep_b)];

        // 1. Link up: both pairs measured over rxe0.
        let asked = Instant::now();
        create_check(cp, "team.gang-vm-up.00000001", &members, 180);
        let up = poll(&sync, "both results", Duration::from_secs(200), || {
            let r = results(cp, "team.gang-vm-up.00000001");
            (r.len() == 2).then_some(r)
        });
        let decided = asked.elapsed();
        std::fs::write(
            out.join("check-up.json"),
            Value::Array(up.clone()).to_string(),
        )
        .unwrap();
        for (node, peer) in [(NODE_A, NODE_B), (NODE_B, NODE_A)] {
            let r = result_of(&up, node).unwrap();
            assert_eq!(r["peer"], peer, "{r}");
            assert_eq!(r["ok"], true, "{r}");
            assert_eq!(r["rdma"], "measured", "{r}");
            assert_eq!(r["device"], "rxe0", "{r}");
            assert!(r["rttMicros"].as_f64().is_some_and(|v| v > 0.0), "{r}");
            assert!(r["bandwidthGbps"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        }

        // 2. b's eth0 down after validation, before the check: a -> b fails, naming b.
        host("cut");
        poll(&sync, "b's cut", Duration::from_secs(120), || {
            sync.join("b.cut").exists().then_some(())
        });
        let asked_cut = Instant::now();
        create_check(cp, "team.gang-vm-cut.00000002", &members, 120);
        let a = poll(
            &sync,
            "a's result after the cut",
            Duration::from_secs(150),
            || result_of(&results(cp, "team.gang-vm-cut.00000002"), NODE_A),
        );
        let failed_after = asked_cut.elapsed();
        std::fs::write(out.join("check-cut.json"), a.to_string()).unwrap();
        assert_eq!(a["ok"], false, "{a}");
        assert_eq!(a["peer"], NODE_B, "{a}");
        let err = a["error"].as_str().unwrap_or_default();
        assert!(
            err.contains(&format!("peer {NODE_B} (169.254.78.2:9465)")),
            "the error names the pair: {err}"
        );
        eprintln!(
            "gang vm: both validated {validated:?} after boot; link up: check decided (both \
             results) in {decided:?}: {up:?}; eth0 down on b: a's failed result in \
             {failed_after:?}: {err}"
        );
    }));
    if outcome.is_err() {
        host("abort");
    }
    host("done");
    let status = child.wait().expect("wait for tests/vm/run-pair.sh");
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    assert!(
        status.success(),
        "the VM pair failed ({status}); see {}/{{a,b}}/{{steps.log,stderr,console.log,agent.log}}",
        out.display()
    );
}
