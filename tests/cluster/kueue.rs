//! Kueue for real: Kueue v0.19's own manager, kube-controller-manager and
//! kube-scheduler on the shared control plane (`tests/common/kueue.rs`), the `fabricgate
//! admission-check` controller as a separate process, and a real agent on each of six fixture
//! Nodes in two leaves. The Topology, ResourceFlavor, ClusterQueue, LocalQueue, AdmissionCheck
//! and Job are read from docs/gangs.md, as users copy them.
//!
//! - all nodes good: the Job (suspended by Kueue's webhook) is admitted and its 3 pods are
//!   bound to exactly the nodes TAS assigned, all in one leaf;
//! - an assigned node fails before the check decides: `Retry` naming it, then, once Kueue
//!   reserves quota again, admitted on the other leaf;
//! - the check controller down (killed): the Workload keeps its quota and stays pending, the
//!   Job suspended and without pods (fail closed), until a controller decides.
//!
//! The tests share Kueue's queues and take [`Kueue::serial`]; each has its own Nodes (and leaf
//! values), deleted at its end with its Job, pods and Workloads.

use crate::common::kueue::Kueue;
use crate::common::sysfs::FakeHca;
use crate::common::{Agent, Launch, TAINT, TestNode, wait_until};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) const NS: &str = "ml";
pub(crate) const JOB: &str = "llm-pretrain";
pub(crate) const LEAF: &str = "network.topology.nvidia.com/leaf";
const POOL: (&str, &str) = ("node.example.com/pool", "gpu-rdma");
const CHECK: &str = "fabricgate-preflight";
pub(crate) const WORKERS: usize = 3;

/// The YAML block of docs/gangs.md after `<!-- kueue-test: {name} -->`.
pub fn doc_yaml(name: &str) -> String {
    let path = crate::common::repo_root().join("docs/gangs.md");
    let text = std::fs::read_to_string(&path).expect("read docs/gangs.md");
    let marker = format!("<!-- kueue-test: {name} -->");
    let after = text
        .split_once(&marker)
        .unwrap_or_else(|| panic!("docs/gangs.md has no {marker}"))
        .1;
    let body = after
        .trim_start()
        .strip_prefix("```yaml\n")
        .unwrap_or_else(|| panic!("{marker} is not followed by a ```yaml block"));
    body.split_once("\n```")
        .unwrap_or_else(|| panic!("the block after {marker} does not end"))
        .0
        .to_owned()
}

/// Six Nodes in two leaves (`{prefix}-a-*`, `{prefix}-b-*`), each with 8 GPUs, the flavor's
/// pool label and a real agent; deleted (with the Jobs, their pods and Workloads) on drop.
pub(crate) struct Fleet {
    kueue: &'static Kueue,
    pub(crate) nodes: Vec<TestNode>,
    pub(crate) hcas: Vec<FakeHca>,
    agents: Vec<Agent>,
    /// The agents' requirements file (peers on, over loopback) and the pool's key.
    _config: tempfile::TempDir,
}

/// The peers port of every agent in these tests (each on its own loopback address), and the
/// controller's `peers.listen` port: one free port, picked once.
fn peers_port() -> u16 {
    static PORT: std::sync::OnceLock<u16> = std::sync::OnceLock::new();
    *PORT.get_or_init(|| {
        std::net::TcpListener::bind("127.0.0.11:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port on 127.0.0.11")
    })
}

/// The pool's peers key in these tests.
const PEERS_KEY: &str = "0d6a1c5e3b7f9a2d4c6e8f0a1b3c5d7e9f1a2b4c6d8e0f1a3b5c7d9e1f2a4b6c\n";

impl Fleet {
    pub(crate) fn up(kueue: &'static Kueue, prefix: &str) -> Fleet {
        Self::up_sized(kueue, prefix, 2, WORKERS)
    }

