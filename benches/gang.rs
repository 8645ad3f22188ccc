//! Quota reserved -> admission check decided, for gangs of 8, 32 and 64 nodes on a validated
//! fleet of `FABRICGATE_FLEET` agents (default 500, `tests/common/fleet.rs`) on the real
//! kube-apiserver with Kueue's CRDs (the API half). Printed, not asserted.
//!
//! `cargo bench --profile dev --bench gang -- decide` (without a name it measures nothing).
//!
//! The harness plays Kueue (it reserves quota with a TAS assignment, as Kueue's scheduler
//! writes it) and the members' agents: as soon as the FabricCheck appears it fills every
//! member's answer: all at once (`concurrent`: one FabricCheckResult per member under its
//! field manager, as the agents do, each on its own warm connection) or one after the other
//! (`sequential`), so the figure is the controller's and the apiserver's part; or the members'
//! real agent half answers (`agents`): each member runs the agent's own `ring::run` (its watch
//! of the FabricChecks, the exchange, its FabricCheckResult) as that Node's agent (its
//! ServiceAccount and node claim, impersonated, so the agents' RBAC and the results policy
//! decide), against a real peer responder on loopback, `--verbs off` (no RDMA here: the
//! authenticated side channel is the exchange). `FABRICGATE_GANG_WRITES` picks the modes,
//! default all three. `FABRICGATE_GANG_SIZES`
//! overrides the gang sizes (default 8,32,64); `FABRICGATE_GANG_POOL` fills the pool up to that
//! many Nodes with GPU-sized ones that are no members (5000 for the scale figure), and the
//! controller's RSS and CPU are printed. `fabricgate admission-check` runs as its own process
//! with the shipped ServiceAccount and RBAC.

#[path = "../tests/common/mod.rs"]
mod common;

use common::controlplane::ControlPlane;
use common::fleet::with_validated_fleet;
use common::procstat::{Usage, usage};
use common::scale::{delete_pool, fill_pool};
use common::{control_plane, kueue_crds, wait_until};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NS: &str = "fabricgate";
const WL_NS: &str = "gang-bench";
const CHECK: &str = "fabricgate-preflight";
const SIZES: [usize; 3] = [8, 32, 64];

/// `FABRICGATE_GANG_SIZES` (comma-separated), default 8, 32, 64.
fn sizes() -> Vec<usize> {
    std::env::var("FABRICGATE_GANG_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| SIZES.to_vec())
}
const REPEATS: usize = 3;

fn main() {
    let names: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if !names.iter().any(|n| n == "decide") {
        println!(
            "gang: nothing measured; name `decide` (cargo bench --profile dev --bench gang -- decide)"
        );
        return;
    }
    decide();
}

fn api(cp: &ControlPlane, gvk: (&str, &str, &str), plural: &str, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(gvk.0, gvk.1, gvk.2), plural);
    Api::namespaced_with(cp.admin(), ns, &ar)
}

