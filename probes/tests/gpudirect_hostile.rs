//! The GPUDirect probe over a copy of the DGX-like fixture spoiled in the ways a real (or
//! hostile) sysfs can be: garbage and non-UTF-8 attributes, a symlink loop, a huge `config`,
//! vanished files. It must not panic, must record what it could not read, and must keep
//! pairing the GPUs it can still see.

use fabricgate_probes::gpudirect::pci::{self, AcsState, Relation};
use fabricgate_probes::gpudirect::{self, GpudirectConfig};
use fabricgate_probes::{Roots, rdma};
use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;
use std::process::Command;

/// A copy of the DGX-like fixture (symlinks kept) under `dir`, to spoil or change.
fn copy_dgx_healthy(dir: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/dgx-healthy");
    let node = dir.join("node");
    let copied = Command::new("cp").arg("-a").arg(&src).arg(&node).status();
    assert!(copied.is_ok_and(|s| s.success()), "cp -a {}", src.display());
    node
}

#[test]
fn spoiled_tree_degrades_per_device_without_panicking() {
    let tmp = tempfile::tempdir().unwrap();
    let node = copy_dgx_healthy(tmp.path());
    let sys = node.join("sys");
    let devices = sys.join("bus/pci/devices");
    // GPU 0: non-UTF-8 class; GPU 1: garbage vendor.
    fs::write(devices.join("0000:15:00.0/class"), b"\xff\xfe\n").unwrap();
    fs::write(devices.join("0000:19:00.0/vendor"), "nvidia\n").unwrap();
    // A link that loops on itself.
    symlink("0000:ff:00.0", devices.join("0000:ff:00.0")).unwrap();
    // GPU 2's HCA-side switch port: a 1 MiB config of 0xff.
    let dsp = fs::canonicalize(devices.join("0000:34:01.0")).unwrap();
    fs::write(dsp.join("config"), vec![0xffu8; 1 << 20]).unwrap();
    // GPU 3's GPU-side switch port: config gone.
    let dsp = fs::canonicalize(devices.join("0000:38:00.0")).unwrap();
    fs::remove_file(dsp.join("config")).unwrap();
    // GPU 4: no NUMA affinity.
    fs::write(devices.join("0000:95:00.0/numa_node"), "-1\n").unwrap();
    // Transport: a netdev without mtu, an ECN switch with garbage.
    fs::remove_file(sys.join("class/net/enp22s0np0/mtu")).unwrap();
    fs::write(sys.join("class/net/enp26s0np0/ecn/roce_np/enable/3"), "2\n").unwrap();
    // Peer memory: an unreadable /proc/modules line set.
    fs::write(node.join("proc/modules"), b"\x00\x01garbage\n").unwrap();

    let roots = Roots::new(&sys, node.join("proc"));
    let rdma = rdma::sysfs::probe(&roots);
    let report = gpudirect::probe(&roots, &GpudirectConfig::default(), &rdma);

    let gpus: Vec<&str> = report.gpus.iter().map(|g| g.address.as_str()).collect();
    assert_eq!(
        gpus,
        [
            "0000:35:00.0",
            "0000:39:00.0",
            "0000:95:00.0",
            "0000:99:00.0",
            "0000:b5:00.0",
            "0000:b9:00.0"
        ]
    );
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.contains("0000:15:00.0/class")),
        "{:?}",
        report.errors
    );
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.contains("0000:19:00.0/vendor"))
    );
    assert_eq!(report.pairs.len(), 6);
    // The six GPUs still get their own switch's HCA.
    assert!(report.pairs.iter().all(|p| p.relation == Relation::Pix));
    let pair = |gpu: &str| report.pairs.iter().find(|p| p.gpu == gpu).unwrap();
    // All-ones extended config space: no capabilities, not a redirect.
    assert_eq!(pair("0000:35:00.0").bridges[2].acs, AcsState::Absent);
    assert_eq!(
        pair("0000:39:00.0").bridges[0].acs,
        AcsState::Unknown { bytes_read: 0 }
    );
    assert!(
        report
            .errors
            .iter()
            .any(|e| e.contains("0000:38:00.0/config"))
    );
    assert_eq!(pair("0000:95:00.0").numa, None);
    // A garbage /proc/modules is not "loaded"; the sysfs fallback is not used when it reads.
    assert_eq!(report.peermem.method, None);
    let t = |dev: &str| report.transport.iter().find(|t| t.device == dev).unwrap();
    assert_eq!(
        (t("mlx5_0").netdev_mtu, t("mlx5_0").active_mtu),
        (None, None)
    );
    let ecn = t("mlx5_1").ecn.as_ref().unwrap();
    assert_eq!(ecn.np.get(&3), None);
    assert_eq!(ecn.np.get(&2), Some(&true));
    assert!(
        t("mlx5_1")
            .errors
            .iter()
            .any(|e| e.contains("roce_np/enable/3"))
    );
}

