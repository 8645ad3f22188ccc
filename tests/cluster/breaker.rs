//! The blast-radius breaker against the real kube-apiserver: a pool of 10 Nodes (a label
//! selector, as the DaemonSet's nodeSelector), half of them already tainted; the agent of a
//! sixth failing node does not taint it and says why, and taints once the pool recovers.

use crate::common::controlplane::{AuditEvent, ControlPlane};
use crate::common::guard::{
    GUARD_NS, Guard, published_pool, shipped_guard_lease, shipped_lease, start_guard,
};
use crate::common::sysfs::FakeHca;
use crate::common::{TAINT, TestNode, control_plane, wait_until};
use serde_json::json;
use std::time::Duration;

const POOL: &str = "fabricgate.io/test-pool";

/// The pool `POOL=<pool>` of 10 Nodes `<pool>-0..9`: 0–4 failing, tainted by their agents
/// (not running here), 5–8 validated, 9 this test's: registered with the taint as the docs
/// recommend, its agent started over that pool (`--interval 300ms`, `--resync-interval 1s`)
/// and validated (it untaints whatever the pool looks like: the breaker never blocks recovery).
fn half_tainted_pool(
    cp: &'static ControlPlane,
    pool: &str,
) -> (Vec<String>, TestNode, FakeHca, crate::common::Agent) {
    let names: Vec<String> = (0..10).map(|i| format!("{pool}-{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        // The GPU taint, as on the other test nodes: keeps the scheduler test's pods off.
        let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
        let taints = if i < 5 || i == 9 {
            json!([gpu, { "key": TAINT, "effect": "NoSchedule" }])
        } else {
            json!([gpu])
        };
        cp.create_node(name, json!({ POOL: pool }), taints, json!({}));
    }
    let node = TestNode {
        cp,
        name: names[9].clone(),
    };
    let hca = FakeHca::new(true);
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"{POOL}={pool}\"\n"),
    )
    .unwrap();
    let agent = node.start_agent(
        &hca,
        &[
            "--interval",
            "300ms",
            "--resync-interval",
            "1s",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    (names, node, hca, agent)
}

#[test]
fn ten_nodes_at_one_half_the_sixth_failing_node_is_not_tainted_and_recovery_untaints() {
    let Some(cp) = control_plane() else { return };
    // A node outside the pool, tainted: must not count.
    cp.create_node(
        "breaker-other-pool",
        json!({ POOL: "elsewhere" }),
        json!([{ "key": TAINT, "effect": "NoSchedule" }]),
        json!({}),
    );
    let (names, node, hca, agent) = half_tainted_pool(cp, "breaker");
    // 6 of 10 tainted, yet the agent untaints its validated node: the breaker never blocks
    // recovery.
    agent.wait("validation", Duration::from_secs(30), || node.ready());

    // The port fails: tainting would make 6 of 10 tainted, above 0.5.
    let events_before = node.events().len();
    hca.set_port(false);
    agent.wait("BreakerOpen", Duration::from_secs(10), || {
        node.has_reason("FabricReady", "BreakerOpen")
    });
    let fabric = node.condition("FabricReady").unwrap();
    assert_eq!(fabric["status"], "False");
    let message = fabric["message"].as_str().unwrap();
    assert!(message.contains("6 of 10"), "{message}");
    assert!(
        message.contains("PortDown"),
        "what would have tainted it: {message}"
    );
    assert!(
        message.contains("fabricgate.io/breaker-override"),
        "{message}"
    );
    // Held for several resyncs: still not tainted.
    std::thread::sleep(Duration::from_secs(2));
    assert!(!node.has_our_taint(), "{:?}", node.taints());
    assert_eq!(node.label("fabricgate.io/ready").as_deref(), Some("false"));
    let events = node.events();
    assert!(events.len() > events_before);
    let ev = events.last().unwrap();
    assert_eq!(ev["reason"], "FabricNotReady");
    assert!(ev["note"].as_str().unwrap().contains("BreakerOpen"), "{ev}");
    assert!(
        agent.log().contains("BLAST-RADIUS BREAKER OPEN"),
        "{}",
        agent.log()
    );

    // One failing node recovers (its agent untaints it): 5 of 10 is within the limit, and the
    // next resync taints this node.
    cp.kubectl(&["taint", "node", &names[0], &format!("{TAINT}:NoSchedule-")]);
    agent.wait("the taint", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    wait_until("reason PortDown", Duration::from_secs(5), || {
        node.has_reason("FabricReady", "PortDown")
    });

    // Recovery untaints normally, whatever the pool looks like.
    cp.kubectl(&["taint", "node", &names[5], &format!("{TAINT}=x:NoSchedule")]);
    cp.kubectl(&["taint", "node", &names[6], &format!("{TAINT}=x:NoSchedule")]);
    hca.set_port(true);
    agent.wait("recovery", Duration::from_secs(15), || node.ready());
    drop(agent);
}

/// The shipped guard (deploy/guard.yaml, its ServiceAccount's token) over the pool
/// `selector`, with `breaker` lines under `node.breaker:`, on the shipped Lease; its agent
/// pods are never there, but it would taint for that only after an hour. Returns once its
/// leader published the summary of this pool.
fn pool_guard(
    cp: &'static ControlPlane,
    selector: &str,
    breaker: &str,
    scratch: &std::path::Path,
) -> Guard {
    pool_guard_renewing(cp, selector, breaker, scratch, "300ms", "5s")
}

/// [`pool_guard`] renewing its Lease (and so the summary) every `poll` (`--poll-interval`),
/// held for `lease` (`--lease-duration`).
fn pool_guard_renewing(
    cp: &'static ControlPlane,
    selector: &str,
    breaker: &str,
    scratch: &std::path::Path,
    poll: &str,
    lease: &str,
) -> Guard {
    let config = pool_guard_config(selector, breaker, scratch);
    let timing = [
        "--stale-after",
        "1h",
        "--poll-interval",
        poll,
        "--lease-duration",
        lease,
    ];
    start_pool_guard(
        cp,
        selector,
        "app=fg-no-agent-pods",
        &config,
        scratch,
        &timing,
    )
}

/// The guard over the pool `selector` and the agent pods `pods`, with `timing`.
fn pool_guard_timed(
    cp: &'static ControlPlane,
    selector: &str,
    pods: &str,
    scratch: &std::path::Path,
    timing: &[&str],
) -> Guard {
    let config = pool_guard_config(selector, "", scratch);
    start_pool_guard(cp, selector, pods, &config, scratch, timing)
}

/// The guard's requirements: the pool `selector`, `breaker` lines under `node.breaker:`.
fn pool_guard_config(
    selector: &str,
    breaker: &str,
    scratch: &std::path::Path,
) -> std::path::PathBuf {
    let config = scratch.join("guard-requirements.yaml");
    let breaker = if breaker.is_empty() {
        String::new()
    } else {
        format!("  breaker:\n{breaker}")
    };
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"{selector}\"\n{breaker}"),
    )
    .unwrap();
    config
}

