use super::*;
use fabricgate_probes::Roots;
use fabricgate_probes::rdma::peer::{Keys, Responder};
use serde_json::json;
use std::time::Instant;

fn check(members: &[(&str, &str)], deadline: &str) -> FabricCheck {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheck",
        "metadata": { "name": "ns.job.0123abcd", "namespace": "fabricgate", "uid": "u-1" },
        "spec": {
            "workload": { "namespace": "ns", "name": "job", "uid": "0123abcd-x" },
            "members": members.iter().map(|(n, e)| json!({ "node": n, "endpoint": e }))
                .collect::<Vec<_>>(),
            "deadline": deadline,
        },
    }))
    .unwrap();
    FabricCheck::from_dynamic(&obj).unwrap()
}

#[test]
fn each_member_measures_the_next_once_before_the_deadline() {
    let now: Timestamp = "2026-12-02T03:00:00Z".parse().unwrap();
    let soon = "2026-12-02T03:00:20Z";
    let c = check(
        &[("a", "1.1.1.1:1"), ("b", "2.2.2.2:2"), ("c", "3:3")],
        soon,
    );
    let next = |n: &str| match decide(&c, n, now) {
        Decision::Measure(m) => m.node,
        Decision::Skip(why) => format!("skip: {why}"),
    };
    assert_eq!(next("a"), "b");
    assert_eq!(next("b"), "c");
    assert_eq!(next("c"), "a", "the ring closes");
    assert_eq!(next("d"), "skip: not a member");
    let late = check(&[("a", "x"), ("b", "y")], "2026-12-02T02:59:59Z");
    assert_eq!(decide(&late, "a", now), Decision::Skip("past its deadline"));
    let garbled = check(&[("a", "x"), ("b", "y")], "soon");
    assert_eq!(
        decide(&garbled, "a", now),
        Decision::Skip("no readable deadline")
    );
    let alone = check(&[("a", "x")], soon);
    assert_eq!(decide(&alone, "a", now), Decision::Skip("not a member"));
    let no_spec: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheck",
        "metadata": { "name": "x" },
    }))
    .unwrap();
    assert!(FabricCheck::from_dynamic(&no_spec).is_none());

    let mut taken = Taken::default();
    let d: Timestamp = soon.parse().unwrap();
    assert!(taken.take("u-1", d, now));
    assert!(!taken.take("u-1", d, now), "one exchange per check");
    let much_later = Timestamp::from_second(d.as_second() + 61).unwrap();
    assert!(taken.take("u-2", d, much_later));
    assert_eq!(taken.0.len(), 1, "old checks are forgotten: {:?}", taken.0);
}

fn key() -> Keys {
    Keys::from_secrets(&[b"0123456789abcdef0123456789abcdef"])
}

fn responder(node: &str, ports: Vec<LocalPort>) -> Responder {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let r = Responder::start(
        l,
        Identity {
            node_name: node.into(),
            group: String::new(),
        },
        Arc::new(KeyRing::fixed(key())),
        Roots::default(),
        Duration::from_secs(10),
    )
    .unwrap();
    r.set_ports(ports);
    r
}

fn ib() -> LocalPort {
    LocalPort {
        device: "mlx5_0".into(),
        port: 1,
        gid_index: None,
    }
}

fn pair(me: &str, peer: &str, endpoint: String, keys: &Keys) -> PairResult {
    let me = Identity {
        node_name: me.into(),
        group: String::new(),
    };
    let peer = Member {
        node: peer.into(),
        endpoint,
        ..Member::default()
    };
    measure_pair(&PairJob {
        me: &me,
        peer: &peer,
        ports: &[],
        keys,
        plan: Plan::default(),
        min_bandwidth_gbps: None,
        max_rtt_micros: None,
        until: Instant::now() + Duration::from_secs(5),
        session: Duration::from_secs(5),
        source: None,
        check_uid: "0f1e2d3c-aaaa-bbbb-cccc-000000000001",
    })
}

