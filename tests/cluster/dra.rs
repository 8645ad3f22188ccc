//! DRA (`kubernetes.dra`, docs/dra.md) against the real kube-apiserver and kube-scheduler, no
//! kubelet: the test publishes the node's ResourceSlice in DraNet's format (as DraNet's kubelet
//! plugin does; the real node's Go plugin does it for real in tests/node) and stands in for the
//! plugin's registration socket with a listening unix socket; the agent over a four-HCA fixture
//! keeps a DeviceTaintRule per bad HCA, and the scheduler allocates ResourceClaims around it.

use crate::common::agent::{Agent, Launch};
use crate::common::controlplane::ControlPlane;
use crate::common::fixture::{Shape, write_node};
use crate::common::{TestNode, control_plane, wait_until};
use serde_json::{Value, json};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const DRIVER: &str = "dra.net";
pub(crate) const NS: &str = "dra-test";

/// A node with four 400G InfiniBand HCAs `mlx5_0..3` (fixture PCI `0000:1a/2a/3a/4a:00.0`), a
/// plugin registration directory with a live `dra.net-reg.sock`, and a requirements file.
pub(crate) struct DraNode {
    pub(crate) node: TestNode,
    dir: tempfile::TempDir,
    socket: Option<UnixListener>,
}

fn pci(i: usize) -> String {
    format!("0000:{:02x}:00.0", 0x1a + i * 0x10)
}

/// DraNet's device name for a PCI NIC (pkg/names: `pci-` and the address, `:`/`.` as `-`).
pub fn device_name(i: usize) -> String {
    format!("pci-{}", pci(i).replace([':', '.'], "-"))
}

impl DraNode {
    fn new(cp: &'static ControlPlane, name: &str, extra_config: &str) -> Self {
        Self::with(cp, name, json!({}), 3, extra_config)
    }

    /// A node with these extra labels, requiring `min_active_ports` of its four ports.
    pub(crate) fn with(
        cp: &'static ControlPlane,
        name: &str,
        labels: Value,
        min_active_ports: u32,
        extra_config: &str,
    ) -> Self {
        cp.create_node(
            name,
            labels,
            json!([{ "key": "fabricgate.io/unvalidated", "effect": "NoSchedule" }]),
            json!({}),
        );
        let dir = tempfile::tempdir().unwrap();
        write_node(
            dir.path(),
            Shape {
                ib_devices: 4,
                roce_devices: 0,
                ports_per_device: 1,
            },
            1,
        );
        std::fs::create_dir_all(dir.path().join("registry")).unwrap();
        let mut n = DraNode {
            node: TestNode {
                cp,
                name: name.to_owned(),
            },
            dir,
            socket: None,
        };
        n.plugin_up(true);
        std::fs::write(
            n.config(),
            format!(
                "rdma:\n  min_active_ports: {min_active_ports}\n  min_rate_gbps: 400\n  link_layer: InfiniBand\n\
                 node:\n  recover_after: 2\nkubernetes:\n  dra:\n    slice_grace: 3s\n    \
                 drivers: [{{name: {DRIVER}}}]\n    registry_dir: {}\n{extra_config}",
                n.dir.path().join("registry").display()
            ),
        )
        .unwrap();
        n
    }

    fn config(&self) -> PathBuf {
        self.dir.path().join("requirements.yaml")
    }

    /// The plugin's registration socket answers (`true`), or is left behind with nobody
    /// listening, as a killed plugin leaves it.
    fn plugin_up(&mut self, up: bool) {
        let path = self.dir.path().join("registry/dra.net-reg.sock");
        if up {
            let _ = std::fs::remove_file(&path);
            self.socket = Some(UnixListener::bind(&path).unwrap());
        } else {
            self.socket = None;
            assert!(path.exists(), "a killed plugin's socket file stays");
        }
    }

    pub(crate) fn port_state(&self, hca: usize, up: bool) {
        let dir = self.dir.path().join(format!(
            "sys/devices/pci0000:00/{}/infiniband/mlx5_{hca}/ports/1",
            pci(hca)
        ));
        let (state, phys) = if up {
            ("4: ACTIVE\n", "5: LinkUp\n")
        } else {
            ("1: DOWN\n", "3: Disabled\n")
        };
        for (file, text) in [("state", state), ("phys_state", phys)] {
            let tmp = dir.join(format!(".{file}.tmp"));
            std::fs::write(&tmp, text).unwrap();
            std::fs::rename(&tmp, dir.join(file)).unwrap();
        }
    }

    /// `mlx5_{hca}` leaves the host's RDMA view (exclusive RDMA netns mode: moved into a pod's
    /// namespace): its class entry is gone, as the host sees a device of another namespace.
    pub(crate) fn hide_hca(&self, hca: usize) {
        std::fs::remove_file(
            self.dir
                .path()
                .join(format!("sys/class/infiniband/mlx5_{hca}")),
        )
        .unwrap();
    }

    pub(crate) fn start_agent(&self, interval: &str) -> Agent {
        let kubeconfig = self.node.agent_kubeconfig(None);
        let config = self.config();
        let args = ["--interval", interval, "--config", config.to_str().unwrap()];
        Launch::at(
            &self.node.name,
            &self.dir.path().join("sys"),
            &self.dir.path().join("proc"),
            self.dir.path(),
        )
        .kubeconfig(Some(&kubeconfig))
        .args(&args)
        .start()
    }

