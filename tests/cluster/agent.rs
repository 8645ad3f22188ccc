//! `fabricgate run` end to end against the real kube-apiserver: the real binary, with the
//! agent's own pod-bound ServiceAccount token (so RBAC and the admission policy of
//! `daemonset.yaml` are in force), over a fixture sysfs tree whose port the tests flip.

use crate::common::faultproxy::{Fault, FaultProxy};
use crate::common::sysfs::FakeHca;
use crate::common::{
    AGENT_USER, TAINT, TestNode, committed_fixture, control_plane, signal, start_agent,
    start_agent_at, taint_keys, wait_exit, wait_until,
};
use serde_json::Value;
use std::time::{Duration, Instant};

#[test]
fn healthy_node_is_validated_after_recover_after_probes_and_keeps_others_fields() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-healthy");
    let (_hca, agent) = node.run_agent(true, None, &["--interval", "200ms"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());

    let n = node.json();
    let labels = &n["metadata"]["labels"];
    assert_eq!(labels["fabricgate.io/ready"], "true");
    assert_eq!(labels["fabricgate.io/rdma.ready"], "true");
    assert_eq!(labels["fabricgate.io/rdma.active-ports"], "1");
    assert_eq!(labels["fabricgate.io/rdma.link-layer"], "InfiniBand");
    assert_eq!(labels["fabricgate.io/rdma.rate-gbps"], "400");
    assert_eq!(labels["fabricgate.io/lustre.ready"], "true");
    assert_eq!(labels["team"], "ml", "another owner's label survives");
    assert_eq!(
        taint_keys(&n),
        vec!["nvidia.com/gpu"],
        "only our taint was removed"
    );
    let fabric = node.condition("FabricReady").unwrap();
    assert_eq!(fabric["status"], "True");
    assert_eq!(fabric["reason"], "FabricValidated");
    assert_eq!(node.condition("RDMAReady").unwrap()["status"], "True");
    assert_eq!(node.condition("LustreReady").unwrap()["status"], "True");
    assert_eq!(
        node.condition("Ready").unwrap()["reason"],
        "KubeletReady",
        "the kubelet's condition survives"
    );

    // Server-side apply: the real server records fabricgate as the owner of exactly its
    // labels (metadata) and its conditions (status), and keeps the other managers' fields.
    let managed = n["metadata"]["managedFields"].as_array().unwrap();
    let ours: Vec<&Value> = managed
        .iter()
        .filter(|m| m["manager"] == "fabricgate" && m["operation"] == "Apply")
        .collect();
    let labels_entry = ours
        .iter()
        .find(|m| m["subresource"].is_null())
        .expect("an Apply entry for the labels");
    let owned: Vec<&String> = labels_entry["fieldsV1"]["f:metadata"]["f:labels"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert!(
        owned.iter().all(|k| k.starts_with("f:fabricgate.io/")),
        "{owned:?}"
    );
    assert_eq!(owned.len(), 6, "{owned:?}");
    let status_entry = ours
        .iter()
        .find(|m| m["subresource"] == "status")
        .expect("an Apply entry for the conditions");
    let conds = status_entry["fieldsV1"]["f:status"]["f:conditions"]
        .as_object()
        .unwrap();
    for t in ["FabricReady", "RDMAReady", "LustreReady"] {
        assert!(
            conds.contains_key(&format!("k:{{\"type\":\"{t}\"}}")),
            "{conds:?}"
        );
    }
    assert!(!conds.contains_key("k:{\"type\":\"Ready\"}"));
    assert!(
        managed.iter().any(|m| m["manager"] != "fabricgate"),
        "the registering manager keeps its entry"
    );

    let events = node.events();
    assert_eq!(
        events.len(),
        1,
        "one event for the one transition: {events:#?}"
    );
    assert_eq!(events[0]["reason"], "FabricReady");
    assert_eq!(events[0]["type"], "Normal");
    assert_eq!(events[0]["regarding"]["kind"], "Node");
    assert_eq!(events[0]["regarding"]["name"], node.name.as_str());
    assert_eq!(events[0]["regarding"]["uid"], n["metadata"]["uid"]);
    assert_eq!(events[0]["reportingController"], "fabricgate.io/agent");

    assert!(agent.log().contains("good_probes=3"), "{}", agent.log());
    let (status, took) = agent.stop();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn port_down_taints_within_one_interval_and_recovers_after_recover_after_probes() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-flip");
    let interval = Duration::from_millis(500);
    let (hca, agent) = node.run_agent(true, None, &["--interval", "500ms"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    let events_before = node.events().len();

    hca.set_port(false);
    let took = wait_until("the taint", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    // One interval, plus the API round trips and a loaded CI machine's scheduling.
    assert!(
        took < interval + Duration::from_millis(1500),
        "port down to taint took {took:?}"
    );
    eprintln!("port down -> taint on the real apiserver: {took:?} (interval {interval:?})");
    wait_until("condition, label and event", Duration::from_secs(5), || {
        node.events().len() > events_before
    });
    assert_eq!(node.label("fabricgate.io/ready").as_deref(), Some("false"));
    assert_eq!(
        node.label("fabricgate.io/rdma.ready").as_deref(),
        Some("false")
    );
    assert_eq!(
        node.label("fabricgate.io/rdma.active-ports").as_deref(),
        Some("0")
    );
    assert_eq!(
        node.label("fabricgate.io/rdma.rate-gbps"),
        None,
        "a label we no longer set is removed (server-side apply)"
    );
    let fabric = node.condition("FabricReady").unwrap();
    assert_eq!(fabric["status"], "False");
    assert_eq!(fabric["reason"], "PortDown");
    assert!(
        fabric["message"]
            .as_str()
            .unwrap()
            .contains("mlx5_0 port 1")
    );
    let ev = node.events().last().cloned().unwrap();
    assert_eq!(ev["reason"], "FabricNotReady");
    assert_eq!(ev["type"], "Warning");
    assert!(ev["note"].as_str().unwrap().contains("PortDown"), "{ev}");
    assert_eq!(
        node.taints(),
        vec!["nvidia.com/gpu", TAINT],
        "our taint goes after the others, whose order is kept"
    );

    // Back up: still tainted for recover_after - 1 good probes.
    hca.set_port(true);
    let up_at = Instant::now();
    wait_until("untaint", Duration::from_secs(15), || !node.has_our_taint());
    let took = up_at.elapsed();
    assert!(
        took >= interval * 2 - Duration::from_millis(200),
        "untainted after {took:?}: sooner than 3 probes"
    );
    assert_eq!(node.condition("FabricReady").unwrap()["status"], "True");
    assert_eq!(
        node.label("fabricgate.io/rdma.rate-gbps").as_deref(),
        Some("400")
    );
    drop(agent);
}

#[test]
fn restarting_the_agent_on_a_validated_node_writes_nothing() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-restart");
    let (hca, agent) = node.run_agent(true, None, &["--interval", "100ms"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    let (status, _) = agent.stop();
    assert!(status.success());
    let mark = cp.audit_mark();
    let agent = node.start_agent(&hca, &["--interval", "100ms"]);
    let until = Instant::now() + Duration::from_millis(2000);
    while Instant::now() < until {
        assert!(!node.has_our_taint(), "a restart re-tainted a healthy node");
        std::thread::sleep(Duration::from_millis(20));
    }
    let writes = node.agent_writes(mark);
    assert!(writes.is_empty(), "{writes:#?}");
    assert!(
        !node.agent_requests(mark).is_empty(),
        "the new agent did read its Node"
    );
    assert!(agent.log().contains("resuming"), "{}", agent.log());
    // And it still fails fast.
    hca.set_port(false);
    wait_until("the taint", Duration::from_secs(5), || node.has_our_taint());
}

#[test]
fn steady_state_makes_zero_writes_and_flapping_makes_no_taint_storm() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-flap");
    let (hca, mut agent) = node.run_agent(
        true,
        None,
        &["--interval", "20ms", "--resync-interval", "1h"],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    std::thread::sleep(Duration::from_millis(200));
    let mark = cp.audit_mark();
    // 100 ticks at 20ms (jittered down by up to 10%).
    std::thread::sleep(Duration::from_millis(2000));
    assert!(agent.alive());
    let requests = node.agent_requests(mark);
    assert!(
        requests.iter().all(|e| !e.is_write()),
        "writes at steady state: {requests:#?}"
    );
    assert!(
        requests.iter().all(|e| e.verb != "get"),
        "not even reads between resyncs: {requests:#?}"
    );

    // Flap the port for 2 s: up 10 ms, down 40 ms. With recover_after 3 the agent may only
    // untaint after three good probes in a row, which a 10 ms up phase never gives at a 20 ms
    // interval. An up phase this thread was descheduled in (1.5 intervals or more) may
    // legitimately untaint and the next down re-taint: two more writes each.
    let mark = cp.audit_mark();
    let until = Instant::now() + Duration::from_secs(2);
    let mut long_ups = 0;
    while Instant::now() < until {
        let up_since = Instant::now();
        hca.set_port(true);
        std::thread::sleep(Duration::from_millis(10));
        hca.set_port(false);
        if up_since.elapsed() >= Duration::from_millis(30) {
            long_ups += 1;
        }
        std::thread::sleep(Duration::from_millis(40));
    }
    std::thread::sleep(Duration::from_millis(500));
    let writes = node.taint_writes(mark);
    assert!(writes >= 1, "the first failure taints");
    assert!(
        writes <= 1 + 2 * long_ups,
        "{writes} taint writes while flapping ({long_ups} up phases long enough to recover): a storm"
    );
    assert!(node.has_our_taint());
    let all = node.agent_writes(mark).len();
    assert!(all <= 4 + 8 * long_ups, "{all} writes");
}

#[test]
fn a_live_watch_undoes_drift_at_once_without_periodic_reads() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-watch-drift");
    let (_hca, agent) = node.run_agent(
        true,
        None,
        &["--interval", "20ms", "--resync-interval", "100ms"],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    std::thread::sleep(Duration::from_millis(300));
    let mark = cp.audit_mark();
    std::thread::sleep(Duration::from_millis(1500));
    let requests = node.agent_requests(mark);
    assert!(
        requests.is_empty(),
        "with the watch live, 15 resyncs read nothing: {requests:#?}"
    );

    // Drift: someone removes our label, and puts our taint back by hand; the watch shows it
    // and the agent undoes both at once (it would take a resync period without the watch).
    cp.kubectl(&["label", "node", &node.name, "fabricgate.io/ready-"]);
    let took = wait_until("the label to come back", Duration::from_secs(5), || {
        node.label("fabricgate.io/ready").as_deref() == Some("true")
    });
    eprintln!("hand-removed label restored via the watch after {took:?}");
    cp.kubectl(&["taint", "node", &node.name, &format!("{TAINT}=:NoSchedule")]);
    wait_until("the hand-made taint to go", Duration::from_secs(5), || {
        !node.has_our_taint()
    });
    assert_eq!(node.taints(), vec!["nvidia.com/gpu"]);
    let writes = node.agent_writes(mark);
    assert_eq!(
        writes.len(),
        2,
        "one label apply, one taint patch: {writes:#?}"
    );
}

#[test]
fn without_a_watch_resync_reads_and_undoes_drift() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-resync");
    // Watches fail; everything else goes through.
    let proxy = FaultProxy::without_watches(&cp.url, &cp.ca_file);
    let (_hca, agent) = node.run_agent(
        true,
        Some(&proxy.url()),
        &["--interval", "20ms", "--resync-interval", "100ms"],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    std::thread::sleep(Duration::from_millis(200));
    let mark = cp.audit_mark();
    std::thread::sleep(Duration::from_millis(1500));
    let requests = node.agent_requests(mark);
    assert!(requests.iter().all(|e| !e.is_write()), "{requests:#?}");
    assert!(
        requests.iter().filter(|e| e.verb == "get").count() >= 5,
        "{requests:#?}"
    );
    cp.kubectl(&["label", "node", &node.name, "fabricgate.io/ready-"]);
    wait_until("the label to come back", Duration::from_secs(5), || {
        node.label("fabricgate.io/ready").as_deref() == Some("true")
    });
}

#[test]
fn a_hand_removed_taint_is_restored() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-untainted-by-hand");
    let (_hca, _agent) = node.run_agent(
        false,
        None,
        &["--interval", "100ms", "--resync-interval", "500ms"],
    );
    wait_until("a condition", Duration::from_secs(30), || {
        node.condition("FabricReady").is_some()
    });
    assert!(node.has_our_taint());
    let mark = cp.audit_mark();
    // The watch shows the removal at once: the agent may restore the taint before this test
    // could read the Node, so the audit log proves it was gone and put back.
    cp.kubectl(&["taint", "node", &node.name, &format!("{TAINT}-")]);
    let took = wait_until("the taint to be restored", Duration::from_secs(10), || {
        node.has_our_taint() && node.taint_writes(mark) == 1
    });
    eprintln!("hand-removed taint restored after {took:?}");
    assert_eq!(node.taints(), vec!["nvidia.com/gpu", TAINT]);
}

#[test]
fn api_outage_is_survived_and_converges_after() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-outage");
    let proxy = FaultProxy::start(&cp.url, &cp.ca_file);
    let interval = Duration::from_millis(100);
    let (hca, mut agent) = node.run_agent(true, Some(&proxy.url()), &["--interval", "100ms"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());

    // 30 intervals of outage (5 minutes at the default 10s), cycling through the faults,
    // while the port goes down.
    hca.set_port(false);
    for fault in [
        Fault::Reset,
        Fault::Status {
            code: 500,
            retry_after: None,
            plain: false,
        },
        Fault::Status {
            code: 503,
            retry_after: None,
            plain: true,
        },
        Fault::Status {
            code: 429,
            retry_after: Some(1),
            plain: false,
        },
    ] {
        proxy.set_fault(fault);
        std::thread::sleep(interval * 8);
        assert!(agent.alive(), "the agent died during the outage");
    }
    proxy.set_fault(Fault::Stall(Duration::from_millis(300)));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!node.has_our_taint(), "the outage kept the taint out");
    proxy.clear_fault();
    let cleared = Instant::now();
    // Retry-After (1s) may still be pending from the last 429, then one backoff.
    wait_until("convergence", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    assert!(
        cleared.elapsed() < Duration::from_secs(1) + interval * 2 + Duration::from_secs(3),
        "{:?}",
        cleared.elapsed()
    );
    wait_until("conditions", Duration::from_secs(5), || {
        node.condition("FabricReady")
            .is_some_and(|c| c["status"] == "False")
    });
    assert!(agent.alive());
    wait_until("the recovery log line", Duration::from_secs(5), || {
        agent.log().contains("reachable again")
    });
    assert!(agent.log().contains("backing off"));
    let seen = proxy.seen();
    for code in [0, 500, 503, 429] {
        assert!(
            seen.iter().any(|s| s.status == code),
            "the agent met fault {code}: {seen:?}"
        );
    }
}

/// Both forms of 429: a Status body with `details.retryAfterSeconds`, and API Priority and
/// Fairness's plain-text body where only the `Retry-After` header says how long.
#[test]
fn retry_after_is_honoured() {
    let Some(cp) = control_plane() else { return };
    for (i, plain) in [false, true].into_iter().enumerate() {
        let node = TestNode::seeded(cp, &format!("agent-retry-after-{i}"));
        let proxy = FaultProxy::start(&cp.url, &cp.ca_file);
        let hca = FakeHca::new(true);
        let kubeconfig = node.agent_kubeconfig(Some(&proxy.url()));
        let agent = start_agent(&node.name, &hca, Some(&kubeconfig), &["--interval", "50ms"]);
        agent.wait("validation", Duration::from_secs(30), || node.ready());
        proxy.set_fault(Fault::Status {
            code: 429,
            retry_after: Some(2),
            plain,
        });
        proxy.reset_seen();
        hca.set_port(false);
        std::thread::sleep(Duration::from_millis(3000));
        let throttled: Vec<Instant> = proxy
            .seen()
            .iter()
            .filter(|r| r.status == 429)
            .map(|r| r.at)
            .collect();
        assert!(!throttled.is_empty());
        // Backoff alone would retry every <= 50ms: 60 requests in 3s.
        assert!(
            throttled.len() <= 2,
            "plain={plain}: {} requests while throttled",
            throttled.len()
        );
        for pair in throttled.windows(2) {
            assert!(
                pair[1] - pair[0] >= Duration::from_millis(1900),
                "plain={plain}"
            );
        }
        proxy.clear_fault();
        wait_until("convergence", Duration::from_secs(10), || {
            node.has_our_taint()
        });
    }
}

#[test]
fn concurrent_writer_conflict_is_retried_and_its_taint_kept() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-conflict");
    // Without its watch the agent reads the Node before it writes: the other writer gets in
    // between that read and the write. (With the watch, a stale view fails the same way.)
    let proxy = FaultProxy::without_watches(&cp.url, &cp.ca_file);
    let (hca, agent) = node.run_agent(true, Some(&proxy.url()), &["--interval", "200ms"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());

    // Between the agent's read and its taint write, another controller adds a taint.
    let name = node.name.clone();
    proxy.after_next_get(&format!("/api/v1/nodes/{name}"), move || {
        if let Some(cp) = control_plane() {
            cp.kubectl(&[
                "taint",
                "node",
                &name,
                "example.com/maintenance=:NoSchedule",
            ]);
        }
    });
    proxy.reset_seen();
    hca.set_port(false);
    wait_until("the taint", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    let conflicts: Vec<_> = proxy
        .seen()
        .into_iter()
        .filter(|r| r.status == 409 || r.status == 422)
        .collect();
    assert_eq!(
        conflicts.len(),
        1,
        "the stale write was rejected once: {conflicts:?}"
    );
    // kubectl put its taint first; ours goes last, the others keep their order.
    assert_eq!(
        node.taints(),
        vec!["example.com/maintenance", "nvidia.com/gpu", TAINT]
    );
}

#[test]
fn sigterm_exits_cleanly_within_5s_even_with_a_write_in_flight() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-sigterm");
    let proxy = FaultProxy::start(&cp.url, &cp.ca_file);
    let (hca, agent) = node.run_agent(true, Some(&proxy.url()), &["--interval", "100ms"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    // A hung API server: the next write never finishes on its own.
    proxy.set_fault(Fault::Stall(Duration::from_secs(30)));
    hca.set_port(false);
    std::thread::sleep(Duration::from_millis(400));
    let (status, took) = agent.stop();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn sigterm_during_startup_against_a_hung_api_server_exits_within_5s() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-sigterm-start");
    let proxy = FaultProxy::start(&cp.url, &cp.ca_file);
    proxy.set_fault(Fault::Stall(Duration::from_secs(30)));
    let (_hca, agent) = node.run_agent(true, Some(&proxy.url()), &["--interval", "100ms"]);
    wait_until("the first read to hang", Duration::from_secs(10), || {
        !proxy.seen().is_empty() || agent.log().contains("probe")
    });
    std::thread::sleep(Duration::from_millis(500));
    let (status, took) = agent.stop();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn sigint_exits_cleanly() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-sigint");
    let (_hca, mut agent) = node.run_agent(false, None, &["--interval", "100ms"]);
    wait_until("a condition", Duration::from_secs(30), || {
        node.condition("FabricReady").is_some()
    });
    let started = Instant::now();
    signal(&agent.child, "INT");
    let status = wait_exit(&mut agent.child, Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(agent.log().contains("SIGINT"));
}

#[test]
fn a_node_that_starts_bad_is_described_but_gets_no_event_until_it_changes() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-starts-bad");
    let hca = FakeHca::new(false);
    let mark = cp.audit_mark();
    let _agent = node.start_agent(&hca, &["--interval", "100ms"]);
    wait_until("a condition", Duration::from_secs(30), || {
        node.condition("FabricReady").is_some()
    });
    wait_until("the event", Duration::from_secs(5), || {
        !node.events().is_empty()
    });
    std::thread::sleep(Duration::from_millis(300));
    // Registered with our taint already: no taint write is needed.
    assert_eq!(node.taint_writes(mark), 0);
    assert!(node.has_our_taint());
    assert_eq!(node.condition("FabricReady").unwrap()["reason"], "PortDown");
    let events = node.events();
    assert_eq!(events.len(), 1, "absent -> not ready is a transition");
    assert_eq!(events[0]["reason"], "FabricNotReady");
}

#[test]
fn dry_run_with_a_cluster_reads_and_logs_the_difference_without_writing() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-dry-run");
    let hca = FakeHca::new(false);
    let mark = cp.audit_mark();
    let agent = node.start_agent(&hca, &["--interval", "100ms", "--dry-run"]);
    wait_until("dry-run diff", Duration::from_secs(20), || {
        agent
            .log()
            .contains("would write condition FabricReady=False")
    });
    std::thread::sleep(Duration::from_millis(500));
    let requests = node.agent_requests(mark);
    assert!(requests.iter().all(|e| !e.is_write()), "{requests:#?}");
    assert!(requests.iter().any(|e| e.verb == "get"), "{requests:#?}");
    assert!(
        node.condition("FabricReady").is_none(),
        "nothing was written"
    );
    let log = agent.log();
    assert!(
        log.contains("fabricgate.io/ready: (none) -> false"),
        "{log}"
    );
    assert_eq!(log.matches("would write labels").count(), 1, "{log}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-json-logs");
    let (_hca, agent) = node.run_agent(
        false,
        None,
        &["--interval", "100ms", "--log-format", "json"],
    );
    wait_until("a condition", Duration::from_secs(30), || {
        node.condition("FabricReady").is_some()
    });
    let log_path = agent.log.clone();
    let (status, _) = agent.stop();
    assert!(status.success());
    let log = std::fs::read_to_string(log_path).unwrap();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert!(lines.iter().any(|l| {
        l["message"] == "applied conditions"
            && l["conditions"]
                .as_str()
                .unwrap()
                .contains("FabricReady=False(PortDown)")
    }));
    assert!(lines.iter().all(|l| l["level"].is_string()));
}

/// The committed 8 x 400G NDR fixture trees drive the Node through the real binary.
#[test]
fn committed_fixtures_drive_the_node() {
    let Some(cp) = control_plane() else { return };
    let scratch = tempfile::tempdir().unwrap();
    for (fixture, ready_expected) in [("ndr-8x400-healthy", true), ("ndr-port-down", false)] {
        let node = TestNode::seeded(cp, &format!("fixture-{fixture}"));
        let root = committed_fixture(fixture);
        let kubeconfig = node.agent_kubeconfig(None);
        let config = committed_fixture("requirements-ndr.yaml");
        let agent = start_agent_at(
            &node.name,
            &root.join("sys"),
            &root.join("proc"),
            scratch.path(),
            Some(&kubeconfig),
            &["--interval", "100ms", "--config", config.to_str().unwrap()],
        );
        if ready_expected {
            agent.wait(fixture, Duration::from_secs(30), || node.ready());
            assert_eq!(
                node.label("fabricgate.io/rdma.active-ports").as_deref(),
                Some("8")
            );
            assert_eq!(
                node.label("fabricgate.io/rdma.rate-gbps").as_deref(),
                Some("400")
            );
        } else {
            wait_until(fixture, Duration::from_secs(30), || {
                node.has_reason("FabricReady", "PortDown")
            });
            assert!(node.has_our_taint());
            assert_eq!(node.label("fabricgate.io/ready").as_deref(), Some("false"));
        }
    }
}

/// Zero writes at steady state, from the apiserver's audit log over a quiet minute at the
/// default resync interval; and the per-node-hour figures.
#[test]
fn a_quiet_minute_costs_no_writes_in_the_audit_log() {
    let Some(cp) = control_plane() else { return };
    let node = TestNode::seeded(cp, "agent-quiet-minute");
    let (_hca, agent) = node.run_agent(true, None, &["--interval", "1s"]);
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    std::thread::sleep(Duration::from_secs(1));
    let mark = cp.audit_mark();
    let quiet = Duration::from_secs(60);
    std::thread::sleep(quiet);
    let requests = node.agent_requests(mark);
    let writes = requests.iter().filter(|e| e.is_write()).count();
    let reads = requests.len() - writes;
    let per_hour = |n: usize| n as f64 * 3600.0 / quiet.as_secs_f64();
    eprintln!(
        "quiet minute (--interval 1s, default resync): {writes} writes, {reads} reads by {AGENT_USER} \
         => {:.0} writes and {:.0} reads per node-hour: {:?}",
        per_hour(writes),
        per_hour(reads),
        requests
            .iter()
            .map(|e| format!("{} {}", e.verb, e.resource_path()))
            .collect::<Vec<_>>()
    );
    assert_eq!(writes, 0, "{requests:#?}");
    // The watch is live: no periodic reads (at most one re-watch if the server ended it).
    assert!(requests.iter().all(|e| e.verb == "watch"), "{requests:#?}");
    assert!(reads <= 1, "{requests:#?}");
}