/// Without a usable local port the side channel decides: a welcoming responder of the right
/// node is ok (`unmeasured`); the wrong node, no port there, a stranger's key, nothing
/// listening and our own missing key are `ok: false` with an error naming the peer.
#[test]
fn without_rdma_the_side_channel_decides_and_failures_name_the_peer() {
    let b = responder("b", vec![ib()]);
    let at = b.local_addr().to_string();
    let r = pair("a", "b", at.clone(), &key());
    assert!(r.ok, "{r:?}");
    assert_eq!(
        (r.node.as_str(), r.peer.as_str(), r.rdma),
        ("a", "b", Rdma::Unmeasured)
    );
    assert!(r.error.is_none() && r.rtt_micros.is_none());
    let err = |r: PairResult| {
        assert!(!r.ok, "{r:?}");
        r.error.unwrap()
    };
    let e = err(pair("a", "c", at.clone(), &key()));
    assert!(
        e.starts_with("verification: peer c (") && e.contains("answered as node b"),
        "{e}"
    );
    let e = err(pair("b", "b2", at.clone(), &key()));
    assert!(e.starts_with("refused: peer b2"), "{e}");
    let stranger = Keys::from_secrets(&[b"ffffffffffffffffffffffffffffffff"]);
    let e = err(pair("a", "b", at.clone(), &stranger));
    assert!(
        e.starts_with(&format!("connect: peer b ({at})")) && e.contains("no peers key"),
        "{e}"
    );
    let e = err(pair("a", "b", at.clone(), &Keys::from_secrets(&[])));
    assert!(e.starts_with("local: this agent has no peers key"), "{e}");
    let e = err(pair("a", "b", "not an address".into(), &key()));
    assert!(e.starts_with("connect: peer b (not an address)"), "{e}");
    let portless = responder("p", Vec::new());
    let e = err(pair("a", "p", portless.local_addr().to_string(), &key()));
    assert!(e.contains("no usable RDMA port"), "{e}");
    drop(b);
    std::thread::sleep(Duration::from_millis(100));
    let e = err(pair("a", "b", at.clone(), &key()));
    assert!(e.starts_with(&format!("connect: peer b ({at})")), "{e}");
}

/// The entry as written: camelCase, absent values left out, `rdma` in lower case.
#[test]
fn results_serialize_as_the_interface_says() {
    let r = PairResult {
        node: "a".into(),
        peer: "b".into(),
        ok: true,
        rdma: Rdma::Measured,
        device: Some("mlx5_0".into()),
        port: Some(1),
        rtt_micros: Some(14.2),
        bandwidth_gbps: None,
        error: None,
        finished_at: "2026-12-02T03:00:07Z".into(),
        received: None,
        rails: Vec::new(),
    };
    assert_eq!(
        serde_json::to_value(&r).unwrap(),
        json!({ "node": "a", "peer": "b", "ok": true, "rdma": "measured", "device": "mlx5_0",
                "port": 1, "rttMicros": 14.2, "finishedAt": "2026-12-02T03:00:07Z" })
    );
}

/// The offset of the API server's clock is read from its `Date` header
/// (whole seconds, so its middle), against the middle of our request; garbage is no offset.
#[test]
fn redteam_the_api_servers_date_gives_the_clock_offset() {
    let sent: Timestamp = "2026-12-03T07:30:00.100Z".parse().unwrap();
    let received: Timestamp = "2026-12-03T07:30:00.300Z".parse().unwrap();
    // Our clock 15 minutes ahead of the API server's.
    let o =
        super::clock::offset_from_date("Thu, 03 Dec 2026 07:15:00 GMT", sent, received).unwrap();
    assert_eq!(o.as_millis(), -(15 * 60 * 1000) + 300);
    assert_eq!(
        super::clock::offset_from_date("Thu, 03 Dec 2026 07:30:00 GMT", sent, received)
            .unwrap()
            .as_millis(),
        300
    );
    for bad in ["", "yesterday", "2026-12-03T07:15:00Z"] {
        assert_eq!(
            super::clock::offset_from_date(bad, sent, received),
            None,
            "{bad}"
        );
    }
    // Past the deadline on our clock, not on the API server's: measured.
    let c = check(&[("a", "x"), ("b", "y")], "2026-12-03T07:15:20Z");
    let server_now = sent.checked_add(o).unwrap();
    assert_eq!(decide(&c, "a", sent), Decision::Skip("past its deadline"));
    assert!(matches!(decide(&c, "a", server_now), Decision::Measure(_)));
}

