//! A pool of thousands of GPU Nodes on the real API server: `pool` Node objects of
//! a real GPU node's size (labels, capacity, 50 container images: about 10 kB each), real
//! agents on the first `agents` of them (the fleet, in this process, as the agent's
//! ServiceAccount), the guard beside them (its ServiceAccount, in this process) or not, and
//! the API server's own account of each phase: requests per component from the audit log,
//! response bytes per resource and verb from its `/metrics`, its CPU and its RSS.
//! `FABRICGATE_SCALE=... cargo bench --profile dev --bench apiserver -- scale` (docs/scale.md).

use super::TAINT;
use super::controlplane::{AuditEvent, ControlPlane};
use super::fleet::Fleet;
use fabricgate::cluster::guard::{self, GuardSettings};
use fabricgate::config::Config;
use fabricgate::node::{RetryAfter, clients_from};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const FLEET_USER: &str = "fabricgate-fleet";
const GUARD_USER: &str = "system:serviceaccount:fabricgate:fabricgate-guard";
/// The label that marks the Nodes with a running agent (the bench's census watches those).
const AGENT_LABEL: &str = "fabricgate-scale/agent";

/// What one run measures.
pub struct ScaleSpec {
    /// Node objects in the pool, agents' included.
    pub pool: usize,
    /// Real agents, on the first Nodes of the pool.
    pub agents: usize,
    /// How many of the agents lose their port at once (a leaf switch).
    pub leaf: usize,
    /// The guard runs (and publishes the pool summary the agents' breakers read).
    pub guard: bool,
    pub quiet: Duration,
}

/// A Node as a GPU node's kubelet and Node Feature Discovery leave it: about 10 kB of JSON.
pub fn gpu_node(name: &str, pool: &str, agent: bool) -> Value {
    let mut labels = json!({
        "pool": pool,
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": "gpu-h200-8x",
        "topology.kubernetes.io/zone": "zone-a",
        "topology.kubernetes.io/region": "region-1",
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H200",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.memory": "143771",
        "nvidia.com/cuda.driver.major": "570",
        "nvidia.com/cuda.driver.minor": "124",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/mig.capable": "true",
        "feature.node.kubernetes.io/pci-15b3.present": "true",
        "feature.node.kubernetes.io/rdma.available": "true",
        "feature.node.kubernetes.io/rdma.capable": "true",
        "feature.node.kubernetes.io/kernel-version.full": "6.8.0-1021-nvidia",
        "feature.node.kubernetes.io/cpu-model.vendor_id": "Intel",
        "feature.node.kubernetes.io/system-os_release.ID": "ubuntu",
        "feature.node.kubernetes.io/system-os_release.VERSION_ID": "22.04",
        "network.topology/leaf": format!("leaf-{}", name.len() % 16),
        "network.topology/spine": "spine-2",
    });
    // A Node with an agent registers with our taint (as the docs recommend) and its agent
    // validates it; one without stands for a validated Node of the pool whose agent this
    // machine cannot run: untainted, labelled and `FabricReady=True`, as its agent left it.
    let mut taints =
        vec![json!({ "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" })];
    let mut conditions: Vec<Value> = vec![
        json!({ "type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory", "message": "kubelet has sufficient memory available" }),
        json!({ "type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure", "message": "kubelet has no disk pressure" }),
        json!({ "type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID", "message": "kubelet has sufficient PID available" }),
        json!({ "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status" }),
    ];
    if agent {
        labels[AGENT_LABEL] = json!("true");
        taints.push(json!({ "key": TAINT, "effect": "NoSchedule" }));
    } else {
        for (k, v) in [
            ("fabricgate.io/ready", "true"),
            ("fabricgate.io/rdma.ready", "true"),
            ("fabricgate.io/rdma.active-ports", "8"),
            ("fabricgate.io/rdma.link-layer", "InfiniBand"),
            ("fabricgate.io/rdma.rate-gbps", "400"),
        ] {
            labels[k] = json!(v);
        }
        for t in ["FabricReady", "RDMAReady"] {
            conditions.push(json!({ "type": t, "status": "True", "reason": "Validated",
                "message": "validated by fabricgate", "lastTransitionTime": "2026-01-01T00:00:00Z" }));
        }
    }
    let images: Vec<Value> = (0..50)
        .map(|i| {
            json!({
                "names": [
                    format!("registry.example.com/ml/training-image-{i}@sha256:{:064x}", i * 7919 + 13),
                    format!("registry.example.com/ml/training-image-{i}:v2.{i}.0"),
                ],
                "sizeBytes": 1_000_000_000u64 + i * 37_000_000,
            })
        })
        .collect();
    let resources = json!({
        "cpu": "224", "memory": "2113459744Ki", "ephemeral-storage": "3750157108Ki",
        "hugepages-1Gi": "0", "hugepages-2Mi": "0", "pods": "110",
        "nvidia.com/gpu": "8", "rdma/hca_shared_devices_a": "8",
    });
    json!({
        "metadata": { "name": name, "labels": labels, "annotations": {
            "node.alpha.kubernetes.io/ttl": "0",
            "volumes.kubernetes.io/controller-managed-attach-detach": "true",
            "nfd.node.kubernetes.io/feature-labels": "cpu-model.vendor_id,kernel-version.full,pci-15b3.present,rdma.available,rdma.capable,system-os_release.ID,system-os_release.VERSION_ID",
        }},
        "spec": { "taints": taints },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": conditions,
            "addresses": [
                { "type": "InternalIP", "address": "10.0.0.1" },
                { "type": "Hostname", "address": name },
            ],
            "nodeInfo": {
                "machineID": "0123456789abcdef0123456789abcdef", "systemUUID": "01234567-89ab-cdef-0123-456789abcdef",
                "bootID": "01234567-89ab-cdef-0123-456789abcdef", "kernelVersion": "6.8.0-1021-nvidia",
                "osImage": "Ubuntu 22.04.5 LTS", "containerRuntimeVersion": "containerd://1.7.27",
                "kubeletVersion": "v1.37.2", "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": images,
        },
    })
}

