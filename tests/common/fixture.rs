//! Writes a small synthetic node in the shape real sysfs has it (class links into `devices/`,
//! attribute text exactly as the kernel prints it), for the metrics tests that change
//! counters between probes (the committed trees under tests/fixtures/ are read-only).

#![allow(dead_code)]

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

/// Shape of the node.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// InfiniBand HCAs (NDR, 1 port each unless `ports_per_device` says otherwise).
    pub ib_devices: usize,
    /// RoCE HCAs, with Ethernet ports and a netdev per port.
    pub roce_devices: usize,
    pub ports_per_device: usize,
}

impl Shape {
    /// The node the tests use: 2 NDR IB ports + 1 RoCE port, small enough to read.
    pub const SMALL: Shape = Shape {
        ib_devices: 2,
        roce_devices: 1,
        ports_per_device: 1,
    };
}

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    fs::write(path, text).unwrap();
}

/// Write the node under `node/sys` and `node/proc`; counters scaled by `tick` so successive
/// calls look like traffic.
pub fn write_node(node: &Path, shape: Shape, tick: u64) {
    let root = &node.join("sys");
    let class_ib = root.join("class/infiniband");
    let class_net = root.join("class/net");
    fs::create_dir_all(&class_ib).unwrap();
    fs::create_dir_all(&class_net).unwrap();
    let total = shape.ib_devices + shape.roce_devices;
    for d in 0..total {
        let roce = d >= shape.ib_devices;
        let name = format!("mlx5_{d}");
        let pci = format!("0000:{:02x}:00.0", 0x1a + d * 0x10);
        let pci_dir = root.join("devices/pci0000:00").join(&pci);
        let dev_dir = pci_dir.join("infiniband").join(&name);
        write(&pci_dir.join("numa_node"), &format!("{}\n", d / 6));
        write(&pci_dir.join("current_link_speed"), "32.0 GT/s PCIe\n");
        write(&pci_dir.join("max_link_speed"), "32.0 GT/s PCIe\n");
        write(&pci_dir.join("current_link_width"), "16\n");
        write(&pci_dir.join("max_link_width"), "16\n");
        write(&dev_dir.join("node_type"), "1: CA\n");
        write(
            &dev_dir.join("node_guid"),
            &format!("946d:ae03:00f2:{:04x}\n", 0x1a00 + d),
        );
        write(
            &dev_dir.join("sys_image_guid"),
            &format!("946d:ae03:00f2:{:04x}\n", 0x1a00 + d),
        );
        write(&dev_dir.join("fw_ver"), "28.39.1002\n");
        write(&dev_dir.join("hca_type"), "MT4129\n");
        write(&dev_dir.join("board_id"), "MT_0000000838\n");
        if !class_ib.join(&name).exists() {
            symlink(
                format!("../../devices/pci0000:00/{pci}/infiniband/{name}"),
                class_ib.join(&name),
            )
            .unwrap();
        }
        if !dev_dir.join("device").exists() {
            symlink(format!("../../../{pci}"), dev_dir.join("device")).unwrap();
        }
        for p in 1..=shape.ports_per_device {
            let port_dir = dev_dir.join("ports").join(p.to_string());
            write(&port_dir.join("state"), "4: ACTIVE\n");
            write(&port_dir.join("phys_state"), "5: LinkUp\n");
            write(&port_dir.join("sm_lid"), "0x1\n");
            write(&port_dir.join("lid"), &format!("{:#x}\n", 0x10 + d * 4 + p));
            write(&port_dir.join("cap_mask"), "0xa751e84a\n");
            let seed = (d * 10 + p) as u64;
            let c = port_dir.join("counters");
            for (file, value) in [
                ("port_xmit_data", 1_000_000 * seed * tick),
                ("port_rcv_data", 2_000_000 * seed * tick),
                ("port_xmit_packets", 4_000 * seed * tick),
                ("port_rcv_packets", 8_000 * seed * tick),
                ("symbol_error", 0),
                ("link_downed", seed % 3),
                ("link_error_recovery", 0),
                ("port_rcv_errors", seed % 2),
                ("port_xmit_discards", 0),
                ("excessive_buffer_overrun_errors", 0),
                ("local_link_integrity_errors", 0),
                ("port_rcv_remote_physical_errors", 0),
                ("port_rcv_switch_relay_errors", 0),
                ("port_rcv_constraint_errors", 0),
                ("port_xmit_constraint_errors", 0),
                ("VL15_dropped", 0),
                ("port_xmit_wait", 17 * seed),
            ] {
                write(&c.join(file), &format!("{value}\n"));
            }
            if roce {
                write(&port_dir.join("link_layer"), "Ethernet\n");
                write(&port_dir.join("rate"), "200 Gb/sec (4X HDR)\n");
                let netdev = format!("ens{}f{}np{}", d + 1, p - 1, p - 1);
                write(
                    &port_dir.join("gids/0"),
                    &format!("fe80:0000:0000:0000:966d:aeff:fe03:{:04x}\n", 0x1a00 + d),
                );
                write(
                    &port_dir.join("gids/1"),
                    &format!("0000:0000:0000:0000:0000:ffff:0a00:{:04x}\n", d + 1),
                );
                write(&port_dir.join("gid_attrs/types/0"), "IB/RoCE v1\n");
                write(&port_dir.join("gid_attrs/types/1"), "RoCE v2\n");
                write(&port_dir.join("gid_attrs/ndevs/0"), &format!("{netdev}\n"));
                write(&port_dir.join("gid_attrs/ndevs/1"), &format!("{netdev}\n"));
                let hw = port_dir.join("hw_counters");
                for (file, value) in [
                    ("out_of_sequence", seed),
                    ("packet_seq_err", 0),
                    ("rnr_nak_retry_err", 0),
                    ("local_ack_timeout_err", 2),
                    ("implied_nak_seq_err", 0),
                    ("duplicate_request", 0),
                    ("req_cqe_error", 0),
                    ("resp_cqe_error", 0),
                    ("np_cnp_sent", 40 * seed * tick),
                    ("np_ecn_marked_roce_packets", 41 * seed * tick),
                    ("rp_cnp_handled", 39 * seed * tick),
                    ("rx_write_requests", 1000 * tick),
                    // A writable knob, not a counter (the probe skips it).
                    ("lifespan", 10),
                ] {
                    write(&hw.join(file), &format!("{value}\n"));
                }
                let net_dir = pci_dir.join("net").join(&netdev);
                write(
                    &net_dir.join("statistics/rx_bytes"),
                    &format!("{}\n", 5_000_000 * tick),
                );
                write(
                    &net_dir.join("statistics/tx_bytes"),
                    &format!("{}\n", 3_000_000 * tick),
                );
                if !net_dir.join("device").exists() {
                    symlink(format!("../../../{pci}"), net_dir.join("device")).unwrap();
                }
                if !class_net.join(&netdev).exists() {
                    symlink(
                        format!("../../devices/pci0000:00/{pci}/net/{netdev}"),
                        class_net.join(&netdev),
                    )
                    .unwrap();
                }
            } else {
                write(&port_dir.join("link_layer"), "InfiniBand\n");
                write(&port_dir.join("rate"), "400 Gb/sec (4X NDR)\n");
                write(
                    &port_dir.join("gids/0"),
                    &format!("fe80:0000:0000:0000:946d:ae03:00f2:{:04x}\n", 0x1a00 + d),
                );
                write(
                    &port_dir.join("gids/1"),
                    "0000:0000:0000:0000:0000:0000:0000:0000\n",
                );
            }
        }
    }
    // The pod network: a physical NIC and a loopback that auto mode must skip.
    let eth = root.join("devices/pci0000:00/0000:05:00.0");
    write(&eth.join("vendor"), "0x8086\n");
    let eth0 = eth.join("net/eth0");
    write(
        &eth0.join("statistics/rx_bytes"),
        &format!("{}\n", 7_000_000 * tick),
    );
    write(
        &eth0.join("statistics/tx_bytes"),
        &format!("{}\n", 6_000_000 * tick),
    );
    if !eth0.join("device").exists() {
        symlink("../../../0000:05:00.0", eth0.join("device")).unwrap();
    }
    if !class_net.join("eth0").exists() {
        symlink(
            "../../devices/pci0000:00/0000:05:00.0/net/eth0",
            class_net.join("eth0"),
        )
        .unwrap();
    }
    let lo = root.join("devices/virtual/net/lo");
    write(&lo.join("statistics/rx_bytes"), "123\n");
    write(&lo.join("statistics/tx_bytes"), "123\n");
    if !class_net.join("lo").exists() {
        symlink("../../devices/virtual/net/lo", class_net.join("lo")).unwrap();
    }
    fs::create_dir_all(node.join("proc/self")).unwrap();
    write(
        &node.join("proc/self/mountinfo"),
        "21 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n",
    );
}
