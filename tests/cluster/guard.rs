//! `fabricgate guard` against the real kube-apiserver: two replicas elect a leader on a
//! Lease; the test plays the kubelet, setting the agent pods' Ready condition on the status
//! subresource (and deleting a pod as a node drain or crash would).

use crate::common::controlplane::{AuditEvent, Grant, rbac_grants};
use crate::common::faultproxy::{Fault, FaultProxy};
use crate::common::guard::{GUARD_NS, Guard};
use crate::common::{TAINT, TestNode, control_plane, signal, wait_until};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

const NS: &str = GUARD_NS;
const GUARD_USER: &str = "system:serviceaccount:fabricgate:fabricgate-guard";
const POOL: &str = "fabricgate.io/test-pool";
const APP: &str = "fg-agent-test";
/// Not the shipped name: that one is the breaker tests' (`common::guard::shipped_lease`).
const LEASE: &str = "fabricgate-guard-failover";
/// The label of the shipped pool (`node.pool_selector`, the DaemonSet's nodeSelector).
const GPU_PRESENT: &str = "nvidia.com/gpu.present";

/// The timing of these tests' guards.
const TIMING: [&str; 6] = [
    "--stale-after",
    "3s",
    "--poll-interval",
    "300ms",
    "--lease-duration",
    "3s",
];

fn start_guard(identity: &str, config: &Path, kubeconfig: &Path, scratch: &Path) -> Guard {
    start_guard_for(identity, APP, LEASE, config, kubeconfig, scratch)
}

/// A guard over the agent pods labelled `app=APP`, electing its leader on Lease `lease`.
fn start_guard_for(
    identity: &str,
    app: &str,
    lease: &str,
    config: &Path,
    kubeconfig: &Path,
    scratch: &Path,
) -> Guard {
    let selector = format!("app={app}");
    start_guard_selecting(
        identity,
        Some(&selector),
        lease,
        config,
        kubeconfig,
        scratch,
    )
}

/// A guard over the agent pods `selector` selects (`None`: its default), electing its leader
/// on Lease `lease`.
fn start_guard_selecting(
    identity: &str,
    selector: Option<&str>,
    lease: &str,
    config: &Path,
    kubeconfig: &Path,
    scratch: &Path,
) -> Guard {
    crate::common::guard::start_guard(
        identity, selector, lease, config, kubeconfig, scratch, &TIMING,
    )
}

fn pod_name(node: &str) -> String {
    format!("agent-{node}")
}

fn set_ready(cp: &crate::common::controlplane::ControlPlane, node: &str, ready: bool) {
    set_pod_ready(cp, &pod_name(node), ready);
}

/// Pod `name`'s status as its kubelet would report it: Running, Ready or not.
pub(crate) fn set_pod_ready(
    cp: &crate::common::controlplane::ControlPlane,
    name: &str,
    ready: bool,
) {
    let patch = json!({ "status": { "phase": "Running", "conditions": [
        { "type": "Ready", "status": if ready { "True" } else { "False" } },
    ]}})
    .to_string();
    cp.kubectl(&[
        "-n",
        NS,
        "patch",
        "pod",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch,
    ]);
}

fn holder(cp: &crate::common::controlplane::ControlPlane) -> Option<String> {
    holder_of(cp, LEASE)
}

fn holder_of(cp: &crate::common::controlplane::ControlPlane, lease: &str) -> Option<String> {
    cp.get_json(&format!(
        "/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{lease}"
    ))?["spec"]["holderIdentity"]
        .as_str()
        .map(str::to_owned)
}

