//! `fabricgate run` end to end: the real binary against the API-server stand-in, over a
//! fixture sysfs tree whose port the tests flip.

mod support;

use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use support::apiserver::{ApiServer, Fault};
use support::sysfs::FakeHca;

const NODE: &str = "gpu-node-1";
const TAINT: &str = "fabricgate.io/unvalidated";

struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn stop(mut self) -> (ExitStatus, Duration) {
        let started = Instant::now();
        signal(&self.child, "TERM");
        let status = wait_exit(&mut self.child, Duration::from_secs(10));
        (status, started.elapsed())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig}");
}

fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Start `fabricgate run` against `api` (no api: no kubeconfig at all).
fn start_agent(hca: &FakeHca, api: Option<&ApiServer>, extra: &[&str]) -> Agent {
    static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = hca.scratch().join(format!("agent-{n}.log"));
    let kubeconfig = hca.scratch().join("kubeconfig");
    match api {
        Some(api) => api.write_kubeconfig(&kubeconfig),
        None => {
            let _ = std::fs::remove_file(&kubeconfig);
        }
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fabricgate"));
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(hca.sysfs_root())
        .arg("--proc-root")
        .arg(hca.proc_root())
        .args(["--verbs", "off", "--metrics-addr", "127.0.0.1:0"])
        .args(extra)
        .env("KUBECONFIG", &kubeconfig)
        .env("HOME", hca.scratch())
        .env("NODE_NAME", NODE)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    Agent {
        child: cmd.spawn().unwrap(),
        log,
    }
}

fn seeded_api() -> ApiServer {
    let api = ApiServer::start();
    let mut node = ApiServer::kubelet_node(NODE);
    // Registered as the docs recommend, plus what other owners put there.
    node["metadata"]["labels"]["team"] = json!("ml");
    node["spec"]["taints"] = json!([
        { "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" },
        { "key": TAINT, "effect": "NoSchedule" },
    ]);
    api.seed_node(node);
    api
}

fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    loop {
        if f() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn taints(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| t["key"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn has_our_taint(api: &ApiServer) -> bool {
    taints(&api.node(NODE).unwrap()).iter().any(|k| k == TAINT)
}

fn label(api: &ApiServer, key: &str) -> Option<String> {
    api.node(NODE).unwrap()["metadata"]["labels"][key]
        .as_str()
        .map(str::to_owned)
}

fn condition(api: &ApiServer, type_: &str) -> Option<Value> {
    api.node(NODE).unwrap()["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == json!(type_))
        .cloned()
}

/// Validated, and the Event for it recorded (it is the last write of a transition).
fn ready(api: &ApiServer) -> bool {
    !has_our_taint(api)
        && label(api, "fabricgate.io/ready").as_deref() == Some("true")
        && api
            .events()
            .last()
            .is_some_and(|e| e["reason"] == "FabricReady")
}

/// Writes of one kind, by path and content type.
fn taint_writes(api: &ApiServer) -> usize {
    api.requests()
        .iter()
        .filter(|r| {
            r.verb == "patch"
                && r.status == 200
                && r.content_type.as_deref() == Some("application/json-patch+json")
        })
        .count()
}

#[test]
fn healthy_node_is_validated_after_recover_after_probes_and_keeps_others_fields() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let agent = start_agent(&hca, Some(&api), &["--interval", "200ms"]);
    wait_until("validation", Duration::from_secs(20), || ready(&api));

    let node = api.node(NODE).unwrap();
    let labels = &node["metadata"]["labels"];
    assert_eq!(labels["fabricgate.io/ready"], "true");
    assert_eq!(labels["fabricgate.io/rdma.ready"], "true");
    assert_eq!(labels["fabricgate.io/rdma.active-ports"], "1");
    assert_eq!(labels["fabricgate.io/rdma.link-layer"], "InfiniBand");
    assert_eq!(labels["fabricgate.io/rdma.rate-gbps"], "400");
    assert_eq!(labels["fabricgate.io/lustre.ready"], "true");
    assert_eq!(labels["team"], "ml", "another owner's label survives");
    assert_eq!(
        taints(&node),
        vec!["nvidia.com/gpu"],
        "only our taint was removed"
    );
    let fabric = condition(&api, "FabricReady").unwrap();
    assert_eq!(fabric["status"], "True");
    assert_eq!(fabric["reason"], "FabricValidated");
    assert_eq!(condition(&api, "RDMAReady").unwrap()["status"], "True");
    assert_eq!(condition(&api, "LustreReady").unwrap()["status"], "True");
    assert_eq!(
        condition(&api, "Ready").unwrap()["reason"],
        "KubeletReady",
        "the kubelet's condition survives"
    );
    let events = api.events();
    assert_eq!(
        events.len(),
        1,
        "one event for the one transition: {events:#?}"
    );
    assert_eq!(events[0]["reason"], "FabricReady");
    assert_eq!(events[0]["type"], "Normal");
    assert_eq!(events[0]["regarding"]["kind"], "Node");
    assert_eq!(events[0]["regarding"]["name"], NODE);
    assert_eq!(events[0]["regarding"]["uid"], node["metadata"]["uid"]);

    // Untainted only after recover_after (3) probes: at 200ms that is >= ~2 intervals after
    // the first probe; the agent's own log says how many good probes it counted.
    assert!(agent.log().contains("good_probes=3"), "{}", agent.log());
    let (status, took) = agent.stop();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn port_down_taints_within_one_interval_and_recovers_after_recover_after_probes() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let interval = Duration::from_millis(500);
    let agent = start_agent(&hca, Some(&api), &["--interval", "500ms"]);
    wait_until("validation", Duration::from_secs(20), || ready(&api));
    let events_before = api.events().len();

    hca.set_port(false);
    let took = wait_until("the taint", Duration::from_secs(10), || has_our_taint(&api));
    // One interval, plus the API round trips and a loaded CI machine's scheduling.
    assert!(
        took < interval + Duration::from_millis(700),
        "port down to taint took {took:?}"
    );
    wait_until("condition, label and event", Duration::from_secs(2), || {
        api.events().len() > events_before
    });
    assert_eq!(label(&api, "fabricgate.io/ready").as_deref(), Some("false"));
    assert_eq!(
        label(&api, "fabricgate.io/rdma.ready").as_deref(),
        Some("false")
    );
    assert_eq!(
        label(&api, "fabricgate.io/rdma.active-ports").as_deref(),
        Some("0")
    );
    assert_eq!(
        label(&api, "fabricgate.io/rdma.rate-gbps"),
        None,
        "a label we no longer set is removed (server-side apply)"
    );
    let fabric = condition(&api, "FabricReady").unwrap();
    assert_eq!(fabric["status"], "False");
    assert_eq!(fabric["reason"], "PortDown");
    assert!(
        fabric["message"]
            .as_str()
            .unwrap()
            .contains("mlx5_0 port 1")
    );
    let ev = api.events().last().cloned().unwrap();
    assert_eq!(ev["reason"], "FabricNotReady");
    assert_eq!(ev["type"], "Warning");
    assert!(ev["note"].as_str().unwrap().contains("PortDown"), "{ev}");
    assert_eq!(
        taints(&api.node(NODE).unwrap()),
        vec!["nvidia.com/gpu", TAINT],
        "our taint goes after the others, whose order is kept"
    );

    // Back up: still tainted for recover_after - 1 good probes.
    hca.set_port(true);
    let up_at = Instant::now();
    wait_until("untaint", Duration::from_secs(10), || !has_our_taint(&api));
    let took = up_at.elapsed();
    assert!(
        took >= interval * 2 - Duration::from_millis(200),
        "untainted after {took:?}: sooner than 3 probes"
    );
    assert!(took < interval * 4 + Duration::from_secs(1), "{took:?}");
    assert_eq!(condition(&api, "FabricReady").unwrap()["status"], "True");
    assert_eq!(
        label(&api, "fabricgate.io/rdma.rate-gbps").as_deref(),
        Some("400")
    );
    drop(agent);
}

#[test]
fn restarting_the_agent_on_a_validated_node_writes_nothing() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let agent = start_agent(&hca, Some(&api), &["--interval", "100ms"]);
    wait_until("validation", Duration::from_secs(20), || ready(&api));
    let (status, _) = agent.stop();
    assert!(status.success());
    api.reset_requests();
    let agent = start_agent(&hca, Some(&api), &["--interval", "100ms"]);
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        assert!(!has_our_taint(&api), "a restart re-tainted a healthy node");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(api.writes(), 0, "{:?}", api.counts());
    assert!(agent.log().contains("resuming"), "{}", agent.log());
    // And it still fails fast.
    hca.set_port(false);
    wait_until("the taint", Duration::from_secs(5), || has_our_taint(&api));
}

#[test]
fn steady_state_makes_zero_writes_and_flapping_makes_no_taint_storm() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let mut agent = start_agent(
        &hca,
        Some(&api),
        &["--interval", "20ms", "--resync-interval", "1h"],
    );
    wait_until("validation", Duration::from_secs(20), || ready(&api));
    std::thread::sleep(Duration::from_millis(100));
    api.reset_requests();
    // 100 ticks at 20ms (jittered down by up to 10%).
    std::thread::sleep(Duration::from_millis(2000));
    assert!(agent.alive());
    assert_eq!(api.writes(), 0, "{:?}", api.counts());
    assert_eq!(
        api.count("get"),
        0,
        "not even reads between resyncs: {:?}",
        api.counts()
    );

    // Flap the port for 2 s: up 10 ms, down 40 ms. With recover_after 3 the agent may only
    // untaint after three good probes in a row, which a 10 ms up phase never gives at a 20 ms
    // interval. On a loaded machine this thread can be descheduled while the port is up; an
    // up phase that really lasted 1.5 intervals or more may legitimately untaint (and the
    // next down re-taint), so each such phase allows two more writes. Anything beyond that
    // is a storm.
    api.reset_requests();
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
    std::thread::sleep(Duration::from_millis(300));
    let writes = taint_writes(&api);
    assert!(writes >= 1, "the first failure taints");
    assert!(
        writes <= 1 + 2 * long_ups,
        "{writes} taint writes while flapping ({long_ups} up phases long enough to recover): a storm"
    );
    assert!(has_our_taint(&api));
    assert!(api.writes() <= 4 + 8 * long_ups, "{:?}", api.counts());
}

#[test]
fn resync_reads_but_does_not_write_at_steady_state() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let _agent = start_agent(
        &hca,
        Some(&api),
        &["--interval", "20ms", "--resync-interval", "100ms"],
    );
    wait_until("validation", Duration::from_secs(20), || ready(&api));
    std::thread::sleep(Duration::from_millis(100));
    api.reset_requests();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(api.writes(), 0, "{:?}", api.counts());
    assert!(api.count("get") >= 5, "{:?}", api.counts());

    // Drift: someone removes our labels by hand; the next resync puts them back.
    api.modify_node(NODE, "kubectl-edit", |n| {
        n["metadata"]["labels"]
            .as_object_mut()
            .unwrap()
            .remove("fabricgate.io/ready");
    });
    wait_until("the label to come back", Duration::from_secs(5), || {
        label(&api, "fabricgate.io/ready").as_deref() == Some("true")
    });
}

#[test]
fn api_outage_is_survived_and_converges_after() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let interval = Duration::from_millis(100);
    let mut agent = start_agent(&hca, Some(&api), &["--interval", "100ms"]);
    wait_until("validation", Duration::from_secs(20), || ready(&api));

    // 30 intervals of outage (5 minutes at the default 10s), cycling through the faults,
    // while the port goes down.
    hca.set_port(false);
    for fault in [
        Fault::DropConnection,
        Fault::InternalError,
        Fault::TooManyRequests {
            retry_after_secs: 1,
        },
    ] {
        api.set_fault(fault);
        std::thread::sleep(interval * 10);
        assert!(agent.alive(), "the agent died during the outage");
    }
    api.set_latency(Duration::from_millis(300));
    std::thread::sleep(Duration::from_millis(300));
    api.set_latency(Duration::ZERO);
    assert!(!has_our_taint(&api), "the outage kept the taint out");
    api.clear_fault();
    let cleared = Instant::now();
    // Retry-After (1s) may still be pending from the last 429, then one backoff (<= interval).
    wait_until("convergence", Duration::from_secs(5), || {
        has_our_taint(&api)
    });
    assert!(
        cleared.elapsed() < Duration::from_secs(1) + interval * 2 + Duration::from_secs(2),
        "{:?}",
        cleared.elapsed()
    );
    wait_until("conditions", Duration::from_secs(2), || {
        condition(&api, "FabricReady").is_some_and(|c| c["status"] == "False")
    });
    assert!(agent.alive());
    wait_until("the recovery log line", Duration::from_secs(2), || {
        agent.log().contains("reachable again")
    });
    assert!(agent.log().contains("backing off"));
}

