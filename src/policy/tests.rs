use super::*;
use fabricgate_probes::rdma::{
    Gid, GidType, Rate, SelftestResult, VerbsDevice, VerbsPort, VerbsStatus,
};
use fabricgate_probes::{ProbeTimings, storage::StorageReport};

fn port(n: u32, layer: LinkLayer, gbps: f64) -> PortReport {
    PortReport {
        port: n,
        state: Some(PortState::Active),
        phys_state: Some(PhysState::LinkUp),
        rate: Some(Rate {
            gbps,
            width: 4,
            speed: "NDR".into(),
        }),
        gids: if layer == LinkLayer::Ethernet {
            vec![Gid {
                index: 1,
                gid: "fe80::1".into(),
                gid_type: Some(GidType::RoceV2),
                netdev: Some("eth1".into()),
            }]
        } else {
            Vec::new()
        },
        link_layer: Some(layer),
        ..PortReport::default()
    }
}

fn device(name: &str, ports: Vec<PortReport>) -> DeviceReport {
    DeviceReport {
        name: name.into(),
        ports,
        ..DeviceReport::default()
    }
}

fn report(devices: Vec<DeviceReport>) -> ProbeReport {
    ProbeReport {
        timestamp: 0.0,
        rdma: RdmaReport {
            subsystem_present: true,
            devices,
            verbs: None,
            errors: Vec::new(),
        },
        storage: StorageReport::default(),
        gpudirect: Default::default(),
        timings: ProbeTimings::default(),
        host: Default::default(),
        facts: Default::default(),
    }
}

fn config(yaml: &str) -> Config {
    Config::parse(yaml).unwrap()
}

fn gpu_report(gpus: &[&str], pairs: &[(&str, &str, Relation)]) -> GpudirectReport {
    use fabricgate_probes::gpudirect::{Gpu, Hca, Pair, PeerMemory};
    let mut hcas: Vec<&str> = pairs.iter().map(|p| p.1).collect();
    hcas.sort_unstable();
    hcas.dedup();
    GpudirectReport {
        gpus: gpus
            .iter()
            .map(|a| Gpu {
                address: (*a).into(),
                device: None,
                class: "0x030200".into(),
                numa_node: Some(0),
                path: String::new(),
            })
            .collect(),
        hcas: hcas
            .iter()
            .map(|h| Hca {
                name: (*h).into(),
                address: String::new(),
                numa_node: Some(0),
                path: String::new(),
            })
            .collect(),
        pairs: pairs
            .iter()
            .map(|(g, h, r)| Pair {
                gpu: (*g).into(),
                hca: (*h).into(),
                hca_address: String::new(),
                relation: *r,
                numa: Some(0),
                hca_numa: Some(1),
                bridges: Vec::new(),
            })
            .collect(),
        worst_relation: pairs.iter().map(|p| p.2).max(),
        peermem: PeerMemory {
            method: Some("dma-buf".into()),
            ..PeerMemory::default()
        },
        ..GpudirectReport::default()
    }
}

