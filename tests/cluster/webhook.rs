//! The admission webhook end to end on the real kube-apiserver: the webhook runs in this
//! process over TLS on 127.0.0.1 (a test CA), registered with `url: https://127.0.0.1:PORT`.
//! An opted-in pod comes back from the API server with the node affinity, the preflight init
//! container, the emptyDir and `NCCL_CONF_FILE`; with the webhook down, `failurePolicy: Fail`
//! refuses opted-in pods with a clear message while other pods are unaffected. Admission
//! latency through the real API server is measured (p50/p99) with and without the webhook.
//!
//! The `redteam_` tests replay the red team's attacks on the real apiserver and scheduler: a pod
//! whose own affinity names the readiness key is still kept off a tainted `ready=false` node, and
//! with the webhook stopped, or its real process frozen (`SIGSTOP`: connections accepted, never
//! answered), a labelled pod outside the opted-in namespaces is refused.
//! Each registers its own configuration under its own label prefix, so the tests' webhooks
//! never see each other's pods.

use crate::common::control_plane;
use crate::common::tls::TestPki;
use fabricgate::config::Config;
use fabricgate::pod::webhook::{self, Endpoint, MutationConfig, ServerConfig};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use std::time::{Duration, Instant};

const OPTED_IN: &str = "webhook-training";
const PLAIN: &str = "webhook-plain";

fn worker(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": { "name": name, "labels": { "job": "pretrain" } },
        "spec": {
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "worker", "image": "pytorch:test",
                "resources": {
                    "requests": { "rdma/hca_shared_devices_a": "1" },
                    "limits": { "rdma/hca_shared_devices_a": "1" },
                },
            }],
        },
    }))
    .unwrap()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[test]
fn opted_in_pods_are_mutated_through_the_real_apiserver_and_refused_when_the_webhook_is_down() {
    let Some(cp) = control_plane() else { return };
    // The webhook on its own runtime, as the binary runs it.
    let hook = Webhook::start(cp, "fabricgate-preflight-test", "fabricgate.io/");
    cp.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {OPTED_IN}\n  labels:\n    \
         fabricgate.io/preflight: \"true\"\n---\napiVersion: v1\nkind: ServiceAccount\n\
         metadata:\n  name: default\n  namespace: {OPTED_IN}\n---\napiVersion: v1\n\
         kind: Namespace\nmetadata:\n  name: {PLAIN}\n---\napiVersion: v1\n\
         kind: ServiceAccount\nmetadata:\n  name: default\n  namespace: {PLAIN}\n"
    ));
    let opted: Api<Pod> = Api::namespaced(cp.admin(), OPTED_IN);
    let plain: Api<Pod> = Api::namespaced(cp.admin(), PLAIN);

    // The configuration takes effect once the apiserver has loaded it.
    let first = first_mutated(cp, &opted, |n| worker(&format!("probe-{n}")));
    let stored = cp
        .get_json(&format!(
            "/api/v1/namespaces/{OPTED_IN}/pods/{}",
            first.metadata.name.unwrap()
        ))
        .unwrap();
    let spec = &stored["spec"];
    let terms = &spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    assert!(
        terms
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["matchExpressions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["key"] == "fabricgate.io/ready" && e["values"] == json!(["true"]))),
        "every term requires the validated label: {terms}"
    );
    let init = spec["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "fabricgate-preflight")
        .unwrap();
    assert_eq!(init["image"], "fabricgate:test");
    assert_eq!(
        init["resources"]["limits"]["rdma/hca_shared_devices_a"], "1",
        "the init container gets the same RDMA devices"
    );
    assert!(
        spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "fabricgate-nccl" && v["emptyDir"].is_object())
    );
    let env = spec["containers"][0]["env"].as_array().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"] == "NCCL_CONF_FILE" && e["value"] == "/fabricgate/nccl.conf"),
        "{env:?}"
    );

    // A pod in a namespace that did not opt in is left alone.
    let other = cp
        .block_on(plain.create(&PostParams::default(), &worker("untouched")))
        .unwrap();
    assert!(other.spec.unwrap().init_containers.is_none());

    // Admission latency through the real API server, with and without the webhook.
    let mut with = Vec::new();
    let mut without = Vec::new();
    for i in 0..40 {
        let t = Instant::now();
        cp.block_on(opted.create(&PostParams::default(), &worker(&format!("lat-{i}"))))
            .unwrap();
        with.push(t.elapsed());
        let t = Instant::now();
        cp.block_on(plain.create(&PostParams::default(), &worker(&format!("lat-{i}"))))
            .unwrap();
        without.push(t.elapsed());
    }
    with.sort();
    without.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    eprintln!(
        "pod create through kube-apiserver: with the webhook p50 {:.1} ms p99 {:.1} ms; \
         without p50 {:.1} ms p99 {:.1} ms",
        ms(percentile(&with, 0.5)),
        ms(percentile(&with, 0.99)),
        ms(percentile(&without, 0.5)),
        ms(percentile(&without, 0.99)),
    );
    assert!(percentile(&with, 0.99) < Duration::from_secs(5), "{with:?}");

    // The webhook goes down: failurePolicy Fail refuses opted-in pods, others go through.
    hook.kill();
    let refused = cp.block_on(opted.create(&PostParams::default(), &worker("while-down")));
    match refused {
        Err(kube::Error::Api(s)) => {
            assert!(
                s.message.contains("failed calling webhook")
                    && s.message.contains("namespaces.preflight.fabricgate.io"),
                "{}",
                s.message
            );
        }
        other => panic!("an opted-in pod must be refused while the webhook is down: {other:?}"),
    }
    cp.block_on(plain.create(&PostParams::default(), &worker("while-down")))
        .expect("pods of other namespaces are unaffected");
    delete_webhook_configuration(cp, "fabricgate-preflight-test");
}

