//! A fleet of agents on the real apiserver: `fabricgate` as a library runs N agents in this
//! process (each its own Node, fixture prober, metrics listener and clients), as user
//! `fabricgate-fleet`. Measured from the audit log and `/proc` of the apiserver: requests per
//! node-hour at steady state (watching each Node vs periodic GETs), the apiserver's CPU, and the
//! time until a correlated failure of 10 % of the fleet (one leaf switch) is fully tainted.
//! Used by the small fleet of `tests/cluster/fleet.rs` and by `benches/apiserver.rs`.

use super::controlplane::ControlPlane;
use super::sysfs::FakeHca;
use super::{TAINT, taint_keys, wait_until};
use fabricgate::agent::daemon::{self, Agent};
use fabricgate::config::{Config, FeatureSection};
use fabricgate::dra::metrics::DraMetrics;
use fabricgate::dra::settings::DraSettings;
use fabricgate::node::{RetryAfter, clients_from};
use fabricgate::observe::metrics::Metrics;
use fabricgate::transport::metrics::PodMetrics;
use fabricgate::transport::settings::RuntimeSettings;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::{ProbeConfig, Prober, Roots};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

const FLEET_USER: &str = "fabricgate-fleet";

/// Fleets started while this is set run with `kubernetes.dra` (docs/dra.md): each Node gets a
/// DraNet-format ResourceSlice, each agent watches its slices and its DeviceTaintRules.
pub static DRA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One fleet at a time in a process: every fleet's agents are the audit log's one user.
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub struct Fleet {
    runtime: tokio::runtime::Runtime,
    stop: tokio::sync::watch::Sender<bool>,
    hcas: Vec<FakeHca>,
    names: Vec<String>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// With [`DRA`]: the registration directory and its live `dra.net-reg.sock`.
    _dra: Option<(tempfile::TempDir, std::os::unix::net::UnixListener)>,
}

/// One DraNet-format slice per Node (its one fake HCA, `mlx5_0`), applied as admin.
fn publish_slices(cp: &ControlPlane, names: &[String]) {
    use k8s_openapi::api::resource::v1::ResourceSlice;
    let slices: Api<ResourceSlice> = Api::all(cp.admin());
    cp.block_on(async {
        for name in names {
            let slice = json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
                "metadata": { "name": format!("{name}-dra.net") },
                "spec": { "driver": "dra.net", "nodeName": name,
                    "pool": { "name": name, "generation": 1, "resourceSliceCount": 1 },
                    "devices": [{ "name": "pci-0000-00-02-0", "attributes": {
                        "dra.net/rdma": { "bool": true },
                        "dra.net/rdmaDevice": { "string": "mlx5_0" } } }] },
            });
            slices
                .patch(
                    &format!("{name}-dra.net"),
                    &PatchParams::apply("fleet-test").force(),
                    &Patch::Apply(&slice),
                )
                .await
                .unwrap();
        }
    });
}

impl Fleet {
    /// Register `n` Nodes `PREFIX-i` (tainted, as the docs recommend) and start one agent per
    /// Node in this process.
    fn start(
        cp: &'static ControlPlane,
        prefix: &str,
        n: usize,
        interval: Duration,
        watch: bool,
        breaker: bool,
    ) -> Fleet {
        let names: Vec<String> = (0..n).map(|i| format!("{prefix}-{i:04}")).collect();
        if breaker {
            // The namespace and the breaker's ledger ConfigMap, as daemonset.yaml ships them.
            cp.install_agent_rbac();
        }
        register(cp, &names, prefix);
        Fleet::start_on(cp, names, prefix, interval, watch, breaker)
    }

    /// One agent per Node of `names` (registered already, labelled `pool=<pool>`) in this
    /// process.
    pub fn start_on(
        cp: &'static ControlPlane,
        names: Vec<String>,
        pool: &str,
        interval: Duration,
        watch: bool,
        breaker: bool,
    ) -> Fleet {
        Fleet::start_tuned(cp, names, pool, interval, watch, breaker, Arc::new(|_| {}))
    }