    /// DraNet's slice for this node: one per node, pool = node name, a device per HCA with
    /// DraNet's attribute names (pkg/apis/attributes.go).
    pub(crate) fn publish_slice(&self, hcas: &[usize]) {
        let devices: Vec<Value> = hcas
            .iter()
            .map(|i| {
                json!({
                    "name": device_name(*i),
                    "attributes": {
                        "dra.net/rdma": { "bool": true },
                        "dra.net/rdmaDevice": { "string": format!("mlx5_{i}") },
                        "dra.net/pciAddress": { "string": pci(*i) },
                        "dra.net/ifName": { "string": format!("ibp{}s0", 0x1a + i * 0x10) },
                        "dra.net/numaNode": { "int": 0 },
                        "resource.kubernetes.io/pcieRoot": { "string": "pci0000:00" },
                    },
                })
            })
            .collect();
        let slice = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": { "name": self.slice_name() },
            "spec": {
                "driver": DRIVER, "nodeName": self.node.name,
                "pool": { "name": self.node.name, "generation": 1, "resourceSliceCount": 1 },
                "devices": devices,
            },
        });
        self.node.cp.apply(&slice.to_string());
    }

    fn slice_name(&self) -> String {
        format!("{}-{DRIVER}", self.node.name)
    }

    fn delete_slice(&self) {
        self.node.cp.kubectl(&[
            "delete",
            "resourceslice",
            &self.slice_name(),
            "--ignore-not-found",
        ]);
    }

    /// This node's DeviceTaintRules (by their pool), by device.
    pub(crate) fn rules(&self) -> Vec<Value> {
        rules(self.node.cp)
            .into_iter()
            .filter(|r| r["spec"]["deviceSelector"]["pool"] == self.node.name.as_str())
            .collect()
    }

    fn fabric_reason(&self) -> String {
        self.node
            .condition("FabricReady")
            .map(|c| c["reason"].as_str().unwrap_or_default().to_owned())
            .unwrap_or_default()
    }
}

fn rules(cp: &ControlPlane) -> Vec<Value> {
    cp.get_json("/apis/resource.k8s.io/v1/devicetaintrules")
        .and_then(|l| l["items"].as_array().cloned())
        .unwrap_or_default()
}

pub(crate) fn setup_claims(cp: &ControlPlane) {
    static ONCE: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        cp.create_namespace(NS);
        cp.serve_dra_net_claims();
    });
}

/// A ResourceClaim for `count` RDMA HCAs of `node`, and a pod that uses it there.
fn claim_pod(cp: &ControlPlane, name: &str, node: &str, count: u32) {
    cp.apply(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": { "name": name, "namespace": NS },
            "spec": { "devices": { "requests": [{ "name": "hca", "exactly": {
                "deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": count,
                "selectors": [{ "cel": { "expression": "device.attributes[\"dra.net\"].rdma == true" } }],
            }}]}},
        })
        .to_string(),
    );
    cp.apply(
        &json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name, "namespace": NS },
            "spec": {
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 0,
                "nodeSelector": { "kubernetes.io/hostname": node },
                "tolerations": [{ "key": "node.kubernetes.io/not-ready", "operator": "Exists" }],
                "resourceClaims": [{ "name": "hca", "resourceClaimName": name }],
                "containers": [{ "name": "worker", "image": "pytorch:test",
                                 "resources": { "claims": [{ "name": "hca" }] } }],
            },
        })
        .to_string(),
    );
}

pub(crate) fn allocated_devices(cp: &ControlPlane, claim: &str) -> Option<Vec<String>> {
    let c = cp.get_json(&format!(
        "/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/{claim}"
    ))?;
    let results = c["status"]["allocation"]["devices"]["results"].as_array()?;
    Some(
        results
            .iter()
            .filter_map(|r| r["device"].as_str().map(str::to_owned))
            .collect(),
    )
}

/// Delete the pods and their claims. Without kube-controller-manager nobody deallocates a
/// claim: its allocation and reservation are dropped here (as the resourceclaim controller
/// does once the pod is gone), so its devices are free for the next claim.
pub(crate) fn delete_pods(cp: &ControlPlane, names: &[&str]) {
    for n in names {
        cp.kubectl(&[
            "-n",
            NS,
            "delete",
            "pod",
            n,
            "--ignore-not-found",
            "--grace-period=0",
            "--force",
        ]);
        cp.release_claim(NS, n);
        cp.kubectl(&[
            "-n",
            NS,
            "delete",
            "resourceclaim",
            n,
            "--ignore-not-found",
            "--wait=false",
        ]);
    }
}

fn pod_events(cp: &ControlPlane, pod: &str) -> String {
    cp.kubectl(&[
        "-n",
        NS,
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.name={pod}"),
        "-o",
        "jsonpath={range .items[*]}{.message}{\"\\n\"}{end}",
    ])
}