/// Pool Node `name` (labelled `POOL=pool`) with its agent pod (`app=app`, Ready).
fn node_with_agent(
    cp: &crate::common::controlplane::ControlPlane,
    name: &str,
    pool: &str,
    app: &str,
) {
    cp.create_node(
        name,
        // The shipped pool label (deploy/guard.yaml's admission policy admits only the pool).
        json!({ POOL: pool, GPU_PRESENT: "true" }),
        json!([{ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" }]),
        json!({}),
    );
    ready_pod(cp, &pod_name(name), name, json!({ "app": app }));
}

/// The guard's leader has listed the pool's Nodes and the agent pods (its cache is filled).
fn listed(guard: &Guard) -> bool {
    let log = guard.log();
    log.contains("listed the pool's Nodes") && log.contains("listed the agent pods")
}

/// Whether an audit event of the shipped guard's ServiceAccount is one of
/// `guard_taints_nodes_whose_agent_is_gone_only_the_leader_acts_and_failover_works`'s guards':
/// the breaker tests run guards with the same account meanwhile (on their own Lease, pools,
/// Nodes and agent pods; their ledger reservations and Events cannot be told apart, and are
/// left out).
fn of_this_test(e: &AuditEvent) -> bool {
    let uri = &e.request_uri;
    match e.resource.as_str() {
        "leases" => e.name == LEASE || (e.name.is_empty() && e.verb == "create"),
        "nodes" if e.name.is_empty() => {
            uri.contains("test-pool%3Dguard&")
                || uri.ends_with("test-pool%3Dguard")
                || uri.contains("test-pool%21%3Dguard&")
                || uri.ends_with("test-pool%21%3Dguard")
        }
        "nodes" => e.name.starts_with("guard-"),
        "pods" => uri.contains(APP),
        _ => false,
    }
}

/// Whether a request (its URI) lists Nodes outside the pool: the guard's proof of its
/// confinement, by a requirement of the pool selector negated (`!=`).
fn lists_outside_the_pool(uri: &str) -> bool {
    uri.contains("%21%3D") || uri.contains("%21=") || uri.contains("!=")
}

/// How many `verb` requests on `resource` these audit events hold.
fn count(events: &[AuditEvent], resource: &str, verb: &str) -> usize {
    events
        .iter()
        .filter(|e| e.resource == resource && e.subresource.is_empty() && e.verb == verb)
        .count()
}

/// Requests per (resource[/subresource], verb), for the report.
fn breakdown(events: &[AuditEvent]) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for e in events {
        let (_, resource, verb) = e.grant();
        *out.entry(format!("{resource} {verb}")).or_insert(0) += 1;
    }
    out
}

#[test]
fn guard_taints_nodes_whose_agent_is_gone_only_the_leader_acts_and_failover_works() {
    let Some(cp) = control_plane() else { return };
    // The namespace and the agent's ServiceAccount, as daemonset.yaml installs them.
    cp.install_agent_rbac();
    let names: Vec<String> = (0..6).map(|i| format!("guard-{i}")).collect();
    for name in &names {
        node_with_agent(cp, name, "guard", APP);
    }
    // A Node outside the pool, for the leader's proof that it cannot taint there.
    cp.create_node(
        "guard-outside",
        json!({ POOL: "not-guard" }),
        json!([{ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" }]),
        json!({}),
    );
    let node = |i: usize| TestNode {
        cp,
        name: names[i].clone(),
    };
    // The shipped manifest, applied: the guards run with its ServiceAccount and RBAC (its
    // Deployment stays inert: no controller manager runs here).
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/guard.yaml");
    // Server-side, so tests applying it at the same time do not race on its creation.
    cp.apply(&std::fs::read_to_string(manifest).unwrap());
    let token = cp.kubectl(&["-n", NS, "create", "token", "fabricgate-guard"]);
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let mark = cp.audit_mark();
    let config = scratch.path().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"{POOL}=guard\"\n"),
    )
    .unwrap();
    let a = start_guard("guard-a", &config, &kubeconfig, scratch.path());
    let b = start_guard("guard-b", &config, &kubeconfig, scratch.path());
    wait_until("a leader", Duration::from_secs(20), || holder(cp).is_some());
    let leader = holder(cp).unwrap();
    let (leader_guard, follower) = if leader == a.identity { (a, b) } else { (b, a) };
    wait_until("the leader's lists", Duration::from_secs(10), || {
        listed(&leader_guard)
    });
    // ... and its dry run of a taint, which its admission policy admits.
    wait_until("the leader's dry run", Duration::from_secs(10), || {
        leader_guard.log().contains("dry run of the guard's taint")
    });
    // Healthy agents: nothing happens for well over stale_after, and the guard sends nothing
    // but its Lease renewals: no writes, and no reads of Nodes or pods (its watches, open
    // since its start, are logged only when they end).
    let quiet = cp.audit_mark();
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        (0..6).all(|i| !node(i).has_our_taint()),
        "no agent problem, no taint"
    );
    let steady: Vec<AuditEvent> = cp
        .audit_since(quiet)
        .into_iter()
        .filter(|e| e.user == GUARD_USER && of_this_test(e))
        .collect();
    // (Nor its proof of confinement: Nodes listed outside the pool, a dry run on one. Whether
    // it is confined depends on the other tests' Nodes here: its admission policy's pool is
    // the shared control plane's, wider than this test's pool, so it proves again on every
    // turn for a while when one of theirs is found.)
    let not_lease: Vec<_> = steady
        .iter()
        .filter(|e| e.resource != "leases")
        .filter(|e| !lists_outside_the_pool(&e.request_uri))
        .filter(|e| !e.request_uri.contains("dryRun=All"))
        .collect();
    assert!(
        not_lease.is_empty(),
        "steady state: requests other than Lease renewals: {not_lease:#?}"
    );
    eprintln!(
        "steady state, 4 s, --poll-interval 300ms, 2 replicas: {:?}",
        breakdown(&steady)
    );
    assert!(!follower.log().contains("listed"), "the follower listed");

    // A Node joins the pool after the guard started, and no agent pod comes up on it: the
    // Node watch brings it into the cache, and it is tainted.
    let late = TestNode {
        cp,
        name: "guard-late".into(),
    };
    cp.create_node(
        &late.name,
        json!({ POOL: "guard", GPU_PRESENT: "true" }),
        json!([{ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" }]),
        json!({}),
    );
    let t0 = Instant::now();
    wait_until("the late Node's taint", Duration::from_secs(3 + 5), || {
        late.has_our_taint()
    });
    eprintln!(
        "Node added to the pool without an agent -> guard taint: {:?} (stale_after 3s)",
        t0.elapsed()
    );
    wait_until(
        "AgentNotRunning on the late Node",
        Duration::from_secs(5),
        || late.has_reason("FabricReady", "AgentNotRunning"),
    );
    // It leaves the pool again (the Node watch's delete): 3 of 6 may still be tainted under
    // the breaker's default max_unvalidated_fraction 0.5.
    cp.kubectl(&["delete", "node", &late.name]);

    // The agent pod on guard-1 is deleted; the one on guard-2 turns NotReady.
    cp.kubectl(&[
        "-n",
        NS,
        "delete",
        "pod",
        &pod_name(&names[1]),
        "--grace-period=0",
        "--force",
    ]);
    set_ready(cp, &names[2], false);
    let t0 = Instant::now();
    for i in [1, 2] {
        wait_until("the guard's taint", Duration::from_secs(3 + 5), || {
            node(i).has_our_taint()
        });
        wait_until("FabricReady", Duration::from_secs(5), || {
            node(i).condition("FabricReady").is_some()
        });
        let fabric = node(i).condition("FabricReady").expect("FabricReady");
        assert_eq!(fabric["status"], "False");
        assert_eq!(fabric["reason"], "AgentNotRunning", "{fabric}");
    }
    eprintln!(
        "agent gone -> guard taint: {:?} (stale_after 3s)",
        t0.elapsed()
    );
    assert!(
        leader_guard.log().contains("guard-1"),
        "{}",
        leader_guard.log()
    );
    assert!(
        !follower.log().contains("guard-1"),
        "the follower acted: {}",
        follower.log()
    );

    // The guard never untaints: the agent pod on guard-2 is Ready again, the taint stays.
    set_ready(cp, &names[2], true);
    std::thread::sleep(Duration::from_secs(2));
    assert!(node(2).has_our_taint());

    // Failover: the leader dies without releasing; the follower takes the Lease and acts.
    let mut dead = leader_guard;
    signal(dead.child(), "KILL");
    let _ = dead.child_mut().wait();
    set_ready(cp, &names[3], false);
    let t0 = Instant::now();
    follower.wait(
        "the new leader's taint",
        Duration::from_secs(3 + 3 + 5),
        || node(3).has_our_taint(),
    );
    eprintln!("failover + stale_after -> taint: {:?}", t0.elapsed());
    assert_eq!(holder(cp).as_deref(), Some(follower.identity.as_str()));
    wait_until("AgentNotRunning", Duration::from_secs(5), || {
        node(3).has_reason("FabricReady", "AgentNotRunning")
    });
    assert!(
        (0..6)
            .filter(|&i| i != 1 && i != 2 && i != 3)
            .all(|i| !node(i).has_our_taint())
    );
    assert!(
        listed(&follower),
        "the new leader filled its cache: {}",
        follower.log()
    );
    // A clean stop releases the Lease.
    signal(follower.child(), "TERM");
    wait_until("the Lease released", Duration::from_secs(10), || {
        holder(cp).is_none()
    });
    drop(follower);

    // A watch is logged when it ends: the dead leader's and the stopped follower's.
    let guard_requests = || -> Vec<AuditEvent> {
        cp.audit_since(mark)
            .into_iter()
            .filter(|e| e.user == GUARD_USER && of_this_test(e))
            .collect()
    };
    wait_until(
        "both leaders' watches in the audit log",
        Duration::from_secs(10),
        || {
            let r = guard_requests();
            count(&r, "nodes", "watch") >= 2 && count(&r, "pods", "watch") >= 2
        },
    );
    let requests = guard_requests();
    eprintln!("whole run (2 leaderships): {:?}", breakdown(&requests));
    // Each leadership lists the pool's Nodes and the agent pods once, at its start; the
    // follower lists nothing while it follows.
    let node_lists: Vec<&AuditEvent> = requests
        .iter()
        .filter(|e| e.resource == "nodes" && e.subresource.is_empty() && e.verb == "list")
        .collect();
    let (outside, pool): (Vec<&AuditEvent>, Vec<&AuditEvent>) = node_lists
        .iter()
        .partition(|e| lists_outside_the_pool(&e.request_uri));
    assert_eq!(pool.len(), 2, "node lists of the pool: {pool:#?}");
    // And each leadership's proof of its confinement: a few Nodes outside the pool.
    assert!(
        outside.len() >= 2,
        "node lists outside the pool: {outside:#?}"
    );
    assert_eq!(count(&requests, "pods", "list"), 2, "pod lists");
    assert_eq!(count(&requests, "nodes", "get"), 0, "node reads");

    // Least privilege, from the audit log: the guards used exactly what deploy/guard.yaml
    // grants, and nothing they asked for was refused.
    // (But the proof of its confinement: a dry run outside the pool, refused by design.)
    let refused: Vec<_> = requests
        .iter()
        .filter(|e| e.code == 403)
        .filter(|e| !e.request_uri.contains("dryRun=All"))
        .collect();
    assert!(refused.is_empty(), "refused: {refused:#?}");
    // The ledger's and the Events' requests cannot be told apart from the breaker tests'
    // guards' (same account): the grants they use are counted from all of them.
    let shared: Vec<AuditEvent> = cp
        .audit_since(mark)
        .into_iter()
        .filter(|e| e.user == GUARD_USER && matches!(e.resource.as_str(), "configmaps" | "events"))
        .collect();
    assert!(shared.iter().all(|e| e.code != 403), "refused: {shared:#?}");
    let used: BTreeSet<Grant> = requests
        .iter()
        .chain(&shared)
        .map(AuditEvent::grant)
        .collect();
    let manifest = std::fs::read_to_string(manifest).unwrap();
    // Without runtime.on_sockets: evict, the evictions' own ClusterRole goes unused.
    let granted = rbac_grants(&manifest, |d| {
        (d["kind"] == "ClusterRole" || d["kind"] == "Role")
            && d["metadata"]["name"] != "fabricgate-guard-evict"
    });
    assert_eq!(used, granted, "audit log vs deploy/guard.yaml");
}

/// The leader's watch connections are cut (a proxy in front of the apiserver closes every open
/// connection), then the apiserver is unreachable for a while: the guard re-watches from the
/// last resourceVersion it saw (no new list), sees what changed meanwhile, and still taints.
/// After an outage longer than its Lease it lists again, once, and still taints.
#[test]
fn guard_resumes_its_watches_after_the_connections_are_cut_and_still_detects() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    const FAULT_APP: &str = "fg-agent-fault";
    const FAULT_LEASE: &str = "fabricgate-guard-fault";
    // Six nodes: three tainted stay within the breaker's default max_unvalidated_fraction 0.5.
    let names: Vec<String> = (0..6).map(|i| format!("guard-fault-{i}")).collect();
    for name in &names {
        node_with_agent(cp, name, "guard-fault", FAULT_APP);
    }
    let node = |i: usize| TestNode {
        cp,
        name: names[i].clone(),
    };
    let proxy = FaultProxy::start(&cp.url, &cp.ca_file);
    let scratch = tempfile::tempdir().unwrap();
    // The admin's token: this guard's requests stay out of the audit counts of the
    // fabricgate-guard ServiceAccount (the other test); the proxy counts them instead.
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &proxy.url(), &cp.admin_token);
    let config = scratch.path().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"{POOL}=guard-fault\"\n"),
    )
    .unwrap();
    let mut guard = start_guard_for(
        "guard-fault",
        FAULT_APP,
        FAULT_LEASE,
        &config,
        &kubeconfig,
        scratch.path(),
    );
    wait_until("the fault guard leads", Duration::from_secs(20), || {
        holder_of(cp, FAULT_LEASE).as_deref() == Some("guard-fault")
    });
    wait_until("the guard's lists", Duration::from_secs(10), || {
        listed(&guard)
    });
    let lists = |proxy: &FaultProxy| {
        proxy
            .seen()
            .iter()
            .filter(|r| {
                r.method == "GET"
                    && !r.path.contains("watch=")
                    && !lists_outside_the_pool(&r.path)
                    && (r.path.starts_with("/api/v1/nodes")
                        || r.path.starts_with(&format!("/api/v1/namespaces/{NS}/pods")))
            })
            .count()
    };
    assert_eq!(lists(&proxy), 2, "one list of Nodes, one of pods");

    // 1. Every open connection is cut (the watches die mid-stream); then an agent turns
    // NotReady.
    proxy.cut_connections();
    std::thread::sleep(Duration::from_millis(500));
    set_ready(cp, &names[0], false);
    let t0 = Instant::now();
    guard.wait("a taint after the cut", Duration::from_secs(3 + 5), || {
        node(0).has_our_taint()
    });
    eprintln!(
        "watch cut, then agent NotReady -> taint: {:?}",
        t0.elapsed()
    );
    guard.wait("AgentNotRunning", Duration::from_secs(5), || {
        node(0).has_reason("FabricReady", "AgentNotRunning")
    });

    // 2. The apiserver is unreachable for 2 s (every request reset, open connections cut);
    // meanwhile an agent turns NotReady (written past the proxy). The guard sees it once back.
    proxy.set_fault(Fault::Reset);
    std::thread::sleep(Duration::from_millis(300));
    set_ready(cp, &names[1], false);
    std::thread::sleep(Duration::from_millis(1700));
    proxy.clear_fault();
    let t0 = Instant::now();
    guard.wait(
        "a taint after the outage",
        Duration::from_secs(3 + 8),
        || node(1).has_our_taint(),
    );
    eprintln!(
        "2 s outage ends -> taint of a node whose agent failed during it: {:?}",
        t0.elapsed()
    );
    assert!(guard.alive(), "the guard survived: {}", guard.log());
    assert!(
        (2..6).all(|i| !node(i).has_our_taint()),
        "the healthy nodes stay untainted"
    );
    let seen = proxy.seen();
    assert!(
        seen.iter().any(|r| r.status == 0),
        "the outage reset requests: {seen:?}"
    );
    let rewatches = seen
        .iter()
        .filter(|r| r.path.contains("watch=") && r.status == 200)
        .count();
    assert!(rewatches >= 4, "the watches were re-established: {seen:?}");
    // Every watch asks for bookmarks and starts from a resourceVersion the guard saw (a
    // list's, an event's or a bookmark's), never from "0" or nothing.
    for r in seen.iter().filter(|r| r.path.contains("watch=")) {
        assert!(r.path.contains("allowWatchBookmarks=true"), "{}", r.path);
        let version = r
            .path
            .split(['?', '&'])
            .find_map(|kv| kv.strip_prefix("resourceVersion="))
            .unwrap_or("");
        assert!(!version.is_empty() && version != "0", "{}", r.path);
    }
    // Continuity held: the watches resumed from the last resourceVersion, nothing was
    // listed again.
    assert_eq!(lists(&proxy), 2, "lists after the cut: {seen:?}");

    // 3. An outage longer than the Lease (4 s > --lease-duration 3s): the guard cannot know it
    // still leads, drops its watches and cache, and once back takes the Lease again, lists
    // once more and detects an agent that failed meanwhile.
    proxy.set_fault(Fault::Reset);
    std::thread::sleep(Duration::from_millis(300));
    set_ready(cp, &names[2], false);
    std::thread::sleep(Duration::from_millis(3700));
    proxy.clear_fault();
    let t0 = Instant::now();
    guard.wait(
        "a taint after the long outage",
        Duration::from_secs(3 + 8),
        || node(2).has_our_taint(),
    );
    eprintln!(
        "4 s outage ends -> taint of a node whose agent failed during it: {:?}",
        t0.elapsed()
    );
    assert!(guard.alive(), "the guard survived: {}", guard.log());
    assert!(
        guard.log().contains("watches stopped"),
        "the watches were dropped: {}",
        guard.log()
    );
    assert_eq!(lists(&proxy), 4, "one list of each after the long outage");
    assert!(
        (3..6).all(|i| !node(i).has_our_taint()),
        "the healthy nodes stay untainted"
    );
    signal(guard.child(), "TERM");
    let _ = guard.child_mut().wait();
}

/// A pod `name` on Node `node` with `labels`, Ready as its kubelet would report it.
pub(crate) fn ready_pod(
    cp: &crate::common::controlplane::ControlPlane,
    name: &str,
    node: &str,
    labels: Value,
) {
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "namespace": NS, "labels": labels },
        "spec": {
            "nodeName": node,
            "serviceAccountName": "fabricgate",
            "automountServiceAccountToken": false,
            "containers": [{ "name": "agent", "image": "fabricgate:test" }],
        },
    });
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "-n",
            NS,
            "delete",
            "pod",
            name,
            "--ignore-not-found",
            "--grace-period=0",
            "--force",
        ],
        None,
    );
    let (ok, _, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["create", "-f", "-"],
        Some(&pod.to_string()),
    );
    assert!(ok, "create pod {name}: {err}");
    set_pod_ready(cp, name, true);
}