/// Both forms of 429: a Status body with `details.retryAfterSeconds`, and API Priority and
/// Fairness's plain-text body where only the `Retry-After` header says how long.
#[test]
fn retry_after_is_honoured() {
    for fault in [
        Fault::TooManyRequests {
            retry_after_secs: 2,
        },
        Fault::TooManyRequestsPlain {
            retry_after_secs: 2,
        },
    ] {
        let hca = FakeHca::new(true);
        let api = seeded_api();
        let _agent = start_agent(&hca, Some(&api), &["--interval", "50ms"]);
        wait_until("validation", Duration::from_secs(20), || ready(&api));
        api.set_fault(fault.clone());
        api.reset_requests();
        hca.set_port(false);
        std::thread::sleep(Duration::from_millis(3000));
        let throttled: Vec<Instant> = api
            .requests()
            .iter()
            .filter(|r| r.status == 429)
            .map(|r| r.at)
            .collect();
        assert!(!throttled.is_empty());
        // Backoff alone would retry every <= 50ms: 60 requests in 3s.
        assert!(
            throttled.len() <= 2,
            "{fault:?}: {} requests while throttled",
            throttled.len()
        );
        for pair in throttled.windows(2) {
            assert!(
                pair[1] - pair[0] >= Duration::from_millis(1900),
                "{fault:?}"
            );
        }
        api.clear_fault();
        wait_until("convergence", Duration::from_secs(5), || {
            has_our_taint(&api)
        });
    }
}