#[test]
fn dra_a_bad_hca_gets_a_device_taint_rule_and_claims_are_allocated_around_it() {
    let Some(cp) = control_plane() else { return };
    setup_claims(cp);
    let n = DraNode::new(cp, "dra-taint", "");
    n.publish_slice(&[0, 1, 2, 3]);
    let agent = n.start_agent("500ms");
    agent.wait("validation", Duration::from_secs(60), || n.node.ready());
    assert!(n.rules().is_empty(), "{:?}", n.rules());

    // One HCA goes bad: a rule for exactly its device; the node (3 of 3 ports) stays validated.
    let down = Instant::now();
    n.port_state(3, false);
    wait_until("mlx5_3's DeviceTaintRule", Duration::from_secs(15), || {
        n.rules().len() == 1
    });
    eprintln!(
        "figure: port down -> DeviceTaintRule created: {:?} (probe interval 500ms)",
        down.elapsed()
    );
    let rule = &n.rules()[0];
    let selector = &rule["spec"]["deviceSelector"];
    assert_eq!(selector["driver"], DRIVER, "{rule}");
    assert_eq!(selector["pool"], n.node.name.as_str(), "{rule}");
    assert_eq!(selector["device"], device_name(3).as_str(), "{rule}");
    let taint = &rule["spec"]["taint"];
    assert_eq!(taint["key"], "fabricgate.io/unvalidated", "{rule}");
    assert_eq!(taint["value"], "PortDown", "{rule}");
    assert_eq!(taint["effect"], "NoSchedule", "{rule}");
    assert_eq!(
        rule["metadata"]["annotations"]["fabricgate.io/hca"],
        "mlx5_3"
    );
    assert_eq!(
        rule["metadata"]["name"],
        format!("fabricgate-{}-{}", n.node.name, device_name(3)).as_str()
    );
    assert!(
        n.node.ready(),
        "taint_scope device: the node itself stays validated"
    );

    // The scheduler: four HCAs wanted, three untainted: Pending, the taint named; one each:
    // every claim around mlx5_3.
    claim_pod(cp, "all-four", &n.node.name, 4);
    wait_until(
        "the scheduler's word on all-four",
        Duration::from_secs(30),
        || !pod_events(cp, "all-four").is_empty(),
    );
    let events = pod_events(cp, "all-four");
    assert!(allocated_devices(cp, "all-four").is_none(), "{events}");
    // kube-scheduler 1.37.2 does not name the taint: "0/1 nodes are available: 1 cannot
    // allocate all claims." (docs/dra.md); the rule is the cause, as its removal below shows.
    assert!(events.contains("cannot allocate all claims"), "{events}");
    delete_pods(cp, &["all-four"]);
    let singles = ["one-a", "one-b", "one-c"];
    for p in singles {
        claim_pod(cp, p, &n.node.name, 1);
    }
    let mut got = Vec::new();
    for p in singles {
        wait_until(&format!("{p} allocated"), Duration::from_secs(30), || {
            allocated_devices(cp, p).is_some()
        });
        got.extend(allocated_devices(cp, p).unwrap());
    }
    got.sort();
    assert_eq!(
        got,
        vec![device_name(0), device_name(1), device_name(2)],
        "every claim allocated around the tainted device"
    );
    delete_pods(cp, &singles);

    // Repaired: the rule goes after recover_after (2) good probes, not at once, and the claim
    // for all four is allocated.
    claim_pod(cp, "all-four-again", &n.node.name, 4);
    wait_until("all-four-again refused", Duration::from_secs(30), || {
        pod_events(cp, "all-four-again").contains("cannot allocate all claims")
    });
    let up = Instant::now();
    n.port_state(3, true);
    wait_until("the rule removed", Duration::from_secs(20), || {
        n.rules().is_empty()
    });
    let took = up.elapsed();
    // Two good probes, one interval (500 ms) apart; the first may have started just before
    // the port came up and still read it up, so the bound is the interval less a probe's
    // length, not the whole interval (at once would be a few ms).
    assert!(
        took >= Duration::from_millis(300),
        "removed after the hysteresis: {took:?}"
    );
    eprintln!(
        "figure: port up -> DeviceTaintRule removed: {took:?} (recover_after 2, interval 500ms)"
    );
    wait_until("all four allocated", Duration::from_secs(60), || {
        allocated_devices(cp, "all-four-again").is_some_and(|d| d.len() == 4)
    });
    eprintln!(
        "figure: port up -> the waiting 4-HCA claim allocated: {:?}",
        up.elapsed()
    );
    delete_pods(cp, &["all-four-again"]);
    drop(agent);
    n.delete_slice();
}

/// The agent holds a connection to the plugin's registration socket: a killed plugin is known
/// at once and probed, not at the next interval probe (20 s here; the shipped 10 s).
#[test]
fn dra_a_killed_plugin_is_probed_at_once_not_at_the_next_interval() {
    let Some(cp) = control_plane() else { return };
    let mut n = DraNode::new(cp, "dra-kick", "");
    n.publish_slice(&[0, 1, 2, 3]);
    let agent = n.start_agent("20s");
    // Validated at a probe (recover_after 2): the next interval probe is at least 18 s away.
    agent.wait("validation", Duration::from_secs(90), || n.node.ready());
    let killed = Instant::now();
    n.plugin_up(false);
    wait_until(
        "DraDriverUnavailable well before the next interval probe",
        Duration::from_secs(8),
        || n.node.has_our_taint() && n.fabric_reason() == "DraDriverUnavailable",
    );
    eprintln!(
        "figure: plugin socket dead -> DraDriverUnavailable at --interval 20s: {:?}",
        killed.elapsed()
    );
    drop(agent);
}

