//! Discovery, metrics and `fabricgate ping` over made-up peers and outcomes.

use super::*;
use crate::config::Config;
use crate::config::peers::PeerSpec;
use fabricgate_probes::rdma::RdmaReport;
use fabricgate_probes::rdma::peer::{ErrorKind, Identity, LocalPort, Measurement, Outcome, Plan};
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::time::Duration;

fn targets(n: u8) -> Vec<Target> {
    (1..=n)
        .map(|i| Target {
            label: format!("10.0.0.{i}"),
            addr: SocketAddr::from(([10, 0, 0, i], 9465)),
        })
        .collect()
}

#[test]
fn round_robin_covers_every_peer_and_survives_list_changes() {
    let mut sel = Selector::default();
    let t = targets(5);
    let mut seen = Vec::new();
    for _ in 0..5 {
        let order = sel.order(&t);
        assert_eq!(order.len(), 5);
        for x in order.iter().take(2) {
            sel.measured(x.addr);
            seen.push(x.label.clone());
        }
    }
    // 5 rounds of 2 over 5 peers: each peer exactly twice, in rotation.
    for x in &t {
        assert_eq!(
            seen.iter().filter(|s| **s == x.label).count(),
            2,
            "{seen:?}"
        );
    }
    // Self is excluded until it leaves the list.
    sel.exclude(t[0].addr);
    assert!(!sel.order(&t).iter().any(|x| x.addr == t[0].addr));
    sel.retain(&t[1..]);
    assert!(sel.order(&t).iter().any(|x| x.addr == t[0].addr));
    // Exclusions expire: after EXCLUSION_ROUNDS more rounds the address is asked again.
    sel.exclude(t[0].addr);
    for _ in 0..discovery::EXCLUSION_ROUNDS {
        sel.retain(&t);
        assert!(!sel.order(&t).iter().any(|x| x.addr == t[0].addr));
    }
    sel.retain(&t);
    assert!(sel.order(&t).iter().any(|x| x.addr == t[0].addr));
    // The last peer measured vanished: continue after where it was.
    let mut sel = Selector::default();
    sel.measured(t[2].addr);
    let shorter: Vec<Target> = t.iter().filter(|x| x.addr != t[2].addr).cloned().collect();
    assert_eq!(sel.order(&shorter)[0].addr, t[3].addr);
}

#[test]
fn discovery_resolves_static_peers_and_reports_bad_names() {
    let d = Discovery {
        static_peers: vec![
            PeerSpec::parse("127.0.0.1", 9465).unwrap(),
            PeerSpec::parse("127.0.0.1:9465", 9465).unwrap(),
            PeerSpec::parse("localhost:7000", 9465).unwrap(),
            PeerSpec::parse("no-such-host.invalid", 9465).unwrap(),
        ],
        service: None,
        port: 9465,
    };
    let (t, errors) = d.resolve();
    assert!(t.iter().any(|x| x.label == "127.0.0.1"));
    assert_eq!(
        t.iter().filter(|x| x.addr.port() == 9465).count(),
        1,
        "duplicates collapse: {t:?}"
    );
    assert!(t.iter().any(|x| x.label == "localhost:7000"), "{t:?}");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("no-such-host.invalid"));
}

fn measured(us: u64) -> Outcome {
    Outcome::Measured(Measurement {
        peer_node: "b".into(),
        peer_device: "rxe0".into(),
        peer_port: 1,
        rtts: vec![
            Duration::from_micros(us),
            Duration::from_micros(us + 1),
            Duration::from_micros(us + 5),
        ],
        bandwidth: Some(1e9),
        bw_bytes: 1 << 20,
        elapsed: Duration::from_millis(3),
    })
}

fn result(peer: u8, outcome: Outcome) -> PeerResult {
    PeerResult {
        target: targets(peer).pop().unwrap(),
        local: LocalPort {
            device: "rxe0".into(),
            port: 1,
            gid_index: Some(1),
        },
        outcome,
    }
}