#[test]
fn concurrent_writer_conflict_is_retried_and_its_taint_kept() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let _agent = start_agent(&hca, Some(&api), &["--interval", "200ms"]);
    wait_until("validation", Duration::from_secs(20), || ready(&api));

    // Between the agent's read and its taint write, another controller adds a taint.
    api.after_next_get(NODE, |n| {
        n["spec"]["taints"]
            .as_array_mut()
            .unwrap()
            .push(json!({ "key": "example.com/maintenance", "effect": "NoSchedule" }));
    });
    api.reset_requests();
    hca.set_port(false);
    wait_until("the taint", Duration::from_secs(5), || has_our_taint(&api));
    let conflicts = api
        .requests()
        .iter()
        .filter(|r| r.status == 409 || r.status == 422)
        .count();
    assert_eq!(conflicts, 1, "the stale write was rejected once");
    assert_eq!(
        taints(&api.node(NODE).unwrap()),
        vec!["nvidia.com/gpu", "example.com/maintenance", TAINT]
    );
}

#[test]
fn sigterm_exits_cleanly_within_5s_even_with_a_write_in_flight() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let agent = start_agent(&hca, Some(&api), &["--interval", "100ms"]);
    wait_until("validation", Duration::from_secs(20), || ready(&api));
    // A hung API server: the next write never finishes on its own.
    api.set_latency(Duration::from_secs(30));
    hca.set_port(false);
    std::thread::sleep(Duration::from_millis(400));
    let (status, took) = agent.stop();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn sigterm_during_startup_against_a_hung_api_server_exits_within_5s() {
    let hca = FakeHca::new(true);
    let api = seeded_api();
    api.set_latency(Duration::from_secs(30));
    let agent = start_agent(&hca, Some(&api), &["--interval", "100ms"]);
    // The stand-in logs a request when it answers, which a hung server does not: give the
    // agent time to start and send its first read, then stop it while that read hangs.
    std::thread::sleep(Duration::from_millis(800));
    let (status, took) = agent.stop();
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
}