/// Create `n` GPU Nodes `prefix-i` of pool `prefix`, 16 at a time; the first `agents` carry
/// [`AGENT_LABEL`]. Returns the names.
pub fn fill_pool(cp: &ControlPlane, prefix: &str, n: usize, agents: usize) -> Vec<String> {
    let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i:05}")).collect();
    let nodes: Api<Node> = Api::all(cp.admin());
    cp.block_on(async {
        futures::stream::iter(names.iter().enumerate())
            .map(|(i, name)| {
                let nodes = nodes.clone();
                let node: Node =
                    serde_json::from_value(gpu_node(name, prefix, i < agents)).expect("a GPU Node");
                async move {
                    match nodes.create(&PostParams::default(), &node).await {
                        Ok(_) => {}
                        Err(kube::Error::Api(e)) if e.code == 409 => {}
                        Err(e) => panic!("create Node {name}: {e}"),
                    }
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<()>>()
            .await;
    });
    names
}

pub fn delete_pool(cp: &ControlPlane, names: &[String]) {
    let nodes: Api<Node> = Api::all(cp.admin());
    cp.block_on(async {
        futures::stream::iter(names)
            .map(|name| {
                let nodes = nodes.clone();
                async move {
                    let _ = nodes.delete(name, &Default::default()).await;
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<()>>()
            .await;
    });
}

/// Response bytes and count per "resource verb" from the API server's
/// `apiserver_response_sizes` (lists and gets; watches are not in it), and the bytes and count
/// of the events sent on watches per "resource WATCH" (`apiserver_watch_events_sizes`, one per
/// event per watcher).
fn response_sizes(cp: &ControlPlane) -> BTreeMap<String, (f64, f64)> {
    let text = cp.metrics_text();
    if std::env::var_os("FABRICGATE_SCALE_DEBUG").is_some() {
        for l in text
            .lines()
            .filter(|l| l.contains("response_sizes") || l.contains("watch_events_sizes"))
            .take(10)
        {
            eprintln!("scale: metrics: {l}");
        }
    }
    let mut out = histogram_sums(&text, "apiserver_response_sizes");
    out.extend(histogram_sums(&text, "apiserver_watch_events_sizes"));
    out
}

/// Sum and count of histogram `name` per "resource verb" (verb `WATCH` where it has none).
fn histogram_sums(text: &str, name: &str) -> BTreeMap<String, (f64, f64)> {
    let (sums, counts) = (format!("{name}_sum{{"), format!("{name}_count{{"));
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in text.lines() {
        let (sum, rest) = if let Some(r) = line.strip_prefix(sums.as_str()) {
            (true, r)
        } else if let Some(r) = line.strip_prefix(counts.as_str()) {
            (false, r)
        } else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |k: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        let resource = label("resource");
        if resource.is_empty() {
            continue; // the non-resource paths (this very /metrics, /readyz)
        }
        let verb = label("verb");
        let key = format!(
            "{resource} {}",
            if verb.is_empty() { "WATCH" } else { &verb }
        );
        let v: f64 = value.trim().parse().unwrap_or(0.0);
        let e = out.entry(key).or_default();
        if sum {
            e.0 += v;
        } else {
            e.1 += v;
        }
    }
    out
}

/// What the API server did in one phase.
pub(super) struct Phase {
    pub(super) name: &'static str,
    pub(super) took: Duration,
    pub(super) events: Vec<AuditEvent>,
    pub(super) bytes: BTreeMap<String, (f64, f64)>,
    pub(super) cpu: f64,
    pub(super) rss_before: u64,
    pub(super) rss_max: u64,
}

impl Phase {
    /// Measure `f` (which returns when the phase is over).
    pub(super) fn measure(cp: &ControlPlane, name: &'static str, f: impl FnOnce()) -> Phase {
        let mark = cp.audit_mark();
        let sizes = response_sizes(cp);
        let cpu = cp.apiserver_cpu_seconds();
        let rss_before = cp.apiserver_rss_bytes();
        let rss_max = Arc::new(AtomicU64::new(rss_before));
        let done = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (rss_max, done) = (rss_max.clone(), done.clone());
            let pid_rss = cp.apiserver_rss_reader();
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    rss_max.fetch_max(pid_rss(), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let started = Instant::now();
        f();
        let took = started.elapsed();
        done.store(true, Ordering::Relaxed);
        let _ = sampler.join();
        let after = response_sizes(cp);
        let bytes = after
            .into_iter()
            .filter_map(|(k, (s, c))| {
                let (s0, c0) = sizes.get(&k).copied().unwrap_or_default();
                (c > c0).then_some((k, (s - s0, c - c0)))
            })
            .collect();
        Phase {
            name,
            took,
            events: cp.audit_since(mark),
            bytes,
            cpu: cp.apiserver_cpu_seconds() - cpu,
            rss_before,
            rss_max: rss_max.load(Ordering::Relaxed),
        }
    }

    pub(super) fn report(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "  phase {}: {:.1} s; apiserver CPU {:.1} s ({:.1}% of a core), RSS {} MiB -> max {} MiB (+{} MiB)",
            self.name,
            self.took.as_secs_f64(),
            self.cpu,
            100.0 * self.cpu / self.took.as_secs_f64().max(0.001),
            self.rss_before >> 20,
            self.rss_max >> 20,
            self.rss_max.saturating_sub(self.rss_before) >> 20,
        );
        for (who, user) in [("agents", FLEET_USER), ("guard", GUARD_USER)] {
            let mine: Vec<&AuditEvent> = self.events.iter().filter(|e| e.user == user).collect();
            let mut by: BTreeMap<String, usize> = BTreeMap::new();
            for e in &mine {
                // A refused or failed request keeps its code: a breaker that listed the pool
                // after a failed Lease read says so here.
                let key = match e.code {
                    0 | 200..=299 => format!("{} {}", e.resource_path(), e.verb),
                    code => format!("{} {} {code}", e.resource_path(), e.verb),
                };
                *by.entry(key).or_default() += 1;
            }
            let writes = mine.iter().filter(|e| e.is_write()).count();
            let _ = writeln!(
                out,
                "    {who}: {} requests ({writes} writes, {:.2}/s): {by:?}",
                mine.len(),
                mine.len() as f64 / self.took.as_secs_f64().max(0.001)
            );
        }
        let bytes: Vec<String> = self
            .bytes
            .iter()
            .map(|(k, (s, c))| format!("{k}: {c:.0} x {:.1} kB", s / c.max(1.0) / 1024.0))
            .collect();
        let _ = writeln!(out, "    response sizes (all users): {}", bytes.join("; "));
    }

    /// Requests of `user` in this phase on `resource` with `verb`.
    fn count(&self, user: &str, resource: &str, verb: &str) -> usize {
        self.events
            .iter()
            .filter(|e| e.user == user && e.resource == resource && e.verb == verb)
            .count()
    }

    /// Response bytes of all users' `resource verb` ("nodes LIST", "pods WATCH": the events
    /// sent on watches) in this phase.
    pub(super) fn bytes_of(&self, key: &str) -> f64 {
        self.bytes.get(key).map_or(0.0, |(s, _)| *s)
    }
}

/// The agents' Nodes as an admin reflector sees them (one list, then a watch: the census costs
/// no list per look).
pub(super) struct Census {
    store: Store<Node>,
}

impl Census {
    pub(super) fn start(cp: &ControlPlane, fleet: &Fleet) -> Census {
        let nodes: Api<Node> = Api::all(cp.admin());
        let (store, writer) = reflector::store();
        let stream = watcher(
            nodes,
            watcher::Config::default().labels(&format!("{AGENT_LABEL}=true")),
        )
        .reflect(writer)
        .applied_objects();
        let mut stop = fleet.stopping();
        fleet.spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                tokio::select! {
                    _ = stop.changed() => break,
                    next = stream.next() => if next.is_none() { break },
                }
            }
        });
        Census { store }
    }

    /// (tainted, validated, held by the breaker) among `names`.
    pub(super) fn count(&self, names: &[String]) -> (usize, usize, usize) {
        let (mut tainted, mut ready, mut held) = (0, 0, 0);
        for name in names {
            let Some(n) = self
                .store
                .get(&kube::runtime::reflector::ObjectRef::new(name))
            else {
                continue;
            };
            let has_taint = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|ts| ts.iter().any(|t| t.key == TAINT));
            let breaker_open = n
                .status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c.type_ == "FabricReady" && c.reason.as_deref() == Some("BreakerOpen")
                    })
                });
            let validated = n
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("fabricgate.io/ready"))
                .is_some_and(|v| v == "true");
            if has_taint {
                tainted += 1;
            } else if validated {
                ready += 1;
            } else if breaker_open {
                held += 1;
            }
        }
        (tainted, ready, held)
    }

    pub(super) fn wait(&self, what: &str, limit: Duration, mut done: impl FnMut(&Census) -> bool) {
        let started = Instant::now();
        while !done(self) {
            assert!(
                started.elapsed() < limit,
                "scale: timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The guard (its ServiceAccount, in this process beside the agents) over pool `pool`, on the
/// shipped Lease; no agent pods match its selector, and it would taint for that only after a
/// day: it is here for its pool summary and its cost.
fn spawn_guard(cp: &'static ControlPlane, fleet: &Fleet, pool: &str) {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/guard.yaml");
    cp.apply(&std::fs::read_to_string(manifest).expect("deploy/guard.yaml"));
    let token = cp.kubectl(&["-n", "fabricgate", "create", "token", "fabricgate-guard"]);
    let kubeconfig = cp.path(&format!("{pool}-guard.kubeconfig"));
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let mut config = Config::default();
    config.node.pool_selector = format!("pool={pool}");
    let mut stop = fleet.stopping();
    fleet.spawn(async move {
        let kc = kube::config::Kubeconfig::read_from(&kubeconfig).expect("guard kubeconfig");
        let kube_config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .expect("guard kubeconfig");
        let clients = clients_from(kube_config, RetryAfter::default()).expect("guard clients");
        let settings = GuardSettings {
            transport: fabricgate::config::FeatureSection::of(&config).unwrap(),
            config,
            namespace: "fabricgate".to_owned(),
            pod_selector: "app=fabricgate-scale-no-agent-pods".to_owned(),
            stale_after: Duration::from_secs(86_400),
            poll_interval: Duration::from_secs(5),
            // Its pool is not its admission policy's (the shared control plane's): its proof
            // of confinement, at its start, says so; not again while measured.
            prove_every: Duration::from_secs(86_400),
            lease_name: fabricgate::config::DEFAULT_GUARD_LEASE.to_owned(),
            lease_duration: Duration::from_secs(15),
            identity: "scale-guard".to_owned(),
        };
        let watch = clients.watch.unwrap_or_else(|| clients.requests.clone());
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        let metrics = std::sync::Arc::new(guard::GuardMetrics::new());
        if let Err(e) = guard::run(clients.requests, watch, settings, metrics, shutdown).await {
            eprintln!("scale: the guard stopped: {e}");
        }
    });
}

/// Whether the guard's Lease holds a summary of `pool` counting `nodes` Nodes.
fn summary_counts(cp: &ControlPlane, pool: &str, nodes: usize) -> bool {
    super::guard::published_pool(cp)
        .is_some_and(|s| s["selector"] == format!("pool={pool}") && s["nodes"] == nodes)
}

/// The in-process agents' breaker log (`fabricgate::node::breaker`, info and above), kept
/// from the first run on: their own word on why one listed the pool ("no summary from the
/// guard: ..."), for the report. At most 1 MiB; the fleet logs nothing else here.
fn breaker_log() -> &'static std::sync::Mutex<Vec<u8>> {
    static LOG: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());
    static INSTALL: std::sync::Once = std::sync::Once::new();
    struct Append;
    impl std::io::Write for Append {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let mut log = LOG
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if log.len() + buf.len() <= 1 << 20 {
                log.extend_from_slice(buf);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    INSTALL.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "fabricgate::node::breaker=info",
            ))
            .with_ansi(false)
            .with_writer(|| Append)
            .finish();
        // Another subscriber set first (none is in these binaries) only loses the lines.
        let _ = tracing::subscriber::set_global_default(subscriber);
    });
    &LOG
}