    /// As [`Fleet::start_on`], `tune` applied to each agent's configuration last (runtime
    /// transport on, say).
    pub fn start_tuned(
        cp: &'static ControlPlane,
        names: Vec<String>,
        pool: &str,
        interval: Duration,
        watch: bool,
        breaker: bool,
        tune: Arc<dyn Fn(&mut Config) + Send + Sync>,
    ) -> Fleet {
        let n = names.len();
        let prefix = pool;
        if breaker {
            cp.install_agent_rbac();
        }
        let kubeconfig = cp.path(&format!("{prefix}.kubeconfig"));
        cp.write_kubeconfig(&kubeconfig, &cp.url, &cp.fleet_token);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let hcas: Vec<FakeHca> = (0..n).map(|_| FakeHca::new(true)).collect();
        let dra = DRA.load(std::sync::atomic::Ordering::Relaxed).then(|| {
            publish_slices(cp, &names);
            let dir = tempfile::tempdir().unwrap();
            let socket =
                std::os::unix::net::UnixListener::bind(dir.path().join("dra.net-reg.sock"))
                    .unwrap();
            (dir, socket)
        });
        let registry = dra.as_ref().map(|(d, _)| d.path().display().to_string());
        let mut tasks = Vec::new();
        for (name, hca) in names.iter().zip(&hcas) {
            let kc = kubeconfig.clone();
            let name = name.clone();
            let roots = Roots::new(hca.sysfs_root(), hca.proc_root());
            let mut stop_rx = stop_rx.clone();
            let pool = prefix.to_owned();
            let registry = registry.clone();
            let tune = Arc::clone(&tune);
            tasks.push(runtime.spawn(async move {
                let kube_config = {
                    let kc = kube::config::Kubeconfig::read_from(&kc).unwrap();
                    let mut config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                        .await
                        .unwrap();
                    if breaker && std::env::var_os("FABRICGATE_FLEET_ADMIN").is_none() {
                        // As the agent of this Node (its ServiceAccount and the node claim of
                        // its pod-bound token): the agent's RBAC and admission policies (the
                        // own-node one, the ledger's) decide, as in a real pool. The audit
                        // log still names the fleet's user.
                        super::node::impersonate_agent(&mut config, &name);
                    }
                    config
                };
                let retry_after = RetryAfter::default();
                let mut clients = clients_from(kube_config, retry_after.clone()).unwrap();
                if !watch {
                    clients.watch = None;
                }
                let mut config = Config::default();
                // The fixture trees have no kernel events; 500 listeners would only load the host.
                config.events.enabled = false;
                if breaker {
                    // The shipped breaker (0.5 of the pool, 20 new in 10 min) over this pool.
                    config.node.pool_selector = format!("pool={pool}");
                }
                if let Some(registry) = registry {
                    config.kubernetes.dra = Config::parse(&format!(
                        "kubernetes:\n  dra:\n    drivers: [{{name: dra.net}}]\n    registry_dir: {registry}\n"
                    ))
                    .unwrap()
                    .kubernetes
                    .dra;
                }
                tune(&mut config);
                let prober = Prober::new(
                    roots,
                    ProbeConfig {
                        verbs: VerbsMode::Off,
                        ..ProbeConfig::default()
                    },
                );
                let transport = RuntimeSettings::of(&config).unwrap();
                let (metrics, pod_metrics) = Metrics::with_config_and(&config, |live| {
                    transport.enabled.then(|| PodMetrics::register(live))
                });
                let dra = DraSettings::of(&config).unwrap();
                let (metrics, dra_metrics) =
                    metrics.with_families(|r| DraMetrics::register(r, &dra));
                let agent = Agent {
                    node_name: name,
                    transport,
                    dra,
                    metrics: Arc::new(metrics),
                    pod_metrics,
                    dra_metrics,
                    config,
                    prober,
                    interval,
                    resync: Duration::from_secs(60),
                    dry_run: false,
                    listener: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
                    client: Some(clients),
                    retry_after,
                    limits: fabricgate::observe::server::Limits::default(),
                    probe_deadline: Duration::from_secs(60),
                    liveness_grace: Duration::from_secs(60),
                    stale_series_grace: Duration::from_secs(600),
                    failpoint: daemon::Failpoint::None,
                    peers: None,
                    namespace: "fabricgate".to_owned(),
                };
                let shutdown = async move {
                    let _ = stop_rx.wait_for(|s| *s).await;
                };
                let _ = daemon::run(agent, shutdown).await;
            }));
        }
        Fleet {
            runtime,
            stop,
            hcas,
            names,
            tasks,
            _dra: dra,
        }
    }

