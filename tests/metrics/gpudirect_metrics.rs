//! GPUDirect metrics over the DGX-like fixtures: pair relations, the worst relation, ACS,
//! peer memory, port MTUs and ECN arrive under their documented names.

use crate::common;

use common::{committed_fixture, record_fixture, sample};
use fabricgate::config::Config;

fn requirements() -> Config {
    Config::load(&committed_fixture("requirements-dgx.yaml")).unwrap()
}

fn metrics_of(fixture: &str) -> String {
    let config = requirements();
    let metrics = common::agent_metrics(&config);
    record_fixture(&metrics, &committed_fixture(fixture), &config, 1.0);
    metrics.encode(false)
}

#[test]
fn healthy_dgx_exports_pairs_mtu_and_ecn() {
    let t = metrics_of("dgx-healthy");
    assert_eq!(sample(&t, "fabricgate_gpudirect_ready"), Some(1.0), "{t}");
    assert_eq!(sample(&t, "fabricgate_gpudirect_gpus"), Some(8.0));
    assert_eq!(sample(&t, "fabricgate_gpudirect_worst_relation"), Some(0.0));
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_gpudirect_pair_relation{gpu="0000:95:00.0",hca="mlx5_4",relation="PIX",numa="1"}"#
        ),
        Some(0.0)
    );
    assert_eq!(
        t.lines()
            .filter(|l| l.starts_with("fabricgate_gpudirect_pair_relation{"))
            .count(),
        8
    );
    assert_eq!(
        sample(&t, "fabricgate_gpudirect_acs_redirect_bridges"),
        Some(0.0)
    );
    assert_eq!(sample(&t, "fabricgate_gpudirect_peer_memory"), Some(1.0));
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_active_mtu_bytes{device="mlx5_0",port="1"}"#
        ),
        Some(4096.0)
    );
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_ecn_enabled{device="mlx5_0",port="1",point="rp"}"#
        ),
        Some(1.0)
    );
}

#[test]
fn broken_scenarios_move_their_metric() {
    let t = metrics_of("dgx-hca-other-socket");
    assert_eq!(sample(&t, "fabricgate_gpudirect_worst_relation"), Some(4.0));
    assert_eq!(sample(&t, "fabricgate_gpudirect_ready"), Some(0.0));
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_findings{scope="gpudirect",reason="GPUHCATooFar"}"#
        ),
        Some(1.0),
        "{t}"
    );
    let t = metrics_of("dgx-acs-redirect");
    assert_eq!(
        sample(&t, "fabricgate_gpudirect_acs_redirect_bridges"),
        Some(2.0)
    );
    let t = metrics_of("dgx-no-peermem");
    assert_eq!(sample(&t, "fabricgate_gpudirect_peer_memory"), Some(0.0));
    let t = metrics_of("dgx-mtu-1024");
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_active_mtu_bytes{device="mlx5_5",port="1"}"#
        ),
        Some(1024.0)
    );
    let t = metrics_of("dgx-ecn-off");
    assert_eq!(
        sample(
            &t,
            r#"fabricgate_rdma_port_ecn_enabled{device="mlx5_6",port="1",point="np"}"#
        ),
        Some(0.0)
    );
}
