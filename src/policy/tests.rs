use super::*;
use fabricgate_probes::ProbeTimings;
use fabricgate_probes::rdma::{
    Gid, GidType, Rate, SelftestResult, VerbsDevice, VerbsPort, VerbsStatus,
};

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
        timings: ProbeTimings::default(),
        host: Default::default(),
        facts: Default::default(),
    }
}

fn config(yaml: &str) -> Config {
    Config::parse(yaml).unwrap()
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
