//! DRA on the real node: the test control plane's `draplugin` (a kubelet plugin on Kubernetes'
//! own `k8s.io/dynamic-resource-allocation/kubeletplugin`, `tests/controlplane/draplugin.go`)
//! publishing the fixture node's HCAs in DraNet's format (driver `dra.net`), the DeviceClass,
//! and the building blocks of the DRA scenarios: the slice and its devices, claim templates and
//! pods, `DeviceTaintRule`s, and the kubelet's slice wipes read from the audit log.

use super::harness::{RealNode, binary, wait_for};
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// DraNet's driver name (and the DeviceClass selecting it).
pub const DRIVER: &str = "dra.net";
/// The harness's name for the plugin process (`RealNode::signal`, `restart`).
pub const PLUGIN: &str = "draplugin";
/// The fixture whose sysfs tree the plugin publishes (the agent's too).
pub const FIXTURE: &str = "ndr-8x400-healthy";
/// The kubelet deletes a driver's slices this long after its last plugin disconnected
/// (`defaultWipingDelay`, pkg/kubelet/cm/dra/manager.go).
pub const WIPING_DELAY: Duration = Duration::from_secs(30);
/// The namespace of the DRA scenarios' pods and claims.
pub const NS: &str = "dra";

pub const DEVICE_CLASS: &str = r#"apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata:
  name: dra.net
spec:
  selectors:
  - cel:
      expression: device.driver == "dra.net"
"#;

/// The fixture's sysfs tree.
pub fn fixture_sys() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(FIXTURE)
        .join("sys")
}

/// One HCA of the fixture, as sysfs shows it: what the slice must carry.
#[derive(Debug, Clone)]
pub struct Hca {
    pub name: String,
    pub pci_address: String,
    /// `pci0000:0f`: the first directory under `devices/`.
    pub pcie_root: String,
    pub numa_node: Option<i64>,
    pub netdev: Option<String>,
    /// Port 1's link layer: `InfiniBand` (compute) or `Ethernet` (RoCE storage).
    pub link_layer: String,
}

impl Hca {
    /// DraNet's device name: `pci-` + the address with `:` and `.` as `-`.
    pub fn device_name(&self) -> String {
        format!("pci-{}", self.pci_address.replace([':', '.'], "-"))
    }
}

fn read_trimmed(p: PathBuf) -> Option<String> {
    std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned())
}