/// A webhook served from this process on its own runtime and registered with the API server
/// under `prefix` (`<prefix>preflight` opts in, `<prefix>ready` is the affinity).
struct Webhook {
    runtime: tokio::runtime::Runtime,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<fabricgate::Result<()>>>,
    _pki: (tempfile::TempDir, TestPki),
}

impl Webhook {
    fn start(cp: &crate::common::controlplane::ControlPlane, name: &str, prefix: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pki = TestPki::generate(dir.path());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let yaml = format!("node:\n  label_prefix: {prefix}\n");
        let config = Config::parse(&yaml).unwrap();
        let mutation = MutationConfig::new(&config, &yaml, "fabricgate:test");
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = runtime.spawn(webhook::serve(
            ServerConfig::new(mutation, pki.cert_file.clone(), pki.key_file.clone()),
            listener,
            async {
                let _ = stop_rx.await;
            },
        ));
        let configuration = webhook::webhook_configuration(
            name,
            &Endpoint::Url(format!("https://127.0.0.1:{port}")),
            pki.ca_pem.as_bytes(),
            prefix,
            &["kube-system", "fabricgate"],
        );
        cp.apply(&configuration.to_string());
        Self {
            runtime,
            stop: Some(stop),
            server: Some(server),
            _pki: (dir, pki),
        }
    }

    /// Stop the server and end the connections the API server keeps open to it.
    fn kill(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = self.runtime.block_on(server);
        }
        self.runtime.shutdown_timeout(Duration::from_secs(1));
    }
}

fn namespace(cp: &crate::common::controlplane::ControlPlane, name: &str, labels: &str) {
    cp.apply(&format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels: {{{labels}}}\n\
         ---\napiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: default\n  \
         namespace: {name}\n"
    ));
}

fn mutated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .is_some_and(|c| {
            c.iter()
                .any(|c| c.image.as_deref() == Some("fabricgate:test"))
        })
}

/// Create pods made by `make(n)` until one comes back mutated (the API server has loaded
/// the configuration); returns it.
fn first_mutated(
    cp: &crate::common::controlplane::ControlPlane,
    api: &Api<Pod>,
    make: impl Fn(usize) -> Pod,
) -> Pod {
    let mut n = 0;
    let mut found = None;
    crate::common::poll_until(
        "the webhook to be called",
        Duration::from_secs(60),
        Duration::from_millis(200),
        || {
            n += 1;
            let created = cp
                .block_on(api.create(&PostParams::default(), &make(n)))
                .expect("create a pod");
            let done = mutated(&created);
            if done {
                found = Some(created);
            }
            done
        },
        String::new,
    );
    found.unwrap()
}

