//! The guard's leader over a pool of thousands of GPU Nodes: `fabricgate
//! guard` as its own process (the shipped ServiceAccount, RBAC and admission policy), one
//! Ready agent pod per Node (the test plays the kubelets), then what an operator would watch:
//! its first lists, its RSS, the time from an agent's death to its Node's taint, and the same
//! while every Node's kubelet posts status (the watch events it absorbs), with its CPU.
//! `cargo bench --profile dev --bench apiserver -- guard` (docs/scale.md).

use super::TAINT;
use super::controlplane::ControlPlane;
use super::guard::{GUARD_NS, start_guard};
use super::procstat::{Usage, usage};
use super::scale::{delete_pool, fill_pool};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const POOL: &str = "scale-guard";
const APP: &str = "fg-scale-agent";
/// Not the shipped Lease: no pool summary the agents' breakers of other runs would read.
const LEASE: &str = "fabricgate-guard-scale";
const GUARD_USER: &str = "system:serviceaccount:fabricgate:fabricgate-guard";

/// What one run measures.
pub struct GuardScaleSpec {
    pub pool: usize,
    pub stale_after: Duration,
    /// How long every Node's kubelet posts status, as fast as this machine lets it.
    pub storm: Duration,
    pub quiet: Duration,
}

fn pod_name(i: usize) -> String {
    format!("sg-agent-{i:05}")
}

/// One Ready agent pod on each of `nodes`, 16 at a time.
fn create_agent_pods(cp: &ControlPlane, nodes: &[String]) {
    let pods: Api<Pod> = Api::namespaced(cp.admin(), GUARD_NS);
    cp.block_on(async {
        futures::stream::iter(nodes.iter().enumerate())
            .map(|(i, node)| {
                let pods = pods.clone();
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": { "name": pod_name(i), "labels": { "app": APP } },
                    "spec": {
                        "nodeName": node,
                        "serviceAccountName": "fabricgate",
                        "automountServiceAccountToken": false,
                        "containers": [{ "name": "agent", "image": "fabricgate:test" }],
                    },
                }))
                .expect("a pod");
                async move {
                    match pods.create(&PostParams::default(), &pod).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 409 => {}
                        Err(e) => panic!("create pod {}: {e}", pod_name(i)),
                    }
                    let ready = json!({ "status": { "phase": "Running", "conditions": [
                        { "type": "Ready", "status": "True" } ] } });
                    pods.patch_status(&pod_name(i), &PatchParams::default(), &Patch::Merge(&ready))
                        .await
                        .expect("a Ready pod");
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<()>>()
            .await;
    });
}

fn tainted(cp: &ControlPlane, node: &str) -> bool {
    cp.node(node).is_some_and(|n| {
        n["spec"]["taints"]
            .as_array()
            .is_some_and(|ts| ts.iter().any(|t| t["key"] == TAINT))
    })
}

