//! The sysfs reader over the committed fixture trees (real layout, symlinks included) and over
//! small trees built in a temp dir for edge cases.

use fabricgate_probes::Roots;
use fabricgate_probes::rdma::{GidType, LinkLayer, PhysState, PortState, sysfs};
use std::fs;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> Roots {
    let base = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(name);
    Roots::new(base.join("sys"), base.join("proc"))
}

#[test]
fn healthy_node_is_read_through_the_class_symlinks() {
    let report = sysfs::probe(&fixture("ndr-8x400-healthy"));
    assert!(report.subsystem_present);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    let names: Vec<&str> = report.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7",
            "mlx5_8", "mlx5_9"
        ]
    );
    let dev = &report.devices[0];
    assert!(dev.errors.is_empty(), "{:?}", dev.errors);
    assert_eq!(
        dev.node_type.as_ref().map(|n| (n.code, n.name.as_str())),
        Some((1, "CA"))
    );
    assert_eq!(dev.node_guid.as_deref(), Some("a088:c203:0000:1a2b"));
    assert_eq!(dev.fw_ver.as_deref(), Some("28.39.1002"));
    assert_eq!(dev.hca_type.as_deref(), Some("MT4129"));
    assert_eq!(dev.board_id.as_deref(), Some("MT_0000000838"));
    let pci = dev.pci.as_ref().unwrap();
    assert_eq!(pci.address, "0000:18:00.0");
    assert_eq!(pci.numa_node, Some(0));
    assert_eq!(pci.current_speed_gts, Some(32.0));
    assert_eq!(pci.current_width, Some(16));
    assert!(!pci.is_degraded());
    assert_eq!(report.devices[5].pci.as_ref().unwrap().numa_node, Some(1));

    let port = &dev.ports[0];
    assert_eq!(port.port, 1);
    assert_eq!(port.state, Some(PortState::Active));
    assert_eq!(port.phys_state, Some(PhysState::LinkUp));
    assert!(port.is_up());
    let rate = port.rate.as_ref().unwrap();
    assert_eq!(
        (rate.gbps, rate.width, rate.speed.as_str()),
        (400.0, 4, "NDR")
    );
    assert_eq!(port.link_layer, Some(LinkLayer::InfiniBand));
    assert_eq!(port.lid, Some(0x11));
    assert_eq!(port.sm_lid, Some(1));
    // Only the one GID in use; zero entries are skipped.
    assert_eq!(port.gids.len(), 1);
    assert_eq!(port.gids[0].gid_type, Some(GidType::IbRoceV1));
    assert_eq!(port.gids[0].netdev, None);
    assert_eq!(port.counters.get("port_xmit_data"), Some(&1_000_000_000));
    assert_eq!(port.transmit_bytes(), Some(4_000_000_000));
    assert_eq!(port.counters.get("link_downed"), Some(&1));
    assert_eq!(port.hw_counters.get("out_of_sequence"), Some(&0));
    // `lifespan` is a knob, but it is numeric, so it is kept like the kernel shows it.
    assert!(port.errors.is_empty(), "{:?}", port.errors);

    let roce = &report.devices[8].ports[0];
    assert_eq!(roce.link_layer, Some(LinkLayer::Ethernet));
    assert!(roce.has_roce_v2_gid());
    assert_eq!(roce.netdevs(), ["ens10f0np0"]);
    assert_eq!(roce.gids.len(), 4);
    assert_eq!(roce.lid, Some(0));
}

#[test]
fn broken_scenarios_become_per_port_and_per_device_errors() {
    let report = sysfs::probe(&fixture("malformed-state"));
    let port = &report.devices[1].ports[0];
    assert_eq!(port.state, None);
    assert!(
        port.errors[0].contains("mlx5_1/ports/1/state"),
        "{:?}",
        port.errors
    );
    assert!(port.errors[0].contains("\"ACTIVE?\""), "{:?}", port.errors);
    // The other devices are untouched.
    assert_eq!(report.devices[2].ports[0].state, Some(PortState::Active));

    let report = sysfs::probe(&fixture("no-ports-folder"));
    let dev = &report.devices[4];
    assert!(dev.ports.is_empty());
    assert!(dev.errors[0].contains("ports: missing"), "{:?}", dev.errors);
    assert_eq!(report.devices[5].ports.len(), 1);

    let report = sysfs::probe(&fixture("ndr-pcie-x8"));
    let pci = report.devices[2].pci.as_ref().unwrap();
    assert_eq!((pci.current_width, pci.max_width), (Some(8), Some(16)));
    assert!(pci.is_degraded());

    let report = sysfs::probe(&fixture("roce-no-v2"));
    assert!(!report.devices[8].ports[0].has_roce_v2_gid());
    assert!(report.devices[9].ports[0].has_roce_v2_gid());
}

