//! "Pod authors bypass the webhook silently": each test replays one way a pod
//! argued with the mutation at 35f8061 and fails if it works again.

use super::{
    IMAGE, REQUIREMENTS, admit, answer, assert_wired, cfg, env, fixture, init, mutated_review,
};
use fabricgate::config::Config;
use fabricgate::pod::webhook::{self, MutationConfig};
use serde_json::{Value, json};

const READY: &str = "fabricgate.io/ready";

fn worker_review() -> Value {
    fixture("pytorchjob-worker")
}

fn pod_mut(review: &mut Value) -> &mut Value {
    &mut review["request"]["object"]
}

fn terms(pod: &Value) -> &Vec<Value> {
    pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .unwrap()
}

fn ours() -> Value {
    json!({"key": READY, "operator": "In", "values": ["true"]})
}

/// The refusal's message; panics if the pod was admitted.
fn refused(review: &Value) -> String {
    let response = answer(review);
    assert_eq!(response["allowed"], false, "must be refused: {response}");
    assert!(response.get("patch").is_none());
    response["status"]["message"].as_str().unwrap().to_owned()
}

/// Names must stay unique across containers and init containers, and across volumes.
fn assert_valid_names(pod: &Value) {
    let spec = &pod["spec"];
    let mut containers: Vec<&str> = ["containers", "initContainers"]
        .iter()
        .flat_map(|k| spec[*k].as_array().into_iter().flatten())
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    let n = containers.len();
    containers.sort_unstable();
    containers.dedup();
    assert_eq!(
        containers.len(),
        n,
        "container names unique: {containers:?}"
    );
    let mut volumes: Vec<&str> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    let n = volumes.len();
    volumes.sort_unstable();
    volumes.dedup();
    assert_eq!(volumes.len(), n, "volume names unique: {volumes:?}");
    for c in ["containers", "initContainers"]
        .iter()
        .flat_map(|k| spec[*k].as_array().into_iter().flatten())
    {
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            assert!(
                volumes.contains(&m["name"].as_str().unwrap()),
                "{} mounts a volume that exists: {m}",
                c["name"]
            );
        }
    }
}

#[test]
fn redteam_the_pods_own_expressions_on_the_ready_key_do_not_drop_the_requirement() {
    for theirs in [
        json!({"key": READY, "operator": "NotIn", "values": ["x"]}),
        json!({"key": READY, "operator": "Exists"}),
        json!({"key": READY, "operator": "In", "values": ["true", "false"]}),
        json!({"key": READY, "operator": "DoesNotExist"}),
    ] {
        let mut review = worker_review();
        pod_mut(&mut review)["spec"]["affinity"] = json!({"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [theirs.clone()]},
            {"matchExpressions": [theirs.clone(),
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H200"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
        ]}}});
        let (_, pod) = admit(&review);
        assert_wired(&pod);
        for (i, t) in terms(&pod).iter().enumerate() {
            let exprs = t["matchExpressions"].as_array().unwrap();
            assert!(exprs.contains(&ours()), "term {i} with {theirs}: {t}");
            if i < 2 {
                assert!(exprs.contains(&theirs), "the pod's own stays: {t}");
            }
        }
        // Reinvocation adds nothing more.
        let mut again = review.clone();
        again["request"]["object"] = pod;
        assert!(admit(&again).0.get("patch").is_none());
    }
}

