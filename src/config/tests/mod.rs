use super::*;
use fabricgate_probes::rdma::verbs::selftest::SelftestSchedule;
use std::time::Duration;

/// Hostile and out-of-range values, each refused naming its key.
mod hardening;

#[test]
fn empty_file_gives_documented_defaults() {
    let c = Config::parse("").unwrap();
    assert_eq!(c.rdma.devices.as_str(), "*");
    assert_eq!(c.node.on_agent_error, OnAgentError::Taint);
    assert_eq!(c.rdma.min_active_ports, 1);
    assert_eq!(c.rdma.min_rate_gbps, 0.0);
    assert_eq!(c.rdma.link_layer, LinkLayerRequirement::Any);
    assert!(c.rdma.require_roce_v2);
    assert!(c.rdma.require_full_pcie_link);
    assert!(c.lustre.mounts.is_empty());
    assert!(c.lustre.all_lustre);
    assert_eq!(c.lustre.statfs_timeout, std::time::Duration::from_secs(5));
    assert_eq!(c.lustre.min_free_percent, 0.0);
    assert!(c.mounts.is_empty());
    assert_eq!(c.node.taint_key(), "fabricgate.io/unvalidated");
    assert_eq!(c.node.recover_after, 3);
}

#[test]
fn recover_after_must_be_positive() {
    let c = Config::parse("node:\n  recover_after: 5\n").unwrap();
    assert_eq!(c.node.recover_after, 5);
    let e = Config::parse("node:\n  recover_after: 0\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("node.recover_after"), "{e}");
}

#[test]
fn storage_sections_parse_and_build_the_probe_config() {
    let c = Config::parse(
        "lustre:\n  mounts: [\"/lustre/scratch\"]\n  all_lustre: false\n  \
         statfs_timeout: 1500ms\n  min_free_percent: 5\n\
         mounts:\n  - path: /datasets\n    fstype: nfs4\n    writable: false\n  - path: /home\n",
    )
    .unwrap();
    assert!(!c.lustre.all_lustre);
    assert_eq!(
        c.lustre.statfs_timeout,
        std::time::Duration::from_millis(1500)
    );
    assert_eq!(c.mounts[0].fstype.as_deref(), Some("nfs4"));
    assert!(!c.mounts[0].writable);
    assert!(c.mounts[1].writable);
    assert_eq!(c.mounts[1].fstype, None);
    let s = c.storage_config();
    assert!(!s.all_lustre);
    assert_eq!(s.statfs_timeout, std::time::Duration::from_millis(1500));
    assert_eq!(s.required.len(), 3);
    assert_eq!(s.required[0].fstype.as_deref(), Some("lustre"));
    assert_eq!(s.required[0].min_free_percent, 5.0);
    assert!(s.required[0].writable);
    assert_eq!(s.required[1].path, std::path::PathBuf::from("/datasets"));
    assert_eq!(s.required[2].min_free_percent, 0.0);
    // Round trip: the serialized duration reads back.
    let again = Config::parse(&serde_norway::to_string(&c).unwrap()).unwrap();
    assert_eq!(again, c);
}

#[test]
fn bad_storage_values_name_the_key() {
    for (yaml, key) in [
        ("lustre:\n  statfs_timeout: soon\n", "statfs_timeout"),
        ("lustre:\n  statfs_timeout: 0s\n", "lustre.statfs_timeout"),
        (
            "lustre:\n  min_free_percent: 100\n",
            "lustre.min_free_percent",
        ),
        (
            "lustre:\n  min_free_percent: -1\n",
            "lustre.min_free_percent",
        ),
        ("lustre:\n  mounts: [scratch]\n", "lustre.mounts[0]"),
        ("lustre:\n  all_lustre: maybe\n", "all_lustre"),
        ("lustre:\n  statfs_timout: 5s\n", "statfs_timout"),
        ("mounts:\n  - path: datasets\n", "mounts[0].path"),
        (
            "mounts:\n  - path: /a\n  - path: /b\n    fstype: \"\"\n",
            "mounts[1].fstype",
        ),
        ("mounts:\n  - path: /a\n    type: nfs\n", "type"),
        ("mounts:\n  - fstype: nfs\n", "path"),
    ] {
        let e = Config::parse(yaml).unwrap_err();
        assert_eq!(e.exit_code(), crate::EXIT_USAGE);
        let e = e.to_string();
        assert!(e.contains(key), "{yaml:?}: {e}");
    }
}

#[test]
fn full_file_parses() {
    let c = Config::parse(
        "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n  min_rate_gbps: 400\n  \
         link_layer: InfiniBand\n  require_roce_v2: false\n  require_full_pcie_link: false\n\
         lustre:\n  mounts: [\"/lustre/scratch\"]\n",
    )
    .unwrap();
    assert_eq!(c.rdma.min_active_ports, 8);
    assert_eq!(c.rdma.min_rate_gbps, 400.0);
    assert_eq!(c.rdma.link_layer, LinkLayerRequirement::InfiniBand);
    assert!(c.device_matcher().is_match("mlx5_3"));
    assert!(!c.device_matcher().is_match("rxe0"));
    assert_eq!(c.lustre.mounts, vec!["/lustre/scratch".to_string()]);
}

#[test]
fn fail_closed_keys_parse_and_bad_values_name_the_key() {
    let c = Config::parse(
        "kubernetes:\n  rdma_resources: [\"rdma/hca_shared_devices_a\"]\n\
         node:\n  pool_selector: \"pool=a,fabric=ib\"\n  breaker:\n    enabled: false\n\
         \x20   max_unvalidated_fraction: 0.25\n    max_new_per_window: 3\n    window: 5m\n",
    )
    .unwrap();
    assert_eq!(
        c.kubernetes.rdma_resources,
        vec!["rdma/hca_shared_devices_a".to_owned()]
    );
    assert_eq!(c.node.pool_selector, "pool=a,fabric=ib");
    assert!(!c.node.breaker.enabled);
    assert_eq!(c.node.breaker.max_unvalidated_fraction, 0.25);
    assert_eq!(c.node.breaker.max_new_per_window, 3);
    assert_eq!(c.node.breaker.window, Duration::from_secs(300));
    let d = Config::default();
    assert!(d.kubernetes.rdma_resources.is_empty() && d.node.pool_selector.is_empty());
    assert!(d.kubernetes.device_plugin_sockets.is_empty());
    assert_eq!(d.kubernetes.device_plugin_dir, DEFAULT_DEVICE_PLUGIN_DIR);
    let c = Config::parse(
        "kubernetes:\n  device_plugin_dir: /host/device-plugins\n  \
         device_plugin_sockets: [rdma.sock]\n",
    )
    .unwrap();
    assert_eq!(c.kubernetes.device_plugin_dir, "/host/device-plugins");
    assert_eq!(c.kubernetes.device_plugin_sockets, ["rdma.sock"]);
    assert_eq!(d.node.breaker.max_unvalidated_fraction, 0.5);
    assert_eq!(d.node.breaker.guard_lease, "fabricgate-guard");
    let c = Config::parse("node:\n  breaker:\n    guard_lease: \"\"\n").unwrap();
    assert!(
        c.node.breaker.guard_lease.is_empty(),
        "empty: always list the pool"
    );
    for (yaml, key) in [
        (
            "kubernetes:\n  rdma_resources: [\"hca\"]\n",
            "kubernetes.rdma_resources",
        ),
        (
            "node:\n  breaker:\n    max_unvalidated_fraction: 1.5\n",
            "node.breaker.max_unvalidated_fraction",
        ),
        ("node:\n  breaker:\n    window: 0s\n", "node.breaker.window"),
        ("node:\n  pool_selector: \"a=b,\"\n", "node.pool_selector"),
        (
            "node:\n  breaker:\n    guard_lease: Guard/Lease\n",
            "node.breaker.guard_lease",
        ),
        (
            "kubernetes:\n  device_plugin_dir: var/lib/kubelet\n",
            "kubernetes.device_plugin_dir",
        ),
        (
            "kubernetes:\n  device_plugin_sockets: [\"../kubelet.sock\"]\n",
            "kubernetes.device_plugin_sockets",
        ),
    ] {
        let e = Config::parse(yaml).unwrap_err().to_string();
        assert!(e.contains(key), "{yaml}: {e}");
    }
}

#[test]
fn unknown_keys_and_bad_values_name_the_key() {
    let e = Config::parse("rdma:\n  min_port: 2\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("min_port"), "{e}");
    let e = Config::parse("rdma:\n  min_rate_gbps: -1\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("rdma.min_rate_gbps"), "{e}");
    let e = Config::parse("rdma:\n  link_layer: Infiniband\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("Infiniband"), "{e}");
    let e = Config::parse("rdma:\n  min_active_ports: many\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("min_active_ports"), "{e}");
    let e = Config::parse("rdma:\n  devices: \"mlx5_[\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("rdma.devices"), "{e}");
    let e = Config::parse("node:\n  label_prefix: Fabric\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("node.label_prefix"), "{e}");
}

#[test]
fn fallback_section_defaults_parse_and_validate() {
    let c = Config::parse("").unwrap();
    assert!(c.fallback.enabled);
    assert_eq!(c.fallback.window, Duration::from_secs(600));
    assert!(c.fallback.netdevs.is_empty());
    assert_eq!(c.fallback.tcp_min_bytes_per_second, 100_000_000);
    assert_eq!(c.fallback.rdma_max_bytes_per_second, 1_000_000);
    let c = Config::parse(
        "fallback:\n  window: 90s\n  netdevs: [eth0, bond0]\n  \
         tcp_min_bytes_per_second: 5000\n  rdma_max_bytes_per_second: 10\n",
    )
    .unwrap();
    assert_eq!(c.fallback.window, Duration::from_secs(90));
    assert_eq!(c.fallback.netdevs, ["eth0", "bond0"]);
    assert_eq!(c.fallback.tcp_min_bytes_per_second, 5000);
    let e = Config::parse("fallback:\n  window: soon\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("soon"), "{e}");
    let e = Config::parse("fallback:\n  window: 10ms\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fallback.window"), "{e}");
    let e = Config::parse("fallback:\n  netdevs: [\"../x\"]\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fallback.netdevs[0]"), "{e}");
    let e = Config::parse("fallback:\n  tcp_rate: 1\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("tcp_rate"), "{e}");
}

#[test]
fn selftest_schedule_parses_and_bad_values_name_the_key() {
    let c = Config::parse("").unwrap();
    assert_eq!(c.rdma.selftest_schedule(), SelftestSchedule::OnStart);
    assert_eq!(c.rdma.selftest_timeout(), std::time::Duration::from_secs(2));
    let c =
        Config::parse("rdma:\n  selftest: every 6 probes\n  selftest_timeout: 500ms\n").unwrap();
    assert_eq!(c.rdma.selftest_schedule(), SelftestSchedule::Every(6));
    assert_eq!(
        c.rdma.selftest_timeout(),
        std::time::Duration::from_millis(500)
    );
    let c = Config::parse("rdma:\n  selftest: \"off\"\n").unwrap();
    assert_eq!(c.rdma.selftest_schedule(), SelftestSchedule::Off);
    let e = Config::parse("rdma:\n  selftest: sometimes\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rdma.selftest") && e.contains("every N probes"),
        "{e}"
    );
    let e = Config::parse("rdma:\n  selftest_timeout: 0s\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("rdma.selftest_timeout"), "{e}");
}

#[test]
fn gpudirect_transport_and_placement_keys() {
    let c = Config::parse("").unwrap();
    assert!(!c.gpudirect.required);
    assert_eq!(c.gpudirect.max_relation(), Relation::Pxb);
    assert!(!c.gpudirect.allow_acs);
    assert_eq!(c.rdma.min_mtu, None);
    assert!(!c.rdma.roce.require_ecn);
    assert_eq!(c.rdma.roce.ecn_priority, 3);
    assert!(c.placement.required_labels.is_empty());
    let c = Config::parse(
        "rdma:\n  min_mtu: 4096\n  roce:\n    require_ecn: true\n    ecn_priority: 5\n\
         gpudirect:\n  required: true\n  max_relation: PIX\n  allow_acs: true\n\
         placement:\n  required_labels: [topology.kubernetes.io/zone, example.com/rack, block]\n",
    )
    .unwrap();
    assert_eq!(c.rdma.min_mtu, Some(4096));
    assert!(c.rdma.roce.require_ecn);
    assert_eq!(c.rdma.roce.ecn_priority, 5);
    assert!(c.gpudirect.required && c.gpudirect.allow_acs);
    assert_eq!(c.gpudirect.max_relation(), Relation::Pix);
    assert_eq!(c.placement.required_labels.len(), 3);
    for (yaml, key) in [
        ("rdma:\n  min_mtu: 1500\n", "rdma.min_mtu"),
        (
            "rdma:\n  roce:\n    ecn_priority: 8\n",
            "rdma.roce.ecn_priority",
        ),
        ("rdma:\n  roce:\n    ecn: true\n", "ecn"),
        (
            "gpudirect:\n  max_relation: CLOSE\n",
            "gpudirect.max_relation",
        ),
        ("gpudirect:\n  requried: true\n", "requried"),
        (
            "placement:\n  required_labels: [\"bad key!\"]\n",
            "placement.required_labels[0]",
        ),
        (
            "placement:\n  required_labels: [\"Example.com/rack\"]\n",
            "placement.required_labels[0]",
        ),
    ] {
        let e = Config::parse(yaml).unwrap_err().to_string();
        assert!(e.contains(key), "{yaml:?}: {e}");
    }
    assert!(is_label_value("0.1.2.3") && is_label_value("") && is_label_value("PXB"));
    assert!(!is_label_value("-x") && !is_label_value("a/b") && !is_label_value(&"a".repeat(64)));
}

#[test]
fn unreadable_file_names_the_path() {
    let e = Config::load(Path::new("/nonexistent/fabricgate.yaml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/fabricgate.yaml"), "{e}");
}