    /// `leaves` leaves (`a`, `b`, ...) of `per_leaf` Nodes each (at most 8 Nodes in all: each
    /// has its own loopback address from 127.0.0.11).
    pub(crate) fn up_sized(
        kueue: &'static Kueue,
        prefix: &str,
        leaves: usize,
        per_leaf: usize,
    ) -> Fleet {
        Self::up_with(kueue, prefix, leaves, per_leaf, "", &[])
    }

    /// As [`Fleet::up_sized`], `extra` appended to every agent's requirements file and `env`
    /// set for every agent (runtime transport with the pod-facts seam, say).
    pub(crate) fn up_with(
        kueue: &'static Kueue,
        prefix: &str,
        leaves: usize,
        per_leaf: usize,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Fleet {
        let cp = kueue.cp;
        // Peers on, so each agent answers the FabricChecks that name its node, its responder
        // on a loopback port it advertises on its Node; no rounds of its own (no peers).
        let config_dir = tempfile::tempdir().expect("tempdir");
        let key = config_dir.path().join("peers.key");
        std::fs::write(&key, PEERS_KEY).expect("write peers key");
        let config = config_dir.path().join("fabricgate.yaml");
        std::fs::write(
            &config,
            format!(
                "peers:\n  enabled: true\n  listen: \"127.0.0.1:0\"\n  interval: 10m\n  \
                 timeout: 2s\n  key_file: {}\n{extra}",
                key.display()
            ),
        )
        .expect("write agent config");
        let config_arg = config.display().to_string();
        let mut fleet = Fleet {
            kueue,
            nodes: Vec::new(),
            hcas: Vec::new(),
            agents: Vec::new(),
            _config: config_dir,
        };
        for (l, leaf) in ["a", "b", "c", "d"].into_iter().take(leaves).enumerate() {
            for i in 0..per_leaf {
                let name = format!("{prefix}-{leaf}-{i}");
                cp.create_node(
                    &name,
                    json!({ LEAF: format!("{prefix}-leaf-{leaf}"), POOL.0: POOL.1 }),
                    json!([{ "key": TAINT, "effect": "NoSchedule" }]),
                    json!({ "nvidia.com/gpu": "8" }),
                );
                // Each node its own loopback address (its status.addresses, as the kubelet
                // reports them) and the one peers port: the controller accepts only such an
                // endpoint.
                let ip = format!("127.0.0.{}", 11 + l * per_leaf + i);
                cp.patch_node_status(
                    &name,
                    &json!({ "status": { "addresses": [
                        { "type": "InternalIP", "address": ip }] } }),
                );
                let listen = format!("{ip}:{}", peers_port());
                let node = TestNode { cp, name };
                let hca = FakeHca::new(true);
                let kubeconfig = node.agent_kubeconfig(None);
                let args = [
                    "--interval",
                    "500ms",
                    "--config",
                    &config_arg,
                    "--peers-listen",
                    &listen,
                ];
                let (sysfs, proc_root) = (hca.sysfs_root(), hca.proc_root());
                fleet.agents.push(
                    Launch::at(&node.name, &sysfs, &proc_root, hca.scratch())
                        .kubeconfig(Some(&kubeconfig))
                        .args(&args)
                        .env(env)
                        .start(),
                );
                fleet.nodes.push(node);
                fleet.hcas.push(hca);
            }
        }
        wait_until("all the nodes validated", Duration::from_secs(90), || {
            fleet.nodes.iter().all(TestNode::ready)
        });
        fleet
    }

    pub(crate) fn by_name(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("{name} is not a node of this test"))
    }

    pub(crate) fn leaf_of(&self, name: &str) -> String {
        self.nodes[self.by_name(name)]
            .label(LEAF)
            .unwrap_or_default()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let cp = self.kueue.cp;
        delete_job(cp);
        self.agents.clear();
        for node in &self.nodes {
            let _ = cp.kubectl_as(
                &cp.admin_kubeconfig,
                &[
                    "delete",
                    "node",
                    &node.name,
                    "--ignore-not-found",
                    "--wait=false",
                ],
                None,
            );
        }
    }
}

