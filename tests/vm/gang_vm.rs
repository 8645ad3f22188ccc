//! The gang pre-flight on real kernels through the real controller: a
//! 2-node gang, one Soft-RoCE VM per node (tests/vm/run-pair.sh with FG_HOST_NET=1,
//! tests/vm/gang-scenarios.sh), each VM's agent on the host's real kube-apiserver with its
//! Node's pod-bound token, and `fabricgate admission-check` on the host as its own process
//! with the shipped ServiceAccount and RBAC (deploy/admission-check.yaml). Kueue's part is
//! played as in tests/cluster/admission_check.rs: the test creates each Workload (Kueue's own
//! CRDs) and writes its quota reservation, TAS topology assignment (leaf, hostname: one pod on
//! each VM's Node) and the check `Pending`, as Kueue's scheduler writes them:
//! - link up: the check `Ready` on the Workload's status.admissionChecks entry, the FabricCheck
//!   deleted afterwards; quota reserved -> Ready is printed (docs/gangs.md);
//! - b's eth0 (rxe0's netdev) down after both validated, before the check: `Retry` whose
//!   message names the pair (a -> b), the port (rxe0 port 1) and a's error, and a Warning
//!   Event on the Workload.
//!
//! Run: `cargo test --test vm gang_vm`. Outside CI the test skips, saying why, when qemu or
//! the kernel package is unavailable; with CI=true a missing prerequisite is a failure.

use crate::common;
use crate::common::controlplane::ControlPlane;

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NS: &str = "fabricgate";
const NODE_A: &str = "gang-vm-a";
const NODE_B: &str = "gang-vm-b";
const ENDPOINT: &str = "fabricgate.io/peers-endpoint";
const LEAF: &str = common::kueue_crds::LEAF_LABEL;
/// The Workloads' namespace (the controller serves only it).
const WL_NS: &str = "gang-vm";
/// deploy/admission-check.yaml's AdmissionCheck.
const CHECK: &str = "fabricgate-preflight";

fn check_path(name: &str) -> String {
    format!("/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{name}")
}

fn workload_path(name: &str) -> String {
    format!("/apis/kueue.x-k8s.io/v1beta2/namespaces/{WL_NS}/workloads/{name}")
}

/// `fabricgate admission-check` on the host, with the shipped ServiceAccount's token.
struct Controller {
    child: Child,
    log: PathBuf,
}

impl Controller {
    fn start(cp: &ControlPlane, dir: &Path) -> Controller {
        common::kueue_crds::apply_admission_check(cp);
        let kubeconfig = dir.join("admission-check.kubeconfig");
        common::kueue_crds::admission_check_kubeconfig(cp, &kubeconfig);
        // rxe under emulation moves a few MB/s: the floor only shows the burst is judged.
        let config = dir.join("admission-check.yaml");
        std::fs::write(
            &config,
            format!(
                "gang:\n  namespace: {NS}\n  timeout: 60s\n  require_rdma: true\n  \
                 min_bandwidth_gbps: 0.0001\n  max_rtt_micros: 1000000\n"
            ),
        )
        .unwrap();
        let log = dir.join("admission-check.log");
        let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
            .args(["admission-check", "--config"])
            .arg(&config)
            .args(["--namespace", NS, "--lease-name", "gang-vm-check"])
            .args(["--lease-duration", "3s", "--poll-interval", "300ms"])
            .args(["--identity", "gang-vm-host", "--workload-namespace", WL_NS])
            .args(["--metrics-addr", "127.0.0.1:0"])
            .env("KUBECONFIG", &kubeconfig)
            .env("HOME", dir)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start fabricgate admission-check");
        Controller { child, log }
    }