/// Whoever holds the pool's key can run a responder; one that answers as no
/// node (WELCOME's name empty) is not the Node dialled, whatever the key says.
#[test]
fn redteam_a_responder_that_names_no_node_is_not_the_dialled_node() {
    let nameless = responder("", vec![ib()]);
    let r = pair("a", "b", nameless.local_addr().to_string(), &key());
    assert!(!r.ok, "{r:?}");
    let e = r.error.unwrap_or_default();
    assert!(
        e.starts_with("verification: peer b (") && e.contains("answered as no node"),
        "{e}"
    );
}

/// The receiving end is attested from the responder's receipts: ok once a
/// session delivered (a greeting without RDMA, verified bytes with it); nothing, or only
/// failures on every rail announced, is not ok and says why.
#[test]
fn redteam_the_receiving_end_is_attested_from_the_receipts() {
    use fabricgate_probes::rdma::peer::{CheckTag, Receipt, Seen};
    let uid = "0f1e2d3c-aaaa-bbbb-cccc-000000000001";
    let receipt = |rail: u8, rails: u8, seen: Seen| Receipt {
        tag: CheckTag::new(uid, rail, rails).unwrap(),
        from: "a".into(),
        device: "mlx5_0".into(),
        port: 1,
        seen,
    };
    let (r, done) = super::receive::received("a", &[]);
    assert!(!done && !r.ok, "{r:?}");
    assert_eq!(
        r.error.as_deref(),
        Some("nothing received from a for this check")
    );
    let (r, done) = super::receive::received("a", &[receipt(0, 1, Seen::Greeted)]);
    assert!(done && r.ok && r.rdma == Rdma::Unmeasured, "{r:?}");
    let (r, done) = super::receive::received("a", &[receipt(0, 1, Seen::Verified { bytes: 1024 })]);
    assert!(done && r.ok && r.rdma == Rdma::Measured, "{r:?}");
    assert_eq!(r.rails[0].bytes, Some(1024));
    let failed = Seen::Failed("the session broke off before DONE".into());
    let (r, done) = super::receive::received("a", &[receipt(0, 2, failed.clone())]);
    assert!(!done && !r.ok, "one of two rails still to come: {r:?}");
    // Every rail announced must deliver.
    let verified = Seen::Verified { bytes: 1024 };
    let (r, done) = super::receive::received("a", &[receipt(0, 2, verified.clone())]);
    assert!(!done && !r.ok, "rail 1 of 2 not in yet: {r:?}");
    let (r, done) = super::receive::received(
        "a",
        &[
            receipt(0, 2, verified.clone()),
            receipt(1, 2, verified.clone()),
        ],
    );
    assert!(done && r.ok && r.rails.len() == 2, "{r:?}");
    let (r, done) = super::receive::received(
        "a",
        &[receipt(0, 2, verified), receipt(1, 2, failed.clone())],
    );
    assert!(done && !r.ok, "one rail failed: {r:?}");
    let (r, done) =
        super::receive::received("a", &[receipt(0, 2, failed.clone()), receipt(1, 2, failed)]);
    assert!(done && !r.ok, "{r:?}");
    assert!(
        r.error
            .unwrap()
            .contains("a's sessions failed here: the session broke off"),
        "why"
    );
}