/// One reader probe after probe (the agent's way): the GPUs of the last PCI scan are kept
/// while the bus lists the same functions, a function leaving the bus (or the slow cadence)
/// brings a new scan, and the peer-memory, MTU and bridge `config` files, kept open, show a
/// change at once.
#[test]
fn a_kept_reader_rescans_the_bus_on_change_and_rereads_kept_files() {
    let tmp = tempfile::tempdir().unwrap();
    let node = copy_dgx_healthy(tmp.path());
    let sys = node.join("sys");
    let roots = Roots::new(&sys, node.join("proc"));
    let rdma = rdma::sysfs::probe(&roots);
    let mut reader = gpudirect::GpudirectReader::new(&roots, GpudirectConfig::default());
    let first = reader.probe(&rdma, true);
    assert_eq!(first.gpus.len(), 8, "{:?}", first.errors);
    assert_eq!(first.pairs.len(), 8);
    assert_eq!(first.peermem.method.as_deref(), Some("nvidia_peermem"));
    let mtu = |r: &gpudirect::GpudirectReport| {
        r.transport
            .iter()
            .find(|t| t.netdev.as_deref() == Some("enp22s0np0"))
            .and_then(|t| t.netdev_mtu)
    };
    assert_eq!(mtu(&first), Some(9000));

    // A GPU's class now reads as a NIC: the bus lists the same functions, so the last scan
    // stands until the slow cadence.
    let devices = sys.join("bus/pci/devices");
    fs::write(devices.join("0000:35:00.0/class"), "0x020000\n").unwrap();
    // Kept-open files rewritten in place.
    fs::write(sys.join("class/net/enp22s0np0/mtu"), "1500\n").unwrap();
    let modules = fs::read_to_string(node.join("proc/modules")).unwrap();
    let without: String = modules
        .lines()
        .filter(|l| !l.starts_with("nvidia_peermem "))
        .map(|l| format!("{l}\n"))
        .collect();
    fs::write(node.join("proc/modules"), without).unwrap();
    let kept = reader.probe(&rdma, false);
    assert_eq!(kept.gpus.len(), 8);
    assert_eq!(mtu(&kept), Some(1500));
    assert_ne!(kept.peermem.method.as_deref(), Some("nvidia_peermem"));
    let slow = reader.probe(&rdma, true);
    assert_eq!(slow.gpus.len(), 7);

    // ACS control set in place on a switch port of a rail (as `setpci` does): the next probe
    // reads it where the first one found the capability.
    let pair = |r: &gpudirect::GpudirectReport, gpu: &str| {
        r.pairs.iter().find(|p| p.gpu == gpu).cloned().unwrap()
    };
    let rail = pair(&slow, "0000:99:00.0");
    let bridge = rail
        .bridges
        .iter()
        .find(|b| matches!(b.acs, AcsState::Present { control: 0, .. }))
        .map(|b| b.address.clone())
        .unwrap();
    let config = fs::canonicalize(devices.join(&bridge))
        .unwrap()
        .join("config");
    let redirect = (pci::acs::RR | pci::acs::CR).to_le_bytes();
    std::os::unix::fs::FileExt::write_all_at(
        &fs::OpenOptions::new().write(true).open(&config).unwrap(),
        &redirect,
        0x148 + 6,
    )
    .unwrap();
    let acs = |r: &gpudirect::GpudirectReport| {
        pair(r, "0000:99:00.0")
            .bridges
            .into_iter()
            .find(|b| b.address == bridge)
            .map(|b| b.acs)
    };
    let now = reader.probe(&rdma, false);
    assert!(acs(&now).is_some_and(|a| a.redirects()), "{:?}", acs(&now));
    // Only the capability's 8 bytes are read now: with the head of the capability list
    // zeroed, a full walk would find no ACS at all.
    std::os::unix::fs::FileExt::write_all_at(
        &fs::OpenOptions::new().write(true).open(&config).unwrap(),
        &[0; 4],
        0x100,
    )
    .unwrap();
    assert!(acs(&reader.probe(&rdma, false)).is_some_and(|a| a.redirects()));
    assert_eq!(
        acs(&gpudirect::probe(
            &roots,
            &GpudirectConfig::default(),
            &rdma
        )),
        Some(AcsState::Absent),
        "a fresh reader walks the list"
    );
    // Cut to what an unprivileged read sees: the capability is no longer where it was, so
    // the probe reads the whole file again.
    fs::OpenOptions::new()
        .write(true)
        .open(&config)
        .and_then(|f| f.set_len(64))
        .unwrap();
    let cut = reader.probe(&rdma, false);
    assert_eq!(acs(&cut), Some(AcsState::Unknown { bytes_read: 64 }));

    // A function leaves the bus: scanned again at once.
    fs::remove_file(devices.join("0000:39:00.0")).unwrap();
    let gone = reader.probe(&rdma, false);
    let gpus: Vec<&str> = gone.gpus.iter().map(|g| g.address.as_str()).collect();
    assert_eq!(gpus.len(), 6, "{gpus:?}");
    assert!(!gpus.contains(&"0000:39:00.0") && !gpus.contains(&"0000:35:00.0"));
    assert_eq!(gone.pairs.len(), 6);
}
