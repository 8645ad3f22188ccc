use super::device::resolve_pci_function;
use super::parse::is_zero_gid;
use super::*;
use crate::rdma::NodeType;
use crate::sysfs_io::AttrReader;
use std::fs;

/// rxe0 in a real guest: `fw_ver` holds just "\n". That must not block the device.
#[test]
fn empty_text_attribute_is_absent_not_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fw_ver");
    fs::write(&path, "\n").unwrap();
    let mut errors = Vec::new();
    assert_eq!(AttrReader::new().string(&path, &mut errors), None);
    assert!(errors.is_empty(), "{errors:?}");
    fs::write(&path, "20.39.1002\n").unwrap();
    assert_eq!(
        AttrReader::new().string(&path, &mut errors).as_deref(),
        Some("20.39.1002")
    );
}

#[test]
fn parses_every_kernel_port_state() {
    let cases = [
        ("0: NOP\n", PortState::Nop),
        ("1: DOWN\n", PortState::Down),
        ("2: INIT\n", PortState::Init),
        ("3: ARMED\n", PortState::Armed),
        ("4: ACTIVE\n", PortState::Active),
        ("5: ACTIVE_DEFER\n", PortState::ActiveDefer),
        ("7: UNKNOWN\n", PortState::Unknown(7)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_port_state(text), Some(want), "{text:?}");
    }
    assert_eq!(parse_port_state("ACTIVE"), None);
    assert_eq!(parse_port_state("4:"), None);
    assert_eq!(parse_port_state("x: ACTIVE"), None);
}

#[test]
fn parses_every_kernel_phys_state() {
    let cases = [
        ("1: Sleep", PhysState::Sleep),
        ("2: Polling", PhysState::Polling),
        ("3: Disabled", PhysState::Disabled),
        (
            "4: PortConfigurationTraining",
            PhysState::PortConfigurationTraining,
        ),
        ("5: LinkUp", PhysState::LinkUp),
        ("6: LinkErrorRecovery", PhysState::LinkErrorRecovery),
        ("7: Phy Test", PhysState::PhyTest),
        ("0: <unknown>", PhysState::Unknown(0)),
    ];
    for (text, want) in cases {
        assert_eq!(parse_phys_state(text), Some(want), "{text:?}");
    }
}

#[test]
fn parses_rates_with_width_and_speed() {
    let r = parse_rate("400 Gb/sec (4X NDR)\n").unwrap();
    assert_eq!((r.gbps, r.width, r.speed.as_str()), (400.0, 4, "NDR"));
    let r = parse_rate("2.5 Gb/sec (1X SDR)").unwrap();
    assert_eq!((r.gbps, r.width, r.speed.as_str()), (2.5, 1, "SDR"));
    let r = parse_rate("200 Gb/sec (2X NDR)").unwrap();
    assert_eq!((r.gbps, r.width), (200.0, 2));
    let r = parse_rate("10 Gb/sec (4X)").unwrap();
    assert_eq!((r.gbps, r.width, r.speed.as_str()), (10.0, 4, ""));
    assert_eq!(parse_rate("fast"), None);
    assert_eq!(parse_rate("400 Gb/sec"), None);
    assert_eq!(parse_rate("-1 Gb/sec (4X NDR)"), None);
}

#[test]
fn parses_lids_pcie_and_counters() {
    assert_eq!(parse_hex_u32("0x1a\n"), Some(26));
    assert_eq!(parse_hex_u32("26"), None);
    assert_eq!(parse_pcie_speed("32.0 GT/s PCIe\n"), Some(32.0));
    assert_eq!(parse_pcie_speed("8 GT/s"), Some(8.0));
    assert_eq!(parse_pcie_speed("Unknown"), None);
    assert_eq!(parse_counter("123\n"), Some(CounterText::Value(123)));
    assert_eq!(
        parse_counter("N/A (no PMA)\n"),
        Some(CounterText::NotAvailable)
    );
    assert_eq!(parse_counter("lots"), None);
    assert_eq!(
        parse_node_type("1: CA\n"),
        Some(NodeType {
            code: 1,
            name: "CA".into()
        })
    );
}

#[test]
fn pci_addresses_are_recognised() {
    for good in ["0000:3b:00.0", "0000:00:1f.7", "10000:01:00.0"] {
        assert!(is_pci_address(good), "{good}");
    }
    for bad in [
        "mlx5_core.sf.2",
        "pci0000:00",
        "0000:3b:00",
        "0000:3b:00.8",
        "0000:3b:0.0",
        "0000:3b:00.0:1",
        "",
    ] {
        assert!(!is_pci_address(bad), "{bad}");
    }
}

/// The three outcomes of resolving a `device` link: none (software device), a PCI
/// function at or above the target, and a target outside any PCI function.
#[test]
fn device_links_resolve_to_the_pci_function_or_say_why_not() {
    let dir = tempfile::tempdir().unwrap();
    let sys = dir.path().join("sys");
    let roots = Roots::new(&sys, dir.path().join("proc"));
    let mk = |rel: &str| fs::create_dir_all(sys.join(rel)).unwrap();
    mk("devices/virtual/infiniband/rxe0");
    mk("devices/pci0000:00/0000:00:01.0/0000:3b:00.0/mlx5_core.sf.4/infiniband/mlx5_4");
    mk("devices/platform/HISI00D1:00/infiniband/hns_0");
    let link = |target: &str, at: &str| {
        std::os::unix::fs::symlink(target, sys.join(at).join("device")).unwrap();
        sys.join(at).join("device")
    };
    let none = sys.join("devices/virtual/infiniband/rxe0/device");
    assert_eq!(resolve_pci_function(&roots, &none), Ok(None));

    let sf = link(
        "../../../mlx5_core.sf.4",
        "devices/pci0000:00/0000:00:01.0/0000:3b:00.0/mlx5_core.sf.4/infiniband/mlx5_4",
    );
    let (function, below) = resolve_pci_function(&roots, &sf).unwrap().unwrap();
    assert!(
        function.ends_with("0000:00:01.0/0000:3b:00.0"),
        "{function:?}"
    );
    assert_eq!(
        below.as_deref(),
        Some("devices/pci0000:00/0000:00:01.0/0000:3b:00.0")
    );

    let platform = link("../..", "devices/platform/HISI00D1:00/infiniband/hns_0");
    let why = resolve_pci_function(&roots, &platform).unwrap_err();
    assert!(
        why.contains(
            "resolves to devices/platform/HISI00D1:00, which is not inside a PCI \
                      function; the HCA's PCIe link cannot be checked"
        ),
        "{why}"
    );
}

#[test]
fn zero_gids_are_unused() {
    assert!(is_zero_gid("0000:0000:0000:0000:0000:0000:0000:0000"));
    assert!(!is_zero_gid("fe80:0000:0000:0000:ec0d:9a03:0078:6a6a"));
}