fn decide() {
    let Some(cp) = control_plane() else { return };
    let Some(_) = kueue_crds::install(cp) else {
        return;
    };
    cp.install_agent_rbac();
    kueue_crds::apply_admission_check(cp);
    cp.apply(
        &json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": WL_NS } })
            .to_string(),
    );
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("ac.kubeconfig");
    kueue_crds::admission_check_kubeconfig(cp, &kubeconfig);
    let config = scratch.path().join("requirements.yaml");
    // The longest timeout: a slow write under contention must not turn into a Retry here. The
    // `agents` mode answers over the side channel only (`rdma: unmeasured`).
    // Gangs above the default `gang.max_nodes` (256) are measured too.
    std::fs::write(
        &config,
        "gang:\n  timeout: 10m\n  require_rdma: false\n  max_nodes: 1024\n",
    )
    .unwrap();
    let n = common::env_usize("FABRICGATE_FLEET", 500);
    // The rest of a large pool: GPU-sized Nodes the controller's Node watch holds too.
    let pool = common::env_usize("FABRICGATE_GANG_POOL", 0);
    let filler = fill_pool(cp, "gang-filler", pool.saturating_sub(n), 0);
    with_validated_fleet(cp, "gang-fleet", n, |nodes| {
        // The endpoint each agent with peers on publishes (the harness answers for them): one
        // of its Node's addresses, at the peers port, as the controller requires.
        let admin_nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(cp.admin());
        cp.block_on(async {
            for (i, name) in nodes.iter().enumerate() {
                let addresses = json!({ "status": { "addresses": [
                    { "type": "InternalIP", "address": node_address(i).to_string() },
                    { "type": "Hostname", "address": name },
                ] } });
                admin_nodes
                    .patch_status(name, &PatchParams::default(), &Patch::Merge(&addresses))
                    .await
                    .expect("address");
                let patch = json!({ "metadata": { "annotations": {
                    "fabricgate.io/peers-endpoint": format!("{}:{PEERS_PORT}", node_address(i)) } } });
                admin_nodes
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .expect("annotate");
            }
        });
        let log = scratch.path().join("admission-check.log");
        let metrics = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("127.0.0.1:{}", l.local_addr().unwrap().port())
        };
        let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
            .args(["admission-check", "--config"])
            .arg(&config)
            .args(["--lease-name", "gang-bench", "--lease-duration", "5s"])
            .args(["--workload-namespace", WL_NS, "--identity", "gang-bench"])
            .args(["--metrics-listen", &metrics])
            .env("KUBECONFIG", &kubeconfig)
            .env("HOME", scratch.path())
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start fabricgate admission-check");
        let pid = child.id();
        // Stopped however this returns (a failed run panics).
        let _controller = Stop(child);
        let listing = std::time::Instant::now();
        wait_until("the controller's lists", Duration::from_secs(300), || {
            let l = std::fs::read_to_string(&log).unwrap_or_default();
            l.contains("listed Nodes") && l.contains("listed Workloads")
        });
        let listed = usage(pid);
        println!(
            "admission-check over {} Nodes: lists done in {:.1} s, RSS {:.1} MiB (peak {:.1} MiB)",
            n + filler.len(),
            listing.elapsed().as_secs_f64(),
            Usage::mib(listed.rss_bytes),
            Usage::mib(listed.peak_rss_bytes)
        );
        let mut offset = 0;
        let modes = std::env::var("FABRICGATE_GANG_WRITES")
            .unwrap_or_else(|_| "concurrent,sequential,agents".to_owned());
        for mode in modes.split(',').map(str::trim) {
            let answers = match mode {
                "concurrent" => Answers::Concurrent,
                "sequential" => Answers::Sequential,
                "agents" => Answers::Agents,
                other => panic!("FABRICGATE_GANG_WRITES: unknown mode {other}"),
            };
            for g in sizes() {
                let mut runs = Vec::new();
                for rep in 0..REPEATS {
                    let picked: Vec<usize> = (0..g).map(|i| (offset + i) % nodes.len()).collect();
                    let members: Vec<String> = picked.iter().map(|&i| nodes[i].clone()).collect();
                    offset += g;
                    let agents = (answers == Answers::Agents).then(|| {
                        RingAgents::start(cp, picked.iter().map(|&i| (nodes[i].as_str(), i)))
                    });
                    runs.push(one_gang(
                        cp,
                        &format!("{mode}-g{g}-{rep}"),
                        &members,
                        answers,
                    ));
                    drop(agents);
                }
                let median = |f: fn(&Run) -> Duration| {
                    let mut v: Vec<Duration> = runs.iter().map(f).collect();
                    v.sort();
                    v[v.len() / 2]
                };
                let ms = |d: Duration| d.as_secs_f64() * 1000.0;
                println!(
                    "{mode} results, gang of {g} on a fleet of {n}: quota reserved -> Ready median {:.0} ms \
                 (reserved -> FabricCheck created {:.0} ms; {g} results written {:.0} ms; \
                 last result -> Ready {:.0} ms); {REPEATS} runs, max {:.0} ms; \
                 the FabricCheck {:.1} kB",
                    ms(median(|r| r.total)),
                    ms(median(|r| r.created)),
                    ms(median(|r| r.answered)),
                    ms(median(|r| r.decided)),
                    ms(runs.iter().map(|r| r.total).max().unwrap()),
                    runs[0].check_bytes as f64 / 1024.0
                );
                let now = usage(pid);
                println!(
                    "  admission-check after the gangs of {g}: RSS {:.1} MiB (peak {:.1} MiB), \
                     CPU {:.1} s in all",
                    Usage::mib(now.rss_bytes),
                    Usage::mib(now.peak_rss_bytes),
                    now.cpu_seconds
                );
            }
        }
    });
    delete_pool(cp, &filler);
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Answers {
    /// The harness creates every answer at once.
    Concurrent,
    /// The harness creates them one after the other.
    Sequential,
    /// Each member's real agent half answers (`RingAgents`).
    Agents,
}

/// The peers port (`peers.port`'s default): every member's endpoint is at it.
const PEERS_PORT: u16 = 9465;

/// Fleet Node `i`'s address (its `InternalIP`), where its responder listens: a loopback
/// address of its own, outside the tests' 127.0.0.x.
fn node_address(i: usize) -> std::net::Ipv4Addr {
    let i = u32::try_from(i).expect("a fleet below 4 billion nodes");
    std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(127, 1, 0, 1)) + i)
}