#[test]
fn sigint_exits_cleanly() {
    let hca = FakeHca::new(false);
    let api = seeded_api();
    let mut agent = start_agent(&hca, Some(&api), &["--interval", "100ms"]);
    wait_until("a condition", Duration::from_secs(20), || {
        condition(&api, "FabricReady").is_some()
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
    let hca = FakeHca::new(false);
    let api = seeded_api();
    let _agent = start_agent(&hca, Some(&api), &["--interval", "100ms"]);
    wait_until("a condition", Duration::from_secs(20), || {
        condition(&api, "FabricReady").is_some()
    });
    std::thread::sleep(Duration::from_millis(300));
    // Registered with our taint already: no taint write is needed.
    assert_eq!(taint_writes(&api), 0);
    assert!(has_our_taint(&api));
    assert_eq!(
        condition(&api, "FabricReady").unwrap()["reason"],
        "PortDown"
    );
    assert_eq!(api.events().len(), 1, "absent -> not ready is a transition");
    assert_eq!(api.events()[0]["reason"], "FabricNotReady");
}

#[test]
fn missing_node_name_is_a_usage_error() {
    let hca = FakeHca::new(true);
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .arg("run")
        .arg("--sysfs-root")
        .arg(hca.sysfs_root())
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("NODE_NAME"), "{err}");
}

#[test]
fn without_a_cluster_run_fails_clearly_unless_dry_run() {
    let hca = FakeHca::new(true);
    let mut agent = start_agent(&hca, None, &["--interval", "100ms"]);
    let status = wait_exit(&mut agent.child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(2));
    assert!(agent.log().contains("--dry-run"), "{}", agent.log());

    let agent = start_agent(&hca, None, &["--interval", "100ms", "--dry-run"]);
    wait_until("dry-run log", Duration::from_secs(10), || {
        agent.log().contains("would set taint none")
    });
    hca.set_port(false);
    wait_until("dry-run log of the change", Duration::from_secs(10), || {
        agent
            .log()
            .contains("would set taint fabricgate.io/unvalidated:NoSchedule")
            && agent.log().contains("PortDown")
    });
    let log = agent.log();
    // Logged at each change, not each tick.
    assert!(log.matches("would set taint").count() <= 3, "{log}");
    let (status, _) = agent.stop();
    assert!(status.success());
}

#[test]
fn dry_run_with_a_cluster_reads_and_logs_the_difference_without_writing() {
    let hca = FakeHca::new(false);
    let api = seeded_api();
    let agent = start_agent(&hca, Some(&api), &["--interval", "100ms", "--dry-run"]);
    wait_until("dry-run diff", Duration::from_secs(10), || {
        agent
            .log()
            .contains("would write condition FabricReady=False")
    });
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(api.writes(), 0, "{:?}", api.counts());
    assert!(api.count("get") >= 1);
    let log = agent.log();
    assert!(
        log.contains("fabricgate.io/ready: (none) -> false"),
        "{log}"
    );
    assert_eq!(log.matches("would write labels").count(), 1, "{log}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let hca = FakeHca::new(false);
    let api = seeded_api();
    let agent = start_agent(
        &hca,
        Some(&api),
        &["--interval", "100ms", "--log-format", "json"],
    );
    wait_until("a condition", Duration::from_secs(20), || {
        condition(&api, "FabricReady").is_some()
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

/// The closing-note numbers. Run with
/// `cargo test -p fabricgate --test agent -- --ignored --nocapture measure`.
#[test]
#[ignore = "measurement: ~1 minute"]
fn measure_port_down_to_taint_and_steady_state_requests() {
    // Time from the port going down to the taint written, at a 1 s interval (the probe phase is
    // uniform over the interval; the rest is the GET and the JSON patch).
    let hca = FakeHca::new(true);
    let api = seeded_api();
    let interval = Duration::from_secs(1);
    let agent = start_agent(
        &hca,
        Some(&api),
        &["--interval", "1s", "--log-format", "json"],
    );
    wait_until("validation", Duration::from_secs(20), || ready(&api));
    let mut took = Vec::new();
    for _ in 0..10 {
        hca.set_port(false);
        took.push(wait_until("taint", Duration::from_secs(5), || {
            has_our_taint(&api)
        }));
        hca.set_port(true);
        wait_until("untaint", Duration::from_secs(10), || ready(&api));
        // Desynchronise the next flip from the probe phase.
        std::thread::sleep(Duration::from_millis(137));
    }
    took.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "port down -> taint at --interval 1s over {} flips: min {:.0} ms, median {:.0} ms, max {:.0} ms",
        took.len(),
        ms(took[0]),
        ms(took[took.len() / 2]),
        ms(took[took.len() - 1])
    );
    assert!(
        took.iter()
            .all(|d| *d < interval + Duration::from_millis(500))
    );
    // The agent's own part: from the probe that saw the port down to the taint written.
    let mut seen: Option<k8s_openapi::jiff::Timestamp> = None;
    let mut reaction = Vec::new();
    for line in agent.log().lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let at: k8s_openapi::jiff::Timestamp = v["timestamp"].as_str().unwrap().parse().unwrap();
        match v["message"].as_str().unwrap() {
            "node not ready" => seen = Some(at),
            "added taint" => {
                if let Some(s) = seen.take() {
                    reaction.push(Duration::try_from(at - s).unwrap());
                }
            }
            _ => {}
        }
    }
    reaction.sort();
    assert_eq!(reaction.len(), 10);
    println!(
        "probe verdict -> taint written (GET + JSON patch on the stand-in): min {:.1} ms, median {:.1} ms, max {:.1} ms",
        ms(reaction[0]),
        ms(reaction[5]),
        ms(reaction[9])
    );
    drop(agent);

    // Steady state: writes and reads over 100 resync periods, scaled to the defaults
    // (--interval 10s, --resync-interval 60s).
    let api = seeded_api();
    let _agent = start_agent(
        &hca,
        Some(&api),
        &["--interval", "10ms", "--resync-interval", "100ms"],
    );
    wait_until("validation", Duration::from_secs(20), || ready(&api));
    std::thread::sleep(Duration::from_millis(200));
    api.reset_requests();
    std::thread::sleep(Duration::from_secs(10));
    let writes = api.writes();
    let gets = api.count("get");
    let periods = 100.0;
    println!(
        "steady state over {periods} resync periods (1000 probes): {writes} writes, {gets} reads \
         => per node per hour at the defaults: {:.0} writes, {:.0} reads",
        writes as f64 / periods * 60.0,
        gets as f64 / periods * 60.0
    );
    assert_eq!(writes, 0);
}

fn committed_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The committed 8 x 400G NDR fixture trees drive the Node through the real binary.
#[test]
fn committed_fixtures_drive_the_node() {
    let scratch = FakeHca::new(true);
    for (fixture, ready_expected) in [("ndr-8x400-healthy", true), ("ndr-port-down", false)] {
        let api = seeded_api();
        let root = committed_fixture(fixture);
        let kubeconfig = scratch.scratch().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig);
        let mut child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
            .arg("run")
            .arg("--sysfs-root")
            .arg(root.join("sys"))
            .arg("--proc-root")
            .arg(root.join("proc"))
            .arg("--config")
            .arg(committed_fixture("requirements-ndr.yaml"))
            .args(["--verbs", "off", "--metrics-addr", "127.0.0.1:0"])
            .args(["--interval", "100ms"])
            .env("KUBECONFIG", &kubeconfig)
            .env("NODE_NAME", NODE)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        if ready_expected {
            wait_until(fixture, Duration::from_secs(20), || ready(&api));
            assert_eq!(
                label(&api, "fabricgate.io/rdma.active-ports").as_deref(),
                Some("8")
            );
            assert_eq!(
                label(&api, "fabricgate.io/rdma.rate-gbps").as_deref(),
                Some("400")
            );
        } else {
            wait_until(fixture, Duration::from_secs(20), || {
                condition(&api, "FabricReady").is_some_and(|c| c["reason"] == "PortDown")
            });
            assert!(has_our_taint(&api));
            assert_eq!(label(&api, "fabricgate.io/ready").as_deref(), Some("false"));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}