/// The Jobs of `NS`, their pods (forced: no kubelet confirms their end) and Workloads, gone.
pub(crate) fn delete_job(cp: &crate::common::controlplane::ControlPlane) {
    let k = |args: &[&str]| {
        let _ = cp.kubectl_as(&cp.admin_kubeconfig, args, None);
    };
    k(&["-n", NS, "delete", "jobs", "--all", "--wait=false"]);
    k(&[
        "-n",
        NS,
        "delete",
        "pods",
        "--all",
        "--grace-period=0",
        "--force",
    ]);
    k(&[
        "-n",
        NS,
        "delete",
        "workloads.kueue.x-k8s.io",
        "--all",
        "--wait=true",
        "--timeout=60s",
    ]);
}

/// deploy/admission-check.yaml: the FabricCheck CRD, the AdmissionCheck, the controller's
/// ServiceAccount and RBAC (its Deployment stays inert: no kubelet runs it here).
const MANIFEST: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/admission-check.yaml");

/// The shipped manifest, then the Queues of docs/gangs.md; the AdmissionCheck docs/gangs.md
/// shows is the manifest's.
pub(crate) fn apply_queues(cp: &crate::common::controlplane::ControlPlane) {
    use serde::Deserialize;
    let manifest = std::fs::read_to_string(MANIFEST).expect("read deploy/admission-check.yaml");
    let shipped = serde_norway::Deserializer::from_str(&manifest)
        .map(|d| Value::deserialize(d).expect("manifest YAML"))
        .find(|v| v["kind"] == "AdmissionCheck")
        .expect("deploy/admission-check.yaml has an AdmissionCheck");
    let documented: Value =
        serde_norway::from_str(&doc_yaml("admission-check")).expect("docs/gangs.md YAML");
    assert_eq!(
        documented, shipped,
        "docs/gangs.md shows the shipped AdmissionCheck"
    );
    cp.install_agent_rbac();
    crate::common::kueue_crds::apply_admission_check(cp);
    cp.apply(&doc_yaml("queues"));
}

/// The Job of docs/gangs.md, created as written.
fn create_job(cp: &crate::common::controlplane::ControlPlane) -> Value {
    let (ok, out, err) = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["create", "-o", "json", "-f", "-"],
        Some(&doc_yaml("job")),
    );
    assert!(ok, "create the Job: {err}");
    serde_json::from_str(&out).expect("created Job JSON")
}

/// The Workload Kueue made for the Job.
fn workload(cp: &crate::common::controlplane::ControlPlane) -> Option<Value> {
    workload_of(cp, JOB)
}

/// The Workload Kueue made for Job `job`.
pub(crate) fn workload_of(
    cp: &crate::common::controlplane::ControlPlane,
    job: &str,
) -> Option<Value> {
    let list = cp.get_json(&format!(
        "/apis/kueue.x-k8s.io/v1beta2/namespaces/{NS}/workloads"
    ))?;
    list["items"]
        .as_array()?
        .iter()
        .find(|w| {
            w["metadata"]["ownerReferences"]
                .as_array()
                .is_some_and(|o| o.iter().any(|r| r["kind"] == "Job" && r["name"] == job))
        })
        .cloned()
}

pub(crate) fn condition_true(wl: &Value, type_: &str) -> bool {
    wl["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == type_ && c["status"] == "True")
    })
}

/// fabricgate's entry in the Workload's `status.admissionChecks`.
pub(crate) fn check_state(wl: &Value) -> Option<(String, String)> {
    wl["status"]["admissionChecks"]
        .as_array()?
        .iter()
        .find(|c| c["name"] == CHECK)
        .map(|c| {
            (
                c["state"].as_str().unwrap_or("").to_owned(),
                c["message"].as_str().unwrap_or("").to_owned(),
            )
        })
}

