use super::*;
use std::fs;
use std::os::unix::fs::symlink;

const PCI: &str = "devices/pci0000:00/0000:00:03.0";

/// An HCA port as the kernel lays it out: `class/infiniband/<dev>` → the PCI function's
/// `infiniband/<dev>`, whose `device` points back at the function.
fn hca(root: &Path, device: &str, link_layer: &str) -> std::path::PathBuf {
    let rel = format!("{PCI}/infiniband/{device}");
    let dir = root.join(&rel);
    fs::create_dir_all(dir.join("ports/1/counters")).unwrap();
    fs::write(dir.join("ports/1/link_layer"), format!("{link_layer}\n")).unwrap();
    symlink("../../../0000:00:03.0", dir.join("device")).unwrap();
    fs::create_dir_all(root.join("class/infiniband")).unwrap();
    symlink(
        format!("../../{rel}"),
        root.join("class/infiniband").join(device),
    )
    .unwrap();
    dir.join("ports/1")
}

fn netdev(root: &Path, name: &str, on_hca: bool, kind: &str, dev_port: &str) -> std::path::PathBuf {
    let rel = if on_hca {
        format!("{PCI}/net/{name}")
    } else {
        format!("devices/virtual/net/{name}")
    };
    let dir = root.join(&rel);
    fs::create_dir_all(dir.join("statistics")).unwrap();
    fs::write(dir.join("type"), format!("{kind}\n")).unwrap();
    fs::write(dir.join("dev_port"), format!("{dev_port}\n")).unwrap();
    fs::write(dir.join("mtu"), "1500\n").unwrap();
    if on_hca {
        symlink("../../../0000:00:03.0", dir.join("device")).unwrap();
    }
    fs::create_dir_all(root.join("class/net")).unwrap();
    symlink(format!("../../{rel}"), root.join("class/net").join(name)).unwrap();
    dir
}

fn counters(port: &Path, xmit_words: u64, rcv_words: u64) {
    fs::write(
        port.join("counters/port_xmit_data"),
        format!("{xmit_words}\n"),
    )
    .unwrap();
    fs::write(
        port.join("counters/port_rcv_data"),
        format!("{rcv_words}\n"),
    )
    .unwrap();
}

fn stats(dev: &Path, tx: u64, rx: u64) {
    fs::write(dev.join("statistics/tx_bytes"), format!("{tx}\n")).unwrap();
    fs::write(dev.join("statistics/rx_bytes"), format!("{rx}\n")).unwrap();
}

/// On InfiniBand the port's data counters carry IPoIB too: what `ib0` (and its P_Key child)
/// moved over the window is taken off; an Ethernet netdev of the same function, or an IPoIB
/// netdev of the other port, is not.
#[test]
fn an_infiniband_ports_bytes_are_the_words_times_four_less_its_ipoib() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let port = hca(root, "mlx5_0", "InfiniBand");
    let ib0 = netdev(root, "ib0", true, "32", "0");
    let child = netdev(root, "ib0.8001", true, "32", "0");
    let other_port = netdev(root, "ib1", true, "32", "1");
    let eth = netdev(root, "ens1f0", true, "1", "0");
    let roots = Roots::new(root, root);
    let ipoib = ipoib_netdevs_of_node(&roots);
    assert_eq!(
        ipoib_of_port(&roots, &ipoib, "mlx5_0", 1),
        ["ib0", "ib0.8001"]
    );
    assert_eq!(ipoib_of_port(&roots, &ipoib, "mlx5_0", 2), ["ib1"]);
    let t0 = Instant::now();
    counters(&port, 1_000, 2_000);
    for d in [&ib0, &child, &other_port, &eth] {
        stats(d, 100, 100);
    }
    let before = read_port(&roots, "mlx5_0", 1, &ipoib_netdevs_of_node(&roots), t0);
    assert_eq!(before.counter, PortCounter::DataWords);
    assert_eq!(before.link_layer.as_deref(), Some("InfiniBand"));
    // 10 MB of RDMA each way, plus 3 MB sent over ib0 and 1 MB received on the child.
    counters(&port, 1_000 + 3_250_000, 2_000 + 2_750_000);
    stats(&ib0, 100 + 3_000_000, 100);
    stats(&child, 100, 100 + 1_000_000);
    stats(&other_port, 9_000_000, 9_000_000);
    stats(&eth, 9_000_000, 9_000_000);
    let after = read_port(
        &roots,
        "mlx5_0",
        1,
        &ipoib_netdevs_of_node(&roots),
        t0 + Duration::from_secs(5),
    );
    let (tx, rx, subtracted) = between(&before, &after).unwrap();
    assert_eq!((tx, rx), (10_000_000, 10_000_000));
    assert_eq!(subtracted, ["ib0", "ib0.8001"]);
}