#[test]
fn redteam_a_squatted_init_container_name_and_volume_do_not_stop_the_mutation() {
    let mut review = worker_review();
    let spec = &mut pod_mut(&mut review)["spec"];
    spec["initContainers"] = json!([{
        "name": webhook::INIT_CONTAINER, "image": "busybox:1.36",
        "command": ["true"],
    }]);
    spec["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": webhook::VOLUME, "hostPath": {"path": "/tmp/planted"}}));
    let (response, pod) = admit(&review);
    assert!(response["patch"].is_string(), "{response}");
    assert_valid_names(&pod);
    let first = init(&pod);
    assert_eq!(first["name"], format!("{}-1", webhook::INIT_CONTAINER));
    assert_eq!(first["image"], IMAGE);
    assert_eq!(first["args"][0], "preflight");
    assert_eq!(
        env(first, webhook::REQUIREMENTS_ENV),
        Some(&json!(REQUIREMENTS))
    );
    // The NCCL files go to a volume of the webhook's own, an emptyDir, not the pod's hostPath.
    let vol = format!("{}-1", webhook::VOLUME);
    let ours = pod["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == vol.as_str())
        .expect("the webhook's volume");
    assert_eq!(ours["emptyDir"]["medium"], "Memory");
    for c in [first, &pod["spec"]["containers"][0]] {
        let m = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"] == "/fabricgate")
            .unwrap();
        assert_eq!(m["name"], vol.as_str(), "{}", c["name"]);
    }
    // The user's container is still there, after preflight.
    assert_eq!(pod["spec"]["initContainers"][1]["image"], "busybox:1.36");
    let mut again = review.clone();
    again["request"]["object"] = pod;
    assert!(
        admit(&again).0.get("patch").is_none(),
        "recognised by content"
    );

    // An init container with the webhook's name and image but not its content (other
    // arguments, or a sidecar that does not block the workers) is not preflight either.
    for fake in [
        json!({"name": webhook::INIT_CONTAINER, "image": IMAGE, "args": ["selftest"]}),
        json!({"name": webhook::INIT_CONTAINER, "image": IMAGE, "restartPolicy": "Always",
               "args": ["preflight", "--nccl-dir", "/fabricgate", "--termination-log",
                        "/dev/termination-log"],
               "env": [{"name": webhook::REQUIREMENTS_ENV, "value": REQUIREMENTS}]}),
    ] {
        let mut review = worker_review();
        pod_mut(&mut review)["spec"]["initContainers"] = json!([fake]);
        let (_, pod) = admit(&review);
        assert_valid_names(&pod);
        assert_eq!(init(&pod)["name"], format!("{}-1", webhook::INIT_CONTAINER));
        assert!(init(&pod)["restartPolicy"].is_null());
    }
}

#[test]
fn redteam_a_mount_of_the_pods_own_at_the_nccl_dir_is_refused() {
    let mut review = worker_review();
    let spec = &mut pod_mut(&mut review)["spec"];
    spec["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "planted", "configMap": {"name": "my-nccl"}}));
    spec["containers"][0]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "planted", "mountPath": "/fabricgate/"}));
    let why = refused(&review);
    assert!(
        why.contains("container pytorch mounts volume planted at /fabricgate")
            && why.contains("mount it elsewhere"),
        "{why}"
    );
}

#[test]
fn redteam_no_container_but_preflight_may_write_the_nccl_files() {
    // A container that mounts the name the webhook would pick does not get it: the webhook
    // picks another.
    let mut review = worker_review();
    let spec = &mut pod_mut(&mut review)["spec"];
    spec["initContainers"] = json!([{"name": "rewrite", "image": "busybox:1.36",
        "volumeMounts": [{"name": webhook::VOLUME, "mountPath": "/x"}]}]);
    let (_, pod) = admit(&review);
    let vol = init(&pod)["volumeMounts"][0]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(vol, webhook::VOLUME);
    // In an already mutated pod, a writable mount of the webhook's volume is refused.
    let mut review = mutated_review();
    pod_mut(&mut review)["spec"]["containers"][0]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": webhook::VOLUME, "mountPath": "/rw"}));
    let why = refused(&review);
    assert!(why.contains("writable at /rw"), "{why}");
}

