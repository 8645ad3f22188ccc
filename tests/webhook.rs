//! The admission webhook: AdmissionReview in, JSON patch out, on recorded pod specs
//! (tests/fixtures/admission/: a PyTorchJob worker, a JobSet pod, a pod with blanket
//! tolerations, one already mutated); then the server over real TLS on 127.0.0.1 with a test
//! CA, and the certificate reloaded when its files change. `redteam` replays the red
//! team's attacks on the pod path (pods that argue with the webhook, a server held open).

mod common;
#[path = "webhook/redteam.rs"]
mod redteam;
#[path = "webhook/slow_clients.rs"]
mod slow_clients;

use common::tls::TestPki;
use fabricgate::config::Config;
use fabricgate::pod::webhook::{self, Endpoint, MutationConfig, ServerConfig};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const REQUIREMENTS: &str = "rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 8\n  \
                            min_rate_gbps: 400\n  link_layer: InfiniBand\n\
                            lustre:\n  mounts: [/lustre/scratch]\n\
                            mounts:\n  - path: /datasets\n    writable: false\n";
pub const IMAGE: &str = "registry.example.com/fabricgate:0.1.0";

pub fn cfg() -> MutationConfig {
    let config = Config::parse(REQUIREMENTS).unwrap();
    MutationConfig::new(&config, REQUIREMENTS, IMAGE)
}

pub fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/admission")
        .join(format!("{name}.json"))
}

pub fn fixture(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_path(name)).unwrap()).unwrap()
}

/// The review's response, and the pod with the patch applied (the pod as sent when there is
/// no patch).
pub fn admit(review: &Value) -> (Value, Value) {
    let out = webhook::review(&serde_json::to_vec(review).unwrap(), &cfg()).unwrap();
    let response = out["response"].clone();
    assert_eq!(out["kind"], "AdmissionReview");
    assert_eq!(out["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(response["uid"], review["request"]["uid"], "uid echoed");
    assert_eq!(response["allowed"], true, "the webhook never denies");
    let mut pod = review["request"]["object"].clone();
    if let Some(b64) = response.get("patch") {
        assert_eq!(response["patchType"], "JSONPatch");
        let bytes: k8s_openapi::ByteString = serde_json::from_value(b64.clone())
            .unwrap_or_else(|e| panic!("patch is not base64 ({e}): {b64}"));
        let patch: json_patch::Patch = serde_json::from_slice(&bytes.0).unwrap();
        json_patch::patch(&mut pod, &patch).unwrap_or_else(|e| panic!("patch does not apply: {e}"));
    }
    (response, pod)
}

pub fn init(pod: &Value) -> &Value {
    &pod["spec"]["initContainers"][0]
}

pub fn env<'a>(c: &'a Value, name: &str) -> Option<&'a Value> {
    c["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .map(|e| &e["value"])
}

pub fn mount_paths(c: &Value) -> Vec<String> {
    c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap().to_owned())
        .collect()
}

pub fn ready_term_count(pod: &Value) -> usize {
    pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            t["matchExpressions"].as_array().is_some_and(|e| {
                e.contains(
                    &json!({"key": "fabricgate.io/ready", "operator": "In", "values": ["true"]}),
                )
            })
        })
        .count()
}

/// Everything every mutated pod must have.
pub fn assert_wired(pod: &Value) {
    let spec = &pod["spec"];
    let terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .unwrap();
    assert_eq!(
        ready_term_count(pod),
        terms.len(),
        "every ORed term: {terms:?}"
    );
    let vol = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == webhook::VOLUME)
        .expect("NCCL volume");
    assert_eq!(vol["emptyDir"]["medium"], "Memory");
    let init = init(pod);
    assert_eq!(
        init["name"],
        webhook::INIT_CONTAINER,
        "preflight runs first"
    );
    assert_eq!(init["image"], IMAGE);
    assert_eq!(init["args"][0], "preflight");
    assert_eq!(
        env(init, webhook::REQUIREMENTS_ENV),
        Some(&json!(REQUIREMENTS))
    );
    assert_eq!(init["terminationMessagePath"], "/dev/termination-log");
    assert!(mount_paths(init).contains(&"/fabricgate".to_owned()));
    // Requests equal limits: the pod's QoS class is unchanged.
    assert_eq!(init["resources"]["requests"], init["resources"]["limits"]);
    for c in spec["containers"].as_array().unwrap() {
        let rdma = ["requests", "limits"].iter().any(|s| {
            c["resources"][*s].as_object().is_some_and(|m| {
                m.keys()
                    .any(|k| k.starts_with("rdma/") || k.starts_with("nvidia.com/hostdev"))
            })
        });
        if rdma {
            assert_eq!(env(c, "NCCL_NET"), Some(&json!("IB")), "{}", c["name"]);
        }
        assert_eq!(
            env(c, "NCCL_CONF_FILE"),
            Some(&json!("/fabricgate/nccl.conf")),
            "{}",
            c["name"]
        );
        let m = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == webhook::VOLUME)
            .expect("NCCL volume mounted");
        assert_eq!(m["readOnly"], true);
    }
}

