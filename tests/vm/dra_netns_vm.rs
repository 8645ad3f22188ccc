//! DRA claims in pods' network namespaces, end to end on a real kernel and the real apiserver: an
//! HCA a DRA claim gave to a pod, in that pod's network namespace (RDMA netns mode exclusive),
//! judged by the agent daemon from inside that namespace. The Soft-RoCE VM runs
//! tests/vm/dra-netns-scenarios.sh: the agent in a namespace without the HCA, the claim's pod a
//! real process (its cgroup named after the real Pod's UID) in the namespace where rxe0 lives — the
//! roles swapped, since rxe cannot be moved, which is the same to the kernel. The host publishes
//! rxe0 as DraNet would, lets the real scheduler allocate it to the Pod's claim, and watches the
//! Node and the DeviceTaintRules:
//!
//! 1. the Node validated although the agent's own namespace has no RDMA device (the HCA is the
//!    pod's: 0 of 0 ports required), no rule;
//! 2. rxe0's port down (eth0 down in the pod's namespace): a DeviceTaintRule for its DRA
//!    device, `PortDown`, naming the pod; the Node still validated;
//! 3. the port up again: the rule removed.
//!
//! Outside CI the test skips, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use crate::common;

use common::controlplane::ControlPlane;
use common::has_taint;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const NODE: &str = "fabricgate-vm-dra";
const NS: &str = "dra-vm";
const DRIVER: &str = "dra.net";
/// rxe0 as DraNet names a device without a PCI address: the RDMA device attribute names it.
const DEVICE: &str = "rxe0";
const POD: &str = "holder";

/// What the host saw; filled phase by phase, so a failure shows how far it got.
#[derive(Debug, Default)]
struct Seen {
    /// Agent start to the Node validated.
    start_to_ready: Option<Duration>,
    /// The Node then, and the rules then.
    ready_node: Option<Value>,
    rules_when_ready: Vec<Value>,
    /// eth0 down (the guest's marker) to the rule; the rule and the Node then.
    down_to_rule: Option<Duration>,
    rule: Option<Value>,
    node_with_rule: Option<Value>,
    /// eth0 up to the rule gone.
    up_to_cleared: Option<Duration>,
    error: Option<String>,
}

enum Boot {
    Ran(PathBuf, Box<Seen>),
    Skipped(String),
}

fn rules(cp: &ControlPlane) -> Vec<Value> {
    cp.get_json("/apis/resource.k8s.io/v1/devicetaintrules")
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r["spec"]["deviceSelector"]["pool"] == NODE)
        .collect()
}

fn is_validated(node: &Value) -> bool {
    !has_taint(node) && node["metadata"]["labels"]["fabricgate.io/ready"] == "true"
}

struct Host<'a> {
    cp: &'a ControlPlane,
    out: &'a Path,
    child: &'a mut Child,
}

impl Host<'_> {
    const POLL: Duration = Duration::from_millis(50);

    fn marker(&mut self, name: &str, limit: Duration) -> Result<Instant, String> {
        let start = Instant::now();
        loop {
            if self.out.join(name).exists() {
                return Ok(Instant::now());
            }
            if !matches!(self.child.try_wait(), Ok(None)) || start.elapsed() > limit {
                return Err(format!("the guest never wrote {name}"));
            }
            std::thread::sleep(Self::POLL);
        }
    }

    fn until(
        &mut self,
        what: &str,
        since: Instant,
        limit: Duration,
        mut done: impl FnMut(&ControlPlane) -> bool,
    ) -> Result<Duration, String> {
        loop {
            if done(self.cp) {
                return Ok(since.elapsed());
            }
            if !matches!(self.child.try_wait(), Ok(None)) || since.elapsed() > limit {
                return Err(format!(
                    "never {what}: Node {}, rules {:?}",
                    self.cp.node(NODE).unwrap_or_default(),
                    rules(self.cp)
                ));
            }
            std::thread::sleep(Self::POLL);
        }
    }

    fn ack(&self, name: &str) {
        std::fs::write(self.out.join(format!("host.{name}")), b"").unwrap();
    }

    fn drive(&mut self, seen: &mut Seen) -> Result<(), String> {
        let started = self.marker("agent.started", Duration::from_secs(240))?;
        seen.start_to_ready = Some(self.until(
            "validated",
            started,
            Duration::from_secs(120),
            |cp| cp.node(NODE).is_some_and(|n| is_validated(&n)),
        )?);
        // A few probes more: validated and no rule is the steady state, not a passing moment.
        std::thread::sleep(Duration::from_secs(3));
        seen.ready_node = self.cp.node(NODE);
        seen.rules_when_ready = rules(self.cp);
        self.ack("ready");

        let down = self.marker("port.down", Duration::from_secs(60))?;
        seen.down_to_rule = Some(self.until(
            "a PortDown rule for rxe0's device",
            down,
            Duration::from_secs(60),
            |cp| {
                rules(cp).iter().any(|r| {
                    r["spec"]["deviceSelector"]["device"] == DEVICE
                        && r["spec"]["taint"]["value"] == "PortDown"
                })
            },
        )?);
        seen.rule = rules(self.cp).into_iter().next();
        seen.node_with_rule = self.cp.node(NODE);
        self.ack("ruled");

        let up = self.marker("port.up", Duration::from_secs(60))?;
        seen.up_to_cleared = Some(self.until(
            "the rule removed",
            up,
            Duration::from_secs(60),
            |cp| rules(cp).is_empty(),
        )?);
        self.ack("cleared");
        Ok(())
    }
}