/// The shipped guard (deploy/guard.yaml, its ServiceAccount's token) on the shipped Lease;
/// returns once its leader published the summary of the pool `selector`.
fn start_pool_guard(
    cp: &'static ControlPlane,
    selector: &str,
    pods: &str,
    config: &std::path::Path,
    scratch: &std::path::Path,
    timing: &[&str],
) -> Guard {
    cp.install_agent_rbac();
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/guard.yaml");
    cp.apply(&std::fs::read_to_string(manifest).unwrap());
    let token = cp.kubectl(&["-n", GUARD_NS, "create", "token", "fabricgate-guard"]);
    let kubeconfig = scratch.join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let guard = start_guard(
        "guard-pool-summary",
        Some(pods),
        fabricgate::config::DEFAULT_GUARD_LEASE,
        config,
        &kubeconfig,
        scratch,
        timing,
    );
    guard.wait(
        "the pool summary published",
        Duration::from_secs(40),
        || published_pool(cp).is_some_and(|p| p["selector"] == selector),
    );
    guard
}

/// A newly failing node decides without listing the pool. The guard's leader (the
/// shipped deploy/guard.yaml and its ServiceAccount) publishes the pool's summary on its
/// Lease; the agent reads that one object (and the ledger when it may taint). The breaker
/// holds as with the list: 5 of 10 tainted, the sixth failing node is held (`BreakerOpen`,
/// "6 of 10"); one recovers, the guard's next renewal says so, and the node is tainted after
/// reading 2 small objects and one compare-and-swap, no Node list. With the guard gone (its
/// Lease no longer renewed), the agent lists the pool again.
#[test]
fn the_breaker_counts_the_pool_from_the_guards_summary_without_listing_it() {
    let Some(cp) = control_plane() else { return };
    let _lease = shipped_lease();
    let (names, node, hca, agent) = half_tainted_pool(cp, "summary");
    let guard = pool_guard(cp, &format!("{POOL}=summary"), "", hca.scratch());
    guard.wait(
        "the validated node counted",
        Duration::from_secs(10),
        || {
            published_pool(cp).is_some_and(|p| {
                p["nodes"] == 10 && p["taintedOld"].as_array().is_some_and(|t| t.len() == 5)
            })
        },
    );
    let lease_bytes = serde_json::to_vec(&shipped_guard_lease(cp).unwrap())
        .unwrap()
        .len();

    // The port fails: 6 of 10 would be tainted.
    let mark = cp.audit_mark();
    hca.set_port(false);
    agent.wait("BreakerOpen", Duration::from_secs(10), || {
        node.has_reason("FabricReady", "BreakerOpen")
    });
    let message = node.condition("FabricReady").unwrap()["message"].to_string();
    assert!(message.contains("6 of 10"), "{message}");
    assert!(!node.has_our_taint());
    assert!(
        agent
            .log()
            .contains("counting the pool from the guard's summary"),
        "{}",
        agent.log()
    );

    // One of the five recovers: the next renewal publishes it, the next resync taints.
    let recovered = cp.audit_mark();
    cp.kubectl(&["taint", "node", &names[0], &format!("{TAINT}:NoSchedule-")]);
    agent.wait("the taint", Duration::from_secs(10), || {
        node.has_our_taint()
    });
    let used = node.agent_requests(mark);
    let refused: Vec<&AuditEvent> = used.iter().filter(|e| e.code == 403).collect();
    assert!(refused.is_empty(), "{refused:#?}");
    let reads_or_ledger = |events: &[AuditEvent]| -> Vec<String> {
        events
            .iter()
            .filter(|e| e.resource == "leases" || e.resource == "configmaps" || e.verb == "list")
            .map(|e| format!("{} {}", e.resource, e.verb))
            .collect()
    };
    let all = reads_or_ledger(&used);
    assert!(
        all.iter()
            .all(|r| r == "leases get" || r.starts_with("configmaps ")),
        "deciding read only the guard's Lease and the ledger, never listed the pool: {all:?}"
    );
    let since_recovery = reads_or_ledger(&node.agent_requests(recovered));
    let ledger: Vec<&String> = since_recovery
        .iter()
        .filter(|r| r.starts_with("configmaps "))
        .collect();
    assert_eq!(
        ledger,
        ["configmaps get", "configmaps update"],
        "one reservation"
    );
    let lease_reads = since_recovery.iter().filter(|r| *r == "leases get").count();
    assert!(
        (1..=3).contains(&lease_reads),
        "one Lease read per resync until the renewal showed the recovery: {since_recovery:?}"
    );
    eprintln!(
        "figure: a newly failing node decided from the guard's summary: {} requests ({}), \
         the Lease {lease_bytes} bytes as JSON; no Node list",
        since_recovery.len(),
        since_recovery.join(", ")
    );
    hca.set_port(true);
    agent.wait("recovery", Duration::from_secs(15), || node.ready());

    // The guard is gone: its Lease is not renewed for longer than its 5 s, and the next
    // decision lists the pool (it still holds the cap).
    drop(guard);
    std::thread::sleep(Duration::from_secs(6));
    let stale = cp.audit_mark();
    hca.set_port(false);
    agent.wait(
        "the taint, decided from a list",
        Duration::from_secs(10),
        || node.has_our_taint(),
    );
    let lists = node
        .agent_requests(stale)
        .iter()
        .filter(|e| e.resource == "nodes" && e.verb == "list")
        .count();
    assert_eq!(
        lists, 1,
        "a stale summary is not used: the agent lists the pool"
    );
    assert!(
        agent.log().contains("was not renewed within its duration"),
        "{}",
        agent.log()
    );
    drop(agent);
}