/// The pool's peers key.
fn keys() -> fabricgate_probes::rdma::peer::Keys {
    fabricgate_probes::rdma::peer::Keys::from_secrets(&[b"0123456789abcdef0123456789abcdef"])
}

/// For each member: a peer responder on its endpoint and the agent's own `ring::run`, with
/// that Node's agent identity, until dropped.
struct RingAgents {
    stop: tokio::sync::watch::Sender<bool>,
    _responders: Vec<fabricgate_probes::rdma::peer::Responder>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RingAgents {
    fn start<'a>(cp: &ControlPlane, members: impl Iterator<Item = (&'a str, usize)>) -> Self {
        use fabricgate_probes::rdma::peer::{Identity, KeyRing, LocalPort, Plan, Responder};
        use std::sync::{Arc, Mutex};
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let ring_keys = Arc::new(KeyRing::fixed(keys()));
        let mut responders = Vec::new();
        let mut tasks = Vec::new();
        // The control plane's runtime (a multi-threaded one that keeps running).
        let runtime = cp.block_on(async { tokio::runtime::Handle::current() });
        for (node, i) in members {
            let identity = Identity {
                node_name: node.to_owned(),
                group: String::new(),
            };
            let listener = std::net::TcpListener::bind((node_address(i), PEERS_PORT))
                .expect("a responder port");
            let r = Responder::start(
                listener,
                identity.clone(),
                Arc::clone(&ring_keys),
                fabricgate_probes::Roots::default(),
                Duration::from_secs(10),
            )
            .expect("a responder");
            r.set_ports(vec![LocalPort {
                device: "mlx5_0".into(),
                port: 1,
                gid_index: None,
            }]);
            let expected = r.expected_peers();
            let receipts = r.receipts();
            responders.push(r);
            let clients = cp.block_on(agent_clients(cp, node));
            let ring = fabricgate::gang::ring::Ring {
                node: node.to_owned(),
                namespace: NS.to_owned(),
                identity,
                ports: Arc::new(Mutex::new(Vec::new())),
                rdma: false,
                keys: Arc::clone(&ring_keys),
                plan: Plan::default(),
                bandwidth: (0, Duration::ZERO),
                session: Duration::from_secs(5),
                source: None,
                expected: Some(expected),
                receipts,
                requests: clients.requests,
                watch: clients.watch,
                max_backoff: Duration::from_secs(5),
                clock_ahead: Duration::ZERO,
            };
            let rx = stop_rx.clone();
            tasks.push(runtime.spawn(fabricgate::gang::ring::run(ring, rx)));
        }
        // Each watch has listed (and waits on its WATCH) before the clock starts.
        std::thread::sleep(Duration::from_secs(2));
        RingAgents {
            stop,
            _responders: responders,
            tasks,
        }
    }
}