#[test]
fn pytorchjob_worker_gets_affinity_preflight_and_nccl_conf() {
    let review = fixture("pytorchjob-worker");
    let before = review["request"]["object"].clone();
    let (response, pod) = admit(&review);
    assert!(response.get("warnings").is_none(), "{response}");
    assert_wired(&pod);
    let init = init(&pod);
    // The pod's RDMA resource, so the device plugin gives preflight the same devices; not
    // its GPUs.
    assert_eq!(
        init["resources"]["limits"]["rdma/rdma_shared_device_a"],
        "1"
    );
    assert_eq!(
        init["resources"]["requests"]["rdma/rdma_shared_device_a"],
        "1"
    );
    assert!(init["resources"]["limits"].get("nvidia.com/gpu").is_none());
    // The worker's IPC_LOCK, and its Lustre mount (a required path).
    assert_eq!(
        init["securityContext"]["capabilities"]["add"],
        json!(["IPC_LOCK"])
    );
    assert_eq!(mount_paths(init), ["/fabricgate", "/lustre/scratch"]);
    // Nothing else changed.
    assert_eq!(pod["spec"]["nodeSelector"], before["spec"]["nodeSelector"]);
    assert_eq!(pod["spec"]["tolerations"], before["spec"]["tolerations"]);
    assert_eq!(pod["metadata"], before["metadata"]);
    let worker = &pod["spec"]["containers"][0];
    assert_eq!(env(worker, "NCCL_DEBUG"), Some(&json!("WARN")));
    assert_eq!(
        worker["env"].as_array().unwrap().len(),
        before["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap()
            .len()
            + 2,
        "NCCL_CONF_FILE and NCCL_NET"
    );
    assert_eq!(env(worker, "NCCL_NET"), Some(&json!("IB")));
}

/// A native gang's pod (`spec.schedulingGroup`, Kubernetes 1.37) is wired like any
/// opted-in pod, keeps its group, and gets none of the removed `v1alpha2` fields
/// (`spec.workloadRef`).
#[test]
fn a_gang_pod_is_wired_like_any_other_and_keeps_its_scheduling_group() {
    let mut review = fixture("pytorchjob-worker");
    review["request"]["object"]["spec"]["schedulingGroup"] = json!({ "podGroupName": "llm" });
    let (response, pod) = admit(&review);
    assert!(response.get("warnings").is_none(), "{response}");
    assert_wired(&pod);
    assert_eq!(
        pod["spec"]["schedulingGroup"],
        json!({ "podGroupName": "llm" })
    );
    assert!(pod["spec"].get("workloadRef").is_none(), "{}", pod["spec"]);
    let ops: Vec<Value> = response.get("patch").map_or_else(Vec::new, |b64| {
        let bytes: k8s_openapi::ByteString = serde_json::from_value(b64.clone()).unwrap();
        serde_json::from_slice(&bytes.0).unwrap()
    });
    assert!(
        ops.iter().all(|op| {
            let path = op["path"].as_str().unwrap_or_default();
            !path.starts_with("/spec/schedulingGroup") && !path.starts_with("/spec/workloadRef")
        }),
        "the patch touches the gang fields: {ops:?}"
    );
}

#[test]
fn jobset_pod_opted_in_by_namespace_keeps_its_affinity_terms_and_init_order() {
    let review = fixture("jobset-pod");
    let before = review["request"]["object"].clone();
    assert!(
        before["metadata"]["labels"]
            .get("fabricgate.io/preflight")
            .is_none(),
        "namespace opt-in: the pod carries no label"
    );
    let (response, pod) = admit(&review);
    assert!(response.get("warnings").is_none(), "{response}");
    assert_wired(&pod);
    // Both ORed accelerator terms still hold their own expression, plus the ready one.
    let terms = &pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    for i in 0..2 {
        assert_eq!(terms[i]["matchExpressions"].as_array().unwrap().len(), 2);
        assert_eq!(
            terms[i]["matchExpressions"][0],
            before["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"][i]["matchExpressions"][0]
        );
    }
    assert_eq!(
        pod["spec"]["affinity"]["podAntiAffinity"],
        before["spec"]["affinity"]["podAntiAffinity"]
    );
    let names: Vec<&str> = pod["spec"]["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, [webhook::INIT_CONTAINER, "fetch-tokenizer"]);
    let init = init(&pod);
    assert_eq!(init["resources"]["limits"]["nvidia.com/hostdev"], "8");
    assert_eq!(init["securityContext"]["runAsUser"], 1000);
    // /datasets is required (read-only allowed) and mounted from the PVC, read-only.
    let datasets = init["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/datasets")
        .expect("the required /datasets mount");
    assert_eq!(datasets["readOnly"], true);
    assert_eq!(datasets["name"], "datasets");
}

#[test]
fn blanket_tolerations_cannot_escape_the_required_affinity() {
    let review = fixture("blanket-tolerations");
    let (_, pod) = admit(&review);
    assert_wired(&pod);
    // The pod still tolerates every taint (fabricgate.io/unvalidated included): the affinity
    // is what keeps it off a node that is not validated.
    assert_eq!(pod["spec"]["tolerations"], json!([{"operator": "Exists"}]));
    assert_eq!(ready_term_count(&pod), 1);
    // Both containers, the sidecar without any env before, read the NCCL config.
    let sidecar = &pod["spec"]["containers"][1];
    assert_eq!(sidecar["name"], "log-shipper");
    assert_eq!(sidecar["env"].as_array().unwrap().len(), 1);
    // /lustre covers the required /lustre/scratch: preflight gets that mount.
    assert!(mount_paths(init(&pod)).contains(&"/lustre".to_owned()));
    assert_eq!(
        init(&pod)["resources"]["limits"]["rdma/hca_shared_devices_a"],
        "1"
    );
}

pub fn mutated_review() -> Value {
    let mut review = fixture("pytorchjob-worker");
    let (_, pod) = admit(&review);
    review["request"]["object"] = pod;
    review
}

#[test]
fn already_mutated_pods_get_no_patch() {
    // The stored fixture: a worker as the API server stored it after an earlier admission.
    if std::env::var_os("FABRICGATE_BLESS").is_some() {
        let mut review = mutated_review();
        review["request"]["uid"] = json!("e1e2e3e4-0000-4000-8000-a1a2a3a4a5a6");
        let text = serde_json::to_string_pretty(&review).unwrap() + "\n";
        std::fs::write(fixture_path("already-mutated"), text).unwrap();
    }
    for review in [fixture("already-mutated"), mutated_review()] {
        let out = webhook::review(&serde_json::to_vec(&review).unwrap(), &cfg()).unwrap();
        assert_eq!(out["response"]["allowed"], true);
        assert!(
            out["response"].get("patch").is_none(),
            "{}",
            out["response"]
        );
        assert!(out["response"].get("warnings").is_none());
    }
}

#[test]
fn reinvocation_wires_only_a_container_another_webhook_added() {
    let mut review = mutated_review();
    let containers = review["request"]["object"]["spec"]["containers"]
        .as_array_mut()
        .unwrap();
    containers.push(json!({"name": "istio-proxy", "image": "istio/proxyv2:1.24"}));
    let (response, pod) = admit(&review);
    let patch: k8s_openapi::ByteString = serde_json::from_value(response["patch"].clone()).unwrap();
    let ops: Vec<Value> = serde_json::from_slice(&patch.0).unwrap();
    assert_eq!(
        ops.len(),
        2,
        "env and mount of the new container only: {ops:?}"
    );
    assert!(ops.iter().all(|o| {
        o["path"]
            .as_str()
            .unwrap()
            .starts_with("/spec/containers/1/")
    }));
    assert_wired(&pod);
}

#[test]
fn a_pod_that_chose_sockets_is_refused_saying_what_to_remove() {
    let mut review = fixture("pytorchjob-worker");
    review["request"]["object"]["spec"]["containers"][0]["env"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "NCCL_NET", "value": "Socket"}));
    let response = answer(&review);
    assert_eq!(response["allowed"], false, "{response}");
    assert!(response.get("patch").is_none(), "{response}");
    let why = response["status"]["message"].as_str().unwrap();
    assert!(
        why.contains("llama-70b-pretrain-worker-3")
            && why.contains("NCCL_NET=\"Socket\"")
            && why.contains("remove it"),
        "{why}"
    );
}