/// At 5,000 Nodes a pool list can fail under a burst (docs/scale.md: 21 of 64 timed out), and a
/// failed list used to taint at once, past the cap. Now the ledger still decides: with two
/// reservations of the pool in flight and `max_new_per_window: 2`, an agent whose pool list
/// fails (the proxy answers 500) is held with `BreakerOpen`; once they are past the in-flight
/// time, with nothing to show their Nodes failing, it taints (fail closed).
#[test]
fn a_failed_pool_list_still_counts_the_ledgers_reservations_in_flight() {
    use crate::common::faultproxy::{Fault, FaultProxy};
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, Patch, PatchParams};
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let name = "listfail-0";
    let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
    cp.create_node(
        name,
        json!({ POOL: "listfail" }),
        json!([gpu, { "key": TAINT, "effect": "NoSchedule" }]),
        json!({}),
    );
    let node = TestNode {
        cp,
        name: name.to_owned(),
    };
    let proxy = FaultProxy::start(&cp.url, &cp.ca_file);
    let hca = FakeHca::new(true);
    let selector = format!("{POOL}=listfail");
    let config = hca.scratch().join("requirements.yaml");
    std::fs::write(
        &config,
        format!(
            "node:\n  pool_selector: \"{selector}\"\n  breaker:\n    guard_lease: \"\"\n    \
             max_new_per_window: 2\n"
        ),
    )
    .unwrap();
    let agent = crate::common::start_agent(
        name,
        &hca,
        Some(&node.agent_kubeconfig(Some(&proxy.url()))),
        &[
            "--interval",
            "300ms",
            "--resync-interval",
            "1s",
            "--config",
            config.to_str().unwrap(),
        ],
    );
    agent.wait("validation", Duration::from_secs(30), || node.ready());
    // Two other Nodes of this pool reserved a moment ago (their agents' entries).
    let now = k8s_openapi::jiff::Timestamp::now();
    let ledger: Api<ConfigMap> = Api::namespaced(cp.admin(), GUARD_NS);
    cp.block_on(ledger.patch(
        fabricgate::policy::breaker::LEDGER,
        &PatchParams::default(),
        &Patch::Merge(json!({ "data": {
            "listfail-peer-1": format!("{now} {selector}"),
            "listfail-peer-2": format!("{now} {selector}"),
        }})),
    ))
    .unwrap();
    proxy.set_fault_matching(
        Fault::Status {
            code: 500,
            retry_after: None,
            plain: false,
        },
        "labelSelector=",
    );
    hca.set_port(false);
    agent.wait("BreakerOpen", Duration::from_secs(10), || {
        node.has_reason("FabricReady", "BreakerOpen")
    });
    let message = node.condition("FabricReady").unwrap()["message"].to_string();
    assert!(
        message.contains("2 nodes of the pool already failed") && !node.has_our_taint(),
        "{message}"
    );
    assert!(
        agent.log().contains("deciding from the ledger alone"),
        "{}",
        agent.log()
    );
    // Past the 30 s in flight, nothing shows those two failing: fail closed.
    agent.wait("the taint", Duration::from_secs(45), || {
        node.has_our_taint()
    });
    proxy.clear_fault();
    drop(agent);
}

/// The breaker's one read, measured with a pool of 500 Nodes: a label-selected list from the
/// API server's watch cache (`resourceVersion=0`), as the agent makes it. Prints the figures
/// (docs/failure-modes.md); asserts the list is the pool and only the pool.
#[test]
fn breaker_list_of_a_500_node_pool() {
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Api, DeleteParams, ListParams, PostParams};
    let Some(cp) = control_plane() else { return };
    let nodes: Api<Node> = Api::all(cp.admin());
    let names: Vec<String> = (0..500).map(|i| format!("pool500-{i:03}")).collect();
    cp.block_on(async {
        for (i, name) in names.iter().enumerate() {
            let mut node: Node = serde_json::from_value(json!({
                "metadata": { "name": name, "labels": {
                    POOL: "p500", "kubernetes.io/hostname": name,
                    "nvidia.com/gpu.product": "H200",
                }},
                "spec": { "taints": if i % 10 == 0 {
                    json!([{ "key": TAINT, "effect": "NoSchedule" }])
                } else { json!([]) } },
            }))
            .unwrap();
            node.metadata.resource_version = None;
            let _ = nodes.create(&PostParams::default(), &node).await;
        }
    });
    let params = ListParams::default()
        .labels(&format!("{POOL}=p500"))
        .match_any();
    let mut times = Vec::new();
    let mut count = 0;
    let mut tainted = 0;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let list = cp.block_on(nodes.list(&params)).unwrap();
        times.push(started.elapsed());
        count = list.items.len();
        tainted = list
            .items
            .iter()
            .filter(|n| {
                n.spec
                    .as_ref()
                    .and_then(|s| s.taints.as_ref())
                    .is_some_and(|ts| ts.iter().any(|t| t.key == TAINT))
            })
            .count();
    }
    let bytes = serde_json::to_vec(&cp.get_json(&format!(
        "/api/v1/nodes?labelSelector={POOL}%3Dp500&resourceVersion=0"
    )))
    .unwrap()
    .len();
    times.sort();
    eprintln!(
        "breaker list of a 500-node pool: median {:?}, max {:?}, {} kB of JSON",
        times[2],
        times[4],
        bytes / 1024
    );
    assert_eq!(count, 500, "the list is exactly the pool");
    assert_eq!(tainted, 50);
    cp.block_on(async {
        for name in &names {
            let _ = nodes.delete(name, &DeleteParams::default()).await;
        }
    });
}

