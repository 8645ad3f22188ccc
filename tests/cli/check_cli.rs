//! `fabricgate check` through the real binary over the fixture trees: exit codes, JSON keys,
//! and the verdict and reason for every scenario.

use crate::common;

use common::{fixture, report_port};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn check(fixture_name: &str, config: Option<&str>, extra: &[&str]) -> Output {
    let dir = fixture(fixture_name);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fabricgate"));
    cmd.arg("check")
        .arg("--verbs")
        .arg("off")
        .arg("--sysfs-root")
        .arg(dir.join("sys"))
        .arg("--proc-root")
        .arg(dir.join("proc"));
    let tmp = tempfile::NamedTempFile::new().unwrap();
    if let Some(yaml) = config {
        std::fs::write(tmp.path(), yaml).unwrap();
        cmd.arg("--config").arg(tmp.path());
    }
    cmd.args(extra).output().unwrap()
}

fn check_json(fixture_name: &str, config: Option<&str>) -> (i32, Value) {
    let out = check(fixture_name, config, &["--format", "json"]);
    (out.status.code().unwrap(), common::stdout_json(&out))
}

const NDR: &str = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n  min_rate_gbps: 400\n  link_layer: InfiniBand\n";
const ALL_TEN: &str = "rdma:\n  min_active_ports: 10\n";

/// The Node condition of type `type_` in a `check --format json` report.
fn condition<'a>(json: &'a Value, type_: &str) -> &'a Value {
    common::condition_in(&json["conditions"], type_)
        .unwrap_or_else(|| panic!("no {type_} condition: {json:#}"))
}

fn reasons(json: &Value) -> Vec<String> {
    json["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn healthy_ndr_node_is_validated_with_labels_and_no_taint() {
    let (code, json) = check_json("ndr-8x400-healthy", Some(NDR));
    assert_eq!(code, 0, "{json:#}");
    assert_eq!(json["ready"], true);
    assert_eq!(json["rdma"]["ready"], true);
    assert!(reasons(&json).is_empty());
    assert_eq!(json["rdma"]["devices"].as_array().unwrap().len(), 10);
    let p = report_port(&json, "mlx5_0", 1);
    assert_eq!(p["state"], "ACTIVE");
    assert_eq!(p["phys_state"], "LinkUp");
    assert_eq!(p["rate_gbps"], 400.0);
    assert_eq!(p["link_layer"], "InfiniBand");
    let labels = &json["labels"];
    assert_eq!(labels["fabricgate.io/ready"], "true");
    assert_eq!(labels["fabricgate.io/rdma.ready"], "true");
    assert_eq!(labels["fabricgate.io/rdma.active-ports"], "8");
    assert_eq!(labels["fabricgate.io/rdma.link-layer"], "InfiniBand");
    assert_eq!(labels["fabricgate.io/rdma.rate-gbps"], "400");
    assert_eq!(json["taints"].as_array().unwrap().len(), 0);
    let conds = json["conditions"].as_array().unwrap();
    let types: Vec<&str> = conds.iter().map(|c| c["type"].as_str().unwrap()).collect();
    assert_eq!(types, ["FabricReady", "RDMAReady", "LustreReady"]);
    assert!(conds.iter().all(|c| c["status"] == "True"));
}

#[test]
fn roce_storage_ports_count_with_their_netdev_and_gid() {
    let (code, json) = check_json("ndr-8x400-healthy", Some(ALL_TEN));
    assert_eq!(code, 0, "{json:#}");
    let p = report_port(&json, "mlx5_8", 1);
    assert_eq!(p["link_layer"], "Ethernet");
    assert_eq!(p["rate_gbps"], 200.0);
    assert_eq!(p["netdevs"][0], "ens10f0np0");
    assert_eq!(json["labels"]["fabricgate.io/rdma.link-layer"], "Mixed");
    assert_eq!(json["labels"]["fabricgate.io/rdma.rate-gbps"], "200");
}

/// The TCP path's counters (a registered subsystem, src/checks/netdev) under their key, with
/// their probe's timing; a collected fact never becomes a part of the verdict it has none of.
#[test]
fn the_tcp_paths_counters_show_under_netdevs_with_their_timing() {
    let (code, json) = check_json("ndr-8x400-healthy", Some(ALL_TEN));
    assert_eq!(code, 0, "{json:#}");
    let names: Vec<&str> = json["netdevs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    // No `fallback.netdevs`: the physical interfaces (eth0 is under devices/virtual/).
    assert_eq!(names, ["ens10f0np0", "ens11f0np0"]);
    assert!(
        json["netdevs"][0]["rx_bytes"].is_u64(),
        "{:#}",
        json["netdevs"]
    );
    assert!(
        json["timings"]["netdev_seconds"].is_f64(),
        "{:#}",
        json["timings"]
    );
    assert!(json["netdevs"].get("ready").is_none());
}

/// Each broken scenario: the exit code, the reason that must appear, and the port count.
#[test]
fn every_failure_scenario_gives_its_reason() {
    let cases: &[(&str, &str, &[&str], &str)] = &[
        (
            "ndr-port-down",
            NDR,
            &["mlx5_3 port 1: state DOWN, phys Disabled"],
            "7",
        ),
        (
            "ndr-port-init",
            NDR,
            &[
                "mlx5_5 port 1: state INIT",
                "subnet manager has not activated",
            ],
            "7",
        ),
        (
            "ndr-degraded-link",
            NDR,
            &["mlx5_3 port 1: rate 200 Gb/s (2X NDR) below required 400 Gb/s"],
            "7",
        ),
        (
            "ndr-pcie-x8",
            NDR,
            &[
                "mlx5_2 (0000:38:00.0): PCIe link trained at x8 at 32 GT/s, capable of x16 at 32 GT/s",
            ],
            "7",
        ),
        (
            "roce-no-v2",
            ALL_TEN,
            &["mlx5_8 port 1: no RoCE v2 GID on ens10f0np0"],
            "9",
        ),
        (
            "malformed-state",
            NDR,
            &[
                "mlx5_1 port 1: cannot tell the port state",
                "ports/1/state",
                "\"ACTIVE?\"",
            ],
            "7",
        ),
        ("no-ports-folder", NDR, &["mlx5_4:", "ports: missing"], "7"),
    ];
    for (name, config, wanted, ports) in cases {
        let (code, json) = check_json(name, Some(config));
        assert_eq!(code, 1, "{name}: {json:#}");
        assert_eq!(json["ready"], false, "{name}");
        assert_eq!(json["rdma"]["ready"], false, "{name}");
        let all = reasons(&json).join("\n");
        for w in *wanted {
            assert!(all.contains(w), "{name}: reason {w:?} not in:\n{all}");
        }
        assert_eq!(
            json["labels"]["fabricgate.io/rdma.active-ports"], *ports,
            "{name}"
        );
        assert_eq!(json["labels"]["fabricgate.io/ready"], "false", "{name}");
        let taints = json["taints"].as_array().unwrap();
        assert_eq!(taints.len(), 1, "{name}");
        assert_eq!(taints[0]["key"], "fabricgate.io/unvalidated");
        assert_eq!(taints[0]["effect"], "NoSchedule");
        assert!(taints[0].get("value").is_none());
    }
}

#[test]
fn port_in_init_sets_a_condition_reason_for_the_subnet_manager() {
    let (_, json) = check_json("ndr-port-init", Some(NDR));
    let rdma = condition(&json, "RDMAReady");
    assert_eq!(rdma["status"], "False");
    assert_eq!(rdma["reason"], "PortNotActivatedBySM");
    assert!(rdma["message"].as_str().unwrap().contains("mlx5_5 port 1"));
}

#[test]
fn a_down_port_beyond_the_requirement_is_a_warning_not_a_failure() {
    let (code, json) = check_json("ndr-port-down", Some("rdma:\n  min_active_ports: 9\n"));
    assert_eq!(code, 0, "{json:#}");
    let warnings = json["warnings"].as_array().unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().unwrap().contains("mlx5_3 port 1: state DOWN"))
    );
}