/// The review's response, allowed or not.
pub fn answer(review: &Value) -> Value {
    let out = webhook::review(&serde_json::to_vec(review).unwrap(), &cfg()).unwrap();
    assert_eq!(
        out["response"]["uid"], review["request"]["uid"],
        "uid echoed"
    );
    out["response"].clone()
}

#[test]
fn opted_out_non_rdma_and_non_create_requests_are_untouched() {
    // Label "false": opted out even in an opted-in namespace.
    let mut review = fixture("jobset-pod");
    review["request"]["object"]["metadata"]["labels"]["fabricgate.io/preflight"] = json!("false");
    assert!(admit(&review).0.get("patch").is_none());
    // No RDMA resource and no label: the namespace opted in, this pod does not use RDMA.
    let mut review = fixture("jobset-pod");
    review["request"]["object"]["spec"]["containers"][0]["resources"] = json!({});
    assert!(admit(&review).0.get("patch").is_none());
    // The label alone is enough, even without an RDMA resource.
    review["request"]["object"]["metadata"]["labels"]["fabricgate.io/preflight"] = json!("true");
    assert!(admit(&review).0.get("patch").is_some());
    // UPDATE and other kinds pass through.
    let mut review = fixture("pytorchjob-worker");
    review["request"]["operation"] = json!("UPDATE");
    review["request"]["oldObject"] = review["request"]["object"].clone();
    assert!(admit(&review).0.get("patch").is_none());
    let mut review = fixture("pytorchjob-worker");
    review["request"]["kind"] = json!({"group": "", "version": "v1", "kind": "ConfigMap"});
    assert!(admit(&review).0.get("patch").is_none());
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    for body in [&b"{"[..], b"{}", b"[]", b"{\"kind\":\"AdmissionReview\"}"] {
        let e = webhook::review(body, &cfg()).unwrap_err().to_string();
        assert!(e.contains("AdmissionReview"), "{e}");
    }
}