    /// The fake HCAs, one per Node, in the order of the names.
    pub fn hcas(&self) -> &[FakeHca] {
        &self.hcas
    }

    /// Run `f` on the fleet's runtime (a task beside the agents, e.g. the guard).
    pub fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime.spawn(f)
    }

    /// A receiver that turns `true` when the fleet stops.
    pub fn stopping(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stop.subscribe()
    }

    pub fn stop(self) {
        let _ = self.stop.send(true);
        let tasks = self.tasks;
        self.runtime.block_on(async {
            for t in tasks {
                let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
            }
        });
    }
}

/// Register Nodes `names` labelled `pool=<pool>`, tainted (as the docs recommend), their
/// kubelet Ready.
fn register(cp: &ControlPlane, names: &[String], pool: &str) {
    let nodes: Api<Node> = Api::all(cp.admin());
    cp.block_on(async {
        for name in names {
            let node: Node = serde_json::from_value(json!({
                "metadata": { "name": name, "labels": { "pool": pool } },
                "spec": { "taints": [{ "key": TAINT, "effect": "NoSchedule" }] },
            }))
            .unwrap();
            nodes
                .create(&PostParams::default(), &node)
                .await
                .expect("create node");
            let status = json!({ "status": { "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet is posting ready status" }] } });
            nodes
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .expect("node status");
        }
    });
}

/// How many Nodes of `prefix` carry our taint, and how many are validated.
fn census(cp: &ControlPlane, prefix: &str) -> (usize, usize) {
    let (tainted, ready, _) = census_breaker(cp, prefix);
    (tainted, ready)
}