/// A correlated burst: eight agents of one pool lose their ports at the same instant, with
/// `max_new_per_window: 3`. Each sees almost none of the others' taints in its list (they
/// decide within the same list latency); the ledger's compare-and-swap keeps the cap exact:
/// three tainted, five held with `BreakerOpen`.
#[test]
fn a_burst_of_eight_failures_taints_exactly_max_new_per_window() {
    let Some(cp) = control_plane() else { return };
    // The agents count the pool from the guard's summary (no list), the ledger keeps the cap.
    let _lease = shipped_lease();
    let names: Vec<String> = (0..8).map(|i| format!("burst-{i}")).collect();
    for name in &names {
        let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
        cp.create_node(
            name,
            json!({ POOL: "burst" }),
            json!([gpu, { "key": TAINT, "effect": "NoSchedule" }]),
            json!({}),
        );
    }
    let nodes: Vec<TestNode> = names
        .iter()
        .map(|n| TestNode {
            cp,
            name: n.clone(),
        })
        .collect();
    let hcas: Vec<FakeHca> = (0..8).map(|_| FakeHca::new(true)).collect();
    let agents: Vec<_> = nodes
        .iter()
        .zip(&hcas)
        .map(|(node, hca)| {
            let config = hca.scratch().join("requirements.yaml");
            std::fs::write(
                &config,
                format!(
                    "node:\n  recover_after: 1\n  pool_selector: \"{POOL}=burst\"\n  breaker:\n    \
                     max_new_per_window: 3\n    window: 10m\n"
                ),
            )
            .unwrap();
            node.start_agent(
                hca,
                &["--interval", "300ms", "--config", config.to_str().unwrap()],
            )
        })
        .collect();
    for (agent, node) in agents.iter().zip(&nodes) {
        agent.wait("validation", Duration::from_secs(60), || node.ready());
    }
    let scratch = tempfile::tempdir().unwrap();
    let guard = pool_guard(
        cp,
        &format!("{POOL}=burst"),
        "    max_new_per_window: 3\n    window: 10m\n",
        scratch.path(),
    );
    guard.wait(
        "the validated pool published",
        Duration::from_secs(20),
        || published_pool(cp).is_some_and(|p| p["nodes"] == 8 && p.get("taintedOld").is_none()),
    );
    let mark = cp.audit_mark();
    for hca in &hcas {
        hca.set_port(false);
    }
    let decided = |n: &TestNode| n.has_our_taint() || n.has_reason("FabricReady", "BreakerOpen");
    wait_until(
        "every failing node decided",
        Duration::from_secs(30),
        || nodes.iter().all(decided),
    );
    // Held nodes re-check on every resync; give a wrong extra taint the time to appear.
    std::thread::sleep(Duration::from_secs(2));
    let tainted = nodes.iter().filter(|n| n.has_our_taint()).count();
    let held: Vec<String> = nodes
        .iter()
        .filter(|n| !n.has_our_taint())
        .map(|n| n.condition("FabricReady").unwrap()["message"].to_string())
        .collect();
    assert_eq!(tainted, 3, "held: {held:#?}");
    assert!(
        held.iter()
            .all(|m| m.contains("node.breaker.max_new_per_window 3")),
        "{held:#?}"
    );
    let lists: Vec<AuditEvent> = nodes
        .iter()
        .flat_map(|n| n.agent_requests(mark))
        .filter(|e| e.resource == "nodes" && e.verb == "list")
        .collect();
    assert!(
        lists.is_empty(),
        "the guard's summary was fresh: no agent lists the pool: {lists:#?}"
    );
    drop(agents);
    drop(guard);
}