#[test]
fn redteam_nccl_net_and_ib_disable_that_leave_rdma_are_refused() {
    let cases: &[(Value, &str)] = &[
        (
            json!({"name": "NCCL_NET", "value": "Socket"}),
            "NCCL_NET=\"Socket\"",
        ),
        (
            json!({"name": "NCCL_NET", "value": "socket"}),
            "NCCL_NET=\"socket\"",
        ),
        (
            json!({"name": "NCCL_NET", "value": " IB"}),
            "NCCL_NET=\" IB\"",
        ),
        (
            json!({"name": "NCCL_NET", "valueFrom": {"configMapKeyRef": {"name": "n", "key": "k"}}}),
            "NCCL_NET through valueFrom",
        ),
        (
            json!({"name": "NCCL_IB_DISABLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}),
            "NCCL_IB_DISABLE through valueFrom",
        ),
    ];
    let mut all: Vec<(Value, String)> = cases
        .iter()
        .map(|(e, w)| (e.clone(), (*w).to_owned()))
        .collect();
    for v in ["1", "2", "0x1", "  1", "+1", "-1", "1abc", "true", "yes"] {
        all.push((
            json!({"name": "NCCL_IB_DISABLE", "value": v}),
            format!("NCCL_IB_DISABLE={v:?}"),
        ));
    }
    for (entry, want) in all {
        let mut review = worker_review();
        pod_mut(&mut review)["spec"]["containers"][0]["env"]
            .as_array_mut()
            .unwrap()
            .push(entry.clone());
        let why = refused(&review);
        assert!(
            why.contains(&want) && why.contains("remove it") && why.contains("container pytorch"),
            "{entry}: {why}"
        );
    }
    // What NCCL reads as 0, said plainly, passes; so does an allowed transport in any case.
    for entry in [
        json!({"name": "NCCL_IB_DISABLE", "value": "0"}),
        json!({"name": "NCCL_IB_DISABLE", "value": ""}),
        json!({"name": "NCCL_NET", "value": "ib"}),
    ] {
        let mut review = worker_review();
        pod_mut(&mut review)["spec"]["containers"][0]["env"]
            .as_array_mut()
            .unwrap()
            .push(entry.clone());
        let (response, pod) = admit(&review);
        assert!(response["patch"].is_string(), "{entry}: {response}");
        let nets: Vec<&Value> = pod["spec"]["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["name"] == "NCCL_NET")
            .collect();
        assert_eq!(nets.len(), 1, "one NCCL_NET: {nets:?}");
    }
}

#[test]
fn redteam_env_from_cannot_choose_the_transport() {
    // envFrom cannot be inspected: the explicit NCCL_NET the webhook sets beats it.
    let mut review = worker_review();
    pod_mut(&mut review)["spec"]["containers"][0]["envFrom"] =
        json!([{"configMapRef": {"name": "nccl-socket"}}]);
    let (_, pod) = admit(&review);
    assert_eq!(
        env(&pod["spec"]["containers"][0], "NCCL_NET"),
        Some(&json!("IB"))
    );
}

#[test]
fn redteam_the_pods_own_nccl_ib_hca_is_refused_unless_allowed() {
    let mut review = worker_review();
    pod_mut(&mut review)["spec"]["containers"][0]["env"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "NCCL_IB_HCA", "value": "mlx5_0"}));
    let why = refused(&review);
    assert!(
        why.contains("NCCL_IB_HCA") && why.contains("webhook.allow_user_ib_hca"),
        "{why}"
    );
    let yaml = format!("{REQUIREMENTS}webhook:\n  allow_user_ib_hca: true\n");
    let allowing = MutationConfig::new(&Config::parse(&yaml).unwrap(), &yaml, IMAGE);
    let out = webhook::review(&serde_json::to_vec(&review).unwrap(), &allowing).unwrap();
    assert_eq!(out["response"]["allowed"], true);
    let warnings = out["response"]["warnings"].to_string();
    assert!(warnings.contains("NCCL_IB_HCA=mlx5_0"), "{warnings}");
}

#[test]
fn redteam_a_net_plugin_list_is_honoured_and_socket_is_not_a_verbs_transport() {
    let yaml = format!("{REQUIREMENTS}webhook:\n  nccl_net: [IBext, IB]\n");
    let plugins = MutationConfig::new(&Config::parse(&yaml).unwrap(), &yaml, IMAGE);
    let review = worker_review();
    let out = webhook::review(&serde_json::to_vec(&review).unwrap(), &plugins).unwrap();
    let bytes: k8s_openapi::ByteString =
        serde_json::from_value(out["response"]["patch"].clone()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes.0).unwrap();
    let mut pod = review["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    assert_eq!(
        env(&pod["spec"]["containers"][0], "NCCL_NET"),
        Some(&json!("IBext"))
    );
    assert!(
        init(&pod)["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--nccl-net=IBext")),
        "preflight writes the same transport"
    );
    let e = Config::parse("webhook:\n  nccl_net: [IB, Socket]\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("webhook.nccl_net") && e.contains("TCP"), "{e}");
}

#[test]
fn redteam_native_sidecars_and_init_containers_with_rdma_get_the_same_treatment() {
    let sidecar = |env: Value| {
        json!({"name": "rdma-proxy", "image": "proxy:1", "restartPolicy": "Always",
               "env": env,
               "resources": {"limits": {"rdma/rdma_shared_device_a": "1"}}})
    };
    let mut review = worker_review();
    pod_mut(&mut review)["spec"]["initContainers"] = json!([sidecar(json!([]))]);
    let (_, pod) = admit(&review);
    assert_valid_names(&pod);
    let inits = pod["spec"]["initContainers"].as_array().unwrap();
    assert_eq!(inits[0]["image"], IMAGE, "preflight first");
    assert_eq!(env(&inits[1], "NCCL_NET"), Some(&json!("IB")));
    assert_eq!(
        env(&inits[1], "NCCL_CONF_FILE"),
        Some(&json!("/fabricgate/nccl.conf"))
    );
    let mut review = worker_review();
    pod_mut(&mut review)["spec"]["initContainers"] =
        json!([sidecar(json!([{"name": "NCCL_IB_DISABLE", "value": "1"}]))]);
    let why = refused(&review);
    assert!(
        why.contains("container rdma-proxy sets NCCL_IB_DISABLE"),
        "{why}"
    );
}

#[test]
fn redteam_an_admission_review_other_than_v1_is_refused() {
    for version in ["admission.k8s.io/v1beta1", "admission.k8s.io/v2", ""] {
        let mut review = worker_review();
        review["apiVersion"] = json!(version);
        let e = webhook::review(&serde_json::to_vec(&review).unwrap(), &cfg())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("admission.k8s.io/v1") && e.contains(version),
            "{e}"
        );
    }
    let mut review = worker_review();
    review["kind"] = json!("ConversionReview");
    assert!(webhook::review(&serde_json::to_vec(&review).unwrap(), &cfg()).is_err());
}