/// The nodes TAS assigned to the Workload's pod sets (the hostname level of
/// `status.admission.podSetAssignments[].topologyAssignment`, v1beta2's compact form).
pub(crate) fn assigned_nodes(wl: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for psa in wl["status"]["admission"]["podSetAssignments"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let ta = &psa["topologyAssignment"];
        let Some(level) = ta["levels"]
            .as_array()
            .and_then(|l| l.iter().position(|l| l == "kubernetes.io/hostname"))
        else {
            continue;
        };
        for slice in ta["slices"].as_array().into_iter().flatten() {
            let values = &slice["valuesPerLevel"][level];
            if let Some(u) = values["universal"].as_str() {
                out.push(u.to_owned());
            }
            let ind = &values["individual"];
            let prefix = ind["prefix"].as_str().unwrap_or("");
            let suffix = ind["suffix"].as_str().unwrap_or("");
            for root in ind["roots"].as_array().into_iter().flatten() {
                out.push(format!("{prefix}{}{suffix}", root.as_str().unwrap_or("")));
            }
        }
    }
    out.sort();
    out
}

/// The nodes the Job's pods are bound to (sorted), and how many pods there are.
fn bound_pods(cp: &crate::common::controlplane::ControlPlane) -> (usize, Vec<String>) {
    bound_pods_of(cp, JOB)
}

/// The nodes Job `job`'s pods are bound to (sorted), and how many pods there are.
pub(crate) fn bound_pods_of(
    cp: &crate::common::controlplane::ControlPlane,
    job: &str,
) -> (usize, Vec<String>) {
    let list = cp
        .get_json(&format!(
            "/api/v1/namespaces/{NS}/pods?labelSelector=job-name%3D{job}"
        ))
        .unwrap_or_default();
    let pods = list["items"].as_array().cloned().unwrap_or_default();
    let mut on: Vec<String> = pods
        .iter()
        .filter_map(|p| p["spec"]["nodeName"].as_str().map(str::to_owned))
        .collect();
    on.sort();
    (pods.len(), on)
}

pub(crate) fn job_suspended(cp: &crate::common::controlplane::ControlPlane) -> bool {
    cp.get_json(&format!("/apis/batch/v1/namespaces/{NS}/jobs/{JOB}"))
        .is_some_and(|j| j["spec"]["suspend"] == Value::Bool(true))
}

/// `fabricgate admission-check` as its own process, killed on drop.
pub(crate) struct Controller {
    child: Child,
    log: PathBuf,
    /// `127.0.0.1:PORT` of its `/metrics`.
    metrics: String,
}

impl Controller {
    /// With the shipped ServiceAccount's token (its RBAC from deploy/admission-check.yaml),
    /// serving only the Job's namespace, on a Lease of its own.
    fn start(kueue: &Kueue) -> Controller {
        Self::start_with(kueue, "  require_rdma: false\n")
    }