/// The namespace, the DeviceClass, this node's slice (rxe0 as DraNet publishes an RDMA NIC),
/// and a Pod with a claim for one HCA, allocated by the real scheduler: the Pod's UID.
fn claim_rxe0(cp: &ControlPlane) -> Result<String, String> {
    cp.create_namespace(NS);
    cp.serve_dra_net_claims();
    cp.apply(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"name": format!("{NODE}-dra.net")},
            "spec": {
                "driver": DRIVER, "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": DEVICE, "attributes": {
                    "dra.net/rdma": {"bool": true},
                    "dra.net/rdmaDevice": {"string": "rxe0"},
                    "dra.net/ifName": {"string": "eth0"},
                }}],
            },
        })
        .to_string(),
    );
    cp.apply(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": POD, "namespace": NS},
            "spec": {"devices": {"requests": [{"name": "hca", "exactly": {
                "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1,
            }}]}},
        })
        .to_string(),
    );
    cp.apply(
        &json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": POD, "namespace": NS},
            "spec": {
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 0,
                "nodeSelector": {"kubernetes.io/hostname": NODE},
                "tolerations": [{"operator": "Exists"}],
                "resourceClaims": [{"name": "hca", "resourceClaimName": POD}],
                "containers": [{"name": "worker", "image": "pytorch:test",
                                "resources": {"claims": [{"name": "hca"}]}}],
            },
        })
        .to_string(),
    );
    let claim = format!("/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{POD}");
    let start = Instant::now();
    loop {
        let allocated = cp.get_json(&claim).is_some_and(|c| {
            c["status"]["allocation"]["devices"]["results"][0]["device"] == DEVICE
        });
        if allocated {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err(format!(
                "the scheduler never allocated rxe0: {:?}",
                cp.get_json(&claim)
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    cp.get_json(&format!("/api/v1/namespaces/{NS}/pods/{POD}"))
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
        .ok_or_else(|| "the Pod has no UID".to_owned())
}

/// Everything the test made, gone (the claim released by hand: no kube-controller-manager).
fn clean_up(cp: &ControlPlane) {
    cp.kubectl(&[
        "-n",
        NS,
        "delete",
        "pod",
        POD,
        "--ignore-not-found",
        "--grace-period=0",
        "--force",
    ]);
    cp.release_claim(NS, POD);
    cp.kubectl(&[
        "-n",
        NS,
        "delete",
        "resourceclaim",
        POD,
        "--ignore-not-found",
    ]);
    cp.kubectl(&[
        "delete",
        "resourceslice",
        &format!("{NODE}-dra.net"),
        "--ignore-not-found",
    ]);
    cp.kubectl(&[
        "delete",
        "devicetaintrules",
        "-l",
        &format!("fabricgate.io/node={NODE}"),
        "--ignore-not-found",
    ]);
    cp.kubectl(&["delete", "node", NODE, "--ignore-not-found"]);
}

fn boot() -> &'static Boot {
    static BOOT: OnceLock<Boot> = OnceLock::new();
    BOOT.get_or_init(|| {
        if let Some(why) = common::vm_prerequisites_missing() {
            common::require(false, &why, "run .ci/vm.sh");
            return Boot::Skipped(why);
        }
        let Some(cp) = ControlPlane::shared() else {
            return Boot::Skipped("no control plane binary (run .ci/controlplane.sh)".into());
        };
        let _slot = common::vm_slot();
        // The runtime-transport component's RBAC (the pods watch, the claims), taken back at
        // the end.
        let _widened = common::controlplane::WidenedRbac::apply(cp);
        cp.create_node(NODE, json!({}), json!([]), json!({}));
        let mut seen = Seen::default();
        let uid = match claim_rxe0(cp) {
            Ok(uid) => uid,
            Err(e) => {
                clean_up(cp);
                panic!("{e}");
            }
        };
        let (mut cmd, out) =
            common::vm_command("run.sh", 400, "dra-netns-vm", "dra-netns-scenarios.sh");
        let kubeconfig = out.join("kubeconfig");
        cp.write_kubeconfig(
            &kubeconfig,
            &format!("https://10.0.3.2:{}", cp.port),
            &cp.agent_token(NODE),
        );
        let mut child = cmd
            .env("FG_KUBECONFIG", &kubeconfig)
            .env("FG_NODE", NODE)
            .env("FG_POD_UID", &uid)
            .spawn()
            .expect("run tests/vm/run.sh");
        let mut host = Host {
            cp,
            out: &out,
            child: &mut child,
        };
        if let Err(e) = host.drive(&mut seen) {
            host.ack("abort");
            seen.error = Some(e);
        }
        let status = child.wait().expect("wait for tests/vm/run.sh");
        clean_up(cp);
        if seen.error.is_none() {
            assert!(
                status.success(),
                "the VM run failed ({status}); see {}/console.log, stderr and daemon.log",
                out.display()
            );
        }
        Boot::Ran(out, Box::new(seen))
    })
}

fn ran() -> Option<(&'static Path, &'static Seen)> {
    match boot() {
        Boot::Ran(out, seen) => {
            if let Some(e) = &seen.error {
                panic!("{e}; see {}/daemon.log and console.log", out.display());
            }
            Some((out, seen))
        }
        Boot::Skipped(why) => {
            common::require(false, why, "run .ci/vm.sh");
            None
        }
    }
}

#[test]
fn an_hca_in_its_claims_pods_namespace_is_in_use_and_the_node_validated_without_it() {
    let Some((out, seen)) = ran() else { return };
    let class = std::fs::read_to_string(out.join("agent-class-infiniband.txt")).unwrap();
    assert_eq!(class, "", "the agent's own namespace has no RDMA device");
    let node = seen.ready_node.as_ref().unwrap();
    assert!(is_validated(node), "{node:#}");
    assert_eq!(
        node["metadata"]["labels"]["fabricgate.io/rdma.active-ports"],
        "0"
    );
    assert!(
        seen.rules_when_ready.is_empty(),
        "{:?}",
        seen.rules_when_ready
    );
    // What the agent exports of it.
    let metrics = std::fs::read_to_string(out.join("metrics-ready.txt")).unwrap();
    let in_use: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("fabricgate_dra_device_in_use{"))
        .collect();
    assert_eq!(
        in_use,
        [format!(
            r#"fabricgate_dra_device_in_use{{hca="rxe0",claim="{NS}/{POD}"}} 1"#
        )],
        "{metrics}"
    );
    eprintln!(
        "figure: agent start to the Node validated with its one HCA in a pod: {:?}",
        seen.start_to_ready
    );
}

#[test]
fn its_port_down_inside_the_pods_namespace_taints_its_device_never_the_node() {
    let Some((out, seen)) = ran() else { return };
    let link = std::fs::read_to_string(out.join("rdma-link-down.txt")).unwrap();
    assert!(link.contains("link rxe0/1 state DOWN"), "{link}");
    let rule = seen.rule.as_ref().unwrap();
    assert_eq!(rule["spec"]["deviceSelector"]["driver"], DRIVER);
    assert_eq!(rule["spec"]["taint"]["value"], "PortDown");
    let message = rule["metadata"]["annotations"]["fabricgate.io/message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains(&format!(
            "rxe0/1: state DOWN, phys Disabled in pod {NS}/{POD}'s network namespace, where claim {NS}/{POD} holds it"
        )),
        "{rule:#}"
    );
    let node = seen.node_with_rule.as_ref().unwrap();
    assert!(is_validated(node), "never the node: {node:#}");
    assert!(seen.up_to_cleared.is_some());
    eprintln!(
        "figure: rxe0 port down in the pod's namespace -> DeviceTaintRule {:?}; up -> removed {:?} (interval 1s, recover_after 2)",
        seen.down_to_rule, seen.up_to_cleared
    );
}