/// The breaker log's lines about any of `nodes` that say why the pool was listed.
fn why_listed(nodes: &[String]) -> Vec<String> {
    let log = breaker_log()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    String::from_utf8_lossy(&log)
        .lines()
        .filter(|l| {
            (l.contains("no summary from the guard") || l.contains("cannot list the pool"))
                && l.split_whitespace()
                    .any(|word| nodes.iter().any(|n| word == format!("node={n}")))
        })
        .map(str::to_owned)
        .collect()
}

/// The guard's Lease as the agents read it: holder, renewal, duration, and the summary's size.
fn guard_lease_state(cp: &ControlPlane) -> String {
    let Some(lease) = super::guard::shipped_guard_lease(cp) else {
        return "not found".to_owned();
    };
    format!(
        "holder {}, renewed {}, duration {} s, summary {}",
        lease["spec"]["holderIdentity"],
        lease["spec"]["renewTime"],
        lease["spec"]["leaseDurationSeconds"],
        lease["metadata"]["annotations"]["fabricgate.io/pool"]
            .as_str()
            .map_or("absent".to_owned(), |t| format!("{} bytes", t.len()))
    )
}

/// What one run found; `report` has it all as text.
pub struct ScaleRun {
    pub report: String,
    /// Of the leaf: tainted, held by the breaker (`BreakerOpen`).
    pub tainted: usize,
    pub held: usize,
    /// Requests of the agents while the leaf was decided: Lease and ledger reads and writes,
    /// pool lists; and the pool lists alone.
    pub decide_requests: usize,
    pub pool_lists: usize,
    /// Requests and writes from the agents and the guard in the quiet window.
    pub steady_requests: usize,
    pub steady_writes: usize,
}

