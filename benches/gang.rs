//! Quota reserved -> admission check decided, for gangs of 8, 32 and 64 nodes on a validated
//! fleet of `FABRICGATE_FLEET` agents (default 500, `tests/common/fleet.rs`) on the real
//! kube-apiserver with Kueue's CRDs (issue 25, item 5: the API half). Printed, not asserted.
//!
//! `cargo bench --profile dev --bench gang -- decide` (without a name it measures nothing).
//!
//! The harness plays Kueue (it reserves quota with a TAS assignment, as Kueue's scheduler
//! writes it) and the members' agents: as soon as the FabricCheck appears it creates every
//! member's answer: all at once (`concurrent`: one FabricCheckResult per member under its
//! field manager, as the agents do, each on its own warm connection) or one after the other
//! (`sequential`; `FABRICGATE_GANG_WRITES` picks, default both), so the figure is the
//! controller's and the apiserver's part, with no RDMA exchange in it. `FABRICGATE_GANG_SIZES`
//! overrides the gang sizes (default 8,32,64). `fabricgate admission-check` runs as its own process with the shipped
//! ServiceAccount and RBAC.

#[path = "../tests/common/mod.rs"]
mod common;

use common::controlplane::ControlPlane;
use common::fleet::with_validated_fleet;
use common::{control_plane, kueue_crds, wait_until};
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
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
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/admission-check.yaml");
    cp.kubectl(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        manifest,
    ]);
    for crd in common::FABRICCHECK_CRDS {
        kueue_crds::wait_established(cp, crd);
    }
    cp.apply(
        &json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": WL_NS } })
            .to_string(),
    );
    let token = cp.kubectl(&["-n", NS, "create", "token", "fabricgate-admission-check"]);
    let scratch = tempfile::tempdir().unwrap();
    let kubeconfig = scratch.path().join("ac.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, token.trim());
    let config = scratch.path().join("requirements.yaml");
    // The longest timeout: a slow write under contention must not turn into a Retry here.
    std::fs::write(&config, "gang:\n  timeout: 10m\n").unwrap();
    let n: usize = std::env::var("FABRICGATE_FLEET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    with_validated_fleet(cp, "gang-fleet", n, |nodes| {
        // The endpoint each agent with peers on publishes (the harness answers for them).
        let admin_nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(cp.admin());
        cp.block_on(async {
            for (i, name) in nodes.iter().enumerate() {
                let patch = json!({ "metadata": { "annotations": {
                    "fabricgate.io/peers-endpoint": format!("127.0.0.1:{}", 20000 + i) } } });
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
        // Stopped however this returns (a failed run panics).
        let _controller = Stop(child);
        wait_until("the controller's lists", Duration::from_secs(60), || {
            let l = std::fs::read_to_string(&log).unwrap_or_default();
            l.contains("listed Nodes") && l.contains("listed Workloads")
        });
        let mut offset = 0;
        let modes = std::env::var("FABRICGATE_GANG_WRITES")
            .unwrap_or_else(|_| "concurrent,sequential".to_owned());
        for mode in modes.split(',').map(str::trim) {
            let sequential = mode == "sequential";
            for g in sizes() {
                let mut runs = Vec::new();
                for rep in 0..REPEATS {
                    let members: Vec<String> = (0..g)
                        .map(|i| nodes[(offset + i) % nodes.len()].clone())
                        .collect();
                    offset += g;
                    runs.push(one_gang(
                        cp,
                        &format!("{mode}-g{g}-{rep}"),
                        &members,
                        sequential,
                    ));
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
                 last result -> Ready {:.0} ms); {REPEATS} runs, max {:.0} ms",
                    ms(median(|r| r.total)),
                    ms(median(|r| r.created)),
                    ms(median(|r| r.answered)),
                    ms(median(|r| r.decided)),
                    ms(runs.iter().map(|r| r.total).max().unwrap())
                );
            }
        }
    });
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
}

/// One Workload of `members.len()` pods reserved on `members`; the harness answers for them.
fn one_gang(cp: &ControlPlane, name: &str, members: &[String], sequential: bool) -> Run {
    let workloads = api(
        cp,
        ("kueue.x-k8s.io", "v1beta2", "Workload"),
        "workloads",
        WL_NS,
    );
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
    let status = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": name, "namespace": WL_NS },
        "status": {
            "conditions": [{ "type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                "message": "Quota reserved in ClusterQueue gpu", "lastTransitionTime": now }],
            "admission": { "clusterQueue": "gpu", "podSetAssignments": [{
                "name": "main", "count": g,
                "topologyAssignment": { "levels": ["kubernetes.io/hostname"],
                    "slices": [{ "domainCount": g, "valuesPerLevel": [
                        { "individual": { "roots": members } }],
                        "podCounts": { "universal": 1 } }] } }] },
            "admissionChecks": [{ "name": CHECK, "state": "Pending", "message": "",
                "lastTransitionTime": now }],
        },
    });
    let state = || -> String {
        let wl = cp
            .get_json(&format!(
                "/apis/kueue.x-k8s.io/v1beta2/namespaces/{WL_NS}/workloads/{name}"
            ))
            .unwrap_or_default();
        kueue_crds::check_entry(&wl, CHECK).0
    };
    let t0 = Instant::now();
    cp.block_on(workloads.patch_status(
        name,
        &PatchParams::apply("kueue-admission").force(),
        &Patch::Apply(&status),
    ))
    .expect("reserve");
    let (spec, check_uid) = loop {
        if let Some(obj) = cp.get_json(&format!(
            "/apis/fabricgate.io/v1alpha1/namespaces/{NS}/fabricchecks/{fc}"
        )) {
            break (
                obj["spec"].clone(),
                obj["metadata"]["uid"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no FabricCheck {fc}"
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
    let t1 = Instant::now();
    cp.block_on(async {
        let writes = ring.iter().enumerate().map(|(i, node)| {
            let peer = &ring[(i + 1) % ring.len()];
            let result = json!({ "node": node, "peer": peer, "ok": true, "rdma": "measured",
                "device": "mlx5_0", "port": 1, "rttMicros": 3.1 });
            let obj: DynamicObject =
                serde_json::from_value(common::fabriccheck_answer(&fc, &check_uid, &result))
                    .expect("an answer");
            let results = results.clone();
            let pp = PostParams {
                field_manager: Some(format!("fabricgate-gang/{node}")),
                ..PostParams::default()
            };
            async move {
                results.create(&pp, &obj).await.expect("a member's answer");
            }
        });
        if sequential {
            for w in writes {
                w.await;
            }
        } else {
            futures::future::join_all(writes).await;
        }
    });
    let answered = t1.elapsed();
    let t2 = Instant::now();
    while state() != "Ready" {
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
    }
}