/// The HCAs of the fixture (`class/infiniband/*`), sorted by name.
pub fn fixture_hcas() -> Vec<Hca> {
    let sys = fixture_sys();
    let mut out = Vec::new();
    for e in std::fs::read_dir(sys.join("class/infiniband"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        // ../../devices/pci0000:0f/0000:10:01.0/0000:18:00.0/infiniband/mlx5_0
        let parts: Vec<String> = target
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .filter(|c| c != "..")
            .collect();
        let (Some(pci), Some(root)) = (parts.iter().rev().nth(2), parts.get(1)) else {
            continue;
        };
        let pci_dir = sys.join(parts[..parts.len() - 2].join("/"));
        let netdev = std::fs::read_dir(pci_dir.join("net"))
            .ok()
            .and_then(|mut d| d.next())
            .and_then(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned());
        out.push(Hca {
            pci_address: pci.clone(),
            pcie_root: root.clone(),
            numa_node: read_trimmed(pci_dir.join("numa_node"))
                .and_then(|s| s.parse().ok())
                .filter(|n: &i64| *n >= 0),
            netdev,
            link_layer: read_trimmed(pci_dir.join(format!("infiniband/{name}/ports/1/link_layer")))
                .unwrap_or_default(),
            name,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The fixture's InfiniBand (compute) HCAs' names: `mlx5_0`..`mlx5_7`.
pub fn compute_hcas() -> Vec<String> {
    fixture_hcas()
        .into_iter()
        .filter(|h| h.link_layer == "InfiniBand")
        .map(|h| h.name)
        .collect()
}

impl RealNode {
    /// Starts the DRA plugin (`draplugin`, driver `dra.net`) on the fixture's sysfs tree, once
    /// the kubelet's start-up wipe of the node's slices is in the audit log (a slice published
    /// before it would be deleted, and republished only after the library's 30 s sync delay).
    pub fn start_dra_plugin(&self) -> Result<(), String> {
        wait_for(
            "the kubelet's start-up wipe of ResourceSlices",
            Duration::from_secs(60),
            || !kubelet_wipes(self, 0).is_empty(),
        )?;
        let d = self.dir.display().to_string();
        self.spawn(
            PLUGIN,
            &binary(),
            &[
                "draplugin".into(),
                format!("--driver={DRIVER}"),
                format!("--node-name={}", self.name),
                format!("--kubeconfig={d}/admin.kubeconfig"),
                "--kubelet-root=/var/lib/kubelet".into(),
                format!("--sysfs-root={}", fixture_sys().display()),
            ],
        )
    }

    /// The DRA side of the node: the DeviceClass `dra.net`, the plugin, its slice.
    pub fn bring_up_dra(&self) -> Result<(), String> {
        self.apply(DEVICE_CLASS)?;
        self.start_dra_plugin()?;
        wait_slice(self, Duration::from_secs(60)).map_err(|e| {
            format!(
                "{e}\n{}",
                super::harness::tail(&self.logs.join("draplugin.log"), 20)
            )
        })?;
        Ok(())
    }
}

/// The `dra.net` ResourceSlices of the node.
pub fn slices(node: &RealNode) -> Vec<Value> {
    node.get_json(&[
        "resourceslices",
        &format!(
            "--field-selector=spec.nodeName={},spec.driver={DRIVER}",
            node.name
        ),
    ])
    .and_then(|l| l["items"].as_array().cloned())
    .unwrap_or_default()
}

/// Waits for the node's one `dra.net` slice with every fixture HCA in it; returns it.
pub fn wait_slice(node: &RealNode, limit: Duration) -> Result<Value, String> {
    let want = fixture_hcas().len();
    let mut last = Vec::new();
    wait_for("the dra.net ResourceSlice", limit, || {
        last = slices(node);
        last.len() == 1 && devices(&last[0]).len() == want
    })
    .map_err(|e| format!("{e}: {} slices: {last:?}", last.len()))?;
    Ok(last.remove(0))
}

/// Waits until the node has no `dra.net` slice; the time it took.
pub fn wait_no_slice(node: &RealNode, limit: Duration) -> Result<Duration, String> {
    wait_for("no dra.net ResourceSlice", limit, || {
        node.get_json(&["resourceslices"]).is_some() && slices(node).is_empty()
    })
}

pub fn devices(slice: &Value) -> Vec<Value> {
    slice
        .pointer("/spec/devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

/// A device's attribute as the API shows it (`{"string": ..}`, `{"int": ..}`, `{"bool": ..}`).
pub fn attr<'a>(device: &'a Value, name: &str) -> Option<&'a Value> {
    device.get("attributes")?.get(name)
}

/// The name of the slice's device whose `dra.net/rdmaDevice` is `rdma_device` (`mlx5_3`).
pub fn hca_device_name(slice: &Value, rdma_device: &str) -> Option<String> {
    devices(slice)
        .into_iter()
        .find(|d| {
            attr(d, "dra.net/rdmaDevice").and_then(|a| a["string"].as_str()) == Some(rdma_device)
        })
        .and_then(|d| d["name"].as_str().map(str::to_owned))
}

/// The slice's pool name.
pub fn pool(slice: &Value) -> String {
    slice
        .pointer("/spec/pool/name")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// A CEL expression matching the HCAs named (by `dra.net/rdmaDevice`).
pub fn rdma_devices_cel(names: &[String]) -> String {
    let list: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    format!(
        "device.attributes['dra.net'].rdma == true && device.attributes['dra.net'].rdmaDevice in [{}]",
        list.join(", ")
    )
}

/// The namespace `NS` and a ResourceClaimTemplate `name` asking for `count` devices of class
/// `dra.net` that match `cel`.
pub fn claim_template(name: &str, count: usize, cel: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {NS}\n---\n\
         apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata:\n  name: {name}\n  namespace: {NS}\n\
         spec:\n  spec:\n    devices:\n      requests:\n      - name: hca\n        exactly:\n          \
         deviceClassName: {DRIVER}\n          count: {count}\n          selectors:\n          - cel:\n              \
         expression: \"{cel}\"\n"
    )
}

/// A pod in `NS` (Debian, `sleep`) with one claim `hca` from the template `template`.
pub fn claim_pod(name: &str, template: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {NS}\n  labels:\n    app: dra-test\n\
         spec:\n  terminationGracePeriodSeconds: 1\n  restartPolicy: Never\n  resourceClaims:\n  - name: hca\n    \
         resourceClaimTemplateName: {template}\n  containers:\n  - name: c\n    image: localhost/debian:bookworm\n    \
         imagePullPolicy: Never\n    command: [sleep, \"3600\"]\n    resources:\n      claims:\n      - name: hca\n"
    )
}

pub fn pod(node: &RealNode, name: &str) -> Option<Value> {
    node.get_json(&["pod", name, "-n", NS])
}

pub fn pod_phase(node: &RealNode, name: &str) -> String {
    pod(node, name)
        .and_then(|p| {
            p.pointer("/status/phase")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .unwrap_or_default()
}

/// Waits for the pod Running; the time it took.
pub fn wait_running(node: &RealNode, name: &str, limit: Duration) -> Result<Duration, String> {
    wait_for(&format!("pod {NS}/{name} Running"), limit, || {
        pod_phase(node, name) == "Running"
    })
    .map_err(|e| format!("{e}: {}", pod_events(node, name).join("; ")))
}

/// `count` pods `PREFIX-i`, one claim each from the template `template`, all Running (each
/// within `limit`): the devices allocated to them and how long that took.
pub fn run_claim_pods(
    node: &RealNode,
    prefix: &str,
    count: usize,
    template: &str,
    limit: Duration,
) -> Result<(Vec<String>, Duration), String> {
    let pods: Vec<String> = (0..count).map(|i| format!("{prefix}-{i}")).collect();
    let t = Instant::now();
    for p in &pods {
        node.apply(&claim_pod(p, template))?;
    }
    for p in &pods {
        wait_running(node, p, limit)?;
    }
    let took = t.elapsed();
    Ok((
        pods.iter()
            .flat_map(|p| allocated_devices(node, p))
            .collect(),
        took,
    ))
}

/// With the device `tainted` (`pool/device`) under a rule: seven one-HCA claims (pods
/// `PREFIX-i`) are allocated around it, then deleted, and the pod `dra-all`, claiming all eight
/// compute HCAs, is refused by the scheduler and left Pending. Its events, oldest first.
pub fn claims_go_around(
    node: &RealNode,
    prefix: &str,
    tainted: &str,
    limit: Duration,
) -> Result<Vec<String>, String> {
    let cel = rdma_devices_cel(&compute_hcas());
    node.apply(&claim_template("one-hca", 1, &cel))?;
    let (got, took) = run_claim_pods(node, prefix, 7, "one-hca", limit)?;
    println!("figure: a rule on {tainted}: 7 one-HCA claims Running {took:?} on {got:?}");
    if got.len() != 7 || got.iter().any(|d| d == tainted) {
        return Err(format!(
            "allocated {got:?}: want 7 devices, not the tainted {tainted}"
        ));
    }
    delete_pods(node)?;
    node.apply(&claim_template("all-compute", 8, &cel))?;
    node.apply(&claim_pod("dra-all", "all-compute"))?;
    let mut events = Vec::new();
    wait_for(
        "the all-HCA pod's FailedScheduling",
        Duration::from_secs(60),
        || {
            events = pod_events(node, "dra-all");
            events.iter().any(|e| e.starts_with("FailedScheduling"))
        },
    )
    .map_err(|e| format!("{e}: {events:?}"))?;
    let p = pod(node, "dra-all").ok_or("no dra-all pod")?;
    if !p["spec"]["nodeName"].is_null() {
        return Err(format!(
            "the all-HCA pod was scheduled past the rule: {}",
            p["status"]
        ));
    }
    Ok(events)
}

/// The devices (`pool/device`) allocated to the pod's claims.
pub fn allocated_devices(node: &RealNode, pod_name: &str) -> Vec<String> {
    let Some(p) = pod(node, pod_name) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for s in p
        .pointer("/status/resourceClaimStatuses")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let Some(claim) = s["resourceClaimName"].as_str() else {
            continue;
        };
        let Some(c) = node.get_json(&["resourceclaim", claim, "-n", NS]) else {
            continue;
        };
        for r in c
            .pointer("/status/allocation/devices/results")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.push(format!(
                "{}/{}",
                r["pool"].as_str().unwrap_or(""),
                r["device"].as_str().unwrap_or("")
            ));
        }
    }
    out
}

/// The pod's events, `reason: message`, oldest first.
pub fn pod_events(node: &RealNode, name: &str) -> Vec<String> {
    node.get_json(&[
        "events",
        "-n",
        NS,
        &format!("--field-selector=involvedObject.name={name}"),
    ])
    .and_then(|l| l["items"].as_array().cloned())
    .unwrap_or_default()
    .iter()
    .map(|e| {
        format!(
            "{}: {}",
            e["reason"].as_str().unwrap_or(""),
            e["message"].as_str().unwrap_or("")
        )
    })
    .collect()
}

/// Deletes the DRA test pods and waits until they and their claims are gone.
pub fn delete_pods(node: &RealNode) -> Result<(), String> {
    node.kubectl(&[
        "delete",
        "pods",
        "-n",
        NS,
        "-l",
        "app=dra-test",
        "--ignore-not-found",
        "--wait=false",
    ])?;
    wait_for(
        "the DRA test pods and claims gone",
        Duration::from_secs(120),
        || {
            let empty = |kind: &str| {
                node.get_json(&[kind, "-n", NS])
                    .is_some_and(|l| l["items"].as_array().is_none_or(Vec::is_empty))
            };
            empty("pods") && empty("resourceclaims")
        },
    )
    .map(|_| ())
}

/// A `DeviceTaintRule` `name` on one device of the `dra.net` pool `pool`.
pub fn device_taint_rule(name: &str, pool: &str, device: &str, key: &str, effect: &str) -> String {
    format!(
        "apiVersion: resource.k8s.io/v1\nkind: DeviceTaintRule\nmetadata:\n  name: {name}\nspec:\n  \
         deviceSelector:\n    driver: {DRIVER}\n    pool: {pool}\n    device: {device}\n  taint:\n    \
         key: {key}\n    value: test\n    effect: {effect}\n"
    )
}

/// The kubelet's deletions of `dra.net`-or-all slices of this node in the audit log after byte
/// `mark`: (stage timestamp, request URI).
pub fn kubelet_wipes(node: &RealNode, mark: u64) -> Vec<(String, String)> {
    let user = format!("system:node:{}", node.name);
    node.audit_events(mark)
        .into_iter()
        .filter(|e| {
            e["user"]["username"] == user.as_str()
                && e["verb"] == "deletecollection"
                && e["objectRef"]["resource"] == "resourceslices"
                && e["responseStatus"]["code"]
                    .as_i64()
                    .is_some_and(|c| c < 300)
        })
        .map(|e| {
            (
                e["stageTimestamp"].as_str().unwrap_or("").to_owned(),
                e["requestURI"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// The audit log's length: a mark for [`kubelet_wipes`].
pub fn audit_mark(node: &RealNode) -> u64 {
    node.audit_mark()
}

/// Whether kube-controller-manager's log says it started the DRA controller `controller`
/// (`resourceclaim-controller`, `device-taint-eviction-controller`: their own start lines,
/// KCM's "Started controller" is below its default verbosity).
pub fn controller_started(node: &RealNode, controller: &str) -> bool {
    let needle = match controller {
        "resourceclaim-controller" => "\"Starting resource claim controller\"".to_owned(),
        other => format!("\"Starting\" controller=\"{other}\""),
    };
    std::fs::read_to_string(node.logs.join("controller-manager.log"))
        .unwrap_or_default()
        .contains(&needle)
}

/// Whether the driver's registration socket is in the kubelet's plugin registry
/// (`/var/lib/kubelet` is the run directory's `kubelet/`).
pub fn registration_socket_exists(node: &RealNode) -> bool {
    node.dir
        .join(format!("kubelet/plugins_registry/{DRIVER}-reg.sock"))
        .exists()
}

/// Seconds since `t`, for `figure:` lines.
pub fn secs(t: Instant) -> String {
    format!("{:.1} s", t.elapsed().as_secs_f64())
}