/// [`worker`] opted in by the pod label of `prefix`.
fn labelled(prefix: &str, name: &str) -> Pod {
    let mut p = worker(name);
    p.metadata
        .labels
        .get_or_insert_default()
        .insert(format!("{prefix}preflight"), "true".into());
    p
}

/// `outcome` of creating a labelled pod while the webhook of label prefix `prefix` cannot
/// answer: refused by the API server for the failed call (`failurePolicy: Fail`). At 35f8061
/// (`failurePolicy: Ignore`) the pod was created after the 5 s timeout with no preflight and
/// no affinity.
fn assert_refused_for_the_webhook(outcome: kube::Result<Pod>, prefix: &str, why: &str) {
    let hook = format!("pods.preflight.{}", prefix.trim_end_matches('/'));
    match outcome {
        Err(kube::Error::Api(s)) => assert!(
            s.message.contains("failed calling webhook") && s.message.contains(&hook),
            "{}",
            s.message
        ),
        Ok(p) => panic!(
            "a labelled pod was admitted while {why}, mutated: {}",
            mutated(&p)
        ),
        Err(e) => panic!("{e}"),
    }
}

fn delete_webhook_configuration(cp: &crate::common::controlplane::ControlPlane, name: &str) {
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &["delete", "mutatingwebhookconfiguration", name],
        None,
    );
}

#[test]
fn redteam_a_down_webhook_refuses_labelled_pods_outside_opted_in_namespaces() {
    let Some(cp) = control_plane() else { return };
    const PREFIX: &str = "redteam-down.fabricgate.io/";
    const NS: &str = "webhook-rt-down";
    namespace(cp, NS, "");
    let hook = Webhook::start(cp, "fabricgate-preflight-redteam-down", PREFIX);
    let pods: Api<Pod> = Api::namespaced(cp.admin(), NS);
    let first = first_mutated(cp, &pods, |n| labelled(PREFIX, &format!("labelled-{n}")));
    assert!(mutated(&first));

    hook.kill();
    let outcome = cp.block_on(pods.create(&PostParams::default(), &labelled(PREFIX, "while-down")));
    assert_refused_for_the_webhook(outcome, PREFIX, "the webhook is down");
    cp.block_on(pods.create(&PostParams::default(), &worker("unlabelled-while-down")))
        .expect("pods that did not opt in never wait on the webhook");
    delete_webhook_configuration(cp, "fabricgate-preflight-redteam-down");
}