#[test]
fn no_rdma_subsystem_is_not_an_error() {
    let report = sysfs::probe(&fixture("no-rdma"));
    assert!(!report.subsystem_present);
    assert!(report.devices.is_empty());
    assert!(report.errors.is_empty());
}

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

/// `class/infiniband/rxe0` → `devices/virtual/infiniband/rxe0`, as the kernel links a
/// Soft-RoCE device.
fn link_rxe0(sys: &Path) {
    fs::create_dir_all(sys.join("class/infiniband")).unwrap();
    std::os::unix::fs::symlink(
        "../../devices/virtual/infiniband/rxe0",
        sys.join("class/infiniband/rxe0"),
    )
    .unwrap();
}

/// A virtual device (Soft-RoCE) has no PCI parent; counters without a PMA read `N/A`.
#[test]
fn virtual_device_and_unavailable_counters() {
    let tmp = tempfile::tempdir().unwrap();
    let sys: PathBuf = tmp.path().join("sys");
    let dev = sys.join("devices/virtual/infiniband/rxe0");
    write(&dev.join("node_type"), "1: CA\n");
    let port = dev.join("ports/1");
    write(&port.join("state"), "1: DOWN\n");
    write(&port.join("phys_state"), "3: Disabled\n");
    write(&port.join("rate"), "2.5 Gb/sec (1X SDR)\n");
    write(&port.join("link_layer"), "Ethernet\n");
    write(&port.join("counters/port_xmit_data"), "N/A (no PMA)\n");
    write(&port.join("counters/symbol_error"), "oops\n");
    write(&port.join("hw_counters/sent_pkts"), "42\n");
    link_rxe0(&sys);
    let report = sysfs::probe(&Roots::new(&sys, tmp.path()));
    let d = &report.devices[0];
    assert_eq!(d.pci, None);
    assert_eq!(d.node_guid, None);
    let p = &d.ports[0];
    assert_eq!(p.state, Some(PortState::Down));
    assert_eq!(p.rate.as_ref().map(|r| r.gbps), Some(2.5));
    assert_eq!(p.counters.get("port_xmit_data"), None);
    assert_eq!(p.transmit_bytes(), None);
    assert_eq!(p.hw_counters.get("sent_pkts"), Some(&42));
    assert_eq!(p.errors.len(), 1, "{:?}", p.errors);
    assert!(p.errors[0].contains("symbol_error"));
    assert_eq!(p.lid, None);
}

/// A device whose name is not UTF-8 is reported (escaped name, one error), never dropped;
/// a device re-created between probes (new directory) is read afresh by the same reader; the
/// counters follow their own cadence and carry the time they were read.
#[test]
fn odd_names_re_created_devices_and_the_counters_cadence() {
    use std::os::unix::ffi::OsStrExt;
    let tmp = tempfile::tempdir().unwrap();
    let sys: PathBuf = tmp.path().join("sys");
    let make = |dir: &str, state: &str, xmit: &str| {
        let dev = sys.join("devices/virtual/infiniband").join(dir);
        write(&dev.join("node_type"), "1: CA\n");
        write(&dev.join("ports/1/state"), state);
        write(&dev.join("ports/1/phys_state"), "5: LinkUp\n");
        write(&dev.join("ports/1/counters/port_xmit_data"), xmit);
    };
    make("rxe0.a", "4: ACTIVE\n", "10\n");
    fs::create_dir_all(sys.join("class/infiniband")).unwrap();
    let link = sys.join("class/infiniband/rxe0");
    std::os::unix::fs::symlink("../../devices/virtual/infiniband/rxe0.a", &link).unwrap();
    let odd = sys
        .join("class/infiniband")
        .join(std::ffi::OsStr::from_bytes(b"mlx5_\xff"));
    std::os::unix::fs::symlink("../../devices/virtual/infiniband/rxe0.a", &odd).unwrap();

    let mut reader = sysfs::SysfsReader::new(&Roots::new(&sys, tmp.path()));
    let r = reader.probe(true);
    assert_eq!(r.devices.len(), 2, "{:?}", r.devices);
    assert_eq!(r.devices[0].name, "rxe0");
    assert_eq!(r.devices[1].name, "mlx5_\\xff");
    assert!(
        r.devices[1].errors[0].contains("not UTF-8"),
        "{:?}",
        r.devices[1]
    );
    let p = &r.devices[0].ports[0];
    assert_eq!(p.state, Some(PortState::Active));
    assert_eq!(p.counters.get("port_xmit_data"), Some(&10));
    let first_read = p.counters_timestamp.unwrap();

    // A counter moves, the state is rewritten in place: the state is read at once, the
    // counter only when counters are due.
    write(
        &sys.join("devices/virtual/infiniband/rxe0.a/ports/1/counters/port_xmit_data"),
        "20\n",
    );
    write(
        &sys.join("devices/virtual/infiniband/rxe0.a/ports/1/state"),
        "1: DOWN\n",
    );
    let r = reader.probe(false);
    let p = &r.devices[0].ports[0];
    assert_eq!(p.state, Some(PortState::Down));
    assert_eq!(p.counters.get("port_xmit_data"), Some(&10));
    assert_eq!(p.counters_timestamp, Some(first_read));
    let r = reader.probe(true);
    assert_eq!(
        r.devices[0].ports[0].counters.get("port_xmit_data"),
        Some(&20)
    );

    // The device is re-created elsewhere (driver reload): the link now points at a new
    // directory, which is opened afresh.
    make("rxe0.b", "4: ACTIVE\n", "5\n");
    fs::remove_file(&link).unwrap();
    std::os::unix::fs::symlink("../../devices/virtual/infiniband/rxe0.b", &link).unwrap();
    let r = reader.probe(false);
    let p = &r.devices[0].ports[0];
    assert_eq!(p.state, Some(PortState::Active));
    assert_eq!(
        p.counters.get("port_xmit_data"),
        Some(&5),
        "a new port is read in full"
    );
}