/// One compromised agent disabled the breaker fleet-wide. With node `rt-ledger-0`'s
/// own pod-bound token it rewrote the shared ledger with fresh entries for the other nodes of
/// its pool, so another node with a real port down said `BreakerOpen` and stayed untainted.
/// Replayed here, rewriting it every 200 ms (far more often than every window), while the
/// victim's port goes down: every forged write is refused by the admission policy
/// `fabricgate-breaker-ledger`, and even entries for healthy nodes that do get in (written as
/// admin here, a minute old) count for nothing, because a reservation counts only while its
/// Node shows the failure. The victim is tainted `PortDown`. What the forger may still do, and
/// does here: keep its own entry fresh (one slot, as tainting its own Node would). It
/// could also drop others' entries, lifting their reservations so that a burst
/// overshoots `max_new_per_window`; now that is refused while the ledger holds no more than
/// `LEDGER_PRUNE_AT` entries.
#[test]
fn redteam_a_compromised_agent_cannot_forge_the_breaker_ledger() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, Patch, PatchParams, PostParams};
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let names: Vec<String> = (0..6).map(|i| format!("rt-ledger-{i}")).collect();
    let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
    for (i, name) in names.iter().enumerate() {
        // rt-ledger-0: the compromised agent's node; 1..4 healthy; 5: the victim, registered
        // with the taint as the docs recommend.
        let taints = if i == 5 {
            json!([gpu, { "key": TAINT, "effect": "NoSchedule" }])
        } else {
            json!([gpu])
        };
        cp.create_node(name, json!({ POOL: "rt-ledger" }), taints, json!({}));
    }
    let forger = cp.block_on(crate::common::controlplane::client_from(
        &cp.agent_kubeconfig(&names[0], None),
    ));
    let ledger: Api<ConfigMap> = Api::namespaced(forger, "fabricgate");
    let now = || k8s_openapi::jiff::Timestamp::now().to_string();
    // One forged rewrite: fresh entries for every other node of the pool (`own`: only its
    // own entry, which it may). The answer's code, or 200.
    let forge = |own: bool| -> u16 {
        let Ok(mut cm) = cp.block_on(ledger.get(fabricgate::policy::breaker::LEDGER)) else {
            return 0;
        };
        let mut data = cm.data.take().unwrap_or_default();
        if own {
            data.insert(names[0].clone(), now());
        } else {
            for name in &names[1..] {
                data.insert(name.clone(), now());
            }
        }
        cm.data = Some(data);
        match cp.block_on(ledger.replace(
            fabricgate::policy::breaker::LEDGER,
            &PostParams::default(),
            &cm,
        )) {
            Ok(_) => 200,
            Err(kube::Error::Api(e)) => {
                if e.code == 403 {
                    assert!(
                        e.message
                            .contains("ValidatingAdmissionPolicy 'fabricgate-breaker-ledger'")
                            && e.message
                                .contains("may reserve only its own entry rt-ledger-0"),
                        "{}",
                        e.message
                    );
                }
                e.code
            }
            Err(e) => panic!("not an API answer: {e}"),
        }
    };
    wait_until(
        "the ledger's policy to refuse a forged entry",
        Duration::from_secs(60),
        || forge(false) == 403,
    );
    // Forged entries that got in anyway (before the policy was loaded, or on a cluster without
    // it), a minute old: past the moment a reservation is in flight, within the window.
    let admin: Api<ConfigMap> = Api::namespaced(cp.admin(), "fabricgate");
    let minute_ago = k8s_openapi::jiff::Timestamp::from_second(
        k8s_openapi::jiff::Timestamp::now().as_second() - 60,
    )
    .unwrap()
    .to_string();
    let stale: BTreeMap<String, String> = names[1..5]
        .iter()
        .map(|n| (n.clone(), minute_ago.clone()))
        .collect();
    cp.block_on(admin.patch(
        fabricgate::policy::breaker::LEDGER,
        &PatchParams::default(),
        &Patch::Merge(json!({ "data": stale })),
    ))
    .expect("admin writes the stale forged entries");

    // The forger, every 200 ms for the rest of the test.
    let stop = AtomicBool::new(false);
    let refused = AtomicUsize::new(0);
    let forged = AtomicUsize::new(0);
    let own_kept = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                match forge(false) {
                    403 => refused.fetch_add(1, Ordering::Relaxed),
                    200 => forged.fetch_add(1, Ordering::Relaxed),
                    _ => 0,
                };
                if forge(true) == 200 {
                    own_kept.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let victim = TestNode {
            cp,
            name: names[5].clone(),
        };
        let hca = FakeHca::new(true);
        let config = hca.scratch().join("requirements.yaml");
        std::fs::write(
            &config,
            format!(
                "node:\n  pool_selector: \"{POOL}=rt-ledger\"\n  breaker:\n    \
                 max_new_per_window: 2\n    window: 10m\n"
            ),
        )
        .unwrap();
        let agent = victim.start_agent(
            &hca,
            &["--interval", "300ms", "--config", config.to_str().unwrap()],
        );
        agent.wait("validation", Duration::from_secs(30), || victim.ready());
        std::thread::sleep(Duration::from_secs(1));
        hca.set_port(false);
        agent.wait("the victim's taint", Duration::from_secs(15), || {
            victim.has_our_taint()
        });
        wait_until("reason PortDown", Duration::from_secs(5), || {
            victim.has_reason("FabricReady", "PortDown")
        });
        // Held through more forged rounds and resyncs.
        std::thread::sleep(Duration::from_secs(2));
        assert!(victim.has_our_taint(), "{:?}", victim.taints());
        assert!(
            !agent.log().contains("BLAST-RADIUS BREAKER OPEN"),
            "{}",
            agent.log()
        );
        stop.store(true, Ordering::Relaxed);
        drop(agent);
    });
    let (refused, forged, own_kept) = (
        refused.into_inner(),
        forged.into_inner(),
        own_kept.into_inner(),
    );
    eprintln!(
        "forger: {refused} forged rewrites refused, {forged} admitted, {own_kept} of its own \
         entry kept fresh"
    );
    assert_eq!(
        forged, 0,
        "a forged rewrite of others' entries was admitted"
    );
    assert!(refused >= 10, "the forger kept trying: {refused}");
    assert!(own_kept >= 1, "its own entry stays its own to write");
    // Dropping another's entry (it would lift a reservation) is refused.
    let mut cm = cp
        .block_on(ledger.get(fabricgate::policy::breaker::LEDGER))
        .unwrap();
    let mut data = cm.data.take().unwrap_or_default();
    assert!(data.remove(&names[1]).is_some(), "{data:?}");
    cm.data = Some(data);
    match cp.block_on(ledger.replace(
        fabricgate::policy::breaker::LEDGER,
        &PostParams::default(),
        &cm,
    )) {
        Err(kube::Error::Api(e)) => assert!(
            e.code == 403
                && e.message
                    .contains("may not drop the entries of other nodes"),
            "{e:?}"
        ),
        Ok(_) => panic!("dropping another node's entry was admitted"),
        Err(e) => panic!("not an API answer: {e}"),
    }
}

/// Nodes `<pool>-0..n` of the pool `POOL=<pool>`: those in `agents` registered with the taint
/// (as the docs recommend) and their agents started with the shipped breaker
/// (`recover_after: 1`, `--resync-interval 1s`) and validated; of the others, those below
/// `tainted` failed earlier (tainted, their agents not running here), the rest validated.
fn pool_with_agents(
    cp: &'static ControlPlane,
    pool: &str,
    n: usize,
    tainted: usize,
    agents: std::ops::Range<usize>,
) -> (Vec<TestNode>, Vec<FakeHca>, Vec<crate::common::Agent>) {
    let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
    let nodes: Vec<TestNode> = (0..n)
        .map(|i| {
            let name = format!("{pool}-{i}");
            let taints = if i < tainted || agents.contains(&i) {
                json!([gpu, { "key": TAINT, "effect": "NoSchedule" }])
            } else {
                json!([gpu])
            };
            cp.create_node(&name, json!({ POOL: pool }), taints, json!({}));
            TestNode { cp, name }
        })
        .collect();
    let (hcas, started) = validated_agents(&nodes, pool, agents);
    (nodes, hcas, started)
}