#[test]
fn dra_a_dead_driver_is_unavailable_and_a_kubelet_restart_is_held_back() {
    let Some(cp) = control_plane() else { return };
    let mut n = DraNode::new(cp, "dra-driver", "");
    n.publish_slice(&[0, 1, 2, 3]);
    let agent = n.start_agent("500ms");
    agent.wait("validation", Duration::from_secs(60), || n.node.ready());

    // The plugin killed: its socket stays, nobody answers: the node, at once.
    let killed = Instant::now();
    n.plugin_up(false);
    wait_until("DraDriverUnavailable", Duration::from_secs(15), || {
        n.node.has_our_taint() && n.fabric_reason() == "DraDriverUnavailable"
    });
    eprintln!(
        "figure: plugin socket dead -> DraDriverUnavailable: {:?}",
        killed.elapsed()
    );
    let message = n.node.condition("FabricReady").unwrap()["message"].clone();
    assert!(
        message.to_string().contains("refuses connections"),
        "{message}"
    );
    n.plugin_up(true);
    agent.wait("validated again", Duration::from_secs(30), || {
        n.node.ready()
    });

    // The kubelet restarts: every slice of the node deleted, then published again within
    // slice_grace (3 s): no taint.
    let mark = cp.audit_mark();
    n.delete_slice();
    std::thread::sleep(Duration::from_secs(1));
    n.publish_slice(&[0, 1, 2, 3]);
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        n.node.ready(),
        "a slice back within the grace taints nothing"
    );
    assert_eq!(n.node.taint_writes(mark), 0);

    // The slice gone for good: DraDriverUnavailable after the grace, not before.
    let gone = Instant::now();
    n.delete_slice();
    wait_until(
        "DraDriverUnavailable (no slice)",
        Duration::from_secs(20),
        || n.fabric_reason() == "DraDriverUnavailable",
    );
    let took = gone.elapsed();
    assert!(
        took >= Duration::from_secs(3),
        "held for slice_grace: {took:?}"
    );
    let message = n.node.condition("FabricReady").unwrap()["message"].clone();
    assert!(
        message.to_string().contains("publishes no ResourceSlice"),
        "{message}"
    );

    // An HCA missing from the slice is named.
    n.publish_slice(&[0, 1, 2]);
    wait_until("DraDeviceMissing", Duration::from_secs(20), || {
        n.fabric_reason() == "DraDeviceMissing"
    });
    let message = n.node.condition("FabricReady").unwrap()["message"].clone();
    assert!(
        message.to_string().contains("mlx5_3 (0000:4a:00.0)"),
        "{message}"
    );
    drop(agent);
    n.delete_slice();
}

#[test]
fn dra_rules_edited_or_deleted_by_hand_are_restored_and_stale_ones_removed_at_start() {
    let Some(cp) = control_plane() else { return };
    let n = DraNode::new(cp, "dra-drift", "    taint_effect: NoExecute\n");
    n.publish_slice(&[0, 1, 2, 3]);
    // A rule an earlier run left for a device that is healthy now.
    let stale = format!("fabricgate-{}-{}", n.node.name, device_name(0));
    cp.apply(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": { "name": stale, "labels": { "fabricgate.io/node": n.node.name } },
            "spec": {
                "deviceSelector": { "driver": DRIVER, "pool": n.node.name, "device": device_name(0) },
                "taint": { "key": "fabricgate.io/unvalidated", "value": "PortDown", "effect": "NoSchedule" },
            },
        })
        .to_string(),
    );
    n.port_state(2, false);
    let agent = n.start_agent("500ms");
    wait_until("only mlx5_2's rule", Duration::from_secs(30), || {
        let r = n.rules();
        r.len() == 1 && r[0]["spec"]["deviceSelector"]["device"] == device_name(2).as_str()
    });
    let name = n.rules()[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(n.rules()[0]["spec"]["taint"]["effect"], "NoExecute");

    // Edited by hand: put back.
    cp.kubectl(&[
        "patch",
        "devicetaintrule",
        &name,
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/spec/taint/value","value":"Fixed"}]"#,
    ]);
    wait_until("the value restored", Duration::from_secs(15), || {
        n.rules()
            .first()
            .is_some_and(|r| r["spec"]["taint"]["value"] == "PortDown")
    });
    // Deleted by hand: created again.
    cp.kubectl(&["delete", "devicetaintrule", &name]);
    wait_until("the rule re-created", Duration::from_secs(15), || {
        n.rules().len() == 1
    });
    // Steady state: no writes.
    std::thread::sleep(Duration::from_secs(2));
    let mark = cp.audit_mark();
    std::thread::sleep(Duration::from_secs(3));
    let writes = n.node.agent_writes(mark);
    assert!(writes.is_empty(), "steady state writes nothing: {writes:?}");
    drop(agent);
    n.port_state(2, true);
    cp.kubectl(&["delete", "devicetaintrule", &name, "--ignore-not-found"]);
    n.delete_slice();
}

/// As an agent's token (node-bound), admin or another account: create/delete a rule.
fn as_token(cp: &ControlPlane, kubeconfig: &Path, verb: &str, rule: &Value) -> (bool, String) {
    let (ok, out, err) = match verb {
        "create" => cp.kubectl_as(kubeconfig, &["create", "-f", "-"], Some(&rule.to_string())),
        "delete" => cp.kubectl_as(
            kubeconfig,
            &[
                "delete",
                "devicetaintrule",
                rule["metadata"]["name"].as_str().unwrap(),
            ],
            None,
        ),
        _ => cp.kubectl_as(
            kubeconfig,
            &[
                "patch",
                "devicetaintrule",
                rule["metadata"]["name"].as_str().unwrap(),
                "--type=merge",
                "-p",
                r#"{"spec":{"taint":{"value":"Changed"}}}"#,
            ],
            None,
        ),
    };
    (ok, format!("{out}{err}"))
}