/// A reader given counter names reads only those files of each group (the rest are neither
/// opened nor reported, so a broken one outside the selection is not an error); a group left
/// at `None` is read in full; a named file the driver does not have is absent, not an error.
#[test]
fn a_counter_selection_reads_only_the_named_files() {
    let tmp = tempfile::tempdir().unwrap();
    let sys: PathBuf = tmp.path().join("sys");
    let port = sys.join("devices/virtual/infiniband/rxe0/ports/1");
    write(&port.join("../../node_type"), "1: CA\n");
    write(&port.join("state"), "4: ACTIVE\n");
    write(&port.join("counters/port_xmit_data"), "7\n");
    write(&port.join("counters/symbol_error"), "1\n");
    write(
        &port.join("counters/unicast_xmit_packets"),
        "not a number\n",
    );
    write(&port.join("hw_counters/out_of_sequence"), "3\n");
    write(&port.join("hw_counters/rx_write_requests"), "9\n");
    link_rxe0(&sys);
    let roots = Roots::new(&sys, tmp.path());
    let names = |list: &[&str]| Some(list.iter().map(|n| n.to_string()).collect::<Vec<_>>());
    let mut reader = sysfs::SysfsReader::with_counter_names(
        &roots,
        sysfs::CounterNames {
            counters: names(&["port_xmit_data", "symbol_error", "link_downed"]),
            hw_counters: None,
        },
    );
    let r = reader.probe(true);
    let p = &r.devices[0].ports[0];
    let keys = |m: &std::collections::BTreeMap<String, u64>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&p.counters), ["port_xmit_data", "symbol_error"]);
    assert_eq!(
        keys(&p.hw_counters),
        ["out_of_sequence", "rx_write_requests"]
    );
    assert!(p.errors.is_empty(), "{:?}", p.errors);

    // The same tree read in full: the file outside the selection is read, and its garbage
    // is an error naming it.
    let r = sysfs::SysfsReader::new(&roots).probe(true);
    let p = &r.devices[0].ports[0];
    assert_eq!(keys(&p.counters), ["port_xmit_data", "symbol_error"]);
    assert_eq!(p.errors.len(), 1, "{:?}", p.errors);
    assert!(
        p.errors[0].contains("unicast_xmit_packets"),
        "{:?}",
        p.errors
    );
}

