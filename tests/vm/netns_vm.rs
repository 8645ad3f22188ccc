//! What the kernel does with an RDMA device and network namespaces (docs/dra.md, "Exclusive
//! RDMA network namespaces"): the Soft-RoCE VM runs tests/vm/capture-netns.sh and these tests
//! hold the kernel to what that section says, in the shared mode (the default) and in the
//! exclusive mode a DRA driver uses to hand an HCA to a pod — and show what the agent itself
//! (`fabricgate check`) makes of a namespace whose HCA lives elsewhere.
//!
//! Outside CI the test skips, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use crate::common;

use fabricgate_probes::transport::restrack::{parse_device_dump, parse_port_dump};
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn boot() -> &'static Result<PathBuf, String> {
    static BOOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BOOT.get_or_init(|| {
        let req = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vm/rxe-requirements.yaml");
        common::run_vm_once(
            "run.sh",
            240,
            "netns-vm",
            "capture-netns.sh",
            &[("FG_REQ", OsStr::new(req.as_os_str()))],
            "console.log, stderr and netns/steps.txt",
        )
    })
}

/// One step of the capture: its output and exit status.
struct Step {
    output: String,
    rc: i32,
}

/// The steps of `netns/steps.txt` (`### NAME: CMD`, the output, `### rc N`) by name.
fn steps(dir: &Path) -> BTreeMap<String, Step> {
    let text = std::fs::read_to_string(dir.join("netns/steps.txt")).unwrap();
    let mut out = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    for line in text.lines() {
        if let Some(rc) = line.strip_prefix("### rc ") {
            let (name, output) = current.take().unwrap();
            out.insert(
                name,
                Step {
                    output,
                    rc: rc.parse().unwrap(),
                },
            );
        } else if let Some(head) = line.strip_prefix("### ")
            && let Some((name, _cmd)) = head.split_once(": ")
            && current.is_none()
        {
            current = Some((name.to_owned(), String::new()));
        } else if let Some((_, output)) = current.as_mut() {
            output.push_str(line);
            output.push('\n');
        }
    }
    out
}

fn step<'a>(all: &'a BTreeMap<String, Step>, name: &str) -> &'a Step {
    all.get(name)
        .unwrap_or_else(|| panic!("no step {name} in steps.txt"))
}

/// The datagrams `capture_rdma_restrack.py` wrote as `devices-NN.bin` in `dir`, in order.
fn device_dump(dir: &Path) -> Vec<String> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("devices-") && n.ends_with(".bin"))
        .collect();
    names.sort();
    let datagrams: Vec<Vec<u8>> = names
        .iter()
        .map(|n| std::fs::read(dir.join(n)).unwrap())
        .collect();
    parse_device_dump(&datagrams)
        .unwrap()
        .into_iter()
        .map(|d| d.name)
        .collect()
}

fn class_entries(tree: &Path, class: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(tree.join("sys/class").join(class))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".keep")
        .collect();
    names.sort();
    names
}

#[test]
fn shared_mode_shows_the_device_everywhere_and_refuses_to_move_it() {
    let Some(out) = common::vm_results(boot()) else {
        return;
    };
    let s = steps(out);
    assert!(step(&s, "mode-initial").output.contains("netns shared"));
    // A namespace sees the device (sysfs and netlink), though its netdev stays behind.
    assert!(step(&s, "shared-ns-sys").output.contains("rxe0 ->"));
    assert!(step(&s, "shared-ns-rdma-dev").output.contains("rxe0"));
    let link = &step(&s, "shared-ns-rdma-link").output;
    assert!(
        link.contains("state ACTIVE") && !link.contains("netdev"),
        "{link}"
    );
    let moved = step(&s, "shared-move");
    assert_eq!(moved.rc, 1);
    assert!(moved.output.contains("Operation not supported"));
    // The mode changes only while no other network namespace exists.
    let busy = step(&s, "shared-set-exclusive-with-netns");
    assert_eq!(busy.rc, 1);
    assert!(busy.output.contains("Device or resource busy"));
    assert_eq!(step(&s, "exclusive-set").rc, 0);
    assert!(
        step(&s, "mode-exclusive")
            .output
            .contains("netns exclusive")
    );
}