/// A requirements file of 150 KiB (mostly the operator's comments): what reaches the init
/// container stays small enough to exec, and means the same requirements.
pub fn long_requirements() -> String {
    format!(
        "{REQUIREMENTS}{}",
        "# Site notes kept with the requirements: which pools, who to call, why.\n"
            .repeat(150 * 1024 / 72 + 1)
    )
}

#[test]
fn redteam_150_kib_of_requirements_do_not_bloat_the_init_containers_env() {
    let yaml = long_requirements();
    assert!(yaml.len() >= 150 * 1024);
    let config = Config::parse(&yaml).unwrap();
    let m = MutationConfig::new(&config, &yaml, IMAGE);
    let out = webhook::review(&serde_json::to_vec(&worker_review()).unwrap(), &m).unwrap();
    let bytes: k8s_openapi::ByteString =
        serde_json::from_value(out["response"]["patch"].clone()).unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes.0).unwrap();
    let mut pod = worker_review()["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    let value = env(init(&pod), webhook::REQUIREMENTS_ENV)
        .and_then(Value::as_str)
        .unwrap();
    eprintln!(
        "requirements: {} bytes as written, {} bytes handed to preflight",
        yaml.len(),
        value.len()
    );
    assert!(
        value.len() <= webhook::MAX_REQUIREMENTS_BYTES,
        "{} bytes",
        value.len()
    );
    assert_eq!(Config::parse(value).unwrap(), config);
}