    /// With `gang` as the `gang:` section's lines besides `timeout: 10s`.
    pub(crate) fn start_with(kueue: &Kueue, gang: &str) -> Controller {
        let cp = kueue.cp;
        let dir = cp.run_dir().join("admission-check");
        std::fs::create_dir_all(&dir).expect("mkdir admission-check");
        let kubeconfig = dir.join("admission-check.kubeconfig");
        crate::common::kueue_crds::admission_check_kubeconfig(cp, &kubeconfig);
        let n = std::fs::read_dir(&dir).map_or(0, Iterator::count);
        let log = dir.join(format!("controller-{n}.log"));
        let config = dir.join(format!("config-{n}.yaml"));
        let metrics = format!(
            "127.0.0.1:{}",
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("a free port for /metrics")
        );
        // The fixture agents have no verbs (see docs/gangs.md): the pair exchange runs over
        // the side channel only.
        std::fs::write(
            &config,
            format!(
                "gang:\n{gang}  timeout: 10s\npeers:\n  listen: \"0.0.0.0:{}\"\n",
                peers_port()
            ),
        )
        .expect("controller config");
        let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
            .arg("admission-check")
            .arg("--config")
            .arg(&config)
            .args(["--metrics-addr", &metrics, "--workload-namespace", NS])
            // One identity for every start: a restarted controller holds the Lease at once.
            .args([
                "--identity",
                "kueue-tests",
                "--lease-name",
                "fabricgate-kueue-tests",
            ])
            .args(["--lease-duration", "4s", "--poll-interval", "500ms"])
            .env("KUBECONFIG", &kubeconfig)
            .env("HOME", &dir)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("controller log"))
            .spawn()
            .expect("start fabricgate admission-check");
        Controller {
            child,
            log,
            metrics,
        }
    }

    pub(crate) fn log(&self) -> String {
        crate::common::controlplane::tail(&self.log, 30)
    }

    /// `series`'s value on the controller's `/metrics`, once it serves them.
    pub(crate) fn metric(&self, series: &str) -> f64 {
        let mut body = String::new();
        wait_until_ctx(
            "the controller's /metrics",
            Duration::from_secs(10),
            || {
                let got = crate::common::try_http_get(
                    &self.metrics,
                    "/metrics",
                    None,
                    Duration::from_secs(1),
                );
                match got {
                    Some((200, _, b)) => {
                        body = b;
                        true
                    }
                    _ => false,
                }
            },
            || self.log(),
        );
        crate::common::sample(&body, series).unwrap_or_else(|| panic!("no {series} in:\n{body}"))
    }

    /// SIGKILL, as a crashed or evicted controller: nothing is written on the way out.
    pub(crate) fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The ClusterQueue is active: its AdmissionCheck is `Active` (its controller has run).
pub(crate) fn wait_queue_active(kueue: &Kueue, controller: &Controller) {
    wait_until_ctx(
        "ClusterQueue training Active",
        Duration::from_secs(60),
        || {
            kueue
                .cp
                .get_json("/apis/kueue.x-k8s.io/v1beta2/clusterqueues/training")
                .is_some_and(|q| condition_true(&q, "Active"))
        },
        || {
            format!(
                "\ncontroller:\n{}\nkueue:\n{}",
                controller.log(),
                kueue.log(20)
            )
        },
    );
}

pub(crate) fn wait_until_ctx(
    what: &str,
    limit: Duration,
    done: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) -> Duration {
    crate::common::poll_until(what, limit, Duration::from_millis(50), done, context)
}

/// The Workload, once Kueue has reserved quota for it and TAS assigned `WORKERS` nodes.
fn wait_reserved(kueue: &Kueue, why: &str) -> Value {
    let last = std::cell::RefCell::new(None);
    wait_until_ctx(
        why,
        Duration::from_secs(60),
        || {
            *last.borrow_mut() = workload(kueue.cp);
            last.borrow().as_ref().is_some_and(|w| {
                condition_true(w, "QuotaReserved") && assigned_nodes(w).len() == WORKERS
            })
        },
        || {
            format!(
                "\nworkload: {:#?}\nkueue:\n{}",
                last.borrow(),
                kueue.log(20)
            )
        },
    );
    last.into_inner().expect("workload")
}

/// Admitted, the Job running, its pods bound to exactly the assigned nodes: those nodes.
pub(crate) fn wait_admitted_and_bound(kueue: &Kueue, controller: &Controller) -> Vec<String> {
    let cp = kueue.cp;
    let wl = std::cell::RefCell::new(None);
    wait_until_ctx(
        "the Workload Admitted",
        Duration::from_secs(90),
        || {
            *wl.borrow_mut() = workload(cp);
            wl.borrow()
                .as_ref()
                .is_some_and(|w| condition_true(w, "Admitted"))
        },
        || {
            format!(
                "\nworkload: {:#?}\ncontroller:\n{}",
                wl.borrow(),
                controller.log()
            )
        },
    );
    let wl = wl.into_inner().expect("workload");
    assert_eq!(check_state(&wl).map(|s| s.0).as_deref(), Some("Ready"));
    let assigned = assigned_nodes(&wl);
    assert_eq!(assigned.len(), WORKERS, "{wl:#}");
    wait_until_ctx(
        "the Job's pods bound",
        Duration::from_secs(60),
        || {
            let (n, on) = bound_pods(cp);
            n == WORKERS && on.len() == WORKERS
        },
        || format!("\npods: {:?}\nkueue:\n{}", bound_pods(cp), kueue.log(20)),
    );
    assert!(!job_suspended(cp), "an admitted Job runs");
    assert_eq!(
        bound_pods(cp).1,
        assigned,
        "each pod on a node TAS assigned"
    );
    assigned
}

