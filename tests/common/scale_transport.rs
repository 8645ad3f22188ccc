//! Runtime transport's watches at scale (docs/scale.md): a pool of GPU Nodes
//! (`scale::gpu_node`), the running pods of `jobs` Jobs of `pods_per_job` pods each bound to
//! them (created as a Job controller would, `Running` and their addresses set through the
//! status subresource as a kubelet would; no kubelet runs), and real agents with
//! `runtime.enabled` on the first `agents` Nodes (the fleet, in this process). Each agent
//! watches its node's pods and, per job with a pod on its node, that job's pods: what those
//! watches carry is read from the API server (the audit log for requests, its
//! `apiserver_response_sizes` and `apiserver_watch_events_sizes` for bytes) while every pod of
//! the cluster changes once, beside what one cluster-wide pod watch would carry.
//! The sampler is the real one over the fixture tree: it finds no pod process, so no pod gets
//! a verdict and nothing is written; the watches are the agent's own, as it opens them.

use super::controlplane::{AuditEvent, ControlPlane};
use super::fleet::Fleet;
use super::procstat;
use super::scale::{Census, Phase, delete_pool, fill_pool};
use fabricgate::config::Config;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

const FLEET_USER: &str = "fabricgate-fleet";
/// The RDMA resource the pods request and the agents judge.
const RESOURCE: &str = "rdma/hca_shared_devices_a";

/// What one run measures.
pub struct TransportScaleSpec {
    /// Node objects in the pool, the agents' included.
    pub pool: usize,
    /// Real agents, on the first Nodes of the pool.
    pub agents: usize,
    /// Running jobs, and pods per job: pod `p` of the cluster (job `p / pods_per_job`) is
    /// bound to Node `p % pool`.
    pub jobs: usize,
    pub pods_per_job: usize,
    /// The jobs' namespaces (job `j` in namespace `j % namespaces`).
    pub namespaces: usize,
    /// `runtime.enabled` (off: the same fleet without runtime transport, for its RSS).
    pub runtime: bool,
    pub quiet: Duration,
}

/// What one run found; `report` has it all as text.
pub struct TransportRun {
    pub report: String,
    /// Pod watches the agents opened (counted once they end, at the fleet's stop): of their
    /// node (field selector), of a job (label selector), of anything else.
    pub node_watches: usize,
    pub job_watches: usize,
    pub other_pod_watches: usize,
    /// One per agent, and one per (agent, job with a pod on its node).
    pub expected_node_watches: usize,
    pub expected_job_watches: usize,
    /// The jobs' watches as `namespace labelSelector`, with how many agents opened each, and
    /// what the placement says they should be.
    pub job_selectors: BTreeMap<String, usize>,
    pub expected_job_selectors: BTreeMap<String, usize>,
    /// The agents' requests at steady state.
    pub quiet_requests: usize,
    /// Pod watch events sent while every pod of the cluster changed once, and how many
    /// the agents' watches select (their nodes' pods and their jobs' pods).
    pub churn_events: f64,
    pub expected_churn_events: usize,
    /// Every pod of the cluster: what one cluster-wide watch would get in the churn, each.
    pub pods: usize,
}

/// Job `j`'s name, its namespace, and pod `p`'s (name, namespace, job) in run `prefix`.
fn job_name(prefix: &str, j: usize) -> String {
    format!("{prefix}-job-{j:04}")
}

fn namespace(prefix: &str, spec: &TransportScaleSpec, j: usize) -> String {
    format!("{prefix}-team-{:02}", j % spec.namespaces.max(1))
}