/// [`census`], and how many untainted Nodes say `BreakerOpen`.
fn census_breaker(cp: &ControlPlane, prefix: &str) -> (usize, usize, usize) {
    let nodes: Api<Node> = Api::all(cp.admin());
    let list = cp
        .block_on(nodes.list(&ListParams::default().labels(&format!("pool={prefix}"))))
        .expect("list nodes");
    let mut tainted = 0;
    let mut ready = 0;
    let mut held = 0;
    for n in list.items {
        let v = serde_json::to_value(&n).unwrap();
        let breaker_open = v["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "FabricReady" && c["reason"] == "BreakerOpen");
        if taint_keys(&v).iter().any(|k| k == TAINT) {
            tainted += 1;
        } else if v["metadata"]["labels"]["fabricgate.io/ready"] == "true" {
            ready += 1;
        } else if breaker_open {
            held += 1;
        }
    }
    (tainted, ready, held)
}

pub struct Figures {
    pub n: usize,
    pub start_to_all_ready: Duration,
    pub quiet: Duration,
    pub requests: usize,
    pub writes: usize,
    pub apiserver_cpu: f64,
    pub failed: usize,
    pub failure_to_all_tainted: Duration,
    /// With the breaker: how many of the failed were tainted (the rest say `BreakerOpen`), and
    /// how many pool lists the agents made for it.
    pub breaker: Option<(usize, usize)>,
}

/// `n` agents of Nodes `prefix-i` in this process: validated, then `quiet` at steady state,
/// then a tenth failing at once; the figures of it.
pub fn run_fleet(
    cp: &'static ControlPlane,
    prefix: &str,
    n: usize,
    watch: bool,
    breaker: bool,
    quiet: Duration,
) -> Figures {
    let _one = exclusive();
    let interval = Duration::from_secs(2);
    let started = Instant::now();
    let fleet = Fleet::start(cp, prefix, n, interval, watch, breaker);
    wait_until(
        "the whole fleet validated",
        Duration::from_secs(600),
        || census(cp, prefix) == (0, n),
    );
    let start_to_all_ready = started.elapsed();
    std::thread::sleep(Duration::from_secs(2));

    let mark = cp.audit_mark();
    let cpu_before = cp.apiserver_cpu_seconds();
    std::thread::sleep(quiet);
    let cpu = cp.apiserver_cpu_seconds() - cpu_before;
    let events: Vec<_> = cp
        .audit_since(mark)
        .into_iter()
        .filter(|e| e.user == FLEET_USER)
        .collect();
    let writes = events.iter().filter(|e| e.is_write()).count();

    // One leaf switch fails: 10 % of the fleet at once.
    let failed = n.div_ceil(10);
    let mark = cp.audit_mark();
    let failure = Instant::now();
    for hca in fleet.hcas.iter().take(failed) {
        hca.set_port(false);
    }
    let mut decided = (0, 0);
    wait_until(
        "the failed tenth tainted (or held by the breaker)",
        Duration::from_secs(300),
        || {
            let (tainted, _, held) = census_breaker(cp, prefix);
            decided = (tainted, held);
            if breaker {
                tainted + held == failed
            } else {
                tainted == failed
            }
        },
    );
    let failure_to_all_tainted = failure.elapsed();
    let lists = cp
        .audit_since(mark)
        .into_iter()
        .filter(|e| e.user == FLEET_USER && e.verb == "list" && e.resource == "nodes")
        .count();
    let names = fleet.names.clone();
    fleet.stop();
    // Leave the cluster as it was for the other tests' node counts.
    let nodes: Api<Node> = Api::all(cp.admin());
    cp.block_on(async {
        for name in names {
            let _ = nodes.delete(&name, &Default::default()).await;
        }
    });
    Figures {
        n,
        start_to_all_ready,
        quiet,
        requests: events.len(),
        writes,
        apiserver_cpu: cpu,
        failed,
        failure_to_all_tainted,
        breaker: breaker.then_some((decided.0, lists)),
    }
}

/// The figures of one run as a line of docs/scale.md.
pub fn report(label: &str, f: &Figures) -> String {
    let node_hours = f.n as f64 * f.quiet.as_secs_f64() / 3600.0;
    let breaker = f.breaker.map_or(String::new(), |(tainted, lists)| {
        format!(
            "; breaker: {tainted} of the {} tainted, {} held (BreakerOpen), {lists} pool lists",
            f.failed,
            f.failed - tainted
        )
    });
    format!(
        "{label}: N={} start->all validated {:.1}s; quiet {:?}: {} requests ({} writes) = {:.1} \
         requests/node-hour, apiserver CPU {:.2}s ({:.1}% of a core); {} of {} failed at once -> \
         all decided in {:.2}s{breaker}",
        f.n,
        f.start_to_all_ready.as_secs_f64(),
        f.quiet,
        f.requests,
        f.writes,
        f.requests as f64 / node_hours,
        f.apiserver_cpu,
        100.0 * f.apiserver_cpu / f.quiet.as_secs_f64(),
        f.failed,
        f.n,
        f.failure_to_all_tainted.as_secs_f64()
    )
}

/// `n` agents of Nodes `prefix-i` in this process (probing every 2 s), all validated; `f`
/// runs with their Node names, then the fleet stops and its Nodes are deleted. For figures
/// measured on top of a validated fleet (`benches/gang.rs`).
pub fn with_validated_fleet<T>(
    cp: &'static ControlPlane,
    prefix: &str,
    n: usize,
    f: impl FnOnce(&[String]) -> T,
) -> T {
    let _one = exclusive();
    let fleet = Fleet::start(cp, prefix, n, Duration::from_secs(2), true, false);
    wait_until(
        "the whole fleet validated",
        Duration::from_secs(600),
        || census(cp, prefix) == (0, n),
    );
    let out = f(&fleet.names);
    let names = fleet.names.clone();
    fleet.stop();
    let nodes: Api<Node> = Api::all(cp.admin());
    cp.block_on(async {
        for name in names {
            let _ = nodes.delete(&name, &Default::default()).await;
        }
    });
    out
}