/// A pair is `ok` only when every rail is: one working rail no longer
/// speaks for the others. The answer shows the first failed rail, the slowest RTT and the
/// lowest bandwidth, and every rail.
#[test]
fn redteam_every_rail_must_pass() {
    use crate::gang::fabriccheck::RailResult;
    let rail = |dev: &str, rtt: f64, bw: f64, error: Option<&str>| RailResult {
        device: dev.into(),
        port: 1,
        ok: error.is_none(),
        rtt_micros: Some(rtt),
        bandwidth_gbps: Some(bw),
        error: error.map(str::to_owned),
    };
    let base = PairResult {
        node: "a".into(),
        peer: "b".into(),
        rdma: Rdma::Measured,
        ..PairResult::default()
    };
    let all = super::pair::fold_rails(
        base.clone(),
        vec![
            rail("mlx5_0", 3.0, 90.0, None),
            rail("mlx5_1", 4.5, 80.0, None),
        ],
    );
    assert!(all.ok && all.error.is_none(), "{all:?}");
    assert_eq!(
        (
            all.device.as_deref(),
            all.rtt_micros,
            all.bandwidth_gbps,
            all.rails.len()
        ),
        (Some("mlx5_0"), Some(4.5), Some(80.0), 2)
    );
    let slow = "bandwidth: peer b (x) from mlx5_1/1: 3.1 Gb/s, below the 25 Gb/s asked";
    let one_bad = super::pair::fold_rails(
        base.clone(),
        vec![
            rail("mlx5_0", 3.0, 90.0, None),
            rail("mlx5_1", 3.0, 3.1, Some(slow)),
            rail("mlx5_2", 900.0, 90.0, Some("rtt: ...")),
        ],
    );
    assert!(!one_bad.ok, "{one_bad:?}");
    assert_eq!(
        one_bad.device.as_deref(),
        Some("mlx5_1"),
        "the first failed rail"
    );
    assert_eq!(
        one_bad.error.as_deref(),
        Some(format!("{slow} (and 1 more of 3 rails failed)").as_str())
    );
    let none = super::pair::fold_rails(base, Vec::new());
    assert!(!none.ok && none.error.unwrap().starts_with("local: "));
}

/// A ring task of `node` whose requests `client` carries (no ports, nothing measured).
fn ring_of(node: &str, client: kube::Client) -> Ring {
    Ring {
        node: node.to_owned(),
        namespace: "fabricgate".to_owned(),
        identity: Identity {
            node_name: node.to_owned(),
            group: String::new(),
        },
        ports: Arc::default(),
        rdma: false,
        keys: Arc::new(KeyRing::fixed(key())),
        plan: Plan::default(),
        bandwidth: (0, Duration::ZERO),
        session: Duration::from_secs(1),
        source: None,
        expected: None,
        receipts: Receipts::default(),
        requests: client,
        watch: None,
        max_backoff: Duration::from_secs(1),
        clock_ahead: Duration::ZERO,
    }
}

/// The agent fills the answer the controller created with the check, by a
/// merge patch under its own field manager, and never creates one: not there yet (404) is
/// tried again; refused as invalid (422: filled once already) is left as it is.
#[tokio::test]
async fn the_answer_is_filled_never_created() {
    use crate::node::tests::scripted::{self, status};
    let check = check(
        &[("gpu-a", "127.0.0.1:1"), ("gpu-b", "127.0.0.1:2")],
        "2099-01-01T00:00:00Z",
    );
    let result = PairResult {
        node: "gpu-a".into(),
        peer: "gpu-b".into(),
        ok: true,
        finished_at: "2026-12-05T06:00:00Z".into(),
        ..PairResult::default()
    };
    let path = "/apis/fabricgate.io/v1alpha1/namespaces/fabricgate/fabriccheckresults/u-1.gpu-a";
    let filled = json!({ "apiVersion": "fabricgate.io/v1alpha1", "kind": "FabricCheckResult",
                         "metadata": { "name": "u-1.gpu-a", "namespace": "fabricgate" } });
    let until = Instant::now() + Duration::from_secs(20);
    for answers in [vec![404, 200], vec![404, 422], vec![422]] {
        let (client, mut server) = scripted::client();
        let ring = ring_of("gpu-a", client);
        let want = fabriccheck::result_fill(&check, &result);
        let filled = filled.clone();
        let script = tokio::spawn(async move {
            for code in answers {
                let body = if code == 200 {
                    filled.clone()
                } else {
                    status(code, "scripted")
                };
                let seen = server.answer(code, body).await;
                assert_eq!((seen.method.as_str(), seen.path.as_str()), ("PATCH", path));
                assert_eq!(seen.content_type, "application/merge-patch+json");
                assert_eq!(
                    seen.query.get("fieldManager").map(String::as_str),
                    Some("fabricgate-gang/gpu-a")
                );
                assert_eq!(seen.body, want);
            }
            server
        });
        write_result(&ring, &check, &result, until).await;
        drop(ring);
        let server = script.await.expect("the script");
        // Nothing after the last answer: no create, no further try.
        server.expect_no_more().await;
    }
}