/// The guard's default selector (`app.kubernetes.io/name=fabricgate`) also matched
/// the webhook's pods, so a node running a Ready webhook pod and no live agent was never
/// tainted, and the peers Service selected the webhook too. Now both select the agent's own
/// `app.kubernetes.io/component: agent`: the guard, with its default `--pod-selector` (the
/// shipped one), taints that node `AgentNotRunning`; the peers Service's selector, asked of the
/// apiserver, lists the agent pods and not the webhook's.
#[test]
fn redteam_a_ready_webhook_pod_is_no_live_agent() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    let names: Vec<String> = (0..4).map(|i| format!("rt-gsel-{i}")).collect();
    let agent_labels =
        json!({ "app.kubernetes.io/name": "fabricgate", "app.kubernetes.io/component": "agent" });
    let webhook_labels =
        json!({ "app.kubernetes.io/name": "fabricgate", "app.kubernetes.io/component": "webhook" });
    for (i, name) in names.iter().enumerate() {
        cp.create_node(
            name,
            json!({ POOL: "rt-gsel", GPU_PRESENT: "true" }),
            json!([{ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" }]),
            json!({}),
        );
        if i == 0 {
            // The victim: the webhook's pod, Ready, and no agent.
            ready_pod(cp, "rt-gsel-webhook", name, webhook_labels.clone());
        } else {
            ready_pod(
                cp,
                &format!("rt-gsel-agent-{i}"),
                name,
                agent_labels.clone(),
            );
        }
    }
    let victim = TestNode {
        cp,
        name: names[0].clone(),
    };
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    // The admin's token, as the fault test: this guard stays out of the other test's audit
    // counts of the guard's ServiceAccount.
    cp.write_kubeconfig(&kubeconfig, &cp.url, &cp.admin_token);
    let config = scratch.path().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"{POOL}=rt-gsel\"\n"),
    )
    .unwrap();
    let guard = start_guard_selecting(
        "guard-rt-selector",
        None,
        "fabricgate-guard-rt-selector",
        &config,
        &kubeconfig,
        scratch.path(),
    );
    guard.wait(
        "the node with only a webhook pod tainted",
        Duration::from_secs(20),
        || victim.has_our_taint(),
    );
    guard.wait("AgentNotRunning", Duration::from_secs(5), || {
        victim.has_reason("FabricReady", "AgentNotRunning")
    });
    std::thread::sleep(Duration::from_secs(1));
    for name in &names[1..] {
        let n = TestNode {
            cp,
            name: name.clone(),
        };
        assert!(
            !n.has_our_taint(),
            "{name} has a live agent: {:?}",
            n.taints()
        );
    }
    drop(guard);

    // The peers Service's selector, asked of the apiserver: the agents, not the webhook.
    let service: Value = serde_norway::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/peers-service.yaml"
        ))
        .unwrap(),
    )
    .unwrap();
    let selector: Vec<String> = service["spec"]["selector"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap()))
        .collect();
    let selected = cp.kubectl(&[
        "-n",
        NS,
        "get",
        "pods",
        "-l",
        &selector.join(","),
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ]);
    let selected: Vec<&str> = selected.split_whitespace().collect();
    assert!(
        (1..4).all(|i| selected.contains(&format!("rt-gsel-agent-{i}").as_str())),
        "{selected:?}"
    );
    assert!(!selected.contains(&"rt-gsel-webhook"), "{selected:?}");
}