/// The agents of `nodes[agents]` over the pool `POOL=<pool>` with the shipped breaker
/// (`recover_after: 1`, `--interval 500ms`, `--resync-interval 1s`), each validated.
fn validated_agents(
    nodes: &[TestNode],
    pool: &str,
    agents: std::ops::Range<usize>,
) -> (Vec<FakeHca>, Vec<crate::common::Agent>) {
    let hcas: Vec<FakeHca> = agents.clone().map(|_| FakeHca::new(true)).collect();
    let started: Vec<_> = agents
        .clone()
        .zip(&hcas)
        .map(|(i, hca)| {
            let config = hca.scratch().join("requirements.yaml");
            std::fs::write(
                &config,
                format!("node:\n  recover_after: 1\n  pool_selector: \"{POOL}={pool}\"\n"),
            )
            .unwrap();
            nodes[i].start_agent(
                hca,
                &[
                    "--interval",
                    "500ms",
                    "--resync-interval",
                    "1s",
                    "--config",
                    config.to_str().unwrap(),
                ],
            )
        })
        .collect();
    for (agent, i) in started.iter().zip(agents) {
        agent.wait("validation", Duration::from_secs(90), || nodes[i].ready());
    }
    (hcas, started)
}

fn tainted(nodes: &[TestNode]) -> Vec<&str> {
    nodes
        .iter()
        .filter(|n| n.has_our_taint())
        .map(|n| n.name.as_str())
        .collect()
}

/// The burst that overshot the fraction: 2 of 10 tainted, then 3 fail together (5
/// of 10), then a sixth a second later. The guard renews its summary every 10 s, so the
/// sixth's agent reads a summary that has not seen the three taints of the last second; it
/// counts them from the ledger, under the compare-and-swap that takes its slot, and is held:
/// `BreakerOpen`, 6 of 10 (before: tainted, 6 of 10).
#[test]
fn a_sixth_failing_a_second_after_a_burst_is_held_at_one_half() {
    let Some(cp) = control_plane() else { return };
    let _lease = shipped_lease();
    let (nodes, hcas, agents) = pool_with_agents(cp, "frac", 10, 2, 2..6);
    let scratch = tempfile::tempdir().unwrap();
    let guard = pool_guard_renewing(
        cp,
        &format!("{POOL}=frac"),
        "",
        scratch.path(),
        "10s",
        "30s",
    );
    // Right after a renewal that counted the validated pool: the next is 10 s away.
    crate::common::wait::poll_until(
        "the pool published with two tainted",
        Duration::from_secs(40),
        Duration::from_millis(20),
        || {
            published_pool(cp).is_some_and(|p| {
                p["selector"] == format!("{POOL}=frac")
                    && p["nodes"] == 10
                    && p["taintedOld"].as_array().is_some_and(|t| t.len() == 2)
                    && p.get("taintedNew").is_none()
            })
        },
        || guard.log(),
    );
    for hca in &hcas[..3] {
        hca.set_port(false);
    }
    std::thread::sleep(Duration::from_secs(1));
    hcas[3].set_port(false);
    let decided = |n: &TestNode| n.has_our_taint() || n.has_reason("FabricReady", "BreakerOpen");
    wait_until("the four decided", Duration::from_secs(20), || {
        nodes[2..6].iter().all(decided)
    });
    // Held nodes re-check on every resync (1 s); give a wrong taint the time to appear.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        tainted(&nodes),
        ["frac-0", "frac-1", "frac-2", "frac-3", "frac-4"],
        "{}",
        agents[3].log()
    );
    let message = nodes[5].condition("FabricReady").unwrap()["message"].to_string();
    assert!(
        nodes[5].has_reason("FabricReady", "BreakerOpen") && message.contains("6 of 10"),
        "{message}"
    );
    // It decided from a summary that did not show the burst: the ledger counted it.
    let log = agents[3].log();
    let first = log
        .lines()
        .find(|l| l.contains("breaker: counted the pool before tainting"))
        .unwrap_or_default();
    assert!(first.contains("guard"), "{first}");
    eprintln!("the sixth's first count: {first}");
    drop(agents);
    guard.stop();
}

/// A whole 16-node pool failing within a second. The fraction cap (one half) holds
/// exactly: 8 tainted, 8 held with `BreakerOpen`, however stale each agent's view of the pool.
/// None is lost: two of the tainted recover, their slots are free again (their reservations
/// past the in-flight time, the guard's summary showing them untainted), and two held nodes
/// are tainted on their next resyncs: 8 again.
#[test]
fn a_whole_pool_failing_at_once_is_tainted_to_exactly_one_half() {
    let Some(cp) = control_plane() else { return };
    let _lease = shipped_lease();
    let (nodes, hcas, agents) = pool_with_agents(cp, "whole", 16, 0, 0..16);
    let scratch = tempfile::tempdir().unwrap();
    let guard = pool_guard(cp, &format!("{POOL}=whole"), "", scratch.path());
    guard.wait(
        "the validated pool published",
        Duration::from_secs(20),
        || published_pool(cp).is_some_and(|p| p["nodes"] == 16 && p.get("taintedOld").is_none()),
    );
    for hca in &hcas {
        hca.set_port(false);
    }
    let decided = |n: &TestNode| n.has_our_taint() || n.has_reason("FabricReady", "BreakerOpen");
    crate::common::wait::poll_until(
        "every failing node decided",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || nodes.iter().all(decided),
        String::new,
    );
    std::thread::sleep(Duration::from_secs(3));
    let first = tainted(&nodes);
    assert_eq!(first.len(), 8, "{first:?}");
    let held: Vec<&TestNode> = nodes.iter().filter(|n| !n.has_our_taint()).collect();
    for n in &held {
        let message = n.condition("FabricReady").unwrap()["message"].to_string();
        assert!(
            n.has_reason("FabricReady", "BreakerOpen") && message.contains("9 of 16"),
            "{}: {message}",
            n.name
        );
    }

    // Two of the tainted recover: two held nodes take their slots, none more.
    let recovering: Vec<usize> = (0..16)
        .filter(|&i| nodes[i].has_our_taint())
        .take(2)
        .collect();
    for &i in &recovering {
        hcas[i].set_port(true);
    }
    crate::common::wait::poll_until(
        "two held nodes tainted in the freed slots",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || {
            recovering.iter().all(|&i| nodes[i].ready())
                && held.iter().filter(|n| n.has_our_taint()).count() == 2
        },
        String::new,
    );
    std::thread::sleep(Duration::from_secs(3));
    let now = tainted(&nodes);
    assert_eq!(now.len(), 8, "{now:?}");
    let still_held = nodes
        .iter()
        .filter(|n| !n.has_our_taint() && n.has_reason("FabricReady", "BreakerOpen"))
        .count();
    assert_eq!(still_held, 6);
    drop(agents);
    drop(guard);
}

