//! GPUDirect and transport checks through the real binary over the DGX-like fixture trees
//! (8 GPUs, 8 RoCE HCAs behind 4 PCIe switch complexes on two sockets): the JSON `gpudirect`
//! key, the labels, and the verdict and reason of every scenario.

use crate::common;

use common::fixture;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn requirements_dgx() -> String {
    std::fs::read_to_string(fixture("requirements-dgx.yaml")).unwrap()
}

/// `check --format json` over `sys` and `proc` of a tree.
fn check_at(sys: &Path, proc: &Path, config: &str) -> (i32, Value) {
    let tmp = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(tmp.path(), config).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(common::check_json_args(sys, proc, tmp.path()))
        .output()
        .unwrap();
    (out.status.code().unwrap(), common::stdout_json(&out))
}

fn check(name: &str, config: &str) -> (i32, Value) {
    let dir = fixture(name);
    check_at(&dir.join("sys"), &dir.join("proc"), config)
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

fn codes_of(json: &Value) -> Vec<String> {
    json["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "False")
        .map(|c| c["reason"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn healthy_dgx_pairs_every_gpu_with_its_own_switch_hca() {
    let (code, json) = check("dgx-healthy", &requirements_dgx());
    assert_eq!(code, 0, "{:?}", json["reasons"]);
    assert_eq!(json["ready"], true);
    let gd = &json["gpudirect"];
    assert_eq!(gd["present"], true);
    assert_eq!(gd["ready"], true);
    assert_eq!(gd["required"], true);
    assert_eq!(gd["worst_relation"], "PIX");
    // NVSwitches (vendor 0x10de, bridge class) and the BMC's VGA (vendor 0x1a03) are not GPUs.
    assert_eq!(gd["gpus"].as_array().unwrap().len(), 8);
    let pairs = gd["pairs"].as_array().unwrap();
    assert_eq!(pairs.len(), 8);
    let want = [
        ("0000:15:00.0", "mlx5_0", 0),
        ("0000:19:00.0", "mlx5_1", 0),
        ("0000:35:00.0", "mlx5_2", 0),
        ("0000:39:00.0", "mlx5_3", 0),
        ("0000:95:00.0", "mlx5_4", 1),
        ("0000:99:00.0", "mlx5_5", 1),
        ("0000:b5:00.0", "mlx5_6", 1),
        ("0000:b9:00.0", "mlx5_7", 1),
    ];
    for (pair, (gpu, hca, numa)) in pairs.iter().zip(want) {
        assert_eq!(pair["gpu"], gpu);
        assert_eq!(pair["hca"], hca);
        assert_eq!(pair["relation"], "PIX");
        assert_eq!(pair["numa"], numa);
        // Downstream port, upstream port, downstream port of the second-level switch.
        let bridges = pair["bridges"].as_array().unwrap();
        assert_eq!(bridges.len(), 3, "{pair}");
        for b in bridges {
            assert_ne!(b["acs"]["state"], "unknown", "{b}");
        }
    }
    assert_eq!(
        pairs[0]["bridges"][1]["acs"]["state"], "absent",
        "an upstream port"
    );
    assert_eq!(pairs[0]["bridges"][0]["acs"]["state"], "present");
    assert_eq!(pairs[0]["bridges"][0]["acs"]["control"], 0);
    assert_eq!(gd["peermem"]["method"], "nvidia_peermem");
    assert_eq!(gd["peermem"]["module_state"], "Live");
    let t = &gd["transport"][0];
    assert_eq!(
        (&t["netdev"], &t["netdev_mtu"], &t["active_mtu"]),
        (
            &Value::from("enp22s0np0"),
            &Value::from(9000),
            &Value::from(4096)
        )
    );
    assert_eq!(t["active_mtu_source"], "netdev");
    assert_eq!(t["ecn"]["np"]["3"], true);
    let labels = &json["labels"];
    assert_eq!(labels["fabricgate.io/gpudirect.relation"], "PIX");
    assert_eq!(labels["fabricgate.io/rails"], "0.1.2.3.4.5.6.7");
    assert_eq!(labels["fabricgate.io/gpudirect.ready"], "true");
    let cond = json["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "GPUDirectReady")
        .unwrap();
    assert_eq!(cond["status"], "True");
    assert!(
        strings(&json["warnings"]).is_empty(),
        "{}",
        json["warnings"]
    );
}

#[test]
fn hca_on_the_other_socket_is_sys_and_fails_max_relation() {
    let (code, json) = check("dgx-hca-other-socket", &requirements_dgx());
    assert_eq!(code, 1);
    let gd = &json["gpudirect"];
    assert_eq!(gd["worst_relation"], "SYS");
    let pair = &gd["pairs"][3];
    assert_eq!(
        (&pair["gpu"], &pair["hca"]),
        (&"0000:39:00.0".into(), &"mlx5_3".into())
    );
    assert_eq!((&pair["numa"], &pair["hca_numa"]), (&0.into(), &1.into()));
    // Every other GPU keeps its own rail: mlx5_3 is not crowded onto GPU 2's HCA.
    assert_eq!(json["labels"]["fabricgate.io/rails"], "0.1.2.3.4.5.6.7");
    assert_eq!(json["labels"]["fabricgate.io/gpudirect.relation"], "SYS");
    assert_eq!(json["labels"]["fabricgate.io/gpudirect.ready"], "false");
    let reasons = strings(&gd["reasons"]);
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons[0].contains("mlx5_3")
            && reasons[0].contains("SYS")
            && reasons[0].contains("gpudirect.max_relation PXB"),
        "{reasons:?}"
    );
    // The root ports on that path redirect (IOMMU), but a SYS path crosses the root complex
    // anyway: not an ACS finding.
    assert!(!reasons[0].contains("ACS"));
    assert!(codes_of(&json).contains(&"GPUHCATooFar".to_owned()));
    // With SYS allowed the node passes.
    let relaxed = requirements_dgx().replace("max_relation: PXB", "max_relation: SYS");
    let (code, json) = check("dgx-hca-other-socket", &relaxed);
    assert_eq!(code, 0, "{:?}", json["reasons"]);
}

#[test]
fn acs_redirect_on_one_switch_names_its_ports_unless_allowed() {
    let (code, json) = check("dgx-acs-redirect", &requirements_dgx());
    assert_eq!(code, 1);
    let reasons = strings(&json["gpudirect"]["reasons"]);
    // Only the pair behind that switch: GPU 0000:99:00.0 and mlx5_5, both downstream ports.
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    for (r, port) in reasons.iter().zip(["0000:98:00.0", "0000:98:01.0"]) {
        assert!(r.contains("0000:99:00.0") && r.contains("mlx5_5"), "{r}");
        assert!(r.contains(port) && r.contains("ReqRedir+CmpltRedir"), "{r}");
        assert!(r.contains("gpudirect.allow_acs"), "{r}");
    }
    assert!(codes_of(&json).contains(&"ACSRedirect".to_owned()));
    let pair = &json["gpudirect"]["pairs"][5];
    assert_eq!(pair["relation"], "PIX", "ACS does not change the topology");
    let allowed = requirements_dgx().replace("allow_acs: false", "allow_acs: true");
    let (code, json) = check("dgx-acs-redirect", &allowed);
    assert_eq!(code, 0, "{:?}", json["reasons"]);
    assert!(
        strings(&json["warnings"])
            .iter()
            .any(|w| w.contains("0000:98:00.0")),
        "still reported as a warning"
    );
}

#[test]
fn missing_peermem_fails_only_when_required() {
    let (code, json) = check("dgx-no-peermem", &requirements_dgx());
    assert_eq!(code, 1);
    let gd = &json["gpudirect"];
    assert_eq!(gd["peermem"]["method"], Value::Null);
    assert_eq!(gd["peermem"]["open_kernel_modules"], false);
    let reasons = strings(&gd["reasons"]);
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons[0].contains("nvidia_peermem is not loaded")
            && reasons[0].contains("modprobe nvidia_peermem"),
        "{reasons:?}"
    );
    assert!(codes_of(&json).contains(&"PeerMemoryUnavailable".to_owned()));
    let optional = requirements_dgx().replace("required: true", "required: false");
    let (code, json) = check("dgx-no-peermem", &optional);
    assert_eq!(code, 0, "{:?}", json["reasons"]);
    assert_eq!(json["gpudirect"]["ready"], true);
    assert!(
        strings(&json["warnings"])
            .iter()
            .any(|w| w.contains("nvidia_peermem"))
    );
}

#[test]
fn a_netdev_at_1500_gives_rdma_mtu_1024_and_names_the_fix() {
    let (code, json) = check("dgx-mtu-1024", &requirements_dgx());
    assert_eq!(code, 1);
    let t = json["gpudirect"]["transport"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["device"] == "mlx5_5")
        .unwrap()
        .clone();
    assert_eq!(
        (&t["netdev_mtu"], &t["active_mtu"]),
        (&1500.into(), &1024.into())
    );
    let reasons = strings(&json["rdma"]["reasons"]);
    assert!(
        reasons[0].contains("mlx5_5 port 1: active MTU 1024 below rdma.min_mtu 4096")
            && reasons[0].contains("enp154s0np0 has MTU 1500")
            && reasons[0].contains("at least 4192"),
        "{reasons:?}"
    );
    assert_eq!(json["rdma"]["usable_ports"], 7);
    assert!(codes_of(&json).contains(&"MTUBelowRequired".to_owned()));
    // Without rdma.min_mtu the MTU is reported, not judged.
    let (code, _) = check(
        "dgx-mtu-1024",
        &requirements_dgx().replace("  min_mtu: 4096\n", ""),
    );
    assert_eq!(code, 0);
}

#[test]
fn ecn_off_fails_require_ecn_with_the_sysfs_switch_to_flip() {
    let (code, json) = check("dgx-ecn-off", &requirements_dgx());
    assert_eq!(code, 1);
    let reasons = strings(&json["rdma"]["reasons"]);
    assert!(
        reasons[0].contains("mlx5_6 port 1")
            && reasons[0].contains("roce_np/enable/3")
            && reasons[0].contains("echo 1 > /sys/class/net/enp182s0np0/ecn/roce_rp/enable/3"),
        "{reasons:?}"
    );
    assert!(codes_of(&json).contains(&"ECNDisabled".to_owned()));
    let t = &json["gpudirect"]["transport"][6];
    assert_eq!(t["ecn"]["rp"]["3"], false);
    let (code, _) = check(
        "dgx-ecn-off",
        &requirements_dgx().replace("require_ecn: true", "require_ecn: false"),
    );
    assert_eq!(code, 0);
}

#[test]
fn a_node_without_gpus_says_so_and_passes_unless_required() {
    let (code, json) = check("ndr-8x400-healthy", "rdma:\n  min_active_ports: 8\n");
    assert_eq!(code, 0, "{:?}", json["reasons"]);
    let gd = &json["gpudirect"];
    assert_eq!(gd["present"], false);
    assert_eq!(gd["ready"], true);
    assert!(gd["message"].as_str().unwrap().contains("no NVIDIA GPUs"));
    assert!(gd["pairs"].as_array().unwrap().is_empty());
    assert_eq!(json["labels"].get("fabricgate.io/gpudirect.relation"), None);
    assert_eq!(json["labels"].get("fabricgate.io/rails"), None);
    assert!(
        !json["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "GPUDirectReady")
    );
    // The table says so too.
    let dir = fixture("ndr-8x400-healthy");
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["check", "--verbs", "off", "--sysfs-root"])
        .arg(dir.join("sys"))
        .arg("--proc-root")
        .arg(dir.join("proc"))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("GPUDirect: no NVIDIA GPUs found, not checked"),
        "{table}"
    );

    let (code, json) = check(
        "ndr-8x400-healthy",
        "rdma:\n  min_active_ports: 8\ngpudirect:\n  required: true\n",
    );
    assert_eq!(code, 1);
    assert_eq!(codes_of(&json)[0], "NoGPUs");
}

/// Unprivileged reads of `config` return 64 bytes: ACS is then unknown, reported as a warning,
/// and neither passes nor fails the pair.
#[test]
fn short_config_reads_make_acs_unknown_not_a_verdict() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("dgx-acs-redirect");
    let status = Command::new("cp")
        .arg("-a")
        .arg(&src)
        .arg(tmp.path().join("node"))
        .status()
        .unwrap();
    assert!(status.success());
    let node = tmp.path().join("node");
    let mut truncated = 0;
    let mut stack = vec![node.join("sys/devices")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let entry = entry.unwrap();
            let ft = entry.file_type().unwrap();
            if ft.is_dir() {
                stack.push(entry.path());
            } else if ft.is_file() && entry.file_name() == "config" {
                let bytes = std::fs::read(entry.path()).unwrap();
                std::fs::write(entry.path(), &bytes[..64]).unwrap();
                truncated += 1;
            }
        }
    }
    assert!(truncated > 50, "{truncated}");
    let (code, json) = check_at(&node.join("sys"), &node.join("proc"), &requirements_dgx());
    assert_eq!(code, 0, "{:?}", json["reasons"]);
    let b = &json["gpudirect"]["pairs"][5]["bridges"][0];
    assert_eq!(b["acs"]["state"], "unknown");
    assert_eq!(b["acs"]["bytes_read"], 64);
    let warnings = strings(&json["warnings"]);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("ACS of 24 bridges") && w.contains("CAP_SYS_ADMIN")),
        "{warnings:?}"
    );
}