    fn log(&self) -> String {
        common::last_lines(&std::fs::read_to_string(&self.log).unwrap_or_default(), 40)
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Workload of one pod set of two pods, as Kueue's Job integration makes it; its uid.
fn create_workload(cp: &ControlPlane, name: &str) -> String {
    let wl = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": name, "namespace": WL_NS },
        "spec": {
            "queueName": "gpu",
            "podSets": [{ "name": "main", "count": 2, "template": { "spec": {
                "restartPolicy": "Never",
                "containers": [{ "name": "worker", "image": "registry.example.com/train:1",
                    "resources": { "requests": { "cpu": "1" } } }] } } }],
        },
    });
    cp.apply(&wl.to_string());
    cp.get_json(&workload_path(name)).expect("the Workload")["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Kueue's scheduler reserving quota now, one pod on each VM's Node in leaf `leaf-vm`, our
/// check `Pending` (`kueue_crds::reserve`).
fn reserve(cp: &ControlPlane, name: &str) {
    let when =
        k8s_openapi::jiff::Timestamp::from_second(k8s_openapi::jiff::Timestamp::now().as_second())
            .unwrap()
            .to_string();
    common::kueue_crds::reserve(
        cp,
        WL_NS,
        name,
        CHECK,
        Some("leaf-vm"),
        &[NODE_B, NODE_A],
        &when,
    );
}

/// Our check's (state, message) on the Workload.
fn check_state(cp: &ControlPlane, name: &str) -> (String, String) {
    let wl = cp.get_json(&workload_path(name)).unwrap_or(Value::Null);
    common::kueue_crds::check_entry(&wl, CHECK)
}

/// The Events recorded on Workload `name`.
fn workload_events(cp: &ControlPlane, name: &str) -> Vec<Value> {
    cp.get_json(&format!("/apis/events.k8s.io/v1/namespaces/{WL_NS}/events"))
        .map(|l| l["items"].as_array().cloned().unwrap_or_default())
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["regarding"]["kind"] == "Workload" && e["regarding"]["name"] == name)
        .collect()
}

fn fc_name(name: &str, uid: &str) -> String {
    format!("{WL_NS}.{name}.{}", &uid[..8])
}

/// Poll `check`'s FabricCheck until the Workload's check leaves `Pending`, keeping the last
/// results seen (the controller deletes the FabricCheck once it decides).
fn decide(
    cp: &ControlPlane,
    sync: &Path,
    c: &Controller,
    name: &str,
    fc: &str,
    limit: Duration,
) -> (String, String, Vec<Value>) {
    let mut last = Vec::new();
    let start = Instant::now();
    loop {
        if let Some(r) = results(cp, fc) {
            last = r;
        }
        let (state, message) = check_state(cp, name);
        if state == "Ready" || state == "Retry" || state == "Rejected" {
            return (state, message, last);
        }
        for role in ["a", "b"] {
            assert!(
                !sync.join(format!("{role}.abort")).exists(),
                "VM {role} aborted while {name}'s check was pending"
            );
        }
        assert!(
            start.elapsed() < limit,
            "{name}: no decision within {limit:?}; FabricCheck {fc}: {last:?}; controller \
             log:\n{}",
            c.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The answers to FabricCheck `name` (its agents' FabricCheckResults, by the check's uid
/// label), `None` while the check does not exist or none answered yet.
fn results(cp: &ControlPlane, name: &str) -> Option<Vec<Value>> {
    let uid = cp.get_json(&check_path(name))?["metadata"]["uid"]
        .as_str()?
        .to_owned();
    // (the controller's empty answers, not filled yet, left out)
    let answers: Vec<Value> = common::fabriccheck_answers(cp, &uid)
        .iter()
        .map(|o| o["spec"].clone())
        .filter(|spec| spec.get("ok").is_some())
        .collect();
    (!answers.is_empty()).then_some(answers)
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
    // The slot before the control plane and the installs, so that starting the apiserver and
    // applying CRDs never share the CPUs with another suite's VMs (`vm_slot`: their timings
    // assume unshared CPUs).
    let _slot = common::vm_slot();
    let Some(cp) = ControlPlane::shared() else {
        common::require(false, "no control plane binary", "run .ci/controlplane.sh");
        return;
    };
    if common::kueue_crds::install(cp).is_none() {
        return;
    }
    cp.install_agent_rbac();
    cp.apply(&common::fabriccheck_crds());
    cp.apply(
        &json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": WL_NS } })
            .to_string(),
    );
    // A failed pair whose emulated NIC stopped transmitting (or whose guest kernel panicked
    // in Soft-RoCE) is booted once more, as `common::run_vm_once` does: the emulator failed,
    // not what ran in it.
    let (out, mut failure) = gang_pair(cp);
    if failure.is_some()
        && let Some(fault) = common::vm_emulation_fault(&out)
    {
        common::keep_first_boot("gang-vm", &out, &fault);
        failure = gang_pair(cp).1;
    }
    match failure {
        // Its message was printed when it was raised.
        Some(Failure::Panic(panic)) => std::panic::resume_unwind(panic),
        Some(Failure::Pair(message)) => panic!("{message}"),
        None => {}
    }
}

/// What failed in one boot of the pair.
enum Failure {
    /// The host's side panicked (its payload).
    Panic(Box<dyn std::any::Any + Send>),
    /// The pair's run ended non-zero.
    Pair(String),
}

/// One boot of the pair with the host's side (the Nodes, the controller, Kueue's part): its
/// output folder, and what failed.
fn gang_pair(cp: &ControlPlane) -> (PathBuf, Option<Failure>) {
    // An earlier boot's Workloads and their Events are not this boot's.
    cp.kubectl(&[
        "-n",
        WL_NS,
        "delete",
        "workloads.kueue.x-k8s.io,events",
        "--all",
        "--ignore-not-found",
    ]);
    for (node, ip) in [(NODE_A, "169.254.78.1"), (NODE_B, "169.254.78.2")] {
        cp.create_node(
            node,
            json!({ LEAF: "leaf-vm" }),
            json!([{ "key": common::TAINT, "effect": "NoSchedule" }]),
            json!({}),
        );
        // The address its agent's --peers-listen names, as a kubelet would report it: the
        // controller dials only a Node's own address.
        cp.patch_node_status(
            node,
            &json!({ "status": { "addresses": [{ "type": "InternalIP", "address": ip }] } }),
        );
    }
    let (mut cmd, out) = common::vm_command("run-pair.sh", 1200, "gang-vm", "gang-scenarios.sh");
    let controller = Controller::start(cp, &out);
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

        // 1. Link up: quota reserved -> the controller's FabricCheck -> both pairs measured
        //    over rxe0 -> Ready, and the FabricCheck deleted.
        let uid = create_workload(cp, "up");
        let fc = fc_name("up", &uid);
        let asked = Instant::now();
        reserve(cp, "up");
        let (state, message, up) =
            decide(cp, &sync, &controller, "up", &fc, Duration::from_secs(120));
        let decided = asked.elapsed();
        std::fs::write(
            out.join("check-up.json"),
            json!({ "state": state, "message": message, "results": up }).to_string(),
        )
        .unwrap();
        assert_eq!(state, "Ready", "{message}; results {up:?}");
        assert!(message.contains("2 pairs"), "{message}");
        for (node, peer) in [(NODE_A, NODE_B), (NODE_B, NODE_A)] {
            let Some(r) = result_of(&up, node) else {
                // The results are read by polling; the last poll may predate one entry.
                continue;
            };
            assert_eq!(r["peer"], peer, "{r}");
            assert_eq!(r["ok"], true, "{r}");
            assert_eq!(r["rdma"], "measured", "{r}");
            assert_eq!(r["device"], "rxe0", "{r}");
        }
        poll(
            &sync,
            "the FabricCheck deleted",
            Duration::from_secs(30),
            || cp.get_json(&check_path(&fc)).is_none().then_some(()),
        );

        // 2. b's eth0 down after validation, before the check: Retry naming a -> b, rxe0
        //    port 1 and a's error, with a Warning Event on the Workload.
        host("cut");
        poll(&sync, "b's cut", Duration::from_secs(120), || {
            sync.join("b.cut").exists().then_some(())
        });
        let uid = create_workload(cp, "cut");
        let fc = fc_name("cut", &uid);
        let asked_cut = Instant::now();
        reserve(cp, "cut");
        let (state, message, cut) =
            decide(cp, &sync, &controller, "cut", &fc, Duration::from_secs(150));
        let failed_after = asked_cut.elapsed();
        std::fs::write(
            out.join("check-cut.json"),
            json!({ "state": state, "message": message, "results": cut }).to_string(),
        )
        .unwrap();
        assert_eq!(state, "Retry", "{message}");
        assert!(
            message.contains(&format!("{NODE_A} -> {NODE_B} (rxe0 port 1)"))
                && message.contains(&format!("peer {NODE_B} (169.254.78.2:9465)")),
            "the message names the pair, the port and the error: {message}"
        );
        poll(&sync, "the Retry Event", Duration::from_secs(30), || {
            workload_events(cp, "cut")
                .iter()
                .any(|e| {
                    e["reason"] == "FabricPreflightRetry"
                        && e["type"] == "Warning"
                        && e["note"].as_str().unwrap_or("").contains(NODE_B)
                })
                .then_some(())
        });
        poll(
            &sync,
            "the FabricCheck deleted",
            Duration::from_secs(30),
            || cp.get_json(&check_path(&fc)).is_none().then_some(()),
        );
        eprintln!(
            "gang vm: both validated {validated:?} after boot; link up: quota reserved -> \
             Ready in {decided:?} ({message_up}); eth0 down on b: quota reserved -> Retry in \
             {failed_after:?}: {message}",
            message_up = check_state(cp, "up").1,
        );
    }));
    if outcome.is_err() {
        host("abort");
        eprintln!("admission-check log:\n{}", controller.log());
    }
    host("done");
    let status = child.wait().expect("wait for tests/vm/run-pair.sh");
    drop(controller);
    let failure = match outcome {
        Err(panic) => Some(Failure::Panic(panic)),
        Ok(()) if !status.success() => Some(Failure::Pair(format!(
            "the VM pair failed ({status}); see {}/{{a,b}}/{{steps.log,stderr,console.log,agent.log}}",
            out.display()
        ))),
        Ok(()) => None,
    };
    (out, failure)
}