fn rule_for(node: &str, device: &str) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
        "metadata": { "name": format!("fabricgate-{node}-{device}") },
        "spec": {
            "deviceSelector": { "driver": DRIVER, "pool": node, "device": device },
            "taint": { "key": "fabricgate.io/unvalidated", "value": "PortDown", "effect": "NoExecute" },
        },
    })
}

#[test]
fn redteam_an_agent_cannot_taint_or_untaint_another_nodes_devices() {
    let Some(cp) = control_plane() else { return };
    let a = TestNode::seeded(cp, "dra-sec-a");
    let b = TestNode::seeded(cp, "dra-sec-b");
    let a_config = a.agent_kubeconfig(None);
    // The policy is loaded once a forbidden write is refused.
    let theirs = rule_for(&b.name, "pci-0000-1a-00-0");
    wait_until("the policy loaded", Duration::from_secs(30), || {
        let (ok, _) = as_token(cp, &a_config, "create", &theirs);
        if ok {
            cp.kubectl(&[
                "delete",
                "devicetaintrule",
                theirs["metadata"]["name"].as_str().unwrap(),
            ]);
        }
        !ok
    });
    let (ok, out) = as_token(cp, &a_config, "create", &theirs);
    assert!(
        !ok && out.contains("only the DeviceTaintRules of its own devices"),
        "{out}"
    );

    // Its own device: allowed, and only named as its own.
    let mine = rule_for(&a.name, "pci-0000-1a-00-0");
    let (ok, out) = as_token(cp, &a_config, "create", &mine);
    assert!(ok, "its own device's rule: {out}");
    let mut misnamed = rule_for(&a.name, "pci-0000-2a-00-0");
    misnamed["metadata"]["name"] = json!("innocent-looking");
    let (ok, out) = as_token(cp, &a_config, "create", &misnamed);
    assert!(!ok && out.contains("names its DeviceTaintRules"), "{out}");
    let mut whole_pool = rule_for(&a.name, "x");
    whole_pool["spec"]["deviceSelector"]
        .as_object_mut()
        .unwrap()
        .remove("device");
    let (ok, out) = as_token(cp, &a_config, "create", &whole_pool);
    assert!(!ok && out.contains("names one device"), "{out}");

    // Another node's rule (made by an admin): neither changed nor deleted by A.
    cp.apply(&theirs.to_string());
    let (ok, out) = as_token(cp, &a_config, "patch", &theirs);
    assert!(!ok && out.contains("Forbidden"), "{out}");
    let (ok, out) = as_token(cp, &a_config, "delete", &theirs);
    assert!(!ok && out.contains("Forbidden"), "{out}");
    assert!(
        rules(cp)
            .iter()
            .any(|r| r["metadata"]["name"] == theirs["metadata"]["name"]),
        "B's rule is still there"
    );
    // Moving its own rule onto B's pool: refused too.
    let (ok, out, err) = cp.kubectl_as(
        &a_config,
        &[
            "patch",
            "devicetaintrule",
            mine["metadata"]["name"].as_str().unwrap(),
            "--type=merge",
            "-p",
            &format!(r#"{{"spec":{{"deviceSelector":{{"pool":"{}"}}}}}}"#, b.name),
        ],
        None,
    );
    assert!(!ok, "moved onto another pool: {out}{err}");

    // The guard's and the webhook's accounts may not write rules at all (RBAC).
    for account in ["fabricgate-guard", "fabricgate-webhook"] {
        let kubeconfig = service_account_kubeconfig(cp, account);
        let (ok, out) = as_token(
            cp,
            &kubeconfig,
            "create",
            &rule_for(&a.name, "pci-0000-3a-00-0"),
        );
        assert!(!ok && out.contains("forbidden"), "{account}: {out}");
        let (ok, out) = as_token(cp, &kubeconfig, "delete", &theirs);
        assert!(!ok && out.contains("forbidden"), "{account}: {out}");
    }
    for r in [&mine, &theirs] {
        cp.kubectl(&[
            "delete",
            "devicetaintrule",
            r["metadata"]["name"].as_str().unwrap(),
            "--ignore-not-found",
        ]);
    }
}

/// Node `dra-sq`'s agent squats node `dra-sq-a`'s rule name. The prefix form
/// (its pool, `dra-sq-a`'s device) and `fabricgate-fnv-` are refused; the exact form (its own
/// junk device `a-<device>`) is its own name and allowed, and `dra-sq-a`'s agent then names its
/// bad HCA's rule `fabricgate.<device>.dra-sq-a`, which no other node can take.
#[test]
fn redteam_a_squatted_rule_name_does_not_leave_a_bad_hca_untainted() {
    let Some(cp) = control_plane() else { return };
    let attacker = TestNode::seeded(cp, "dra-sq");
    let attacker_config = attacker.agent_kubeconfig(None);
    let victim = DraNode::new(cp, "dra-sq-a", "");
    let victim_name = format!("fabricgate-{}-{}", victim.node.name, device_name(1));
    let squat = |device: &str, name: &str| {
        let mut r = rule_for(&attacker.name, device);
        r["spec"]["taint"]["effect"] = json!("None");
        r["metadata"]["name"] = json!(name);
        r
    };
    wait_until("the policy loaded", Duration::from_secs(30), || {
        let probe = squat("pci-0000-ff-00-0", "innocent-looking");
        let (ok, _) = as_token(cp, &attacker_config, "create", &probe);
        if ok {
            cp.kubectl(&["delete", "devicetaintrule", "innocent-looking"]);
        }
        !ok
    });
    // Its own pool, the victim's device, under the victim's name: refused.
    let (ok, out) = as_token(
        cp,
        &attacker_config,
        "create",
        &squat(&device_name(1), &victim_name),
    );
    if ok {
        cp.kubectl(&["delete", "devicetaintrule", &victim_name]);
    }
    assert!(
        !ok && out.contains("names its DeviceTaintRules"),
        "prefix squat: {out}"
    );
    let fnv = "fabricgate-fnv-0123456789abcdef-0123456789abcdef";
    let (ok, out) = as_token(cp, &attacker_config, "create", &squat(&device_name(1), fnv));
    if ok {
        cp.kubectl(&["delete", "devicetaintrule", fnv]);
    }
    assert!(
        !ok && out.contains("names its DeviceTaintRules"),
        "fnv squat: {out}"
    );

    // The exact name of its own (junk) device, which is the victim's plain name: allowed.
    let junk = format!("a-{}", device_name(1));
    let (ok, out) = as_token(cp, &attacker_config, "create", &squat(&junk, &victim_name));
    assert!(ok, "the exact name of its own device: {out}");

    // The victim's mlx5_1 goes bad: its rule is written under the name no node can take.
    victim.publish_slice(&[0, 1, 2, 3]);
    victim.port_state(1, false);
    let agent = victim.start_agent("500ms");
    wait_until(
        "mlx5_1's rule under its other name",
        Duration::from_secs(30),
        || victim.rules().len() == 1,
    );
    let rule = &victim.rules()[0];
    assert_eq!(
        rule["metadata"]["name"],
        format!("fabricgate.{}.{}", device_name(1), victim.node.name).as_str(),
        "{rule}"
    );
    assert_eq!(
        rule["spec"]["deviceSelector"]["device"],
        device_name(1).as_str()
    );
    // The alternative name cannot be built by the attacker either.
    let alt = format!("fabricgate.{}.{}", device_name(2), victim.node.name);
    let (ok, out) = as_token(
        cp,
        &attacker_config,
        "create",
        &squat(&device_name(2), &alt),
    );
    assert!(
        !ok && out.contains("names its DeviceTaintRules"),
        "alt squat: {out}"
    );
    let log = agent.log();
    assert!(log.contains("holds this device's name"), "{log}");
    drop(agent);
    let alt1 = format!("fabricgate.{}.{}", device_name(1), victim.node.name);
    for name in [victim_name.as_str(), alt1.as_str(), alt.as_str()] {
        cp.kubectl(&["delete", "devicetaintrule", name, "--ignore-not-found"]);
    }
    victim.delete_slice();
}

/// A kubeconfig with a token of `account` in namespace fabricgate, with the RBAC the shipped
/// manifests give it (deploy/guard.yaml, deploy/webhook.yaml).
fn service_account_kubeconfig(cp: &ControlPlane, account: &str) -> PathBuf {
    let manifest = match account {
        "fabricgate-guard" => "deploy/guard.yaml",
        _ => "deploy/webhook.yaml",
    };
    let text = std::fs::read_to_string(crate::common::repo_root().join(manifest)).unwrap();
    let rbac: Vec<&str> = text
        .split("\n---")
        .filter(|d| {
            d.contains("\nkind: ServiceAccount")
                || d.contains("\nkind: ClusterRole")
                || d.contains("\nkind: Role")
                || d.contains("\nkind: RoleBinding")
                || d.contains("\nkind: ClusterRoleBinding")
                || d.contains("\nkind: Namespace")
        })
        .collect();
    cp.apply(&rbac.join("\n---"));
    let (ok, token, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            "fabricgate",
            "create",
            "token",
            account,
            "--duration=1h",
        ],
        None,
    );
    assert!(ok, "token for {account}: {err}");
    let path = cp.dir().join(format!("{account}-dra.kubeconfig"));
    cp.write_kubeconfig(&path, &cp.url, token.trim());
    path
}