#[test]
fn rails_label_maps_gpus_to_hca_indices_and_marks_gpus_without_one() {
    let gd = gpu_report(
        &["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"],
        &[
            ("0000:01:00.0", "mlx5_1", Relation::Pix),
            ("0000:03:00.0", "mlx5_0", Relation::Phb),
        ],
    );
    let v = evaluate_gpudirect(&gd, &config(""));
    assert_eq!(v.rails.as_deref(), Some("1.x.0"));
    assert_eq!(v.relation, Some(Relation::Phb));
    assert!(v.part.ready, "not required: warnings only");
    assert_eq!(v.part.warnings[0].code, "GPUHCATooFar");
    let v = evaluate_gpudirect(&gd, &config("gpudirect:\n  max_relation: PHB\n"));
    assert!(v.part.warnings.is_empty(), "{:?}", v.part.warnings);
    let v = evaluate_gpudirect(&gd, &config("gpudirect:\n  required: true\n"));
    assert!(!v.part.ready);
    assert_eq!(v.part.findings[0].code, "GPUHCATooFar");
    // GPUs without any HCA.
    let gd = gpu_report(&["0000:01:00.0"], &[]);
    let v = evaluate_gpudirect(&gd, &config("gpudirect:\n  required: true\n"));
    assert_eq!(v.part.findings[0].code, "NoHCAForGPUs");
    assert_eq!(v.rails, None);
    // 40 GPUs do not fit a label value: no label, a warning.
    let names: Vec<String> = (0..40).map(|i| format!("0000:{i:02x}:00.0")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let pairs: Vec<(&str, &str, Relation)> =
        refs.iter().map(|g| (*g, "mlx5_0", Relation::Pix)).collect();
    let v = evaluate_gpudirect(&gpu_report(&refs, &pairs), &config(""));
    assert_eq!(v.rails, None);
    assert!(
        v.part
            .warnings
            .iter()
            .any(|w| w.code == "RailsLabelTooLong")
    );
}

fn reasons(v: &Verdict) -> String {
    v.reasons().join("\n")
}

#[test]
fn counts_only_ports_of_matching_devices_and_link_layer() {
    let r = report(vec![
        device("mlx5_0", vec![port(1, LinkLayer::InfiniBand, 400.0)]),
        device("mlx5_1", vec![port(1, LinkLayer::Ethernet, 200.0)]),
        device("rxe0", vec![port(1, LinkLayer::Ethernet, 2.5)]),
    ]);
    let v = evaluate(
        &r,
        &config("rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 2\n"),
    );
    assert!(v.ready, "{}", reasons(&v));
    assert_eq!(v.rdma.usable_ports, 2);
    assert_eq!(v.rdma.min_rate_gbps, Some(200.0));
    assert_eq!(v.rdma.link_layer.as_deref(), Some("Mixed"));

    let v = evaluate(
        &r,
        &config("rdma:\n  min_active_ports: 2\n  link_layer: InfiniBand\n"),
    );
    assert!(!v.ready);
    assert_eq!(v.rdma.usable_ports, 1);
    assert!(reasons(&v).contains("1 usable RDMA port of 2 required"));

    let v = evaluate(&r, &config("rdma:\n  devices: \"bnxt_*\"\n"));
    assert!(!v.ready);
    assert!(reasons(&v).contains("no RDMA device matches rdma.devices \"bnxt_*\""));
}

#[test]
fn verbs_failures_and_disagreement_block_the_device() {
    let mut dev = device("mlx5_0", vec![port(1, LinkLayer::InfiniBand, 400.0)]);
    dev.verbs = Some(VerbsDevice {
        error: Some("cannot open /dev/infiniband/uverbs0: permission denied".into()),
        ..VerbsDevice::default()
    });
    let mut r = report(vec![dev]);
    r.rdma.verbs = Some(VerbsStatus {
        devices: vec!["mlx5_0".into()],
        error: None,
    });
    let v = evaluate(&r, &Config::default());
    assert!(!v.ready);
    assert!(
        reasons(&v).contains(
            "mlx5_0: sysfs shows the device but verbs cannot open it: cannot open /dev/infiniband/uverbs0"
        ),
        "{}",
        reasons(&v)
    );
    assert_eq!(v.conditions[1].reason, "VerbsUnavailable");

    let mut p = port(1, LinkLayer::InfiniBand, 400.0);
    p.verbs = Some(VerbsPort {
        state: PortState::Down,
        phys_state: PhysState::Polling,
        link_layer: LinkLayer::InfiniBand,
        rate_gbps: None,
        active_width: 0,
        active_speed: 0,
        lid: 0,
        sm_lid: 0,
        active_mtu: 0,
        gid_tbl_len: 0,
    });
    let v = evaluate(&report(vec![device("mlx5_0", vec![p])]), &Config::default());
    assert!(!v.ready);
    assert!(reasons(&v).contains("sysfs says ACTIVE but ibv_query_port says DOWN"));
}

#[test]
fn failed_selftest_names_step_and_errno() {
    let mut p = port(1, LinkLayer::Ethernet, 100.0);
    p.selftest = Some(SelftestResult {
        ok: false,
        failed_step: Some("reg_mr".into()),
        errno: Some(12),
        message: Some("RLIMIT_MEMLOCK too low".into()),
        latency_us: None,
        gid_index: None,
        duration_us: None,
    });
    let v = evaluate(&report(vec![device("rxe0", vec![p])]), &Config::default());
    assert!(!v.ready);
    assert!(
        reasons(&v).contains("rxe0 port 1: data-path self-test failed at reg_mr (errno 12)"),
        "{}",
        reasons(&v)
    );
}

#[test]
fn not_ready_means_taint_and_false_conditions_with_custom_prefix() {
    let mut p = port(1, LinkLayer::InfiniBand, 400.0);
    p.state = Some(PortState::Armed);
    let v = evaluate(
        &report(vec![device("mlx5_0", vec![p])]),
        &config("node:\n  label_prefix: example.com/\n  taint_effect: NoExecute\n"),
    );
    assert_eq!(
        v.taints,
        vec![Taint {
            key: "example.com/unvalidated".into(),
            value: None,
            effect: "NoExecute".into()
        }]
    );
    assert_eq!(
        v.labels.get("example.com/ready").map(String::as_str),
        Some("false")
    );
    assert!(!v.labels.contains_key("example.com/rdma.rate-gbps"));
    let fabric = &v.conditions[0];
    assert_eq!(
        (fabric.type_.as_str(), fabric.status.as_str()),
        ("FabricReady", "False")
    );
    assert_eq!(fabric.reason, "PortNotActivatedBySM");
    assert!(fabric.message.contains("state ARMED"));
}
