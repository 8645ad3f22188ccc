//! The admission webhook end to end on the real kube-apiserver: the webhook runs in this
//! process over TLS on 127.0.0.1 (a test CA), registered with `url: https://127.0.0.1:PORT`.
//! An opted-in pod comes back from the API server with the node affinity, the preflight init
//! container, the emptyDir and `NCCL_CONF_FILE`; with the webhook down, `failurePolicy: Fail`
//! refuses opted-in pods with a clear message while other pods are unaffected. Admission
//! latency through the real API server is measured (p50/p99) with and without the webhook.

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
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());

    // The webhook on its own runtime, as the binary runs it.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let config = Config::default();
    let mutation = MutationConfig::new(&config, "{}\n", "fabricgate:test");
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = runtime.spawn(webhook::serve(
        ServerConfig {
            mutation,
            cert_file: pki.cert_file.clone(),
            key_file: pki.key_file.clone(),
            reload_interval: Duration::from_secs(10),
        },
        listener,
        async {
            let _ = stop_rx.await;
        },
    ));

    let configuration = webhook::webhook_configuration(
        "fabricgate-preflight-test",
        &Endpoint::Url(format!("https://127.0.0.1:{port}")),
        pki.ca_pem.as_bytes(),
        "fabricgate.io/",
        &["kube-system", "fabricgate"],
    );
    cp.apply(&configuration.to_string());
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
    let mut first = None;
    let mut n = 0;
    crate::common::wait_until("the webhook to be called", Duration::from_secs(60), || {
        n += 1;
        let created = cp
            .block_on(opted.create(&PostParams::default(), &worker(&format!("probe-{n}"))))
            .expect("create a pod");
        let mutated = created
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.name == "fabricgate-preflight"));
        if mutated {
            first = Some(created);
        }
        mutated
    });
    let stored = cp
        .get_json(&format!(
            "/api/v1/namespaces/{OPTED_IN}/pods/{}",
            first.unwrap().metadata.name.unwrap()
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
    let _ = stop.send(());
    let _ = runtime.block_on(server);
    // The API server keeps connections to webhooks alive: end the ones still open too.
    runtime.shutdown_timeout(Duration::from_secs(1));
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
    let _ = cp.kubectl_as(
        &cp.admin_kubeconfig,
        &[
            "delete",
            "mutatingwebhookconfiguration",
            "fabricgate-preflight-test",
        ],
        None,
    );
}