/// Kill agent `i` (its pod deleted at once, as a crash with a drain would) and time its Node's
/// taint.
fn death_to_taint(cp: &ControlPlane, nodes: &[String], i: usize, limit: Duration) -> Duration {
    let pods: Api<Pod> = Api::namespaced(cp.admin(), GUARD_NS);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    cp.block_on(pods.delete(&pod_name(i), &dp))
        .expect("delete the agent pod");
    let t0 = Instant::now();
    while !tainted(cp, &nodes[i]) {
        assert!(
            t0.elapsed() < limit,
            "{} not tainted {limit:?} after its agent died",
            nodes[i]
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    t0.elapsed()
}

/// Every Node's kubelet posting status (a heartbeat on `Ready`) round the pool, 16 at a time,
/// until `stop`; counts the updates.
fn kubelets(cp: &'static ControlPlane, nodes: Vec<String>, stop: Arc<AtomicBool>) -> usize {
    let api: Api<Node> = Api::all(cp.admin());
    let posted = Arc::new(AtomicUsize::new(0));
    let counter = posted.clone();
    cp.block_on(async move {
        futures::stream::iter(nodes.iter().cycle())
            .take_while(|_| {
                let go = !stop.load(Ordering::Relaxed);
                async move { go }
            })
            .map(|name| {
                let api = api.clone();
                let counter = counter.clone();
                let beat = json!({ "status": { "conditions": [{
                    "type": "Ready", "status": "True", "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": k8s_openapi::jiff::Timestamp::now().to_string(),
                }] } });
                async move {
                    if api
                        .patch_status(name, &PatchParams::default(), &Patch::Strategic(&beat))
                        .await
                        .is_ok()
                    {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<()>>()
            .await;
    });
    posted.load(Ordering::Relaxed)
}

/// One run: fill, agents, the guard, quiet, deaths, deaths under a status storm.
pub fn run_guard_scale(cp: &'static ControlPlane, spec: &GuardScaleSpec) -> String {
    let _one = super::fleet::exclusive();
    let mut out = String::new();
    // The agents' ServiceAccount (their pods run as it) and the guard's.
    cp.install_agent_rbac();
    cp.apply(
        &std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/guard.yaml"))
            .expect("deploy/guard.yaml"),
    );
    let scratch = tempfile::tempdir().expect("scratch");
    let token = cp.kubectl(&["-n", GUARD_NS, "create", "token", "fabricgate-guard"]);
    let kubeconfig = scratch.path().join("guard.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let config = scratch.path().join("requirements.yaml");
    std::fs::write(
        &config,
        format!("node:\n  pool_selector: \"pool={POOL}\"\n"),
    )
    .expect("config");

    let filled = Instant::now();
    let nodes = fill_pool(cp, POOL, spec.pool, 0);
    create_agent_pods(cp, &nodes);
    let _ = writeln!(
        out,
        "guard scale: {} GPU Nodes with one Ready agent pod each (filled in {:.0} s), \
         --stale-after {:?}",
        nodes.len(),
        filled.elapsed().as_secs_f64(),
        spec.stale_after
    );
    let stale = format!("{}s", spec.stale_after.as_secs());
    let guard = start_guard(
        "scale-guard",
        Some(&format!("app={APP}")),
        LEASE,
        &config,
        &kubeconfig,
        scratch.path(),
        &["--stale-after", &stale],
    );
    let pid = guard.child().id();
    let listed = guard.wait("the guard's lists", Duration::from_secs(600), || {
        let log = guard.log();
        log.contains("listed the pool's Nodes") && log.contains("listed the agent pods")
    });
    std::thread::sleep(Duration::from_secs(10));
    let settled = usage(pid);
    let _ = writeln!(
        out,
        "  leader's lists done {:.1} s after start; RSS 10 s later {:.1} MiB (peak {:.1} MiB), \
         CPU {:.1} s so far",
        listed.as_secs_f64(),
        Usage::mib(settled.rss_bytes),
        Usage::mib(settled.peak_rss_bytes),
        settled.cpu_seconds
    );

    let mark = cp.audit_mark();
    let cpu = usage(pid).cpu_seconds;
    std::thread::sleep(spec.quiet);
    let quiet_cpu = usage(pid).cpu_seconds - cpu;
    let events = cp.audit_since(mark);
    let ours: Vec<_> = events.iter().filter(|e| e.user == GUARD_USER).collect();
    let _ = writeln!(
        out,
        "  quiet {:?}: {} requests from the guard ({} writes: Lease renewals), CPU {:.1} % of a core",
        spec.quiet,
        ours.len(),
        ours.iter().filter(|e| e.is_write()).count(),
        quiet_cpu / spec.quiet.as_secs_f64() * 100.0
    );

    let limit = spec.stale_after + Duration::from_secs(60);
    let deaths: Vec<Duration> = (0..3)
        .map(|i| death_to_taint(cp, &nodes, i, limit))
        .collect();
    let _ = writeln!(
        out,
        "  agent death -> taint (3 deaths, one after the other): {}",
        deaths
            .iter()
            .map(|d| format!("{:.1} s", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let stop = Arc::new(AtomicBool::new(false));
    let storm = {
        let (nodes, stop) = (nodes.clone(), stop.clone());
        std::thread::spawn(move || kubelets(cp, nodes, stop))
    };
    let before = usage(pid);
    let storm_started = Instant::now();
    // Into the storm before the death, so the guard is busy when it must notice it.
    std::thread::sleep(spec.storm / 4);
    let under_storm = death_to_taint(cp, &nodes, 3, limit);
    std::thread::sleep(spec.storm.saturating_sub(storm_started.elapsed()));
    stop.store(true, Ordering::Relaxed);
    let posted = storm.join().unwrap_or(0);
    let stormed = storm_started.elapsed();
    let after = usage(pid);
    let _ = writeln!(
        out,
        "  status storm: {posted} Node status updates in {:.0} s ({:.0}/s, each a watch event for \
         the guard); guard CPU {:.0} % of a core, RSS {:.1} MiB (peak {:.1} MiB); an agent death \
         during it -> taint {:.1} s",
        stormed.as_secs_f64(),
        posted as f64 / stormed.as_secs_f64(),
        (after.cpu_seconds - before.cpu_seconds) / stormed.as_secs_f64() * 100.0,
        Usage::mib(after.rss_bytes),
        Usage::mib(after.peak_rss_bytes),
        under_storm.as_secs_f64()
    );
    let tail: Vec<String> = guard
        .log()
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .take(5)
        .map(str::to_owned)
        .collect();
    if !tail.is_empty() {
        let _ = writeln!(out, "  guard warnings: {}", tail.join(" | "));
    }
    drop(guard);
    let pods: Api<Pod> = Api::namespaced(cp.admin(), GUARD_NS);
    let _ = cp.block_on(pods.delete_collection(
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        },
        &ListParams::default().labels(&format!("app={APP}")),
    ));
    delete_pool(cp, &nodes);
    out
}