#[test]
fn exclusive_mode_hides_the_device_from_other_namespaces() {
    let Some(out) = common::vm_results(boot()) else {
        return;
    };
    let s = steps(out);
    let dir = out.join("netns");
    // The device's own namespace (the host's): sysfs, netlink and verbs show it.
    assert!(step(&s, "excl-host-rdma-dev").output.contains("rxe0"));
    assert_eq!(device_dump(&dir.join("excl-host")), ["rxe0"]);
    assert_eq!(
        class_entries(&dir.join("tree-host"), "infiniband"),
        ["rxe0"]
    );
    assert!(step(&s, "excl-host-ibv").output.contains("rxe0"));
    // Another namespace, with its own sysfs mount: nothing in class/infiniband, nothing over
    // RDMA netlink, nothing for libibverbs — but class/infiniband_verbs is not namespaced:
    // uverbs0 is still listed.
    assert!(class_entries(&dir.join("tree-ns"), "infiniband").is_empty());
    assert_eq!(
        class_entries(&dir.join("tree-ns"), "infiniband_verbs"),
        ["abi_version", "uverbs0"]
    );
    assert!(device_dump(&dir.join("excl-ns")).is_empty());
    assert_eq!(step(&s, "excl-ns-rdma-dev").output, "");
    assert!(!step(&s, "excl-ns-ibv").output.contains("rxe0"));
    // Entering only the network namespace keeps the sysfs mounted in the host's: it still
    // shows the host's devices. Looking inside a namespace takes a sysfs mounted there (a
    // mount namespace) or RDMA netlink from a socket opened there.
    assert_eq!(step(&s, "excl-ns-nsenter-sys").output, "rxe0\n");
    // The agent in that namespace: no RDMA device at all.
    let check: serde_json::Value = serde_json::from_str(&step(&s, "excl-ns-check").output).unwrap();
    assert_eq!(check["rdma"]["devices"], serde_json::json!([]));
    assert_eq!(check["conditions"][1]["reason"], "NoRDMADevices");
    let host: serde_json::Value =
        serde_json::from_str(&step(&s, "excl-host-check").output).unwrap();
    assert_eq!(host["rdma"]["usable_ports"], 1, "{host:#}");
}

#[test]
fn rxe_cannot_be_moved_and_vanishes_with_its_netdev() {
    let Some(out) = common::vm_results(boot()) else {
        return;
    };
    let s = steps(out);
    // Moving needs a driver that can cut its users off (disassociate_ucontext): rxe cannot.
    let moved = step(&s, "exclusive-move");
    assert_eq!(moved.rc, 1);
    assert!(moved.output.contains("Operation not supported"));
    assert!(
        step(&s, "exclusive-move-host-rdma-dev")
            .output
            .contains("rxe0")
    );
    // The netdev moves; rxe unregisters its device: gone from both namespaces.
    assert_eq!(step(&s, "netdev-move").rc, 0);
    assert_eq!(step(&s, "netdev-host-rdma-dev").output, "");
    assert_eq!(step(&s, "netdev-ns-rdma-dev").output, "");
    assert!(!step(&s, "netdev-host-sys").output.contains("rxe0"));
    assert!(step(&s, "netdev-ns-ip-link").output.contains("eth0"));
}