pub(crate) fn start() -> Option<(std::sync::RwLockWriteGuard<'static, ()>, &'static Kueue)> {
    let kueue = Kueue::shared()?;
    let serial = kueue.serial();
    delete_job(kueue.cp);
    // Each test is a new installation as far as the requeue breaker goes: its count rides on
    // the controllers' shared Lease, and earlier tests' requeues would hold this one's.
    let _ = kueue.cp.kubectl_as(
        &kueue.cp.admin_kubeconfig,
        &[
            "-n",
            "fabricgate",
            "annotate",
            "lease",
            "fabricgate-kueue-tests",
            "fabricgate.io/requeues-",
        ],
        None,
    );
    Some((serial, kueue))
}

#[test]
fn kueue_admits_a_gang_whose_nodes_pass_and_binds_it_to_them() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    let fleet = Fleet::up(kueue, "kqa");
    apply_queues(cp);
    let controller = Controller::start(kueue);
    wait_queue_active(kueue, &controller);

    let job = create_job(cp);
    assert_eq!(
        job["spec"]["suspend"],
        Value::Bool(true),
        "Kueue's webhook suspends the Job"
    );
    let on = wait_admitted_and_bound(kueue, &controller);
    let leaves: BTreeSet<String> = on.iter().map(|n| fleet.leaf_of(n)).collect();
    assert_eq!(leaves.len(), 1, "the gang sits in one leaf: {on:?}");
    capture_output(kueue, "admitted");
    controller.kill();
}

#[test]
fn kueue_retries_a_gang_whose_assigned_node_fails_and_admits_it_elsewhere() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    let fleet = Fleet::up(kueue, "kqr");
    // Run once so the AdmissionCheck is Active, then down while Kueue reserves quota: the
    // check stays Pending with the nodes assigned, and one of them fails meanwhile.
    apply_queues(cp);
    let controller = Controller::start(kueue);
    wait_queue_active(kueue, &controller);
    controller.kill();

    create_job(cp);
    let wl = wait_reserved(kueue, "quota reserved while the check controller is down");
    let first = assigned_nodes(&wl);
    let failed = first[0].clone();
    let failed_leaf = fleet.leaf_of(&failed);
    let i = fleet.by_name(&failed);
    fleet.hcas[i].set_port(false);
    wait_until("the assigned node tainted", Duration::from_secs(30), || {
        fleet.nodes[i].has_our_taint()
    });

    let watch = WorkloadWatch::start(cp);
    let controller = Controller::start(kueue);
    let on = wait_admitted_and_bound(kueue, &controller);
    assert!(
        on.iter().all(|n| fleet.leaf_of(n) != failed_leaf),
        "admitted on the other leaf (first {first:?}, {failed} failed): {on:?}"
    );
    let retries = watch.retries();
    assert!(
        retries.iter().any(|m| m.contains(&failed)),
        "a Retry naming {failed}: {retries:?}"
    );
    capture_output(kueue, "retried");
    controller.kill();
}