/// One run: fill, start, quiet, a leaf fails, its repair.
pub fn run_scale(cp: &'static ControlPlane, prefix: &str, spec: &ScaleSpec) -> ScaleRun {
    let _one = super::fleet::exclusive();
    breaker_log();
    let mut out = String::new();
    let size = serde_json::to_vec(&gpu_node(&format!("{prefix}-00000"), prefix, false))
        .map_or(0, |v| v.len());
    let filled = Instant::now();
    let names = fill_pool(cp, prefix, spec.pool, spec.agents);
    let _ = writeln!(
        out,
        "scale {prefix}: {} Nodes of {:.1} kB (filled in {:.0} s), {} agents, leaf {}, guard {}",
        spec.pool,
        size as f64 / 1024.0,
        filled.elapsed().as_secs_f64(),
        spec.agents,
        spec.leaf,
        if spec.guard { "on" } else { "off" }
    );
    let agents: Vec<String> = names[..spec.agents].to_vec();
    let leaf: Vec<String> = agents[..spec.leaf.min(spec.agents)].to_vec();
    let mut fleet: Option<Fleet> = None;
    let start = Phase::measure(cp, "start", || {
        let f = Fleet::start_on(
            cp,
            agents.clone(),
            prefix,
            Duration::from_secs(2),
            true,
            true,
        );
        if spec.guard {
            spawn_guard(cp, &f, prefix);
        }
        fleet = Some(f);
    });
    let fleet = fleet.expect("the fleet");
    let census = Census::start(cp, &fleet);
    let validated = Phase::measure(cp, "start -> all validated", || {
        census.wait("the agents validated", Duration::from_secs(900), |c| {
            c.count(&agents).1 == agents.len()
        });
        if spec.guard {
            let started = Instant::now();
            while !summary_counts(cp, prefix, spec.pool) {
                assert!(
                    started.elapsed() < Duration::from_secs(120),
                    "no pool summary"
                );
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    });
    std::thread::sleep(Duration::from_secs(5));
    let quiet = Phase::measure(cp, "quiet", || std::thread::sleep(spec.quiet));
    let failing = Phase::measure(cp, "leaf fails", || {
        for hca in &fleet.hcas()[..leaf.len()] {
            hca.set_port(false);
        }
        census.wait("the leaf decided", Duration::from_secs(900), |c| {
            let (tainted, _, held) = c.count(&leaf);
            tainted + held == leaf.len()
        });
    });
    let (tainted, _, held) = census.count(&leaf);
    let lease_after_failing = guard_lease_state(cp);
    let repaired = Phase::measure(cp, "leaf repaired", || {
        for hca in &fleet.hcas()[..leaf.len()] {
            hca.set_port(true);
        }
        census.wait("the leaf validated again", Duration::from_secs(900), |c| {
            c.count(&agents).1 == agents.len()
        });
    });
    fleet.stop();
    for p in [&start, &validated, &quiet, &failing, &repaired] {
        p.report(&mut out);
    }
    let pool_lists = failing.count(FLEET_USER, "nodes", "list");
    let decide_requests: usize = [
        "leases get",
        "configmaps get",
        "configmaps update",
        "nodes list",
    ]
    .iter()
    .map(|k| {
        let (resource, verb) = k.split_once(' ').unwrap_or_default();
        failing.count(FLEET_USER, resource, verb)
    })
    .sum();
    let decide_bytes = failing.bytes_of("nodes LIST")
        + failing.bytes_of("leases GET")
        + failing.bytes_of("configmaps GET")
        + failing.bytes_of("configmaps PUT");
    let _ = writeln!(
        out,
        "  leaf of {}: {tainted} tainted, {held} held (BreakerOpen), all decided in {:.1} s; \
         deciding (Lease/ledger reads and writes, pool lists): {decide_requests} requests, \
         {:.1} per failing node, {:.0} kB per failing node ({} pool lists)",
        leaf.len(),
        failing.took.as_secs_f64(),
        decide_requests as f64 / leaf.len().max(1) as f64,
        decide_bytes / 1024.0 / leaf.len().max(1) as f64,
        pool_lists,
    );
    if pool_lists > 0 {
        // Why an agent listed the pool rather than use the guard's summary (one not renewed
        // within the Lease's 15 s, or removed while the guard's cache relists, is not used):
        // the guard's Lease requests and the agents' reads, in time.
        let timeline: Vec<String> = quiet
            .events
            .iter()
            .chain(&failing.events)
            .filter(|e| {
                (e.user == GUARD_USER && e.resource == "leases")
                    || (e.user == FLEET_USER
                        && (e.resource == "leases" || (e.resource == "nodes" && e.verb == "list")))
            })
            .map(|e| {
                let who = if e.user == GUARD_USER {
                    "guard"
                } else {
                    "agent"
                };
                format!(
                    "{} {who} {} {} {}",
                    e.time.get(11..).unwrap_or(&e.time),
                    e.resource,
                    e.verb,
                    e.code
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "  the pool was listed; the guard's Lease after the phase: {lease_after_failing}; \
             in time: {}; the agents' word: {:?}",
            timeline.join("; "),
            why_listed(&leaf)
        );
    }
    let fabricgate: Vec<&AuditEvent> = quiet
        .events
        .iter()
        .filter(|e| e.user == FLEET_USER || e.user == GUARD_USER)
        .collect();
    let steady = fabricgate.len();
    // The guard's Lease renewals are leader election's (as every elected controller's); any
    // other write at steady state is a bug.
    let renewals = fabricgate
        .iter()
        .filter(|e| e.user == GUARD_USER && e.resource == "leases")
        .count();
    let steady_writes = fabricgate
        .iter()
        .filter(|e| e.is_write() && !(e.user == GUARD_USER && e.resource == "leases"))
        .count();
    let _ = writeln!(
        out,
        "  steady state: {steady} requests ({steady_writes} writes besides the guard's {renewals} \
         Lease requests) from fabricgate in {:?} ({:.2}/s)",
        spec.quiet,
        steady as f64 / spec.quiet.as_secs_f64()
    );
    delete_pool(cp, &names);
    // Leave no ledger entries behind for the next run.
    let ledger: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(cp.admin(), "fabricgate");
    let _ = cp.block_on(ledger.patch(
        fabricgate::policy::breaker::LEDGER,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({ "data": null })),
    ));
    ScaleRun {
        report: out,
        tainted,
        held,
        decide_requests,
        pool_lists,
        steady_requests: steady,
        steady_writes,
    }
}