/// The label of the shipped pool: the guard's admission policy admits its taint only there.
const GPU_PRESENT: &str = "nvidia.com/gpu.present";

/// A pool `POOL=<pool>` of `n` Nodes for a burst under the real guard, which judges the agent
/// pods labelled `app=fg-burst-<pool>` (Ready pods, as a kubelet reports them; the agents of
/// `agents` run as processes). `<pool>-0` failed earlier (tainted by its agent, `FabricReady=
/// False` for two minutes); `<pool>-1`'s agent is gone (no pod: the guard taints it); those in
/// `agents` registered with the taint and validated by their agents; the rest validated.
fn burst_pool(
    cp: &'static ControlPlane,
    pool: &str,
    n: usize,
    agents: std::ops::Range<usize>,
) -> (Vec<TestNode>, Vec<FakeHca>, Vec<crate::common::Agent>) {
    cp.install_agent_rbac();
    let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
    let app = format!("fg-burst-{pool}");
    let nodes: Vec<TestNode> = (0..n)
        .map(|i| {
            let name = format!("{pool}-{i}");
            let taints = if i == 0 || agents.contains(&i) {
                json!([gpu, { "key": TAINT, "effect": "NoSchedule" }])
            } else {
                json!([gpu])
            };
            cp.create_node(
                &name,
                json!({ POOL: pool, GPU_PRESENT: "true" }),
                taints,
                json!({}),
            );
            if i != 1 {
                crate::guard::ready_pod(cp, &format!("agent-{name}"), &name, json!({ "app": app }));
            }
            TestNode { cp, name }
        })
        .collect();
    let failed =
        k8s_openapi::jiff::Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(120);
    cp.patch_node_status(
        &nodes[0].name,
        &json!({ "conditions": [{ "type": "FabricReady", "status": "False",
            "reason": "DevicePluginDown", "message": "the device plugin is gone",
            "lastTransitionTime": failed.to_string(),
            "lastHeartbeatTime": failed.to_string() }] }),
    );
    let (hcas, started) = validated_agents(&nodes, pool, agents);
    (nodes, hcas, started)
}

/// Whether the guard's published summary shows `node` tainted.
fn summary_shows_taint(cp: &ControlPlane, node: &str) -> bool {
    published_pool(cp).is_some_and(|p| {
        ["taintedNew", "taintedOld"]
            .iter()
            .any(|k| p[k].as_array().is_some_and(|a| a.iter().any(|n| n == node)))
    })
}

/// A burst of `failing` of the `n` Nodes of pool `pool` (`<pool>-2` on), while the guard's
/// summary lags: the guard renews it every 10 s, and it has just tainted `<pool>-1` (its agent
/// gone) after its last renewal, so no summary the agents read shows that taint, nor the
/// burst's. The first `failing - 1` fail together, the last `stagger` later. Exactly
/// `floor(n / 2)` are tainted (`max_unvalidated_fraction` 0.5), the rest held `BreakerOpen`,
/// however the agents' reads, the renewals and the guard's taint fall. Then two of the burst's
/// tainted Nodes recover, and two held ones take their slots: `floor(n / 2)` again.
fn burst_under_a_lagging_summary(pool: &str, n: usize, failing: usize, stagger: Duration) {
    let Some(cp) = control_plane() else { return };
    let _lease = shipped_lease();
    let (nodes, hcas, agents) = burst_pool(cp, pool, n, 2..2 + failing);
    let scratch = tempfile::tempdir().unwrap();
    let selector = format!("{POOL}={pool}");
    let guard = pool_guard_timed(
        cp,
        &selector,
        &format!("app=fg-burst-{pool}"),
        scratch.path(),
        &[
            "--stale-after",
            "13s",
            "--poll-interval",
            "10s",
            "--lease-duration",
            "30s",
        ],
    );
    crate::common::wait::poll_until(
        "the guard's own taint of the Node whose agent is gone",
        Duration::from_secs(60),
        Duration::from_millis(20),
        || nodes[1].has_our_taint(),
        || guard.log(),
    );
    assert!(
        !summary_shows_taint(cp, &nodes[1].name),
        "the test needs the guard's summary to lag its own taint: {:?}\n{}",
        published_pool(cp),
        guard.log()
    );
    for hca in &hcas[..failing - 1] {
        hca.set_port(false);
    }
    std::thread::sleep(stagger);
    hcas[failing - 1].set_port(false);
    let burst = &nodes[2..2 + failing];
    let decided = |n: &TestNode| n.has_our_taint() || n.has_reason("FabricReady", "BreakerOpen");
    crate::common::wait::poll_until(
        "every failing node decided",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || burst.iter().all(decided),
        || guard.log(),
    );
    let lagging = !summary_shows_taint(cp, &nodes[1].name);
    // Held nodes re-check on every resync (1 s): give a wrong taint the time to appear.
    std::thread::sleep(Duration::from_secs(3));
    let cap = n / 2;
    let report = || {
        let counts: Vec<String> = agents
            .iter()
            .filter_map(|a| {
                a.log()
                    .lines()
                    .find(|l| l.contains("breaker: counted the pool before tainting"))
                    .map(str::to_owned)
            })
            .collect();
        format!("{}\n{}", counts.join("\n"), guard.log())
    };
    let first = tainted(&nodes);
    assert_eq!(first.len(), cap, "{first:?}\n{}", report());
    assert!(first.contains(&nodes[1].name.as_str()), "{first:?}");
    let held: Vec<&TestNode> = burst.iter().filter(|n| !n.has_our_taint()).collect();
    assert_eq!(held.len(), failing + 2 - cap, "{first:?}");
    for h in &held {
        let message = h.condition("FabricReady").unwrap()["message"].to_string();
        let over = format!("{} of {n}", cap + 1);
        assert!(
            h.has_reason("FabricReady", "BreakerOpen") && message.contains(&over),
            "{}: {message}",
            h.name
        );
    }
    eprintln!(
        "figure: {failing} of {n} failing within one renewal ({}the summary still lagging when \
         all had decided): {} tainted, {} held",
        if lagging { "" } else { "not " },
        first.len(),
        held.len()
    );

    // Two of the burst's tainted recover: two held nodes take their slots, none more.
    let recovering: Vec<usize> = (0..failing)
        .filter(|&i| burst[i].has_our_taint())
        .take(2.min(held.len()))
        .collect();
    for &i in &recovering {
        hcas[i].set_port(true);
    }
    let freed = recovering.len();
    crate::common::wait::poll_until(
        "held nodes tainted in the freed slots",
        Duration::from_secs(90),
        Duration::from_millis(500),
        || {
            recovering.iter().all(|&i| burst[i].ready())
                && held.iter().filter(|n| n.has_our_taint()).count() == freed
        },
        report,
    );
    std::thread::sleep(Duration::from_secs(3));
    let now = tainted(&nodes);
    assert_eq!(now.len(), cap, "{now:?}\n{}", report());
    drop(agents);
    guard.stop();
}