#[test]
fn kueue_keeps_a_gang_pending_while_the_check_controller_is_down() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    let _fleet = Fleet::up(kueue, "kqc");
    apply_queues(cp);
    let controller = Controller::start(kueue);
    wait_queue_active(kueue, &controller);
    controller.kill();

    create_job(cp);
    wait_reserved(kueue, "quota reserved while the check controller is down");
    // Kueue lists the check in a later update than the reservation.
    crate::common::wait_until("the check listed Pending", Duration::from_secs(10), || {
        workload(cp).is_some_and(|w| check_state(&w).map(|s| s.0).as_deref() == Some("Pending"))
    });
    // Fail closed: for 15 s the gang holds its quota and nothing of it runs.
    let held = Instant::now();
    while held.elapsed() < Duration::from_secs(15) {
        let wl = workload(cp).expect("the Workload stays");
        assert!(
            !condition_true(&wl, "Admitted"),
            "admitted without a check: {wl:#}"
        );
        assert_eq!(check_state(&wl).map(|s| s.0).as_deref(), Some("Pending"));
        assert!(job_suspended(cp), "the Job stays suspended");
        assert_eq!(bound_pods(cp).0, 0, "no pod exists");
        std::thread::sleep(Duration::from_millis(500));
    }
    // A controller back: the same Workload is decided and admitted.
    let controller = Controller::start(kueue);
    wait_admitted_and_bound(kueue, &controller);
    controller.kill();
}

/// With Kueue itself: a gang whose pre-flight fails every time (RDMA
/// required, and the fixture agents have no verbs: every pair is `unmeasured`) is retried
/// after the check's `requeueAfterSeconds` (Kueue keeps it waiting that long, not re-reserving
/// at once) and, at `gang.max_attempts`, `Rejected`: Kueue deactivates the Workload and the
/// Job never runs.
#[test]
fn redteam_kueue_backs_off_a_failing_gang_then_deactivates_it() {
    let Some((_serial, kueue)) = start() else {
        return;
    };
    let cp = kueue.cp;
    let _fleet = Fleet::up(kueue, "kqb");
    apply_queues(cp);
    let watch = WorkloadWatch::start(cp);
    let controller = Controller::start_with(
        kueue,
        "  require_rdma: true\n  retry_backoff: 3s\n  max_attempts: 2\n",
    );
    wait_queue_active(kueue, &controller);
    create_job(cp);
    let mut first_retry = None;
    let last = std::cell::RefCell::new(None);
    wait_until_ctx(
        "Rejected and deactivated",
        Duration::from_secs(90),
        || {
            let wl = workload(cp);
            if first_retry.is_none()
                && wl
                    .as_ref()
                    .and_then(check_state)
                    .is_some_and(|(s, _)| s == "Retry")
            {
                first_retry = Some(Instant::now());
            }
            *last.borrow_mut() = wl.clone();
            // Kueue resets the check to Pending as it deactivates the Workload.
            wl.is_some_and(|w| {
                w["spec"]["active"] == Value::Bool(false) && condition_true(&w, "Evicted")
            })
        },
        || {
            format!(
                "\nworkload: {:#}\ncontroller:\n{}\nkueue:\n{}",
                last.borrow().clone().unwrap_or_default(),
                controller.log(),
                kueue.log(20)
            )
        },
    );
    let rejected_at = Instant::now();
    let retries = watch.retries();
    assert!(
        retries
            .iter()
            .any(|m| m.contains("attempt 1 of gang.max_attempts 2") && m.contains("in 3 s")),
        "the first failure retried after 3 s: {retries:?}"
    );
    if let Some(t) = first_retry {
        // (lastTransitionTime is in whole seconds: up to half a second earlier than written)
        let waited = rejected_at.duration_since(t);
        eprintln!("first Retry -> deactivated after the second attempt: {waited:?}");
        assert!(
            waited >= Duration::from_millis(2500),
            "Kueue re-reserved before requeueAfterSeconds: {waited:?}"
        );
    }
    let rejected = watch.states("Rejected");
    assert!(
        rejected.iter().any(|m| m.contains("failed 2 times (gang.max_attempts 2)")
            && m.contains("unmeasured")),
        "{rejected:?}"
    );
    let wl = workload(cp).expect("the Workload");
    let evicted = wl["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Evicted").cloned())
        .unwrap_or_default();
    assert_eq!(
        evicted["reason"], "DeactivatedDueToAdmissionCheck",
        "{evicted}"
    );
    // Deactivated: the Job stays suspended, nothing of the gang ever ran.
    std::thread::sleep(Duration::from_secs(2));
    assert!(job_suspended(cp), "the Job stays suspended");
    assert_eq!(bound_pods(cp).0, 0, "no pod exists");
    assert!(!condition_true(&workload(cp).unwrap(), "Admitted"));
    controller.kill();
}