/// A node with mlx5_1 down and its agent, talking to the API server through a fault proxy that
/// answers every DeviceTaintRule request with `code`.
fn refused_rules(
    cp: &'static ControlPlane,
    name: &str,
    code: u16,
) -> (crate::common::faultproxy::FaultProxy, DraNode, Agent) {
    let proxy = crate::common::faultproxy::FaultProxy::start(&cp.url, &cp.ca_file);
    proxy.set_fault_matching(
        crate::common::faultproxy::Fault::Status {
            code,
            retry_after: None,
            plain: false,
        },
        "devicetaintrules",
    );
    let n = DraNode::new(cp, name, "");
    n.publish_slice(&[0, 1, 2, 3]);
    n.port_state(1, false);
    let agent = agent_through(&n, &proxy);
    (proxy, n, agent)
}

/// `n`'s agent (interval 500 ms), talking to the API server through `proxy`.
fn agent_through(n: &DraNode, proxy: &crate::common::faultproxy::FaultProxy) -> Agent {
    let kubeconfig = n.node.agent_kubeconfig(Some(&proxy.url()));
    let config = n.config();
    Launch::at(
        &n.node.name,
        &n.dir.path().join("sys"),
        &n.dir.path().join("proc"),
        n.dir.path(),
    )
    .kubeconfig(Some(&kubeconfig))
    .args(&["--interval", "500ms", "--config", config.to_str().unwrap()])
    .known_addr()
    .start()
}