/// The local port goes down while a round is in flight (it may wait out `peers.timeout`):
/// the next probe drops the port's values at once, and the round, when it ends, does not
/// bring them back.
#[test]
fn a_port_gone_mid_round_loses_its_values_at_the_probe_not_the_round() {
    let mut r = Registry::default();
    let m = PeerMetrics::register(&mut r);
    let rtt = |r: &Registry| {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, r).unwrap();
        s.lines()
            .filter(|l| l.starts_with("fabricgate_peer_rtt_seconds{"))
            .count()
    };
    let ports = [result(1, measured(10)).local];
    let measured_round = Round {
        results: vec![result(1, measured(10))],
        ..Round::default()
    };
    m.record_round(&measured_round, 2, &ports);
    assert_eq!(rtt(&r), 3);
    m.forget_unusable(&[]);
    assert_eq!(rtt(&r), 0, "dropped when the probe finds the port gone");
    // The round that started before the port went down measured it.
    m.record_round(&measured_round, 2, &[]);
    assert_eq!(rtt(&r), 0, "a late measurement of a gone port is not shown");
    m.record_round(&measured_round, 2, &ports);
    assert_eq!(rtt(&r), 3, "back once the port is usable again");
}

#[test]
fn metrics_follow_rounds_and_forget_peers_outside_the_window() {
    let mut r = Registry::default();
    let m = PeerMetrics::register(&mut r);
    let text = |r: &Registry| {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, r).unwrap();
        s
    };
    let ports = vec![result(1, measured(10)).local];
    let round = |results| Round {
        results,
        ..Round::default()
    };
    m.record_round(
        &round(vec![result(1, measured(10)), result(2, measured(20))]),
        2,
        &ports,
    );
    let t = text(&r);
    assert!(
        t.contains(r#"fabricgate_peer_rtt_seconds{device="rxe0",port="1",peer="10.0.0.2",stat="median"} 0.000021"#),
        "{t}"
    );
    assert!(t.contains(r#"fabricgate_peer_bandwidth_bytes_per_second{device="rxe0",port="1",peer="10.0.0.1"} 1000000000"#), "{t}");
    assert!(t.contains(r#"fabricgate_peer_errors_total{device="rxe0",port="1",peer="10.0.0.1",kind="timeout"} 0"#), "{t}");

    // Peer 2 times out: its RTT goes away, its timeout counter counts.
    m.record_round(
        &round(vec![result(
            2,
            Outcome::Failed {
                kind: Some(ErrorKind::Timeout),
                message: "x".into(),
            },
        )]),
        2,
        &ports,
    );
    let t = text(&r);
    assert!(!t.contains(r#"peer="10.0.0.2",stat="median""#), "{t}");
    assert!(t.contains(r#"fabricgate_peer_errors_total{device="rxe0",port="1",peer="10.0.0.2",kind="timeout"} 1"#), "{t}");
    assert!(
        t.contains(r#"peer="10.0.0.1",stat="median""#),
        "still in the window: {t}"
    );

    // Two more rounds with peer 3 only: peers 1 and 2 fall out of the 2-round window.
    for _ in 0..2 {
        m.record_round(&round(vec![result(3, measured(30))]), 2, &ports);
    }
    let t = text(&r);
    assert!(!t.contains(r#"peer="10.0.0.1""#), "{t}");
    assert!(!t.contains(r#"peer="10.0.0.2""#), "{t}");
    assert!(t.contains(r#"peer="10.0.0.3",stat="max""#), "{t}");
    assert!(t.contains("fabricgate_peer_rounds_total 4"), "{t}");

    // The local port goes down: no current values for it, errors stay.
    m.record_round(&round(vec![]), 2, &[]);
    let t = text(&r);
    assert!(!t.contains("fabricgate_peer_rtt_seconds{"), "{t}");
}

#[test]
fn series_stay_bounded_however_many_peers_come_and_go() {
    let mut r = Registry::default();
    let m = PeerMetrics::register(&mut r);
    for i in 0..200u8 {
        let res = vec![result(i.max(1), measured(10))];
        let ports = [res[0].local.clone()];
        let round = Round {
            results: res,
            ..Round::default()
        };
        m.record_round(&round, 3, &ports);
    }
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, &r).unwrap();
    let rtt = s
        .lines()
        .filter(|l| l.starts_with("fabricgate_peer_rtt_seconds{"))
        .count();
    assert_eq!(rtt, 3 * 3, "3 rounds × 1 peer × 3 stats:\n{s}");
}

#[test]
fn ping_without_local_ports_or_peer_says_why() {
    let config = Config::default();
    let ping_to = |addr| {
        ping(
            addr,
            &RdmaReport::default(),
            &config,
            None,
            &Identity::default(),
            &Plan::default(),
            Duration::from_secs(1),
        )
        .unwrap()
    };
    let r = ping_to("127.0.0.1:1");
    assert_eq!(r.exit_code(), crate::EXIT_CANNOT_PROBE);
    assert!(
        r.errors[0].contains("no usable local RDMA port"),
        "{:?}",
        r.errors
    );
    let t = r.to_table();
    assert!(t.contains("UNREACHABLE"), "{t}");
    let bad = ping_to("no-such-host.invalid");
    assert_eq!(bad.exit_code(), crate::EXIT_NOT_VALIDATED);
    assert_eq!(bad.to_json()["ok"], false);
}

#[test]
fn ping_report_formats_measurements_and_failures() {
    let local = result(1, measured(10)).local;
    let r = PingReport {
        peer: "node-b".into(),
        addr: Some(SocketAddr::from(([10, 0, 0, 2], 9465))),
        results: vec![
            (local.clone(), measured(10)),
            (
                LocalPort {
                    device: "rxe1".into(),
                    ..local
                },
                Outcome::Failed {
                    kind: Some(ErrorKind::Timeout),
                    message: "poll_cq: ETIMEDOUT".into(),
                },
            ),
        ],
        errors: vec![],
    };
    assert_eq!(r.exit_code(), crate::EXIT_NOT_VALIDATED);
    let j = r.to_json();
    assert_eq!(j["ports"][0]["rtt_us"]["min"], 10.0);
    assert_eq!(j["ports"][0]["rtt_us"]["max"], 15.0);
    assert_eq!(j["ports"][1]["error_kind"], "timeout");
    let t = r.to_table();
    assert!(t.contains("10.0 µs") && t.contains("8.00 Gb/s"), "{t}");
    assert!(t.contains("FAILED (timeout)"), "{t}");
}

/// A BUSY answer (someone may be holding the peer's sessions) is no error and keeps the last
/// values measured: the peer's RTT stays, its error counters stay at 0.
#[test]
fn a_busy_peer_keeps_its_values_and_counts_no_error() {
    use fabricgate_probes::rdma::peer::Skip;
    let mut r = Registry::default();
    let m = PeerMetrics::register(&mut r);
    let ports = [result(1, measured(10)).local];
    let round = |o| Round {
        results: vec![result(1, o)],
        ..Round::default()
    };
    m.record_round(&round(measured(10)), 3, &ports);
    for _ in 0..2 {
        m.record_round(&round(Outcome::Skipped(Skip::Busy)), 3, &ports);
    }
    let mut t = String::new();
    prometheus_client::encoding::text::encode(&mut t, &r).unwrap();
    assert!(
        t.contains(r#"peer="10.0.0.1",stat="median"} 0.000011"#),
        "{t}"
    );
    for kind in ["connect", "timeout", "verification"] {
        let line = format!(
            r#"fabricgate_peer_errors_total{{device="rxe0",port="1",peer="10.0.0.1",kind="{kind}"}} 0"#
        );
        assert!(t.contains(&line), "{line}\n{t}");
    }
}