#[test]
fn pcie_check_can_be_turned_off() {
    let cfg = format!("{NDR}  require_full_pcie_link: false\n");
    let (code, json) = check_json("ndr-pcie-x8", Some(&cfg));
    assert_eq!(code, 0, "{json:#}");
}

/// `ndr-pci-unresolved`: mlx5_2 is a sub-function whose `device` link names an auxiliary
/// device (its PCI function, trained at x8, is found above it); mlx5_5's link dangles (the
/// function was unplugged). Neither may pass the PCIe rule silently.
#[test]
fn an_unresolvable_pci_function_fails_the_pcie_rule_with_a_reason() {
    let (code, json) = check_json("ndr-pci-unresolved", Some(NDR));
    assert_eq!(code, 1, "{json:#}");
    let all = reasons(&json).join("\n");
    assert!(
        all.contains("mlx5_2 (0000:38:00.0): PCIe link trained at x8 at 32 GT/s"),
        "{all}"
    );
    assert!(
        all.contains("mlx5_5: ") && all.contains("rdma.require_full_pcie_link fails for it"),
        "{all}"
    );
    assert_eq!(json["labels"]["fabricgate.io/rdma.active-ports"], "6");
    let dev5 = json["rdma"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "mlx5_5")
        .unwrap();
    assert!(dev5["pci"].is_null(), "{dev5:#}");
    let why = dev5["pci_error"].as_str().unwrap();
    assert!(
        why.contains("mlx5_5/device: cannot resolve the PCI function"),
        "{why}"
    );
    let errors: Vec<&str> = dev5["errors"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(errors, [why], "the device's errors say so too");

    // Alone, mlx5_5 gives the condition its own reason.
    let (code, json) = check_json("ndr-pci-unresolved", Some("rdma:\n  devices: mlx5_5\n"));
    assert_eq!(code, 1, "{json:#}");
    let rdma = condition(&json, "RDMAReady");
    assert_eq!(rdma["reason"], "PCIeLinkUnknown", "{rdma:#}");

    // With the rule off both devices count, and the unknown link is still a warning.
    let cfg = format!("{NDR}  require_full_pcie_link: false\n");
    let (code, json) = check_json("ndr-pci-unresolved", Some(&cfg));
    assert_eq!(code, 0, "{json:#}");
    let warnings = json["warnings"].to_string();
    assert!(
        warnings.contains("mlx5_5/device: cannot resolve"),
        "{warnings}"
    );

    // The table says the link is unknown rather than showing a dash.
    let out = check("ndr-pci-unresolved", Some(NDR), &[]);
    let text = String::from_utf8(out.stdout).unwrap();
    let row = text
        .lines()
        .find(|l| l.trim_start().starts_with("mlx5_5"))
        .unwrap();
    assert!(row.contains("unknown"), "{row}");
}

#[test]
fn no_rdma_at_all_says_so_and_exits_1() {
    let (code, json) = check_json("no-rdma", None);
    assert_eq!(code, 1);
    assert_eq!(json["rdma"]["ready"], false);
    assert_eq!(json["rdma"]["devices"].as_array().unwrap().len(), 0);
    let all = reasons(&json).join("\n");
    assert!(all.contains("no RDMA devices"), "{all}");
    // Without RDMA requirements the same node is fine.
    let (code, _) = check_json("no-rdma", Some("rdma:\n  min_active_ports: 0\n"));
    assert_eq!(code, 0);
}

#[test]
fn table_output_is_readable() {
    let out = check("ndr-degraded-link", Some(NDR), &[]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("fabricgate: node NOT VALIDATED"), "{text}");
    assert!(text.contains("mlx5_3 port 1: rate 200 Gb/s (2X NDR) below required 400 Gb/s"));
    assert!(
        text.contains("fabricgate.io/unvalidated:NoSchedule"),
        "{text}"
    );
    assert!(
        text.contains("mlx5_3  1     ACTIVE  LinkUp  200 Gb/s (2X NDR)"),
        "{text}"
    );
}

#[test]
fn config_errors_exit_2_and_name_the_key_or_path() {
    let out = check("ndr-8x400-healthy", Some("rdma:\n  min_ports: 8\n"), &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("min_ports"), "{err}");

    let out = check(
        "ndr-8x400-healthy",
        Some("rdma:\n  min_rate_gbps: fast\n"),
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("min_rate_gbps"));

    let out = check(
        "ndr-8x400-healthy",
        None,
        &["--config", "/nonexistent/req.yaml"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/req.yaml"));

    let out = check("ndr-8x400-healthy", None, &["--format", "xml"]);
    assert_eq!(out.status.code(), Some(2));

    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["check", "--sysfs-root", "/nonexistent/sys"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/sys"));
}

#[cfg(unix)]
#[test]
fn unreadable_rdma_class_is_exit_3() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let class = tmp.path().join("sys/class/infiniband");
    std::fs::create_dir_all(&class).unwrap();
    std::fs::create_dir_all(tmp.path().join("proc")).unwrap();
    // Reachable for an unprivileged user, except the class folder itself.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&class, std::fs::Permissions::from_mode(0o000)).unwrap();
    let bin = env!("CARGO_BIN_EXE_fabricgate");
    // Root ignores permission bits: as root, run the check as `nobody`.
    let mut cmd = if common::is_root() {
        let Some(setpriv) = common::require_tool("setpriv", "apt-get install util-linux") else {
            return;
        };
        let mut c = Command::new(setpriv);
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(bin);
        c
    } else {
        Command::new(bin)
    };
    let out = cmd
        .args(["check", "--verbs", "off", "--format", "json"])
        .arg("--sysfs-root")
        .arg(tmp.path().join("sys"))
        .arg("--proc-root")
        .arg(tmp.path().join("proc"))
        .output()
        .unwrap();
    std::fs::set_permissions(&class, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("class/infiniband"),
        "the report names what it could not read"
    );
}

/// The live check on this machine: without RDMA in the kernel it must say so (exit 1), not
/// crash; with RDMA it must report exactly the devices sysfs lists.
#[test]
fn live_check_reports_this_machines_rdma_or_its_absence() {
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["check", "--format", "json"])
        .output()
        .unwrap();
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let class = Path::new("/sys/class/infiniband");
    if !class.exists() {
        assert_eq!(out.status.code(), Some(1));
        let all = reasons(&json).join("\n");
        assert!(all.contains("no RDMA devices"), "{all}");
        assert!(all.contains("ibv_get_device_list"), "{all}");
        return;
    }
    assert!(matches!(out.status.code(), Some(0 | 1)), "{json:#}");
    let mut want: Vec<String> = std::fs::read_dir(class)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    want.sort();
    let got: Vec<&str> = json["rdma"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["name"].as_str())
        .collect();
    assert_eq!(got, want);
}