#[test]
fn webhook_configuration_for_a_test_url() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let doc = webhook::webhook_configuration(
        "fabricgate-preflight",
        &Endpoint::Url("https://127.0.0.1:8443".into()),
        pki.ca_pem.as_bytes(),
        "fabricgate.io/",
        &["kube-system", "fabricgate"],
    );
    assert_eq!(doc["kind"], "MutatingWebhookConfiguration");
    let hooks = doc["webhooks"].as_array().unwrap();
    assert_eq!(hooks.len(), 2);
    let ca: k8s_openapi::ByteString =
        serde_json::from_value(hooks[0]["clientConfig"]["caBundle"].clone()).unwrap();
    assert_eq!(ca.0, pki.ca_pem.as_bytes());
    assert_eq!(
        hooks[0]["clientConfig"]["url"],
        "https://127.0.0.1:8443/mutate"
    );
    // Opted-in namespaces and labelled pods elsewhere both fail closed.
    assert_eq!(hooks[0]["failurePolicy"], "Fail");
    assert_eq!(
        hooks[0]["namespaceSelector"]["matchExpressions"][0],
        json!({"key": "fabricgate.io/preflight", "operator": "In", "values": ["true"]})
    );
    assert_eq!(hooks[1]["failurePolicy"], "Fail");
    assert_eq!(
        hooks[1]["objectSelector"]["matchLabels"]["fabricgate.io/preflight"],
        "true"
    );
    for h in hooks {
        assert_eq!(h["sideEffects"], "None");
        assert_eq!(h["timeoutSeconds"], 5);
        assert_eq!(h["reinvocationPolicy"], "IfNeeded");
        assert_eq!(h["rules"][0]["operations"], json!(["CREATE"]));
    }
}