/// A device of the node in a pool not named after it (its rule would be
/// refused, 403) and a rule whose every write is refused (422) sort before a bad HCA's rule;
/// neither stops it. The foreign-pool device is skipped (`DraForeignPool`), never written.
#[test]
fn redteam_one_refused_or_foreign_pool_rule_does_not_stop_the_others() {
    let Some(cp) = control_plane() else { return };
    let proxy = crate::common::faultproxy::FaultProxy::start(&cp.url, &cp.ca_file);
    let n = DraNode::with(cp, "dra-fp", json!({}), 2, "");
    n.publish_slice(&[0, 1, 2, 3]);
    let foreign_slice = format!("{}-foreign", n.node.name);
    cp.apply(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": { "name": foreign_slice },
            "spec": {
                "driver": DRIVER, "nodeName": n.node.name,
                "pool": { "name": "dra-fp-other", "generation": 1, "resourceSliceCount": 1 },
                "devices": [{ "name": "aaa-0", "attributes": {
                    "dra.net/rdmaDevice": { "string": "mlx5_3" },
                }}],
            },
        })
        .to_string(),
    );
    // mlx5_0's rule exists with another value: the agent must change it, and every change of
    // it is refused.
    let refused = format!("fabricgate-{}-{}", n.node.name, device_name(0));
    cp.apply(
        &json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": { "name": refused, "labels": { "fabricgate.io/node": n.node.name } },
            "spec": {
                "deviceSelector": { "driver": DRIVER, "pool": n.node.name, "device": device_name(0) },
                "taint": { "key": "fabricgate.io/unvalidated", "value": "Old", "effect": "NoSchedule" },
            },
        })
        .to_string(),
    );
    proxy.set_fault_matching(
        crate::common::faultproxy::Fault::Status {
            code: 422,
            retry_after: None,
            plain: false,
        },
        &format!("devicetaintrules/{refused}"),
    );
    n.port_state(0, false);
    n.port_state(3, false);
    let agent = agent_through(&n, &proxy);
    wait_until("mlx5_3's rule", Duration::from_secs(30), || {
        n.rules()
            .iter()
            .any(|r| r["spec"]["deviceSelector"]["device"] == device_name(3).as_str())
    });
    std::thread::sleep(Duration::from_secs(1));
    let all = rules(cp);
    assert!(
        !all.iter()
            .any(|r| r["spec"]["deviceSelector"]["pool"] == "dra-fp-other"),
        "no rule for the foreign pool: {all:?}"
    );
    let log = agent.log();
    assert!(
        log.contains(&refused) && log.contains("422"),
        "the refusal named: {log}"
    );
    drop(agent);
    proxy.clear_fault();
    cp.kubectl(&["delete", "devicetaintrule", &refused, "--ignore-not-found"]);
    for r in n.rules() {
        cp.kubectl(&[
            "delete",
            "devicetaintrule",
            r["metadata"]["name"].as_str().unwrap(),
            "--ignore-not-found",
        ]);
    }
    cp.kubectl(&[
        "delete",
        "resourceslice",
        &foreign_slice,
        "--ignore-not-found",
    ]);
    n.delete_slice();
}

#[test]
fn dra_an_api_server_without_device_taint_rules_turns_the_device_path_off_once() {
    let Some(cp) = control_plane() else { return };
    // Every DeviceTaintRule request answered 404, as a 1.36 server does.
    let (proxy, n, agent) = refused_rules(cp, "dra-old", 404);
    // The node path works: 3 of 4 ports meet min_active_ports 3.
    agent.wait("validation", Duration::from_secs(60), || n.node.ready());
    std::thread::sleep(Duration::from_secs(3));
    let log = agent.log();
    assert_eq!(
        log.matches("does not serve resource.k8s.io/v1 DeviceTaintRules")
            .count(),
        1,
        "one warning: {log}"
    );
    let asked = proxy
        .seen()
        .iter()
        .filter(|s| s.path.contains("devicetaintrules"))
        .count();
    assert!(
        asked <= 2,
        "no retry loop against the missing API: {asked} requests"
    );
    assert!(!log.contains("AgentError"), "{log}");
    assert!(n.rules().is_empty());
    drop(agent);
    n.delete_slice();
}

/// `fabricgate_dra_device_rules_writable` as the agent's /metrics shows it.
fn rules_writable(agent: &Agent) -> Option<String> {
    let (_, body) = agent.get("/metrics")?;
    body.lines()
        .find(|l| l.starts_with("fabricgate_dra_device_rules_writable "))
        .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
}

