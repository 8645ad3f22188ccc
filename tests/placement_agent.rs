//! `placement.required_labels` end to end: the real agent against the API-server stand-in
//! keeps a Node that lacks an operator-provided topology label tainted and says which label,
//! and validates it once the label is there.

mod support;

use serde_json::{Value, json};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::apiserver::ApiServer;
use support::sysfs::FakeHca;

const NODE: &str = "gpu-node-1";
const TAINT: &str = "fabricgate.io/unvalidated";
const RACK: &str = "cloud.example.com/rack";

struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) {
    let started = Instant::now();
    while !f() {
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn fabric_condition(api: &ApiServer) -> Option<Value> {
    let node = api.node(NODE)?;
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "FabricReady")
        .cloned()
}

fn tainted(api: &ApiServer) -> bool {
    api.node(NODE).is_some_and(|n| {
        n["spec"]["taints"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t["key"] == TAINT))
    })
}

#[test]
fn a_missing_topology_label_keeps_the_node_tainted_until_it_is_set() {
    let hca = FakeHca::new(true);
    let api = ApiServer::start();
    let mut node = ApiServer::kubelet_node(NODE);
    node["metadata"]["labels"]["topology.kubernetes.io/zone"] = json!("z1");
    api.seed_node(node);
    let kubeconfig = hca.scratch().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!(
            "node:\n  recover_after: 1\nplacement:\n  required_labels: \
             [topology.kubernetes.io/zone, {RACK}]\n"
        ),
    )
    .unwrap();
    let _agent = Agent(
        Command::new(env!("CARGO_BIN_EXE_fabricgate"))
            .arg("run")
            .arg("--sysfs-root")
            .arg(hca.sysfs_root())
            .arg("--proc-root")
            .arg(hca.proc_root())
            .arg("--config")
            .arg(&config)
            .args(["--verbs", "off", "--metrics-addr", "127.0.0.1:0"])
            .args(["--interval", "50ms", "--resync-interval", "100ms"])
            .env("KUBECONFIG", &kubeconfig)
            .env("HOME", hca.scratch())
            .env("NODE_NAME", NODE)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    wait_until("the placement finding", Duration::from_secs(20), || {
        fabric_condition(&api).is_some_and(|c| c["reason"] == "PlacementLabelsMissing")
    });
    let cond = fabric_condition(&api).unwrap();
    assert_eq!(cond["status"], "False");
    let message = cond["message"].as_str().unwrap();
    assert!(message.contains(RACK), "{message}");
    assert!(
        !message.contains("topology.kubernetes.io/zone"),
        "{message}"
    );
    assert!(tainted(&api));
    let node = api.node(NODE).unwrap();
    assert_eq!(node["metadata"]["labels"]["fabricgate.io/ready"], "false");
    // The fabric itself is fine: RDMAReady stays True.
    let rdma = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "RDMAReady")
        .unwrap()
        .clone();
    assert_eq!(rdma["status"], "True");

    // The operator labels the Node; within a resync the agent validates it.
    api.modify_node(NODE, "kubectl-label", |n| {
        n["metadata"]["labels"][RACK] = json!("r07");
    });
    wait_until(
        "validation after labelling",
        Duration::from_secs(20),
        || fabric_condition(&api).is_some_and(|c| c["status"] == "True") && !tainted(&api),
    );
    let node = api.node(NODE).unwrap();
    assert_eq!(node["metadata"]["labels"]["fabricgate.io/ready"], "true");
    assert_eq!(
        node["metadata"]["labels"][RACK], "r07",
        "the operator's label stays"
    );
}