impl Drop for RingAgents {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The agent's clients as Node `node`'s agent: its ServiceAccount and the node claim of its
/// pod-bound token, impersonated by the admin.
async fn agent_clients(cp: &ControlPlane, node: &str) -> fabricgate::node::Clients {
    let kc = kube::config::Kubeconfig::read_from(&cp.admin_kubeconfig).expect("admin kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .expect("admin config");
    common::node::impersonate_agent(&mut config, node);
    fabricgate::node::clients_from(config, fabricgate::node::RetryAfter::default())
        .expect("the agent's clients")
}

/// Our check's message on Workload `name`.
fn check_message(cp: &ControlPlane, name: &str) -> String {
    let wl = cp
        .get_json(&format!(
            "/apis/kueue.x-k8s.io/v1beta2/namespaces/{WL_NS}/workloads/{name}"
        ))
        .unwrap_or_default();
    kueue_crds::check_entry(&wl, CHECK).1
}

struct Stop(std::process::Child);

impl Drop for Stop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Run {
    total: Duration,
    created: Duration,
    answered: Duration,
    decided: Duration,
    /// The FabricCheck's JSON, as each member's watch receives it.
    check_bytes: usize,
}

/// One Workload of `members.len()` pods reserved on `members`, answered as `answers` says.
fn one_gang(cp: &ControlPlane, name: &str, members: &[String], answers: Answers) -> Run {
    let checks = api(
        cp,
        ("fabricgate.io", "v1alpha1", "FabricCheck"),
        "fabricchecks",
        NS,
    );
    let results = api(
        cp,
        ("fabricgate.io", "v1alpha1", "FabricCheckResult"),
        "fabriccheckresults",
        NS,
    );
    let g = members.len();
    cp.apply(
        &json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": { "name": name, "namespace": WL_NS },
            "spec": { "queueName": "gpu", "podSets": [{ "name": "main", "count": g,
                "template": { "spec": { "containers": [{ "name": "w", "image": "x" }] } } }] },
        })
        .to_string(),
    );
    let uid = cp
        .get_json(&format!(
            "/apis/kueue.x-k8s.io/v1beta2/namespaces/{WL_NS}/workloads/{name}"
        ))
        .unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned();
    let fc = format!("{WL_NS}.{name}.{}", &uid[..8]);
    let now = k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap()
        .to_string();
    let state = || -> String {
        let wl = cp
            .get_json(&format!(
                "/apis/kueue.x-k8s.io/v1beta2/namespaces/{WL_NS}/workloads/{name}"
            ))
            .unwrap_or_default();
        kueue_crds::check_entry(&wl, CHECK).0
    };
    let t0 = Instant::now();
    kueue_crds::reserve(cp, WL_NS, name, CHECK, None, members, &now);
    let (check_bytes, spec, check_uid) = loop {
        if let Some(obj) = cp.get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{fc}"
        )) {
            break (
                serde_json::to_vec(&obj).map_or(0, |v| v.len()),
                obj["spec"].clone(),
                obj["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no FabricCheck {fc}; the check on the Workload: {:?}",
            kueue_crds::check_entry(
                &cp.get_json(&format!(
                    "/apis/kueue.x-k8s.io/v1beta2/namespaces/{WL_NS}/workloads/{name}"
                ))
                .unwrap_or_default(),
                CHECK
            )
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    let created = t0.elapsed();
    let ring: Vec<String> = spec["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["node"].as_str().unwrap().to_owned())
        .collect();
    let t1;
    if answers == Answers::Agents {
        // The agents saw the check on their own watches; wait for all their answers.
        t1 = Instant::now();
        loop {
            let st = state();
            assert!(
                st != "Retry" && st != "Rejected",
                "{name}: {st}: {}",
                check_message(cp, name)
            );
            if st == "Ready" || common::fabriccheck_answers(cp, &check_uid).len() >= g {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(600),
                "{name}: no answers"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    } else {
        // Each agent has its own long-lived connection to the apiserver: open as many (TLS
        // handshakes of a debug build are slow) before the clock starts.
        cp.block_on(async {
            let gets = ring.iter().map(|_| {
                let checks = checks.clone();
                let fc = fc.clone();
                async move {
                    let _ = checks.get(&fc).await;
                }
            });
            futures::future::join_all(gets).await;
        });
        t1 = Instant::now();
        cp.block_on(async {
            let writes = ring.iter().enumerate().map(|(i, node)| {
                let peer = &ring[(i + 1) % ring.len()];
                let prev = &ring[(i + ring.len() - 1) % ring.len()];
                // Both ends of each pair: the receiving end of prev's.
                let result = json!({ "node": node, "peer": peer, "ok": true, "rdma": "measured",
                    "device": "mlx5_0", "port": 1, "rttMicros": 3.1, "bandwidthGbps": 92.1,
                    "received": { "peer": prev, "ok": true, "rdma": "measured",
                        "rails": [{ "device": "mlx5_0", "port": 1, "ok": true,
                            "bytes": 1024 }] } });
                // Filled as the agent fills it: a merge patch of the empty answer the
                // controller created with the check, tried again while
                // the controller has not created it yet.
                let fill = json!({ "spec": common::fabriccheck_answer(&fc, &check_uid, &result)
                    ["spec"].clone() });
                let name = format!("{check_uid}.{node}");
                let results = results.clone();
                let pp = PatchParams {
                    field_manager: Some(format!("fabricgate-gang/{node}")),
                    ..PatchParams::default()
                };
                async move {
                    loop {
                        match results.patch(&name, &pp, &Patch::Merge(&fill)).await {
                            Ok(_) => break,
                            Err(kube::Error::Api(e)) if e.code == 404 => {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            Err(e) => panic!("a member's answer {name}: {e}"),
                        }
                    }
                }
            });
            if answers == Answers::Sequential {
                for w in writes {
                    w.await;
                }
            } else {
                futures::future::join_all(writes).await;
            }
        });
    }
    let answered = t1.elapsed();
    let t2 = Instant::now();
    while state() != "Ready" {
        let st = state();
        assert!(
            st != "Retry" && st != "Rejected",
            "{name}: {st}: {}",
            check_message(cp, name)
        );
        assert!(
            t0.elapsed() < Duration::from_secs(600),
            "{name} not Ready: {}",
            state()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    Run {
        total: t0.elapsed(),
        created,
        answered,
        decided: t2.elapsed(),
        check_bytes,
    }
}