/// Every create of a DeviceTaintRule refused by 422 (a webhook or a policy):
/// the bad HCA is not protected, so the metric says 0 and the Node is tainted with a reason
/// saying so; once the writes pass, the rule is written and the node validated again.
#[test]
fn redteam_a_rule_write_refused_by_422_is_not_invisible() {
    let Some(cp) = control_plane() else { return };
    let proxy = crate::common::faultproxy::FaultProxy::start(&cp.url, &cp.ca_file);
    proxy.set_fault_matching(
        crate::common::faultproxy::Fault::Status {
            code: 422,
            retry_after: None,
            plain: false,
        },
        // Creates only (`?&fieldManager=`): the list and watch pass.
        "devicetaintrules?&fieldManager",
    );
    let n = DraNode::new(cp, "dra-422", "");
    n.publish_slice(&[0, 1, 2, 3]);
    n.port_state(1, false);
    let agent = agent_through(&n, &proxy);
    agent.wait(
        "the refusal on the Node and in the metric",
        Duration::from_secs(60),
        || {
            n.fabric_reason() == "DraDeviceRulesRefused"
                && rules_writable(&agent).as_deref() == Some("0")
        },
    );
    assert!(n.node.has_our_taint(), "the Node is tainted instead");
    let message = n.node.condition("FabricReady").unwrap()["message"].clone();
    let message = message.as_str().unwrap_or_default();
    assert!(
        message.contains("mlx5_1") && message.contains("422") && message.contains("not protecting"),
        "{message}"
    );
    assert!(n.rules().is_empty());

    proxy.clear_fault();
    agent.wait(
        "the rule written, validated again",
        Duration::from_secs(60),
        || n.rules().len() == 1 && n.node.ready() && rules_writable(&agent).as_deref() == Some("1"),
    );
    drop(agent);
    for r in n.rules() {
        cp.kubectl(&[
            "delete",
            "devicetaintrule",
            r["metadata"]["name"].as_str().unwrap(),
            "--ignore-not-found",
        ]);
    }
    n.delete_slice();
}

/// An API server that refuses the agent's DeviceTaintRules (403: RBAC missing; a fault proxy
/// in front of the real one answers them so): one warning naming the grant, retries with
/// backoff instead of a loop, no `AgentError`; the bad HCA's rule cannot be written, so the
/// Node is tainted instead (`DraDeviceRulesRefused`); allowed again, the bad HCA
/// gets its rule and the node is validated.
#[test]
fn dra_an_agent_refused_device_taint_rules_warns_once_backs_off_and_recovers() {
    let Some(cp) = control_plane() else { return };
    let (proxy, n, agent) = refused_rules(cp, "dra-refused", 403);
    agent.wait("the refusal on the Node", Duration::from_secs(60), || {
        n.fabric_reason() == "DraDeviceRulesRefused"
    });
    std::thread::sleep(Duration::from_secs(4));
    let log = agent.log();
    assert_eq!(
        log.matches("the agent may not list DeviceTaintRules")
            .count(),
        1,
        "one warning naming the grant: {log}"
    );
    let asked = proxy
        .seen()
        .iter()
        .filter(|s| s.path.contains("devicetaintrules"))
        .count();
    // 200 ms doubling: a handful in these seconds, not a loop at the probe's pace or faster.
    assert!(asked <= 8, "backs off: {asked} requests");
    assert!(!log.contains("AgentError"), "{log}");
    assert!(n.rules().is_empty());
    assert!(
        n.node.has_our_taint() && n.fabric_reason() == "DraDeviceRulesRefused",
        "the unprotected HCA taints the Node"
    );

    proxy.clear_fault();
    wait_until(
        "mlx5_1's rule once the grant is back",
        Duration::from_secs(30),
        || n.rules().len() == 1,
    );
    agent.wait("validated again", Duration::from_secs(30), || {
        n.node.ready()
    });
    drop(agent);
    n.delete_slice();
}

/// In RDMA netns mode `exclusive` a DRA driver moves an allocated HCA into the
/// pod's network namespace, and the node's sysfs no longer lists it. With the DRA overlay's
/// own grants (its pods watch, `resourceclaims get`; runtime transport off) the agent reads
/// the claims of its node's pods: the HCA a claim holds is in use, not missing — the node stays
/// validated on the other three ports. Released (the pod and claim gone), the same absence is
/// a lost port: tainted.
#[test]
fn dra_an_hca_moved_into_its_claims_pod_is_in_use_not_a_lost_port() {
    let Some(cp) = control_plane() else { return };
    setup_claims(cp);
    let _widened = crate::common::controlplane::WidenedRbac::apply_dra_claims(cp);
    let n = DraNode::with(cp, "dra-inuse", json!({}), 4, "");
    n.publish_slice(&[0, 1, 2, 3]);
    let agent = n.start_agent("500ms");
    agent.wait("validation on 4 of 4", Duration::from_secs(60), || {
        n.node.ready()
    });

    claim_pod(cp, "inuse-0", &n.node.name, 1);
    wait_until("inuse-0 allocated", Duration::from_secs(30), || {
        allocated_devices(cp, "inuse-0").is_some()
    });
    let device = allocated_devices(cp, "inuse-0").unwrap().remove(0);
    let hca = (0..4).find(|i| device_name(*i) == device).unwrap();
    // The driver moves it: gone from the host's /sys/class/infiniband.
    let moved = Instant::now();
    n.hide_hca(hca);
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        n.node.ready() && !n.node.has_our_taint(),
        "an HCA in use by its claim's pod is no lost port: {:?}",
        n.node.condition("RDMAReady")
    );
    assert_eq!(
        n.node.label("fabricgate.io/rdma.active-ports").as_deref(),
        Some("3")
    );
    assert!(n.rules().is_empty(), "in use is not bad: {:?}", n.rules());

    // The pod and its claim gone, the HCA still absent: 3 of 4 ports, not validated.
    delete_pods(cp, &["inuse-0"]);
    wait_until("the lost port tainted", Duration::from_secs(20), || {
        n.node.has_our_taint()
    });
    eprintln!(
        "figure: claim released with its HCA still away -> tainted {:?} after the move",
        moved.elapsed()
    );
    drop(agent);
    n.delete_slice();
}