/// What the apiserver answered a request made as the guard's ServiceAccount: the object, or
/// the refusal's (code, message).
fn as_guard(
    cp: &crate::common::controlplane::ControlPlane,
    node: &str,
    status: bool,
    content_type: &str,
    query: &str,
    body: &Value,
) -> Result<Value, (u16, String)> {
    as_user(cp, GUARD_USER, node, status, content_type, query, body)
}

/// As [`as_guard`], as the ServiceAccount `user` of the guard's namespace.
fn as_user(
    cp: &crate::common::controlplane::ControlPlane,
    user: &str,
    node: &str,
    status: bool,
    content_type: &str,
    query: &str,
    body: &Value,
) -> Result<Value, (u16, String)> {
    // Impersonated through the admin client: RBAC and admission see the guard, and the audit
    // log's `user` stays the admin (the first test counts the guard's own requests).
    let sub = if status { "/status" } else { "" };
    let req = http::Request::builder()
        .method(http::Method::PATCH)
        .uri(format!("/api/v1/nodes/{node}{sub}?{query}"))
        .header(http::header::CONTENT_TYPE, content_type)
        .header("Impersonate-User", user)
        .header("Impersonate-Group", "system:serviceaccounts")
        .header("Impersonate-Group", "system:serviceaccounts:fabricgate")
        .header("Impersonate-Group", "system:authenticated")
        .body(serde_json::to_vec(body).unwrap())
        .unwrap();
    match cp.block_on(cp.admin().request::<Value>(req)) {
        Ok(v) => Ok(v),
        Err(kube::Error::Api(s)) => Err((s.code, s.message)),
        Err(e) => panic!("not an API answer: {e}"),
    }
}