/// RoCE ports' data counters are RoCE's own (mlx5: the vport's IB counters): the netdev's TCP
/// is not in them, and nothing is subtracted.
#[test]
fn a_roce_ports_bytes_are_its_counters_with_nothing_subtracted() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let port = hca(root, "mlx5_0", "Ethernet");
    let eth = netdev(root, "ens1f0np0", true, "1", "0");
    let roots = Roots::new(root, root);
    counters(&port, 0, 0);
    stats(&eth, 0, 0);
    let t0 = Instant::now();
    let before = read_port(&roots, "mlx5_0", 1, &ipoib_netdevs_of_node(&roots), t0);
    counters(&port, 25, 50);
    stats(&eth, 7_000_000, 7_000_000);
    let after = read_port(&roots, "mlx5_0", 1, &ipoib_netdevs_of_node(&roots), t0);
    assert_eq!(between(&before, &after), Ok((100, 200, Vec::new())));
}

/// rxe has no `counters/`: RoCE packets from `hw_counters`, times the MTU rxe derives from its
/// netdev's (1500 → 1024, 9000 → 4096).
#[test]
fn rxe_bytes_are_its_roce_packets_times_the_active_mtu() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let rel = "devices/virtual/infiniband/rxe0";
    let port = root.join(rel).join("ports/1");
    fs::create_dir_all(port.join("hw_counters")).unwrap();
    fs::create_dir_all(port.join("gid_attrs/ndevs")).unwrap();
    fs::write(port.join("link_layer"), "Ethernet\n").unwrap();
    fs::write(port.join("gid_attrs/ndevs/0"), "eth0\n").unwrap();
    fs::create_dir_all(root.join("class/infiniband")).unwrap();
    symlink(format!("../../{rel}"), root.join("class/infiniband/rxe0")).unwrap();
    let eth0 = netdev(root, "eth0", false, "1", "0");
    let roots = Roots::new(root, root);
    let pkts = |sent: u64, rcvd: u64| {
        fs::write(port.join("hw_counters/sent_pkts"), format!("{sent}\n")).unwrap();
        fs::write(port.join("hw_counters/rcvd_pkts"), format!("{rcvd}\n")).unwrap();
    };
    pkts(10, 10);
    let t0 = Instant::now();
    let before = read_port(&roots, "rxe0", 1, &ipoib_netdevs_of_node(&roots), t0);
    assert_eq!(before.counter, PortCounter::PacketsTimesMtu { mtu: 1024 });
    pkts(10 + 6_400, 10 + 100);
    let after = read_port(&roots, "rxe0", 1, &ipoib_netdevs_of_node(&roots), t0);
    assert_eq!(
        between(&before, &after),
        Ok((6_400 * 1024, 100 * 1024, Vec::new()))
    );
    fs::write(eth0.join("mtu"), "9000\n").unwrap();
    assert_eq!(
        read_port(&roots, "rxe0", 1, &ipoib_netdevs_of_node(&roots), t0).counter,
        PortCounter::PacketsTimesMtu { mtu: 4096 }
    );
    assert_eq!(roce_mtu(1500), 1024);
    assert_eq!(roce_mtu(4200), 4096);
    assert_eq!(roce_mtu(2143), 1024);
    assert_eq!(roce_mtu(2144), 2048);
    assert_eq!(roce_mtu(300), 256);
}

#[test]
fn a_port_without_byte_counters_or_a_counter_that_went_back_has_no_figure_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let port = hca(root, "irdma0", "Ethernet");
    fs::remove_dir(port.join("counters")).unwrap();
    let roots = Roots::new(root, root);
    let t0 = Instant::now();
    let none = read_port(&roots, "irdma0", 1, &ipoib_netdevs_of_node(&roots), t0);
    assert_eq!(none.counter, PortCounter::None);
    let why = between(&none, &none).unwrap_err();
    assert!(why.contains("no byte counters"), "{why}");

    let port = hca(root, "mlx5_1", "Ethernet");
    counters(&port, 500, 500);
    let before = read_port(&roots, "mlx5_1", 1, &ipoib_netdevs_of_node(&roots), t0);
    counters(&port, 10, 600);
    let after = read_port(&roots, "mlx5_1", 1, &ipoib_netdevs_of_node(&roots), t0);
    let why = between(&before, &after).unwrap_err();
    assert!(why.contains("transmit counter went back"), "{why}");
    counters(&port, 600, 600);
    fs::write(port.join("counters/port_rcv_data"), "garbage\n").unwrap();
    let why = between(
        &before,
        &read_port(&roots, "mlx5_1", 1, &ipoib_netdevs_of_node(&roots), t0),
    )
    .unwrap_err();
    assert!(why.contains("could not be read"), "{why}");
}

/// An IPoIB netdev that cannot be read leaves no figure rather than one that counts the
/// fallback over `ib0` as RDMA.
#[test]
fn an_unreadable_ipoib_netdev_leaves_no_figure() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let port = hca(root, "mlx5_0", "InfiniBand");
    let ib0 = netdev(root, "ib0", true, "32", "0");
    let roots = Roots::new(root, root);
    counters(&port, 0, 0);
    stats(&ib0, 0, 0);
    let t0 = Instant::now();
    let before = read_port(&roots, "mlx5_0", 1, &ipoib_netdevs_of_node(&roots), t0);
    counters(&port, 1_000_000, 0);
    fs::remove_file(ib0.join("statistics/tx_bytes")).unwrap();
    let after = read_port(&roots, "mlx5_0", 1, &ipoib_netdevs_of_node(&roots), t0);
    let why = between(&before, &after).unwrap_err();
    assert!(why.contains("IPoIB ib0 tx_bytes"), "{why}");
}