/// A training pod of an indexed Job as its controller, Kueue and the scheduler leave it
/// (labels, owner, eight GPUs and HCAs, NCCL's environment, volumes), bound to `node`.
fn training_pod(prefix: &str, spec: &TransportScaleSpec, p: usize, node: &str) -> Value {
    let j = p / spec.pods_per_job;
    let k = p % spec.pods_per_job;
    let job = job_name(prefix, j);
    let uid = format!("{:08x}-0000-4000-8000-{:012x}", j, j * 7919);
    let env: Vec<Value> = [
        ("NCCL_DEBUG", "WARN".to_owned()),
        (
            "NCCL_IB_HCA",
            "mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7".to_owned(),
        ),
        ("NCCL_SOCKET_IFNAME", "eth0".to_owned()),
        ("NCCL_IB_GID_INDEX", "3".to_owned()),
        ("NCCL_NET_GDR_LEVEL", "PHB".to_owned()),
        ("MASTER_ADDR", format!("{job}-0.{job}")),
        ("MASTER_PORT", "29500".to_owned()),
        ("WORLD_SIZE", (spec.pods_per_job * 8).to_string()),
        ("NODE_RANK", k.to_string()),
        ("NPROC_PER_NODE", "8".to_owned()),
        ("JOB_COMPLETION_INDEX", k.to_string()),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".to_owned()),
        ("CUDA_DEVICE_MAX_CONNECTIONS", "1".to_owned()),
        ("HF_HOME", "/data/hf".to_owned()),
        ("CHECKPOINT_DIR", format!("/checkpoints/{job}")),
    ]
    .into_iter()
    .map(|(n, v)| json!({ "name": n, "value": v }))
    .collect();
    let resources =
        json!({ "cpu": "96", "memory": "1600Gi", "nvidia.com/gpu": "8", RESOURCE: "8" });
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("{job}-{k}"),
            "namespace": namespace(prefix, spec, j),
            "labels": {
                "batch.kubernetes.io/job-name": job, "job-name": job,
                "batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                "batch.kubernetes.io/job-completion-index": k.to_string(),
                "kueue.x-k8s.io/podset": "main", "app.kubernetes.io/name": "trainer",
            },
            "annotations": {
                "batch.kubernetes.io/job-completion-index": k.to_string(),
                "kueue.x-k8s.io/workload": format!("job-{job}-{:05x}", j),
            },
            "ownerReferences": [{ "apiVersion": "batch/v1", "kind": "Job", "name": job,
                "uid": uid, "controller": true, "blockOwnerDeletion": true }],
        },
        "spec": {
            "nodeName": node,
            "hostname": format!("{job}-{k}"), "subdomain": job,
            "restartPolicy": "Never",
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "trainer",
                "image": "registry.example.com/ml/train:2026.11",
                "command": ["torchrun"],
                "args": ["--nnodes", spec.pods_per_job.to_string(), "--nproc-per-node", "8",
                    "/workspace/train.py", "--config", "/workspace/configs/llm-70b.yaml"],
                "env": env,
                "resources": { "requests": resources, "limits": resources },
                "volumeMounts": [
                    { "name": "dshm", "mountPath": "/dev/shm" },
                    { "name": "data", "mountPath": "/data", "readOnly": true },
                    { "name": "checkpoints", "mountPath": "/checkpoints" },
                ],
                "securityContext": { "capabilities": { "add": ["IPC_LOCK"] } },
            }],
            "volumes": [
                { "name": "dshm", "emptyDir": { "medium": "Memory", "sizeLimit": "64Gi" } },
                { "name": "data", "persistentVolumeClaim": { "claimName": "datasets", "readOnly": true } },
                { "name": "checkpoints", "persistentVolumeClaim": { "claimName": "checkpoints" } },
            ],
            "tolerations": [
                { "key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule" },
                { "key": "node.kubernetes.io/not-ready", "operator": "Exists",
                  "effect": "NoExecute", "tolerationSeconds": 300 },
            ],
        },
    })
}

/// Pod `p`'s status as its kubelet reports it: running, its address.
fn running_status(p: usize) -> Value {
    let ip = format!(
        "10.{}.{}.{}",
        128 + (p >> 16) % 128,
        (p >> 8) & 255,
        p & 255
    );
    let at = "2026-12-01T00:00:00Z";
    let conditions: Vec<Value> = [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ]
    .into_iter()
    .map(|t| json!({ "type": t, "status": "True", "lastTransitionTime": at }))
    .collect();
    json!({ "status": {
        "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }],
        "hostIP": "10.0.0.1", "hostIPs": [{ "ip": "10.0.0.1" }], "startTime": at,
        "conditions": conditions,
        "containerStatuses": [{ "name": "trainer", "ready": true, "started": true,
            "restartCount": 0, "image": "registry.example.com/ml/train:2026.11",
            "imageID": "registry.example.com/ml/train@sha256:4f3c1b2a9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b",
            "containerID": format!("containerd://{:064x}", p * 104_729 + 1),
            "state": { "running": { "startedAt": at } } }],
    } })
}

/// Run `f` on every pod index, 16 at a time.
fn for_each_pod<F, Fut>(cp: &ControlPlane, pods: usize, f: F)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    cp.block_on(async {
        futures::stream::iter(0..pods)
            .map(&f)
            .buffer_unordered(16)
            .collect::<Vec<()>>()
            .await;
    });
}