/// `kubectl get workloads --watch -o json` on the Job's namespace in the background: every
/// version of the Workloads, so a `Retry` that Kueue turns back into `Pending` within
/// milliseconds is still seen.
pub(crate) struct WorkloadWatch {
    child: Child,
    out: PathBuf,
}

/// A number for each watch of this process (a test may hold several).
fn next_watch() -> usize {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl WorkloadWatch {
    pub(crate) fn start(cp: &crate::common::controlplane::ControlPlane) -> WorkloadWatch {
        let out = cp.run_dir().join(format!(
            "workload-watch-{}-{}.json",
            std::process::id(),
            next_watch()
        ));
        let child = Command::new(cp.binary())
            .arg("kubectl")
            .arg(format!("--kubeconfig={}", cp.admin_kubeconfig.display()))
            .args([
                "-n",
                NS,
                "get",
                "workloads.kueue.x-k8s.io",
                "--watch",
                "-o",
                "json",
            ])
            .env("HOME", cp.run_dir())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("watch output"))
            .stderr(Stdio::null())
            .spawn()
            .expect("kubectl get --watch");
        // The watch is open before anything it must see can happen.
        std::thread::sleep(Duration::from_millis(500));
        WorkloadWatch { child, out }
    }

    /// The messages of every `Retry` state fabricgate's check had.
    pub(crate) fn retries(&self) -> Vec<String> {
        self.states("Retry")
    }

    /// Every version of the Workloads seen so far.
    pub(crate) fn versions(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.out).unwrap_or_default();
        serde_json::Deserializer::from_str(&text)
            .into_iter::<Value>()
            .map_while(Result::ok)
            .collect()
    }

    /// The messages of every `state` fabricgate's check had.
    pub(crate) fn states(&self, state: &str) -> Vec<String> {
        self.versions()
            .into_iter()
            .filter_map(|wl| check_state(&wl))
            .filter(|(s, _)| s == state)
            .map(|(_, message)| message)
            .collect()
    }
}

impl Drop for WorkloadWatch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kubectl get kueueworkloads` and `kubectl describe kueueworkload` of the gang, written to
/// `<target tmp>/kueue-output/{what}-*.txt` for docs/gangs.md, whose copy must have the same
/// columns.
pub(crate) fn capture_output(kueue: &Kueue, what: &str) {
    let cp = kueue.cp;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kueue-output");
    std::fs::create_dir_all(&dir).expect("mkdir kueue-output");
    let get = cp.kubectl(&["-n", NS, "get", "kueueworkloads"]);
    let name = workload(cp).expect("workload")["metadata"]["name"]
        .as_str()
        .expect("name")
        .to_owned();
    let describe = cp.kubectl(&["-n", NS, "describe", "kueueworkload", &name]);
    std::fs::write(dir.join(format!("{what}-get.txt")), &get).expect("write");
    std::fs::write(dir.join(format!("{what}-describe.txt")), &describe).expect("write");
    let doc = std::fs::read_to_string(crate::common::repo_root().join("docs/gangs.md"))
        .expect("read docs/gangs.md");
    let header = get
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect::<Vec<_>>();
    assert!(
        doc.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == header),
        "docs/gangs.md shows `kubectl get workloads` with the real columns {header:?}"
    );
}