/// The burst of the field report: 10 Nodes, one failed earlier and one tainted by the guard
/// a moment ago (its agent gone), three failing together and a fourth a second later, while
/// no summary the agents read shows the guard's taint. Before the guard reserved its taints in
/// the ledger the agents counted one tainted other where there were two, and the fourth was
/// tainted too: 6 of 10.
#[test]
fn a_burst_while_the_guards_summary_lags_its_own_taint_is_held_at_one_half() {
    burst_under_a_lagging_summary("lag", 10, 4, Duration::from_secs(1));
}

/// Three failing within one renewal of the guard's summary, in a pool of 6 with two tainted.
#[test]
fn three_failing_within_one_renewal_are_tainted_to_exactly_one_half() {
    burst_under_a_lagging_summary("three", 6, 3, Duration::from_millis(300));
}

/// Twenty failing within one renewal, in a pool of 24 with two tainted: 12 tainted, 10 held.
#[test]
fn twenty_failing_within_one_renewal_are_tainted_to_exactly_one_half() {
    burst_under_a_lagging_summary("twenty", 24, 20, Duration::from_millis(500));
}

/// Ten agents started together on untainted Nodes: each reserves its start-up taint (a node
/// that starts while five are tainted is held until one validates), all ten validate, and
/// three seconds later one port goes down. Its agent counts the pool from the guard's fresh summary: those
/// reservations, seconds old, are of Nodes it shows validated since, so none is in flight; the
/// failing Node is tainted at once, never `BreakerOpen` (before: held, "6 of 10").
#[test]
fn a_real_failure_right_after_a_fleet_wide_start_is_tainted_at_once() {
    let Some(cp) = control_plane() else { return };
    let _lease = shipped_lease();
    cp.install_agent_rbac();
    let pool = "start";
    let nodes: Vec<TestNode> = (0..10)
        .map(|i| {
            let name = format!("{pool}-{i}");
            cp.create_node(
                &name,
                json!({ POOL: pool, GPU_PRESENT: "true" }),
                json!([{ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" }]),
                json!({}),
            );
            TestNode { cp, name }
        })
        .collect();
    let scratch = tempfile::tempdir().unwrap();
    let guard = pool_guard(cp, &format!("{POOL}={pool}"), "", scratch.path());
    let hcas: Vec<FakeHca> = (0..10).map(|_| FakeHca::new(true)).collect();
    // A 1 s interval and the shipped recover_after (3): validated about 2 s after the
    // start-up taint, a later second than its reservation (a condition's time has seconds).
    let agents: Vec<_> = nodes
        .iter()
        .zip(&hcas)
        .map(|(node, hca)| {
            let config = hca.scratch().join("requirements.yaml");
            std::fs::write(
                &config,
                format!("node:\n  pool_selector: \"{POOL}={pool}\"\n"),
            )
            .unwrap();
            node.start_agent(
                hca,
                &[
                    "--interval",
                    "1s",
                    "--resync-interval",
                    "1s",
                    "--config",
                    config.to_str().unwrap(),
                ],
            )
        })
        .collect();
    for (agent, node) in agents.iter().zip(&nodes) {
        agent.wait("validation", Duration::from_secs(90), || node.ready());
    }
    let ledger = cp
        .get_json("/api/v1/namespaces/fabricgate/configmaps/fabricgate-breaker")
        .unwrap();
    let now = k8s_openapi::jiff::Timestamp::now();
    // The others' start-up reservations, seconds old: before, each counted as a taint in
    // flight, and five of them held the sixth failing node at "6 of 10".
    let fresh = nodes
        .iter()
        .filter(|n| n.name != nodes[5].name)
        .filter(|n| {
            ledger["data"][n.name.as_str()]
                .as_str()
                .and_then(|e| e.split_once(' '))
                .and_then(|(at, _)| at.parse::<k8s_openapi::jiff::Timestamp>().ok())
                .is_some_and(|at| now.duration_since(at).as_secs() < 20)
        })
        .count();
    assert!(fresh >= 5, "start-up reservations in flight time: {ledger}");
    std::thread::sleep(Duration::from_secs(3));
    hcas[5].set_port(false);
    let mut held = false;
    crate::common::wait::poll_until(
        "the failing node tainted",
        Duration::from_secs(10),
        Duration::from_millis(50),
        || {
            held |= nodes[5].has_reason("FabricReady", "BreakerOpen");
            nodes[5].has_our_taint()
        },
        || agents[5].log(),
    );
    assert!(!held, "held by the breaker first: {}", agents[5].log());
    let count = agents[5]
        .log()
        .lines()
        .rev()
        .find(|l| l.contains("breaker: counted the pool before tainting"))
        .unwrap_or_default()
        .to_owned();
    assert!(count.contains("guard"), "{count}");
    drop(agents);
    guard.stop();
}