#[test]
fn redteam_a_pod_naming_the_ready_key_itself_stays_off_a_tainted_unready_node() {
    let Some(cp) = control_plane() else { return };
    const PREFIX: &str = "redteam-sched.fabricgate.io/";
    const NS: &str = "webhook-rt-sched";
    const RESOURCE: &str = "rdma/redteam_sched";
    cp.start_scheduler();
    cp.create_node(
        "rt-sched-unready",
        json!({ format!("{PREFIX}ready"): "false" }),
        json!([{ "key": format!("{PREFIX}unvalidated"), "effect": "NoSchedule" }]),
        json!({ RESOURCE: "1" }),
    );
    namespace(cp, NS, &format!("{PREFIX}preflight: \"true\""));
    let hook = Webhook::start(cp, "fabricgate-preflight-redteam-sched", PREFIX);
    let pods: Api<Pod> = Api::namespaced(cp.admin(), NS);
    // Tolerates every taint, and names the readiness key in its own affinity: at 35f8061 the
    // webhook then added no requirement and the scheduler bound it to the unready node.
    let arguing = |name: &str, scheduler: &str| -> Pod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": name },
            "spec": {
                "automountServiceAccountToken": false,
                "schedulerName": scheduler,
                "tolerations": [{ "operator": "Exists" }],
                "affinity": { "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{ "matchExpressions": [
                        { "key": format!("{PREFIX}ready"), "operator": "NotIn", "values": ["x"] },
                    ]}],
                }}},
                "containers": [{
                    "name": "worker", "image": "pytorch:test",
                    "resources": { "requests": { RESOURCE: "1" }, "limits": { RESOURCE: "1" } },
                }],
            },
        }))
        .unwrap()
    };
    // Until the configuration is loaded, probe with pods no scheduler picks up.
    first_mutated(cp, &pods, |n| arguing(&format!("probe-{n}"), "nobody"));
    let created = cp
        .block_on(pods.create(
            &PostParams::default(),
            &arguing("arguing", "default-scheduler"),
        ))
        .unwrap();
    assert!(mutated(&created));
    let path = format!("/api/v1/namespaces/{NS}/pods/arguing");
    let mut why = String::new();
    crate::common::wait_until(
        "the scheduler to refuse the pod",
        Duration::from_secs(60),
        || {
            let p = cp.get_json(&path).unwrap();
            assert!(
                p["spec"]["nodeName"].is_null(),
                "bound to {} (ready=false, tainted)",
                p["spec"]["nodeName"]
            );
            let cond = p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "PodScheduled" && c["reason"] == "Unschedulable")
                .cloned();
            if let Some(c) = cond {
                why = c["message"].as_str().unwrap_or_default().to_owned();
            }
            !why.is_empty()
        },
    );
    assert!(
        why.contains("affinity"),
        "the scheduler names the node affinity: {why}"
    );

    // A validated node: the same pod is bound there, so nothing else kept it Pending.
    cp.create_node(
        "rt-sched-ready",
        json!({ format!("{PREFIX}ready"): "true" }),
        json!([]),
        json!({ RESOURCE: "1" }),
    );
    crate::common::wait_until("the pod bound", Duration::from_secs(60), || {
        cp.get_json(&path).unwrap()["spec"]["nodeName"]
            .as_str()
            .is_some()
    });
    assert_eq!(
        cp.get_json(&path).unwrap()["spec"]["nodeName"],
        "rt-sched-ready"
    );
    hook.kill();
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "delete",
            "mutatingwebhookconfiguration",
            "fabricgate-preflight-redteam-sched",
        ],
        None,
    );
    for node in ["rt-sched-unready", "rt-sched-ready"] {
        let _ = cp.kubectl_as(
            &cp.admin_kubeconfig,
            &["delete", "node", node, "--wait=false"],
            None,
        );
    }
}

/// The real `fabricgate webhook` binary, registered like [`Webhook`], frozen with `SIGSTOP`:
/// the kernel still accepts connections, nothing answers (a hung webhook, not a gone one).
#[test]
fn redteam_a_hung_webhook_refuses_labelled_pods_outside_opted_in_namespaces() {
    let Some(cp) = control_plane() else { return };
    const PREFIX: &str = "redteam-hung.fabricgate.io/";
    const NS: &str = "webhook-rt-hung";
    namespace(cp, NS, "");
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let config = dir.path().join("requirements.yaml");
    std::fs::write(&config, format!("node:\n  label_prefix: {PREFIX}\n")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .arg("webhook")
        .arg("--config")
        .arg(&config)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--tls-cert-file")
        .arg(&pki.cert_file)
        .arg("--tls-key-file")
        .arg(&pki.key_file)
        .args(["--preflight-image", "fabricgate:test"])
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("webhook.log")).unwrap())
        .spawn()
        .expect("start fabricgate webhook");
    let signal = |sig: &str, pid: u32| {
        std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .expect("kill")
    };
    let configuration = webhook::webhook_configuration(
        "fabricgate-preflight-redteam-hung",
        &Endpoint::Url(format!("https://127.0.0.1:{port}")),
        pki.ca_pem.as_bytes(),
        PREFIX,
        &["kube-system", "fabricgate"],
    );
    cp.apply(&configuration.to_string());
    let pods: Api<Pod> = Api::namespaced(cp.admin(), NS);
    let first = first_mutated(cp, &pods, |n| labelled(PREFIX, &format!("labelled-{n}")));
    assert!(mutated(&first));

    assert!(signal("-STOP", child.id()).success());
    let started = Instant::now();
    let outcome = cp.block_on(pods.create(&PostParams::default(), &labelled(PREFIX, "while-hung")));
    let waited = started.elapsed();
    let _ = signal("-CONT", child.id());
    let _ = child.kill();
    let _ = child.wait();
    delete_webhook_configuration(cp, "fabricgate-preflight-redteam-hung");
    assert_refused_for_the_webhook(outcome, PREFIX, "the webhook hung");
    // The API server gave up after the configuration's timeoutSeconds (5 s), not sooner.
    assert!(waited >= Duration::from_secs(4), "refused after {waited:?}");
}