/// A pod watch or list of the agents' as its request names it.
fn selects(e: &AuditEvent, what: &str) -> bool {
    e.user == FLEET_USER && e.resource == "pods" && e.request_uri.contains(what)
}

/// Query parameter `key` of `uri`, percent-decoded.
fn query_param(uri: &str, key: &str) -> Option<String> {
    let query = uri.split_once('?')?.1;
    let raw = query
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))?;
    let mut out = Vec::new();
    let mut bytes = raw.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hex: String = bytes.by_ref().take(2).map(char::from).collect();
                out.push(u8::from_str_radix(&hex, 16).ok()?);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

fn process_rss() -> u64 {
    procstat::usage(std::process::id()).rss_bytes
}

/// This process's threads (the agents' runtime and the blocking threads of their samplers).
fn process_threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// One run: fill, start, quiet, every pod changing once, stop.
pub fn run_transport_scale(
    cp: &'static ControlPlane,
    prefix: &str,
    spec: &TransportScaleSpec,
) -> TransportRun {
    let _one = super::fleet::exclusive();
    let mut out = String::new();
    let pods = spec.jobs * spec.pods_per_job;
    let filled = Instant::now();
    let names = fill_pool(cp, prefix, spec.pool, spec.agents);
    let namespaces: BTreeSet<String> = (0..spec.jobs.min(spec.namespaces.max(1)))
        .map(|j| namespace(prefix, spec, j))
        .collect();
    for ns in &namespaces {
        cp.create_namespace(ns);
    }
    let admin = cp.admin();
    for_each_pod(cp, pods, |p| {
        let body = training_pod(prefix, spec, p, &names[p % spec.pool]);
        let api: Api<Pod> = Api::namespaced(
            admin.clone(),
            body["metadata"]["namespace"].as_str().unwrap_or_default(),
        );
        async move {
            let pod: Pod = serde_json::from_value(body).expect("a training pod");
            let name = pod.metadata.name.clone().unwrap_or_default();
            match api.create(&PostParams::default(), &pod).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => panic!("create pod {name}: {e}"),
            }
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(running_status(p)),
            )
            .await
            .unwrap_or_else(|e| panic!("pod {name} Running: {e}"));
        }
    });
    let pod_name = |p: usize| {
        let j = p / spec.pods_per_job;
        (
            format!("{}-{}", job_name(prefix, j), p % spec.pods_per_job),
            namespace(prefix, spec, j),
        )
    };
    let stored = cp
        .get_json(&{
            let (name, ns) = pod_name(0);
            format!("/api/v1/namespaces/{ns}/pods/{name}")
        })
        .map_or(0, |v| v.to_string().len());
    let _ = writeln!(
        out,
        "transport {prefix}: {} Nodes, {} jobs x {} pods = {pods} running pods of {:.1} kB \
         (as stored) in {} namespaces (filled in {:.0} s), {} agents, runtime transport {}",
        spec.pool,
        spec.jobs,
        spec.pods_per_job,
        stored as f64 / 1024.0,
        namespaces.len(),
        filled.elapsed().as_secs_f64(),
        spec.agents,
        if spec.runtime { "on" } else { "off" }
    );

    // What the agents' watches select: their nodes' pods, their jobs' pods.
    let agents: Vec<String> = names[..spec.agents].to_vec();
    let mut expected_job_selectors: BTreeMap<String, usize> = BTreeMap::new();
    let mut expected_churn_events = 0;
    let mut judged = 0;
    for a in 0..spec.agents {
        let here: Vec<usize> = (a..pods).step_by(spec.pool).collect();
        judged += here.len();
        let jobs: BTreeSet<usize> = here.iter().map(|p| p / spec.pods_per_job).collect();
        for j in &jobs {
            let key = format!(
                "{} batch.kubernetes.io/job-name={}",
                namespace(prefix, spec, *j),
                job_name(prefix, *j)
            );
            *expected_job_selectors.entry(key).or_default() += 1;
        }
        expected_churn_events += here.len() + jobs.len() * spec.pods_per_job;
    }
    if !spec.runtime {
        expected_job_selectors.clear();
        expected_churn_events = 0;
        judged = 0;
    }
    let expected_node_watches = if spec.runtime { spec.agents } else { 0 };
    let expected_job_watches: usize = expected_job_selectors.values().sum();

    // Every pod's status changed once (a condition's new time, as a kubelet or an operator
    // writes them); `at` must differ between calls, or nothing changes.
    let churn = |cp: &ControlPlane, name: &'static str, at: &'static str| {
        Phase::measure(cp, name, || {
            for_each_pod(cp, pods, |p| {
                let (name, ns) = pod_name(p);
                let api: Api<Pod> = Api::namespaced(admin.clone(), &ns);
                let patch = json!({ "status": { "conditions": [{
                    "type": "example.com/Checkpointed", "status": "True",
                    "lastTransitionTime": at }] } });
                async move {
                    api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(patch))
                        .await
                        .unwrap_or_else(|e| panic!("pod {name} status: {e}"));
                }
            });
            // The events reach the watches within moments.
            std::thread::sleep(Duration::from_secs(2));
        })
    };
    // What the watches already there (the API server's own) get of it, without agents.
    let before = churn(
        cp,
        "every pod changes once, no agent yet",
        "2026-12-01T01:00:00Z",
    );

    let rss_before = process_rss();
    let window = Duration::from_secs(10);
    let runtime = spec.runtime;
    let tune: Arc<dyn Fn(&mut Config) + Send + Sync> = Arc::new(move |c: &mut Config| {
        c.kubernetes.rdma_resources = vec![RESOURCE.to_owned()];
        c.runtime = fabricgate::config::Section::holding(
            "runtime",
            &fabricgate::transport::settings::RuntimeSettings {
                enabled: runtime,
                window,
                ..Default::default()
            },
        )
        .unwrap();
    });
    let mut fleet: Option<Fleet> = None;
    let start = Phase::measure(cp, "start -> all validated, watching, pods judged", || {
        let mark = cp.audit_mark();
        let f = Fleet::start_tuned(
            cp,
            agents.clone(),
            prefix,
            Duration::from_secs(2),
            true,
            false,
            tune,
        );
        let census = Census::start(cp, &f);
        census.wait("the agents validated", Duration::from_secs(900), |c| {
            c.count(&agents).1 == agents.len()
        });
        // A watch is in the audit log only once it ends; its first list is at once.
        let mut lists = (0, 0);
        let started = Instant::now();
        while lists.0 < expected_node_watches || lists.1 < expected_job_watches {
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "the agents' pod lists: {lists:?} of ({expected_node_watches}, \
                 {expected_job_watches})"
            );
            std::thread::sleep(Duration::from_secs(1));
            let events = cp.audit_since(mark);
            let list = |what: &str| {
                events
                    .iter()
                    .filter(|e| e.verb == "list" && selects(e, what))
                    .count()
            };
            lists = (list("fieldSelector=spec.nodeName"), list("labelSelector="));
        }
        // Each judged pod's first verdict (`unknown`: the fixture tree has no pod process) is
        // written once, at its second window; steady state starts after.
        let judged_writes = || {
            cp.audit_since(mark)
                .iter()
                .filter(|e| {
                    e.user == FLEET_USER && e.resource == "pods" && e.subresource == "status"
                })
                .count()
        };
        let started = Instant::now();
        while judged_writes() < judged {
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "the judged pods' first verdicts: {} of {judged}",
                judged_writes()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
        fleet = Some(f);
    });
    let fleet = fleet.expect("the fleet");
    std::thread::sleep(Duration::from_secs(5));
    let rss_started = process_rss();
    let quiet = Phase::measure(cp, "quiet", || std::thread::sleep(spec.quiet));
    let churn = churn(cp, "every pod changes once", "2026-12-01T02:00:00Z");
    let rss_after = process_rss();
    let threads = process_threads();
    let stop_mark = cp.audit_mark();
    fleet.stop();
    // The watches end with the fleet: now in the audit log, with their selectors.
    let mut ended = Vec::new();
    let watches = |ended: &[AuditEvent], what: &str| {
        ended
            .iter()
            .filter(|e| e.verb == "watch" && selects(e, what))
            .count()
    };
    let stopped = Instant::now();
    while stopped.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(500));
        ended = cp.audit_since(stop_mark);
        if watches(&ended, "") >= expected_node_watches + expected_job_watches {
            break;
        }
    }
    let node_watches = watches(&ended, "fieldSelector=spec.nodeName");
    let job_watches = watches(&ended, "labelSelector=");
    let mut job_selectors: BTreeMap<String, usize> = BTreeMap::new();
    for e in ended
        .iter()
        .filter(|e| e.verb == "watch" && selects(e, "labelSelector="))
    {
        let selector = query_param(&e.request_uri, "labelSelector").unwrap_or_default();
        *job_selectors
            .entry(format!("{} {selector}", e.namespace))
            .or_default() += 1;
    }
    let other_pod_watches = watches(&ended, "") - node_watches - job_watches;
    let one_list = Phase::measure(cp, "one cluster-wide pod list (for comparison)", || {
        let all: Api<Pod> = Api::all(cp.admin());
        let listed = cp
            .block_on(all.list(&ListParams::default().match_any()))
            .expect("list every pod");
        // Beside other tests' pods where the control plane is shared.
        assert!(listed.items.len() >= pods, "every pod listed");
    });
    for p in [&before, &start, &quiet, &churn, &one_list] {
        p.report(&mut out);
    }

    let n = spec.agents.max(1) as f64;
    let kb = |b: f64| b / 1024.0;
    let start_pod_requests: BTreeMap<String, usize> = start
        .events
        .iter()
        .filter(|e| e.user == FLEET_USER && e.resource == "pods")
        .fold(BTreeMap::new(), |mut m, e| {
            let kind = if e.subresource == "status" {
                "status of a judged pod"
            } else if e.request_uri.contains("labelSelector=") {
                "of a job"
            } else if e.request_uri.contains("fieldSelector=spec.nodeName") {
                "of its node"
            } else {
                "other"
            };
            *m.entry(format!("{} {kind}", e.verb)).or_default() += 1;
            m
        });
    let quiet_requests = quiet.events.iter().filter(|e| e.user == FLEET_USER).count();
    let events = |p: &Phase| p.bytes.get("pods WATCH").map_or(0.0, |(_, c)| *c);
    let (others, others_bytes) = (events(&before), before.bytes_of("pods WATCH"));
    let churn_events = events(&churn) - others;
    let churn_bytes = churn.bytes_of("pods WATCH") - others_bytes;
    let event_size = churn_bytes / churn_events.max(1.0);
    let list_bytes = start.bytes_of("pods LIST");
    let cluster_list = one_list.bytes_of("pods LIST");
    let _ = writeln!(
        out,
        "  per agent, at start: pod requests {start_pod_requests:?} in all ({:.2} lists per \
         agent), pod lists {:.1} kB; watches opened (counted at the stop): {node_watches} of \
         its node, {job_watches} of a job ({:.2} per agent; expected {expected_job_watches}), \
         {other_pod_watches} other pod watches",
        start_pod_requests
            .iter()
            .filter(|(k, _)| k.starts_with("list"))
            .map(|(_, v)| v)
            .sum::<usize>() as f64
            / n,
        kb(list_bytes / n),
        job_watches as f64 / n,
    );
    let _ = writeln!(
        out,
        "  steady state: {quiet_requests} requests from all agents in {:?}",
        spec.quiet
    );
    let _ = writeln!(
        out,
        "  per agent, every pod of the cluster changing once: {:.1} pod watch events ({:.1} kB; \
         {churn_events:.0} events sent to the agents in all ({others:.0} to the watches there \
         before them, {:.0} kB, left out), {expected_churn_events} selected by the agents' \
         watches, {:.1} kB each)",
        churn_events / n,
        kb(churn_bytes / n),
        kb(others_bytes),
        kb(event_size),
    );
    let _ = writeln!(
        out,
        "  one cluster-wide pod watch instead, per agent: its list {:.0} kB ({pods} pods), the \
         same churn {pods} events ({:.0} kB)",
        kb(cluster_list),
        kb(pods as f64 * event_size),
    );
    let _ = writeln!(
        out,
        "  this process's RSS: {} MiB before the agents, {} MiB once they watch, {} MiB after \
         the churn ({threads} threads): {:.2} MiB per agent",
        rss_before >> 20,
        rss_started >> 20,
        rss_after >> 20,
        (rss_after.max(rss_started).saturating_sub(rss_before)) as f64 / n / 1024.0 / 1024.0,
    );

    for ns in &namespaces {
        let api: Api<Pod> = Api::namespaced(cp.admin(), ns);
        let _ = cp.block_on(api.delete_collection(
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
            &ListParams::default(),
        ));
    }
    delete_pool(cp, &names);
    TransportRun {
        report: out,
        node_watches,
        job_watches,
        other_pod_watches,
        expected_node_watches,
        expected_job_watches,
        job_selectors,
        expected_job_selectors,
        quiet_requests,
        churn_events,
        expected_churn_events,
        pods,
    }
}