/// "Probes it in that namespace where it can", on the real kernel: the agent
/// (`fabricgate check`) runs in a namespace without the HCA, the "pod" holding it is a process
/// in a kubepods cgroup of the namespace where rxe0 lives (the roles swapped, since rxe cannot
/// be moved: the same to the kernel). The agent finds the pod's process, enters its network
/// namespace and lists the HCA there with its port, then the port down once its netdev is.
#[test]
fn an_agent_without_the_hca_sees_it_and_its_port_inside_the_pods_namespace() {
    let Some(out) = common::vm_results(boot()) else {
        return;
    };
    let s = steps(out);
    let text = std::fs::read_to_string(out.join("netns/steps.txt")).unwrap();
    let pid: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("### hca pod uid 5d1e8f3a-2b4c-4d6e-8f0a-1c3e5a7b9d2f pid "))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no hca pod line in steps.txt"));
    let look = |name: &str, state: &str, phys: &str| {
        let step = step(&s, name);
        let check: serde_json::Value = serde_json::from_str(&step.output)
            .unwrap_or_else(|e| panic!("{name}: {e}: {}", step.output));
        // Its own namespace has no RDMA device ...
        assert_eq!(check["rdma"]["devices"], serde_json::json!([]), "{name}");
        // ... the pod's has rxe0, seen from inside it.
        assert_eq!(
            check["pod_namespace_rdma"],
            serde_json::json!([{
                "uid": "5d1e8f3a-2b4c-4d6e-8f0a-1c3e5a7b9d2f",
                "pid": pid,
                "why": null,
                "ports": [{"device": "rxe0", "port": 1, "state": state,
                    "physical_state": phys, "netdev": "eth0"}],
            }]),
            "{name}: {check:#}"
        );
    };
    look("excl-agent-in-ns-check", "ACTIVE", "LinkUp");
    // What the host's own tools said in between: the port is down.
    assert!(
        step(&s, "excl-host-rdma-link-down")
            .output
            .contains("link rxe0/1 state DOWN physical_state DISABLED netdev eth0")
    );
    look("excl-agent-in-ns-check-down", "DOWN", "Disabled");
    // The raw port dumps from the pod's side parse to the same.
    let dir = out.join("netns");
    let ports = |d: &str| {
        let datagrams: Vec<Vec<u8>> = ["ports-0-00.bin", "ports-0-01.bin"]
            .iter()
            .map(|n| std::fs::read(dir.join(d).join(n)).unwrap())
            .collect();
        parse_port_dump(&datagrams).unwrap()
    };
    assert!(ports("excl-pod-ports")[0].is_active());
    assert!(!ports("excl-pod-ports-down")[0].is_active());
}

/// What of the RDMA side needs `CAP_NET_ADMIN` (the runtime-transport component does not
/// grant it): nothing. With it taken away (`capsh --drop`), the QP dump still attributes the
/// pod's queue pair to its PID and the look into the pod's namespace still lists the port,
/// exactly as with it.
#[test]
fn the_rdma_dumps_need_no_net_admin() {
    let Some(out) = common::vm_results(boot()) else {
        return;
    };
    let s = steps(out);
    let cap_eff = step(&s, "no-net-admin-capeff")
        .output
        .trim()
        .strip_prefix("CapEff:")
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap();
    const CAP_NET_ADMIN: u64 = 1 << 12;
    assert_eq!(cap_eff & CAP_NET_ADMIN, 0, "{cap_eff:x}");
    assert_ne!(cap_eff, 0);
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_str(&step(&s, name).output).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let with = json("excl-host-check-pods");
    let without = json("excl-host-check-pods-no-net-admin");
    let qps = &with["pods"][0]["qps"];
    assert!(
        qps.as_array().is_some_and(|q| q
            .iter()
            .any(|qp| qp["type"] == "RC" && qp["pid"].as_u64().is_some())),
        "{with:#}"
    );
    assert_eq!(without["pods"][0]["qps"], *qps);
    assert!(
        step(&s, "excl-rdma-res-qp-no-net-admin")
            .output
            .contains("type RC state INIT")
    );
    let looked = json("excl-agent-in-ns-check")["pod_namespace_rdma"].clone();
    assert_eq!(looked.as_array().map(Vec::len), Some(1));
    assert_eq!(
        json("excl-agent-in-ns-check-no-net-admin")["pod_namespace_rdma"],
        looked
    );
}

/// The committed capture (tests/vm/netns-capture/, probes/tests/fixtures/restrack/
/// netns-exclusive/, from one run of capture-netns.sh) says the same without a VM.
#[test]
fn the_committed_capture_shows_both_views() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dumps = root.join("probes/tests/fixtures/restrack/netns-exclusive");
    assert_eq!(device_dump(&dumps.join("host")), ["rxe0"]);
    assert!(device_dump(&dumps.join("pod")).is_empty());
    let views = root.join("tests/vm/netns-capture");
    assert_eq!(class_entries(&views.join("host"), "infiniband"), ["rxe0"]);
    assert!(class_entries(&views.join("pod"), "infiniband").is_empty());
    assert_eq!(
        class_entries(&views.join("pod"), "infiniband_verbs"),
        ["abi_version", "uverbs0"]
    );
}