/// The quick read an event-triggered probe starts with: only `state` and `phys_state`, through
/// the files the last probe opened; nothing before a first probe, and a port whose state
/// cannot be parsed now is left out rather than guessed.
#[test]
fn port_states_re_read_the_state_files_of_the_opened_ports() {
    let tmp = tempfile::tempdir().unwrap();
    let sys: PathBuf = tmp.path().join("sys");
    let dev = sys.join("devices/virtual/infiniband/rxe0");
    for port in ["1", "2"] {
        write(&dev.join("ports").join(port).join("state"), "4: ACTIVE\n");
        write(
            &dev.join("ports").join(port).join("phys_state"),
            "5: LinkUp\n",
        );
    }
    link_rxe0(&sys);
    let mut reader = sysfs::SysfsReader::new(&Roots::new(&sys, tmp.path()));
    assert!(
        reader.port_states().is_empty(),
        "nothing is open before a probe"
    );
    reader.probe(true);

    write(&dev.join("ports/1/state"), "1: DOWN\n");
    write(&dev.join("ports/1/phys_state"), "3: Disabled\n");
    let states = reader.port_states();
    assert_eq!(
        states,
        vec![
            sysfs::PortStateRead {
                device: "rxe0".into(),
                port: 1,
                state: PortState::Down,
                phys_state: Some(PhysState::Disabled),
            },
            sysfs::PortStateRead {
                device: "rxe0".into(),
                port: 2,
                state: PortState::Active,
                phys_state: Some(PhysState::LinkUp),
            },
        ]
    );
    write(&dev.join("ports/2/state"), "garbage\n");
    let states = reader.port_states();
    assert_eq!(states.len(), 1, "{states:?}");
    assert_eq!(states[0].port, 1);
}

/// The slow attributes (identity, firmware, PCIe capabilities, InfiniBand GID tables) follow
/// the counters' cadence and carry their last values in between; what the verdict reads
/// (states, rate, link layer, the current PCIe link, an Ethernet port's GIDs) is read on
/// every probe.
#[test]
fn slow_attributes_follow_the_counters_cadence_and_verdict_attributes_do_not() {
    let tmp = tempfile::tempdir().unwrap();
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/ndr-8x400-healthy/sys"))
        .arg(tmp.path())
        .status();
    assert!(copied.is_ok_and(|s| s.success()));
    let sys = tmp.path().join("sys");
    let mut reader = sysfs::SysfsReader::new(&Roots::new(&sys, tmp.path()));
    let device = |r: &fabricgate_probes::rdma::RdmaReport, name: &str| {
        r.devices.iter().find(|d| d.name == name).cloned().unwrap()
    };
    let first = reader.probe(true);
    let (ib, roce) = (device(&first, "mlx5_0"), device(&first, "mlx5_8"));
    assert_eq!(ib.fw_ver.as_deref(), Some("28.39.1002"));
    assert_eq!(ib.ports[0].link_layer, Some(LinkLayer::InfiniBand));
    assert_eq!(roce.ports[0].link_layer, Some(LinkLayer::Ethernet));
    let ib_gids = ib.ports[0].gids.len();
    let roce_gids = roce.ports[0].gids.len();
    assert!(ib_gids > 0 && roce_gids > 1);

    let dev = sys.join("class/infiniband/mlx5_0");
    write(&dev.join("fw_ver"), "28.40.1000\n");
    write(&dev.join("device/max_link_width"), "32\n");
    write(&dev.join("device/current_link_width"), "8\n");
    write(&dev.join("ports/1/rate"), "200 Gb/sec (4X HDR)\n");
    let zero = "0000:0000:0000:0000:0000:0000:0000:0000\n";
    write(&dev.join("ports/1/gids/0"), zero);
    write(&sys.join("class/infiniband/mlx5_8/ports/1/gids/3"), zero);

    let between = reader.probe(false);
    let (ib, roce) = (device(&between, "mlx5_0"), device(&between, "mlx5_8"));
    assert_eq!(ib.fw_ver.as_deref(), Some("28.39.1002"), "carried");
    assert_eq!(ib.node_guid, device(&first, "mlx5_0").node_guid, "carried");
    let pci = ib.pci.clone().unwrap();
    assert_eq!((pci.current_width, pci.max_width), (Some(8), Some(16)));
    assert_eq!(
        pci.numa_node,
        device(&first, "mlx5_0").pci.unwrap().numa_node
    );
    assert!(pci.is_degraded(), "the current link is read on every probe");
    assert_eq!(ib.ports[0].rate.as_ref().map(|r| r.gbps), Some(200.0));
    assert_eq!(
        ib.ports[0].gids.len(),
        ib_gids,
        "an IB port's GIDs are carried"
    );
    assert_eq!(
        roce.ports[0].gids.len(),
        roce_gids - 1,
        "RoCE GIDs are read"
    );
    assert!(ib.errors.is_empty() && roce.errors.is_empty(), "{ib:?}");

    let slow = reader.probe(true);
    let ib = device(&slow, "mlx5_0");
    assert_eq!(ib.fw_ver.as_deref(), Some("28.40.1000"));
    assert_eq!(ib.pci.unwrap().max_width, Some(32));
    assert_eq!(ib.ports[0].gids.len(), ib_gids - 1);
}