// ---- over real TLS -------------------------------------------------------------------------

pub struct Server {
    pub addr: SocketAddr,
    pub stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<fabricgate::Result<()>>,
}

pub async fn start(pki: &TestPki, reload: Duration) -> Server {
    start_with(ServerConfig {
        reload_interval: reload,
        ..ServerConfig::new(cfg(), pki.cert_file.clone(), pki.key_file.clone())
    })
    .await
}

pub async fn start_with(config: ServerConfig) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(webhook::serve(config, listener, async {
        let _ = rx.await;
    }));
    Server {
        addr,
        stop: Some(tx),
        task,
    }
}

/// One HTTPS request (HTTP/1.1, `Connection: close`): the server certificate (DER) and
/// the status and body of the answer.
pub async fn https(
    pki: &TestPki,
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &[u8],
) -> (Vec<u8>, u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let connector = tokio_rustls::TlsConnector::from(pki.client_config());
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::IpAddress(addr.ip().into());
    let mut tls = connector
        .connect(name, tcp)
        .await
        .expect("TLS handshake with the test CA");
    let cert = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.write_all(body).await.unwrap();
    let mut raw = Vec::new();
    let _ = tls.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status: u16 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (cert, status, body)
}

#[tokio::test]
async fn serves_admission_reviews_over_tls_trusted_through_the_test_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let mut server = start(&pki, Duration::from_secs(60)).await;
    let (_, status, body) = https(&pki, server.addr, "GET", "/healthz", b"").await;
    assert_eq!((status, body.as_str()), (200, "ok"));

    let review = fixture("pytorchjob-worker");
    let (_, status, body) = https(
        &pki,
        server.addr,
        "POST",
        webhook::MUTATE_PATH,
        &serde_json::to_vec(&review).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["uid"], review["request"]["uid"]);
    assert!(answer["response"]["patch"].is_string(), "{answer}");

    let (_, status, body) = https(&pki, server.addr, "POST", webhook::MUTATE_PATH, b"nope").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not an AdmissionReview"), "{body}");

    server.stop.take().unwrap().send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(5), server.task)
        .await
        .expect("shutdown is prompt")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart_and_a_broken_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let server = start(&pki, Duration::from_millis(50)).await;
    let (first, status, _) = https(&pki, server.addr, "GET", "/healthz", b"").await;
    assert_eq!(status, 200);

    let renewed = pki.issue("fabricgate-webhook-renewed");
    assert_ne!(renewed, first);
    let started = Instant::now();
    loop {
        let (served, _, _) = https(&pki, server.addr, "GET", "/healthz", b"").await;
        if served == renewed {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the renewed certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // A half-written or broken renewal: the last good certificate stays in service.
    std::fs::write(&pki.cert_file, "-----BEGIN CERTIFICATE-----\ngarbage\n").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (served, status, _) = https(&pki, server.addr, "GET", "/healthz", b"").await;
    assert_eq!(status, 200);
    assert_eq!(served, renewed);
    server.task.abort();
}

#[tokio::test]
async fn an_unusable_certificate_fails_at_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path());
    let other = TestPki::generate(&{
        let d = dir.path().join("other");
        std::fs::create_dir(&d).unwrap();
        d
    });
    // The key of another certificate.
    std::fs::copy(&other.key_file, &pki.key_file).unwrap();
    let server = start(&pki, Duration::from_secs(60)).await;
    let err = server.task.await.unwrap().unwrap_err().to_string();
    assert!(
        err.contains("tls.key") && err.contains("does not match"),
        "{err}"
    );
    let missing = ServerConfig::new(cfg(), dir.path().join("absent.crt"), pki.key_file.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = webhook::serve(missing, listener, std::future::pending())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("absent.crt"), "{err}");
}