/// The guard's token could set foreign labels, the breaker override annotation,
/// cordon, clear every taint and zero allocatable on any Node. Now its admission policy
/// (deploy/guard.yaml) refuses each of those, and any write to a Node outside the pool, and a
/// `FabricReady` with any other reason; what the guard does (add its taint, set
/// `FabricReady=False` `AgentNotRunning`) still works.
#[test]
fn redteam_the_guards_token_may_only_fail_a_pool_node_closed() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    cp.apply(include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/guard.yaml"
    )));
    let pool = "rt-guard-pool";
    let outside = "rt-guard-outside";
    let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
    cp.create_node(
        pool,
        json!({ GPU_PRESENT: "true", "team": "ml" }),
        json!([gpu]),
        json!({}),
    );
    cp.create_node(outside, json!({ "team": "ml" }), json!([gpu]), json!({}));
    let merge = "application/merge-patch+json";
    let json_patch = "application/json-patch+json";
    let apply = "application/apply-patch+yaml";
    let ssa = "fieldManager=fabricgate-guard&force=true";
    let node = |name: &str| cp.node(name).unwrap();
    // Either of its two policies: fabricgate-guard (what it may change) or
    // fabricgate-guard-pool (which Nodes: the requirements ConfigMap's pool-selector).
    let refused_by_policy = |r: &Result<Value, (u16, String)>| matches!(r, Err((403, m)) if m.contains("ValidatingAdmissionPolicy 'fabricgate-guard'") || m.contains("ValidatingAdmissionPolicy 'fabricgate-guard-pool'"));
    let refused_by_pool = |r: &Result<Value, (u16, String)>| matches!(r, Err((403, m)) if m.contains("ValidatingAdmissionPolicy 'fabricgate-guard-pool'") && m.contains(fabricgate::cluster::guard::POOL_REFUSAL));
    // The policy is enforced once the apiserver has loaded it.
    let label = json!({ "metadata": { "labels": { "team": "hacked" } } });
    wait_until(
        "the guard's policy enforced",
        Duration::from_secs(60),
        || {
            let r = as_guard(cp, pool, false, merge, "dryRun=All", &label);
            assert!(
                !matches!(&r, Err((403, m)) if m.contains(" cannot ")),
                "the guard's RBAC refused it: {r:?}"
            );
            refused_by_policy(&r)
        },
    );
    let our_taint = json!({ "key": TAINT, "effect": "NoSchedule" });
    let taints = |name: &str, taints: Value| {
        json!([
            { "op": "test", "path": "/metadata/resourceVersion",
              "value": node(name)["metadata"]["resourceVersion"] },
            { "op": "add", "path": "/spec/taints", "value": taints },
        ])
    };
    // ... and its pool policy, with its parameter (the shipped ConfigMap's pool-selector).
    wait_until("the guard's pool enforced", Duration::from_secs(60), || {
        let r = as_guard(
            cp,
            outside,
            false,
            json_patch,
            "dryRun=All",
            &taints(outside, json!([gpu, our_taint])),
        );
        refused_by_pool(&r)
    });
    let fabric = |reason: &str, status: &str| {
        json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": pool },
            "status": { "conditions": [{ "type": "FabricReady", "status": status,
                "reason": reason, "message": "red team" }] } })
    };
    type Attempt<'a> = (&'a str, &'a str, bool, &'a str, &'a str, Value);
    let attempts: Vec<Attempt> = vec![
        ("a foreign label", pool, false, merge, "", label.clone()),
        (
            "the breaker override annotation",
            pool,
            false,
            merge,
            "",
            json!({ "metadata": { "annotations": { "fabricgate.io/breaker-override": "true" } } }),
        ),
        (
            "cordon",
            pool,
            false,
            merge,
            "",
            json!({ "spec": { "unschedulable": true } }),
        ),
        (
            "remove every taint",
            pool,
            false,
            json_patch,
            "",
            taints(pool, json!([])),
        ),
        (
            "replace the GPU taint by its own",
            pool,
            false,
            json_patch,
            "",
            taints(pool, json!([our_taint])),
        ),
        (
            "zero allocatable",
            pool,
            true,
            merge,
            "",
            json!({ "status": { "allocatable": { "nvidia.com/gpu": "0", "pods": "0" } } }),
        ),
        (
            "its own taint on a Node outside the pool",
            outside,
            false,
            json_patch,
            "",
            taints(outside, json!([gpu, our_taint])),
        ),
        (
            "FabricReady=False reason PortDown",
            pool,
            true,
            apply,
            ssa,
            fabric("PortDown", "False"),
        ),
        (
            "FabricReady=True",
            pool,
            true,
            apply,
            ssa,
            fabric("AgentNotRunning", "True"),
        ),
        (
            "the kubelet's Ready=False",
            pool,
            true,
            apply,
            ssa,
            json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": pool },
                "status": { "conditions": [{ "type": "Ready", "status": "False",
                    "reason": "RedTeam", "message": "red team" }] } }),
        ),
    ];
    let before = (node(pool), node(outside));
    let mut wrong = Vec::new();
    for (what, name, status, ct, query, body) in &attempts {
        let r = as_guard(cp, name, *status, ct, query, body);
        if !refused_by_policy(&r) {
            wrong.push(format!("{what}: not refused by the policy: {r:?}"));
        }
        if *name == outside && !refused_by_pool(&r) {
            wrong.push(format!("{what}: not refused as outside the pool: {r:?}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    for (stored, name) in [(&before.0, pool), (&before.1, outside)] {
        assert_eq!(
            node(name)["metadata"]["resourceVersion"],
            stored["metadata"]["resourceVersion"],
            "a refused write changed {name}"
        );
    }

    // What the guard does: its taint, then FabricReady=False AgentNotRunning, as it sends them.
    let r = as_guard(
        cp,
        pool,
        false,
        json_patch,
        "",
        &taints(pool, json!([gpu, our_taint])),
    );
    assert!(r.is_ok(), "adding its taint: {r:?}");
    let r = as_guard(
        cp,
        pool,
        true,
        apply,
        ssa,
        &fabric("AgentNotRunning", "False"),
    );
    assert!(r.is_ok(), "FabricReady=False AgentNotRunning: {r:?}");
    let n = TestNode {
        cp,
        name: pool.to_owned(),
    };
    assert!(n.has_our_taint());
    assert!(n.has_reason("FabricReady", "AgentNotRunning"));
    // Once there, its own taint cannot be taken off by the guard either.
    let r = as_guard(cp, pool, false, json_patch, "", &taints(pool, json!([gpu])));
    assert!(refused_by_policy(&r), "removing its own taint: {r:?}");
    assert_eq!(node(pool)["metadata"]["labels"]["team"], "ml");
}

/// `deploy/guard.yaml` and the requirements ConfigMap of `daemonset.yaml` under other names
/// (`name`: its own ServiceAccount, RBAC, admission policies and bindings; `{name}-requirements`,
/// the ConfigMap its pool policy reads), the ConfigMap's one pool value, `pool-selector`, set to
/// `pool`: the shipped objects, which the other tests use, stay as they are.
fn renamed_guard_manifest(name: &str, pool: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let guard = std::fs::read_to_string(root.join("deploy/guard.yaml")).unwrap();
    let rendered = std::fs::read_to_string(root.join("daemonset.yaml")).unwrap();
    let requirements = rendered
        .split("\n---")
        .find(|d| d.contains("\nkind: ConfigMap") && d.contains("name: fabricgate-requirements"))
        .expect("the requirements ConfigMap in daemonset.yaml");
    let shipped_pool = "\n  pool-selector: nvidia.com/gpu.present=true\n";
    assert!(
        requirements.contains(shipped_pool),
        "the shipped pool moved"
    );
    let requirements =
        requirements.replace(shipped_pool, &format!("\n  pool-selector: \"{pool}\"\n"));
    format!("{guard}\n---{requirements}")
        .replace("fabricgate-requirements", &format!("{name}-requirements"))
        .replace("fabricgate-guard", name)
}

/// The ConfigMap `name` of the guard's namespace as the kubelet mounts it: each key a file in
/// `dir`. Returns the path of its `requirements.yaml`.
fn mount_configmap(
    cp: &crate::common::controlplane::ControlPlane,
    name: &str,
    dir: &Path,
) -> std::path::PathBuf {
    let cm = cp
        .get_json(&format!("/api/v1/namespaces/{NS}/configmaps/{name}"))
        .unwrap_or_else(|| panic!("no ConfigMap {name}"));
    for (key, value) in cm["data"].as_object().unwrap() {
        std::fs::write(dir.join(key), value.as_str().unwrap()).unwrap();
    }
    dir.join("requirements.yaml")
}

/// The guard's `/readyz` status and body.
fn readyz(addr: &str) -> (u16, String) {
    let (status, _, body) = crate::common::http_get(addr, "/readyz", None);
    (status, body)
}

/// The Events about the guard replica `identity` with `reason`: their notes.
fn guard_events(
    cp: &crate::common::controlplane::ControlPlane,
    identity: &str,
    reason: &str,
) -> Vec<String> {
    let list = cp
        .get_json(&format!("/apis/events.k8s.io/v1/namespaces/{NS}/events"))
        .unwrap_or_default();
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["regarding"]["name"] == identity && e["reason"] == reason)
        .filter_map(|e| e["note"].as_str().map(str::to_owned))
        .collect()
}

/// `promtool test rules`: whether FabricgateGuardCannotAct fires over the guard's scraped
/// `blocked` and `leader` values held for 10 minutes (the shipped rule file, its annotations
/// rendered), and what promtool said.
fn guard_alert_fires(blocked: f64, leader: f64) -> (bool, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let rules_path = root.join("deploy/prometheus-rules.yaml");
    let rules: Value =
        serde_norway::from_str(&std::fs::read_to_string(&rules_path).unwrap()).unwrap();
    let rule = rules["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["alert"] == "FabricgateGuardCannotAct")
        .expect("the rule FabricgateGuardCannotAct")
        .clone();
    let job = "fabricgate-guard";
    let mut annotations = serde_json::Map::new();
    for (k, v) in rule["annotations"].as_object().unwrap() {
        let text = v.as_str().unwrap().replace("{{ $labels.job }}", job);
        annotations.insert(k.clone(), Value::String(text));
    }
    let series = |name: &str| format!("{name}{{job=\"{job}\",instance=\"guard-pool:9466\"}}");
    let test = json!({
        "rule_files": [rules_path.to_str().unwrap()],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                { "series": series("fabricgate_guard_blocked"), "values": format!("{blocked}x10") },
                { "series": series("fabricgate_guard_leader"), "values": format!("{leader}x10") },
            ],
            "alert_rule_test": [{
                "eval_time": "6m",
                "alertname": "FabricgateGuardCannotAct",
                "exp_alerts": [{
                    "exp_labels": { "job": job, "severity": rule["labels"]["severity"] },
                    "exp_annotations": annotations,
                }],
            }],
        }],
    });
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("guard_rule_test.yaml");
    std::fs::write(&file, serde_json::to_string(&test).unwrap()).unwrap();
    let out = std::process::Command::new("promtool")
        .args(["test", "rules"])
        .arg(&file)
        .output()
        .expect("promtool");
    let said = format!(
        "promtool test rules:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// The guard proves at start, with a server-side dry run of its taint, that its admission
/// policy lets it act. Its policy's pool changed to a label the Nodes lack: `/readyz` fails at
/// once, `fabricgate_guard_blocked` is 1 and FabricgateGuardCannotAct fires over it, and a
/// Warning Event names both selectors. The pool restored: ready again, and a dead agent's
/// Node is tainted within `--stale-after` + 5 s.
#[test]
fn guard_proves_its_policy_admits_its_taint_and_says_what_disagrees() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    const APP_POOL: &str = "fg-agent-pool";
    const POOL_LEASE: &str = "fabricgate-guard-pool";
    const IDENTITY: &str = "guard-pool";
    let names: Vec<String> = (0..4).map(|i| format!("guard-pool-{i}")).collect();
    for name in &names {
        node_with_agent(cp, name, "guard-pool", APP_POOL);
    }
    let absent = "fabricgate.io/absent-label=true";
    cp.apply(&renamed_guard_manifest("fg-guard-pool", absent));
    // The apiserver's policy informer picks the new policy up within about a second.
    std::thread::sleep(Duration::from_secs(2));
    let token = cp.kubectl(&["-n", NS, "create", "token", "fg-guard-pool"]);
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let config = scratch.path().join("requirements.yaml");
    let selector = format!("{POOL}=guard-pool");
    std::fs::write(&config, format!("node:\n  pool_selector: \"{selector}\"\n")).unwrap();
    let t0 = Instant::now();
    let guard = start_guard_for(
        IDENTITY,
        APP_POOL,
        POOL_LEASE,
        &config,
        &kubeconfig,
        scratch.path(),
    );
    let addr = guard.metrics_addr();

    // At start: not ready, saying why.
    guard.wait("/readyz failing", Duration::from_secs(20), || {
        readyz(&addr).0 == 503
    });
    eprintln!(
        "pool disagrees -> /readyz 503 after {:?} from start",
        t0.elapsed()
    );
    let (_, body) = readyz(&addr);
    assert!(
        body.contains("(pool)") && body.contains("absent-label"),
        "{body}"
    );
    let (_, _, text) = crate::common::http_get(&addr, "/metrics", None);
    let metric = |text: &str, series: &str| crate::common::sample(text, series);
    assert_eq!(
        metric(&text, "fabricgate_guard_blocked"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "fabricgate_guard_leader"),
        Some(1.0),
        "{text}"
    );
    assert!(
        metric(
            &text,
            r#"fabricgate_guard_refused_writes_total{reason="pool"}"#
        ) >= Some(1.0),
        "{text}"
    );
    assert!(
        metric(
            &text,
            r#"fabricgate_guard_writes_total{kind="dry_run",result="refused"}"#
        ) >= Some(1.0),
        "{text}"
    );
    if crate::common::have_tool("promtool") {
        let blocked = metric(&text, "fabricgate_guard_blocked").unwrap();
        let leader = metric(&text, "fabricgate_guard_leader").unwrap();
        let (fires, said) = guard_alert_fires(blocked, leader);
        assert!(fires, "the alert over the guard's values: {said}");
        let (fires, said) = guard_alert_fires(0.0, 1.0);
        assert!(!fires, "no alert over a guard that can act: {said}");
    }
    // The Event names both selectors: the guard's and its policy's.
    guard.wait("the Warning Event", Duration::from_secs(10), || {
        !guard_events(cp, IDENTITY, fabricgate::cluster::guard::POLICY_REFUSES).is_empty()
    });
    let notes = guard_events(cp, IDENTITY, fabricgate::cluster::guard::POLICY_REFUSES);
    assert!(
        notes
            .iter()
            .any(|n| n.contains(&selector) && n.contains("fabricgate.io/absent-label=true")),
        "{notes:#?}"
    );
    // Nothing was written while refused: only dry runs.
    assert!(names.iter().all(|n| {
        !TestNode {
            cp,
            name: n.clone(),
        }
        .has_our_taint()
    }));

    // The pool restored: ready again once a dry run is admitted.
    cp.apply(&renamed_guard_manifest(
        "fg-guard-pool",
        "nvidia.com/gpu.present=true",
    ));
    let t1 = Instant::now();
    guard.wait("/readyz ready again", Duration::from_secs(20), || {
        readyz(&addr).0 == 200
    });
    eprintln!("pool restored -> /readyz 200 after {:?}", t1.elapsed());
    guard.wait("the Normal Event", Duration::from_secs(10), || {
        !guard_events(cp, IDENTITY, fabricgate::cluster::guard::POLICY_ADMITS).is_empty()
    });
    let (_, _, text) = crate::common::http_get(&addr, "/metrics", None);
    assert_eq!(
        metric(&text, "fabricgate_guard_blocked"),
        Some(0.0),
        "{text}"
    );

    // A dead agent's Node is tainted within --stale-after (3 s) + 5 s.
    set_ready(cp, &names[1], false);
    let t2 = Instant::now();
    let dead = TestNode {
        cp,
        name: names[1].clone(),
    };
    guard.wait("the dead agent's taint", Duration::from_secs(3 + 5), || {
        dead.has_our_taint()
    });
    eprintln!("pool restored, agent NotReady -> taint: {:?}", t2.elapsed());
    guard.wait("AgentNotRunning", Duration::from_secs(5), || {
        dead.has_reason("FabricReady", "AgentNotRunning")
    });
    let (_, _, text) = crate::common::http_get(&addr, "/metrics", None);
    assert_eq!(
        metric(
            &text,
            r#"fabricgate_guard_writes_total{kind="taint",result="ok"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(readyz(&addr).0, 200);
    signal(guard.child(), "TERM");
}

/// The pool is defined once, in the requirements ConfigMap's key `pool-selector`.
/// With the shipped manifests (renamed), the guard mounts that ConfigMap and its pool policy
/// reads it: the guard's taint is admitted on the pool's Nodes and refused outside it. The one
/// value changed (nothing else): the guard, restarted as a rollout would, and its policy both
/// follow; the new pool's dead agent is tainted, the old pool's Nodes are refused.
#[test]
fn the_pool_is_one_value_changing_it_moves_the_guard_and_its_policy_together() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    const NAME: &str = "fg-guard-once";
    const APP_ONCE: &str = "fg-agent-once";
    const LEASE_ONCE: &str = "fabricgate-guard-once";
    let user = format!("system:serviceaccount:{NS}:{NAME}");
    let (a, b) = (["once-a-0", "once-a-1"], ["once-b-0", "once-b-1"]);
    for name in a {
        node_with_agent(cp, name, "once-a", APP_ONCE);
    }
    for name in b {
        node_with_agent(cp, name, "once-b", APP_ONCE);
    }
    let pool_a = format!("{POOL}=once-a");
    let pool_b = format!("{POOL}=once-b");
    let configmap = format!("{NAME}-requirements");
    cp.apply(&renamed_guard_manifest(NAME, &pool_a));
    let token = cp.kubectl(&["-n", NS, "create", "token", NAME]);
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let gpu = json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" });
    let our_taint = json!({ "key": TAINT, "effect": "NoSchedule" });
    let dry_run_taint = |node: &str| {
        let now = cp.node(node).unwrap();
        let patch = json!([
            { "op": "test", "path": "/metadata/resourceVersion",
              "value": now["metadata"]["resourceVersion"] },
            { "op": "add", "path": "/spec/taints", "value": [gpu.clone(), our_taint.clone()] },
        ]);
        as_user(
            cp,
            &user,
            node,
            false,
            "application/json-patch+json",
            "dryRun=All",
            &patch,
        )
    };
    let outside = |r: &Result<Value, (u16, String)>| matches!(r, Err((403, m)) if m.contains(fabricgate::cluster::guard::POOL_REFUSAL));
    // The policy as the apiserver enforces it: admitted in the pool, refused outside it.
    let policy_follows = |inside: &str, out: &str| {
        wait_until(
            &format!("the policy's pool holds {inside}, not {out}"),
            Duration::from_secs(60),
            || outside(&dry_run_taint(out)) && dry_run_taint(inside).is_ok(),
        );
    };
    policy_follows(a[1], b[1]);

    // The guard reads the same key, mounted beside its requirements.yaml (as the agents and
    // the admission check do: `Config::load`).
    let mounted = scratch.path().join("etc-fabricgate");
    std::fs::create_dir(&mounted).unwrap();
    let config = mount_configmap(cp, &configmap, &mounted);
    let loaded = fabricgate::config::Config::load(&config).unwrap();
    assert_eq!(loaded.node.pool_selector, pool_a);
    let guard = start_guard_for(
        "guard-once-a",
        APP_ONCE,
        LEASE_ONCE,
        &config,
        &kubeconfig,
        scratch.path(),
    );
    let addr = guard.metrics_addr();
    guard.wait(
        "/readyz ready: its dry run admitted",
        Duration::from_secs(20),
        || readyz(&addr).0 == 200,
    );
    let tainted = |name: &str| {
        TestNode {
            cp,
            name: name.to_owned(),
        }
        .has_our_taint()
    };
    set_ready(cp, a[0], false);
    set_ready(cp, b[0], false);
    guard.wait(
        "pool a's dead agent tainted",
        Duration::from_secs(3 + 5),
        || tainted(a[0]),
    );
    assert!(!tainted(b[0]), "a Node outside the pool was tainted");
    drop(guard);

    // The one value changed, and nothing else.
    let patch = json!({ "data": { fabricgate::config::POOL_SELECTOR_FILE: pool_b } }).to_string();
    cp.kubectl(&[
        "-n",
        NS,
        "patch",
        "configmap",
        &configmap,
        "--type=merge",
        "-p",
        &patch,
    ]);
    policy_follows(b[1], a[1]);
    let config = mount_configmap(cp, &configmap, &mounted);
    let loaded = fabricgate::config::Config::load(&config).unwrap();
    assert_eq!(loaded.node.pool_selector, pool_b);
    let guard = start_guard_for(
        "guard-once-b",
        APP_ONCE,
        LEASE_ONCE,
        &config,
        &kubeconfig,
        scratch.path(),
    );
    let addr = guard.metrics_addr();
    guard.wait(
        "/readyz ready on the new pool",
        Duration::from_secs(20),
        || readyz(&addr).0 == 200,
    );
    // The killed guard's Lease (3 s) runs out first.
    guard.wait(
        "pool b's dead agent tainted",
        Duration::from_secs(3 + 3 + 5),
        || tainted(b[0]),
    );
    assert!(
        guard_events(
            cp,
            "guard-once-b",
            fabricgate::cluster::guard::POLICY_REFUSES
        )
        .is_empty(),
        "the new pool's guard was refused"
    );
    let (_, _, text) = crate::common::http_get(&addr, "/metrics", None);
    assert_eq!(
        crate::common::sample(&text, "fabricgate_guard_blocked"),
        Some(0.0),
        "{text}"
    );
    signal(guard.child(), "TERM");
}

/// The pool check deleted mid-term: the guard's pool policy (fabricgate-guard-pool) reads its
/// pool from the requirements ConfigMap and admits every Node while that ConfigMap is missing.
/// Deleting it lifted the guard token's pool limit without a word (the start's dry run proves
/// only an allowed write). Now the leader proves its confinement every `--prove-every`: a dry
/// run of its taint on a Node outside the pool must be refused. With the ConfigMap gone, the
/// token can indeed taint outside the pool (shown), and within seconds the guard says so:
/// `/readyz` 503 naming the cause, `fabricgate_guard_confined` 0, a Warning Event
/// `GuardNotConfined`. The ConfigMap restored: confined and ready again, Event `GuardConfined`.
#[test]
fn redteam_the_guard_says_when_its_pool_check_is_deleted_mid_term() {
    let Some(cp) = control_plane() else { return };
    cp.install_agent_rbac();
    const NAME: &str = "fg-guard-confine";
    const APP_CONFINE: &str = "fg-agent-confine";
    const LEASE_CONFINE: &str = "fabricgate-guard-confine";
    let user = format!("system:serviceaccount:{NS}:{NAME}");
    for name in ["confine-0", "confine-1"] {
        node_with_agent(cp, name, "confine", APP_CONFINE);
    }
    // A Node outside the pool that this test owns: the dry runs below aim at it.
    cp.create_node(
        "confine-outside",
        json!({ POOL: "not-confine" }),
        json!([{ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" }]),
        json!({}),
    );
    let pool = format!("{POOL}=confine");
    let configmap = format!("{NAME}-requirements");
    let manifest = renamed_guard_manifest(NAME, &pool);
    cp.apply(&manifest);
    let token = cp.kubectl(&["-n", NS, "create", "token", NAME]);
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let mounted = scratch.path().join("etc-fabricgate");
    std::fs::create_dir(&mounted).unwrap();
    let config = mount_configmap(cp, &configmap, &mounted);
    let dry_run_outside = || {
        let now = cp.node("confine-outside").unwrap();
        let patch = json!([
            { "op": "test", "path": "/metadata/resourceVersion",
              "value": now["metadata"]["resourceVersion"] },
            { "op": "add", "path": "/spec/taints", "value": [
                { "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" },
                { "key": TAINT, "effect": "NoSchedule" }] },
        ]);
        as_user(
            cp,
            &user,
            "confine-outside",
            false,
            "application/json-patch+json",
            "dryRun=All",
            &patch,
        )
    };
    wait_until(
        "the pool policy refuses the guard outside its pool",
        Duration::from_secs(60),
        || matches!(dry_run_outside(), Err((403, _))),
    );
    let mut timing: Vec<&str> = TIMING.to_vec();
    timing.extend(["--prove-every", "1s"]);
    let selector = format!("app={APP_CONFINE}");
    let guard = crate::common::guard::start_guard(
        "guard-confine",
        Some(&selector),
        LEASE_CONFINE,
        &config,
        &kubeconfig,
        scratch.path(),
        &timing,
    );
    let addr = guard.metrics_addr();
    let confined = || {
        let (_, _, text) = crate::common::http_get(&addr, "/metrics", None);
        text.lines()
            .find(|l| l.starts_with("fabricgate_guard_confined "))
            .map(|l| {
                l.trim_start_matches("fabricgate_guard_confined ")
                    .to_owned()
            })
    };
    guard.wait("ready and confined", Duration::from_secs(30), || {
        readyz(&addr).0 == 200 && confined().as_deref() == Some("1")
    });

    // The pool check deleted: the guard's token may now taint outside the pool.
    cp.kubectl(&["-n", NS, "delete", "configmap", &configmap]);
    wait_until(
        "the pool policy admitting outside the pool",
        Duration::from_secs(60),
        || dry_run_outside().is_ok(),
    );
    let took = guard.wait("the guard saying so", Duration::from_secs(30), || {
        readyz(&addr).0 == 503 && confined().as_deref() == Some("0")
    });
    let (_, body) = readyz(&addr);
    assert!(body.contains("not confined to its pool"), "{body}");
    let warned = guard_events(
        cp,
        "guard-confine",
        fabricgate::cluster::guard::NOT_CONFINED,
    );
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].contains(&configmap) || warned[0].contains("ConfigMap"),
        "{}",
        warned[0]
    );
    eprintln!("figure: the deleted pool check said within {took:?} (--prove-every 1s)");

    // Restored: confined and ready again.
    cp.apply(&manifest);
    guard.wait("confined again", Duration::from_secs(60), || {
        readyz(&addr).0 == 200 && confined().as_deref() == Some("1")
    });
    assert_eq!(
        guard_events(cp, "guard-confine", fabricgate::cluster::guard::CONFINED).len(),
        1
    );
    drop(guard);
}