#[test]
fn the_shipped_webhook_manifest_fails_closed_and_admits_only_the_api_server() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/webhook.yaml"),
    )
    .unwrap();
    let docs: Vec<Value> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .filter(|d: &Value| !d.is_null())
        .collect();
    let one = |kind: &str| {
        let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "one {kind}");
        found[0].clone()
    };
    // The configuration is the one the library renders (caBundle injected by cert-manager).
    let mut shipped = one("MutatingWebhookConfiguration");
    let mut rendered = webhook::webhook_configuration(
        "fabricgate-preflight",
        &webhook::Endpoint::Service {
            namespace: "fabricgate".into(),
            name: "fabricgate-webhook".into(),
            port: 443,
        },
        b"",
        "fabricgate.io/",
        &["kube-system", "fabricgate"],
    );
    for doc in [&mut shipped, &mut rendered] {
        doc["metadata"] = json!({"name": doc["metadata"]["name"].clone()});
        for hook in doc["webhooks"].as_array_mut().unwrap() {
            hook["clientConfig"]
                .as_object_mut()
                .unwrap()
                .remove("caBundle");
        }
    }
    assert_eq!(shipped, rendered);
    for hook in shipped["webhooks"].as_array().unwrap() {
        assert_eq!(hook["failurePolicy"], "Fail", "{}", hook["name"]);
    }
    // Only the API server's address range may reach the webhook port.
    let policy = one("NetworkPolicy");
    assert_eq!(
        policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "webhook"
    );
    assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
    let ingress = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(ingress.len(), 1);
    assert_eq!(
        ingress[0]["ports"],
        json!([{"protocol": "TCP", "port": 8443}])
    );
    let from = ingress[0]["from"].as_array().unwrap();
    assert!(!from.is_empty());
    for peer in from {
        let cidr = peer["ipBlock"]["cidr"]
            .as_str()
            .expect("only ipBlock peers");
        assert!(
            cidr.contains('/') && cidr != "0.0.0.0/0" && cidr != "::/0",
            "{cidr}"
        );
    }
    // Its arguments are the binary's, and the port the policy opens is the one it serves.
    use clap::Parser;
    let deploy = one("Deployment");
    let container = &deploy["spec"]["template"]["spec"]["containers"][0];
    let mut argv = vec!["fabricgate".to_owned()];
    argv.extend(
        container["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned()),
    );
    argv.push("--preflight-image=img".into());
    let fabricgate::cli::Command::Webhook(args) =
        fabricgate::cli::Cli::try_parse_from(&argv).unwrap().command
    else {
        panic!("not the webhook subcommand: {argv:?}");
    };
    assert_eq!(args.listen.port(), 8443);
    assert_eq!(args.max_connections, 256);
    assert_eq!(container["ports"][0]["containerPort"], 8443);
}

#[test]
fn the_shipped_webhook_manifest_passes_yamllint_and_both_kubernetes_schemas() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let manifest = root.join("deploy/webhook.yaml");
    if let Some(yl) = super::common::require_tool("yamllint", "pip install yamllint") {
        let out = std::process::Command::new(yl)
            .args(["--strict", "-c"])
            .arg(root.join("deploy/yamllint.yaml"))
            .arg(&manifest)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "yamllint:\n{}",
            super::common::stdout_and_stderr(&out)
        );
    }
    let Some(kv) =
        super::common::require_tool("kubernetes-validate", "pip install kubernetes-validate")
    else {
        return;
    };
    let text = std::fs::read_to_string(&manifest).unwrap();
    let objects = text.matches("\napiVersion:").count();
    super::common::assert_valid_for_both_schemas(&kv, &manifest, objects);
}
