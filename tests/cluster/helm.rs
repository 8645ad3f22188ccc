//! The Helm chart `charts/fabricgate` with Helm itself (built from the Go module proxy by
//! `.ci/helm.sh`) and the real apiserver: the chart's files are exactly what
//! `deploy/render.sh` renders from deploy/, its default output is the shipped manifests, every
//! part's output is the part's deploy/ source, everything it renders passes both schemas,
//! yamllint and a server-side dry run, its RBAC grants nothing the sources do not, a bad value
//! is refused naming the key, and `fabricgate cleanup` under the chart's RBAC and admission
//! policy removes exactly fabricgate's marks. Installing, upgrading and uninstalling on a
//! cluster with a kubelet is in tests/node/helm.rs.

use crate::common::controlplane::{ControlPlane, rbac_grants};
use crate::common::sysfs::FakeHca;
use crate::common::{TestNode, control_plane, repo_root, require, require_tool};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// Helm, as `.ci/helm.sh` installs it (`FABRICGATE_HELM` overrides).
pub fn helm() -> Option<PathBuf> {
    let path = std::env::var_os("FABRICGATE_HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/fabricgate-controlplane/bin/helm"));
    require(
        path.is_file(),
        &format!("no helm at {}", path.display()),
        "build it with .ci/helm.sh",
    )
    .then_some(path)
}

fn chart() -> PathBuf {
    repo_root().join("charts/fabricgate")
}

/// `helm template` of the chart with `--set`-style `sets` and a values file `values` (JSON);
/// (success, stdout, stderr).
fn template(helm: &PathBuf, values: &Value, extra: &[&str]) -> (bool, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("values.json");
    std::fs::write(&file, values.to_string()).unwrap();
    let out = Command::new(helm)
        .args(["template", "fabricgate"])
        .arg(chart())
        .args(["--namespace", "fabricgate", "-f"])
        .arg(&file)
        .args(extra)
        .env("HOME", dir.path())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn rendered(helm: &PathBuf, values: &Value) -> String {
    let (ok, out, err) = template(helm, values, &[]);
    assert!(ok, "helm template {values}: {err}");
    out
}

fn documents(text: &str) -> Vec<Value> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn file_documents(path: &str) -> Vec<Value> {
    documents(&std::fs::read_to_string(repo_root().join(path)).unwrap())
}

fn is_hook(d: &Value) -> bool {
    d["metadata"]["annotations"]["helm.sh/hook"].is_string()
}

/// Documents as a sorted list of their JSON texts (an order-free comparison).
fn sorted(docs: impl IntoIterator<Item = Value>) -> Vec<String> {
    let mut v: Vec<String> = docs.into_iter().map(|d| d.to_string()).collect();
    v.sort();
    v
}

/// What the chart renders besides its hooks.
fn release_documents(helm: &PathBuf, values: &Value) -> Vec<Value> {
    documents(&rendered(helm, values))
        .into_iter()
        .filter(|d| !is_hook(d))
        .collect()
}

/// `docs` without the requirements text, which runtimeTransport and peers add their keys to
/// (asserted in `chart_values_change_the_pool_requirements_image_and_knobs`).
fn without_requirements_text(docs: Vec<Value>) -> Vec<Value> {
    docs.into_iter()
        .map(|mut d| {
            if d["kind"] == "ConfigMap" && d["metadata"]["name"] == "fabricgate-requirements" {
                d["data"]["requirements.yaml"] = Value::Null;
            }
            d
        })
        .collect()
}

fn overlay(cp: &ControlPlane, name: &str) -> Vec<Value> {
    let dir = repo_root().join("deploy/overlays").join(name);
    documents(&cp.kubectl(&["kustomize", dir.to_str().unwrap()]))
        .into_iter()
        .filter(|d| d["kind"] != "Namespace")
        .collect()
}

const AGENT_OVERLAYS: [&str; 6] = [
    "shared-device",
    "privileged",
    "dra",
    "shared-device-runtime-transport",
    "privileged-runtime-transport",
    "dra-runtime-transport",
];

/// The values that select `overlay`.
fn overlay_values(overlay: &str) -> Value {
    let rt = overlay.ends_with("-runtime-transport");
    let base = overlay.trim_end_matches("-runtime-transport");
    json!({
        "agent": { "deviceAccess": if base == "shared-device" { "shared-device" } else { "privileged" } },
        "dra": { "enabled": base == "dra" },
        "runtimeTransport": { "enabled": rt },
        "guard": { "enabled": false },
        "cleanup": { "enabled": false },
    })
}

/// Every part enabled (DRA with the privileged access it needs), every metrics object on.
fn all_parts() -> Value {
    json!({
        "agent": { "deviceAccess": "privileged" },
        "guard": { "enabled": true },
        "admissionCheck": { "enabled": true },
        "webhook": { "enabled": true, "caBundle": "Y2E=" },
        "runtimeTransport": { "enabled": true },
        "dra": { "enabled": true },
        "peers": { "enabled": true },
        "metrics": {
            "podMonitor": { "enabled": true },
            "serviceMonitor": { "enabled": true },
            "prometheusRule": { "enabled": true },
            "grafanaDashboard": { "enabled": true },
        },
        "cleanup": { "enabled": true },
    })
}

/// deploy/render.sh's outputs are what it renders now: every agent overlay, the copies and
/// the CRDs (`helm install` installs what is in the chart, so a stale copy would ship).
#[test]
fn chart_files_are_what_deploy_render_sh_renders() {
    let Some(cp) = control_plane() else { return };
    for name in AGENT_OVERLAYS {
        let dir = repo_root().join("deploy/overlays").join(name);
        let want = format!(
            "# GENERATED by deploy/render.sh from deploy/overlays/{name}: edit the sources.\n{}",
            cp.kubectl(&["kustomize", dir.to_str().unwrap()])
        );
        let have =
            std::fs::read_to_string(chart().join(format!("files/agent/{name}.yaml"))).unwrap();
        assert!(
            have == want,
            "charts/fabricgate/files/agent/{name}.yaml is not deploy/overlays/{name} rendered: run deploy/render.sh"
        );
    }
    for (source, copy) in [
        ("deploy/guard.yaml", "guard.yaml"),
        ("deploy/admission-check.yaml", "admission-check.yaml"),
        ("deploy/webhook.yaml", "webhook.yaml"),
        ("deploy/peers-service.yaml", "peers-service.yaml"),
        (
            "deploy/prometheus-rule-operator.yaml",
            "prometheus-rule-operator.yaml",
        ),
        ("deploy/grafana/fabricgate.json", "fabricgate.json"),
    ] {
        let want = std::fs::read_to_string(repo_root().join(source)).unwrap();
        let have = std::fs::read_to_string(chart().join("files").join(copy)).unwrap();
        assert!(
            have == want,
            "charts/fabricgate/files/{copy} is not {source}: run deploy/render.sh"
        );
    }
    let crds: Vec<Value> = file_documents("deploy/admission-check.yaml")
        .into_iter()
        .filter(|d| d["kind"] == "CustomResourceDefinition")
        .collect();
    assert_eq!(crds.len(), 2);
    assert_eq!(
        file_documents("charts/fabricgate/crds/fabricgate.io.yaml"),
        crds,
        "charts/fabricgate/crds/ is not the CRDs of deploy/admission-check.yaml: run deploy/render.sh"
    );
}

/// The default values install what `kubectl apply -f daemonset.yaml -f deploy/guard.yaml`
/// does, object for object (the Namespace aside: Helm installs into it), plus the cleanup
/// hooks; and each part, enabled, adds exactly its deploy/ source.
#[test]
fn chart_renders_the_shipped_manifests_for_the_defaults_and_each_part() {
    let Some(cp) = control_plane() else { return };
    let Some(helm) = helm() else { return };
    let shipped: Vec<Value> = file_documents("daemonset.yaml")
        .into_iter()
        .filter(|d| d["kind"] != "Namespace")
        .chain(file_documents("deploy/guard.yaml"))
        .collect();
    assert_eq!(
        sorted(release_documents(&helm, &json!({}))),
        sorted(shipped.clone()),
        "helm template (default values) is not daemonset.yaml + deploy/guard.yaml"
    );
    // Each agent overlay, chosen by agent.deviceAccess, dra and runtimeTransport.
    for name in AGENT_OVERLAYS {
        assert_eq!(
            sorted(without_requirements_text(release_documents(
                &helm,
                &overlay_values(name)
            ))),
            sorted(without_requirements_text(overlay(cp, name))),
            "the chart with {} is not deploy/overlays/{name}",
            overlay_values(name)
        );
    }
    // Each other part adds its source's documents to the defaults' (CRDs: in crds/).
    for (part, source) in [
        ("admissionCheck", "deploy/admission-check.yaml"),
        ("webhook", "deploy/webhook.yaml"),
        ("peers", "deploy/peers-service.yaml"),
    ] {
        let docs = release_documents(&helm, &json!({ part: { "enabled": true } }));
        let mut want = shipped.clone();
        want.extend(
            file_documents(source)
                .into_iter()
                .filter(|d| d["kind"] != "CustomResourceDefinition"),
        );
        let (docs, want) = (
            without_requirements_text(docs),
            without_requirements_text(want),
        );
        assert_eq!(sorted(docs), sorted(want), "{part}.enabled is not {source}");
    }
    // Metrics objects: none by default, each alone when switched on.
    for (key, kinds) in [
        ("podMonitor", vec!["PodMonitor"]),
        ("serviceMonitor", vec!["Service", "ServiceMonitor"]),
        ("prometheusRule", vec!["PrometheusRule"]),
        ("grafanaDashboard", vec!["ConfigMap"]),
    ] {
        let docs = release_documents(&helm, &json!({ "metrics": { key: { "enabled": true } } }));
        let added: Vec<String> = docs
            .iter()
            .filter(|d| !shipped.contains(d))
            .map(|d| d["kind"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(added, kinds, "metrics.{key}.enabled");
    }
    let dashboard = release_documents(
        &helm,
        &json!({ "metrics": { "grafanaDashboard": { "enabled": true } } }),
    )
    .into_iter()
    .find(|d| d["metadata"]["name"] == "fabricgate-dashboard")
    .unwrap();
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value =
        serde_json::from_str(dashboard["data"]["fabricgate.json"].as_str().unwrap()).unwrap();
    assert_eq!(
        json,
        serde_json::from_str::<Value>(
            &std::fs::read_to_string(repo_root().join("deploy/grafana/fabricgate.json")).unwrap()
        )
        .unwrap()
    );
}

/// The values that change the manifests change what they name, and only that: the pool in
/// one value (nodeSelector and the key pool-selector), the requirements, the image, the
/// interval, resources merged, tolerations added.
#[test]
fn chart_values_change_the_pool_requirements_image_and_knobs() {
    if control_plane().is_none() {
        return;
    }
    let Some(helm) = helm() else { return };
    let values = json!({
        "image": { "repository": "registry.test/fg", "tag": "v9", "pullPolicy": "Always" },
        "poolSelector": "pool=a100,zone=z1",
        "requirements": { "rdma": { "min_active_ports": 4 }, "node": { "label_prefix": "fg.test/" } },
        "agent": {
            "interval": "30s",
            "resources": { "limits": { "memory": "256Mi" } },
            "tolerations": [{ "key": "dedicated", "operator": "Exists" }],
            "priorityClassName": "fabric-critical",
            "sharedDeviceResource": "rdma/ib_shared",
        },
        "guard": { "staleAfter": "2m" },
        "webhook": { "enabled": true },
        "runtimeTransport": { "enabled": true },
    });
    let docs = documents(&rendered(&helm, &values));
    let find = |kind: &str, name: &str| {
        docs.iter()
            .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}"))
            .clone()
    };
    let cm = find("ConfigMap", "fabricgate-requirements");
    assert_eq!(cm["data"]["pool-selector"], "pool=a100,zone=z1");
    let req: fabricgate::config::Config =
        fabricgate::config::Config::parse(cm["data"]["requirements.yaml"].as_str().unwrap())
            .expect("the binary accepts the rendered requirements");
    assert_eq!(req.rdma.min_active_ports, 4);
    let transport: fabricgate::transport::settings::RuntimeSettings =
        fabricgate::config::FeatureSection::of(&req)
            .expect("the binary accepts the rendered runtime section");
    assert!(
        transport.enabled,
        "runtimeTransport turns runtime.enabled on"
    );
    let ds = find("DaemonSet", "fabricgate");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["nodeSelector"], json!({ "pool": "a100", "zone": "z1" }));
    assert_eq!(pod["priorityClassName"], "fabric-critical");
    assert_eq!(pod["hostPID"], true);
    let c = &pod["containers"][0];
    assert_eq!(c["image"], "registry.test/fg:v9");
    assert_eq!(c["imagePullPolicy"], "Always");
    assert!(
        c["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--interval=30s"))
    );
    assert_eq!(c["resources"]["limits"]["memory"], "256Mi");
    assert_eq!(c["resources"]["requests"]["memory"], "32Mi", "merged");
    assert_eq!(c["resources"]["limits"]["rdma/ib_shared"], "1");
    assert!(c["resources"]["limits"]["rdma/hca_shared_devices_a"].is_null());
    let tolerations = pod["tolerations"].as_array().unwrap();
    assert!(tolerations.contains(&json!({ "key": "dedicated", "operator": "Exists" })));
    assert!(
        tolerations.contains(&json!({ "key": "fabricgate.io/unvalidated", "operator": "Exists" })),
        "the shipped tolerations stay"
    );
    let guard = find("Deployment", "fabricgate-guard");
    let g = &guard["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(g["image"], "registry.test/fg:v9");
    assert!(
        g["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--stale-after=2m"))
    );
    let webhook = find("Deployment", "fabricgate-webhook");
    let env = &webhook["spec"]["template"]["spec"]["containers"][0]["env"];
    assert!(
        env.as_array()
            .unwrap()
            .contains(&json!({ "name": "FABRICGATE_IMAGE", "value": "registry.test/fg:v9" })),
        "the preflight init container's image is the chart's: {env}"
    );
    let job = find("Job", "fabricgate-cleanup");
    let args = &job["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(
        args.as_array()
            .unwrap()
            .contains(&json!("--label-prefix=fg.test/")),
        "{args}"
    );
}

/// `helm lint --strict` passes for the defaults and for every part enabled.
#[test]
fn chart_passes_helm_lint_strict() {
    let Some(helm) = helm() else { return };
    let dir = tempfile::tempdir().unwrap();
    for (name, values) in [("defaults", json!({})), ("all-parts", all_parts())] {
        let file = dir.path().join(format!("{name}.json"));
        std::fs::write(&file, values.to_string()).unwrap();
        let out = Command::new(&helm)
            .args(["lint", "--strict", "--namespace", "fabricgate"])
            .arg(chart())
            .arg("-f")
            .arg(&file)
            .env("HOME", dir.path())
            .output()
            .unwrap();
        let text = crate::common::stdout_and_stderr(&out);
        assert!(out.status.success(), "helm lint --strict ({name}):\n{text}");
        assert!(
            text.contains("1 chart(s) linted, 0 chart(s) failed"),
            "{text}"
        );
    }
    // ...and lint does fail a broken chart, so the pass above means something.
    let broken = dir.path().join("broken");
    crate::common::copy_tree(&chart(), &broken);
    std::fs::write(
        broken.join("templates/broken.yaml"),
        "kind: ConfigMap\nmetadata: {{ .Values.nope.missing }}\n",
    )
    .unwrap();
    let out = Command::new(&helm)
        .args(["lint", "--strict", "--namespace", "fabricgate"])
        .arg(&broken)
        .env("HOME", dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success(), "a broken chart passed helm lint");
}

/// Everything the chart renders with every part on (hooks included): both Kubernetes schemas
/// for Kubernetes' own kinds, yamllint, and the real apiserver's server-side dry run.
#[test]
fn chart_with_every_part_passes_both_schemas_yamllint_and_a_server_side_dry_run() {
    let Some(cp) = control_plane() else { return };
    let Some(helm) = helm() else { return };
    let text = rendered(&helm, &all_parts());
    let dir = tempfile::tempdir().unwrap();
    let all = dir.path().join("all-parts.yaml");
    // `helm template` prints each hook with a newline after its own last one: a blank line
    // at the end of its output, Helm's, not the chart's.
    std::fs::write(&all, format!("{}\n", text.trim_end())).unwrap();
    if let Some(yl) = require_tool("yamllint", "pip install yamllint; .ci/deploy.sh does it") {
        let out = Command::new(yl)
            .args(["--strict", "-c"])
            .arg(repo_root().join("deploy/yamllint-rendered.yaml"))
            .arg(&all)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "yamllint:\n{}",
            crate::common::stdout_and_stderr(&out)
        );
    }
    // Other projects' kinds (Kueue's AdmissionCheck, the Prometheus Operator's) are not in
    // Kubernetes' schemas nor served by this apiserver.
    let builtin: Vec<Value> = documents(&text)
        .into_iter()
        .filter(|d| {
            ![
                "AdmissionCheck",
                "PodMonitor",
                "ServiceMonitor",
                "PrometheusRule",
            ]
            .contains(&d["kind"].as_str().unwrap())
        })
        .collect();
    let path = dir.path().join("builtin.yaml");
    let mut body = String::new();
    for d in &builtin {
        body.push_str("---\n");
        body.push_str(&serde_norway::to_string(d).unwrap());
    }
    std::fs::write(&path, &body).unwrap();
    if let Some(kv) = require_tool(
        "kubernetes-validate",
        "pip install kubernetes-validate; .ci/deploy.sh does it",
    ) {
        crate::common::assert_valid_for_both_schemas(&kv, &path, builtin.len());
    }
    cp.install_agent_rbac();
    // The CRDs Helm installs first (crds/), then the release.
    let crds = std::fs::read_to_string(chart().join("crds/fabricgate.io.yaml")).unwrap();
    cp.apply(&crds);
    cp.assert_dry_run_accepts(&path, builtin.len(), "the chart with every part");
}

/// Least privilege, part by part: every grant the chart renders for a service account is one
/// its deploy/ source grants (the audits of tests/repo/deploy_manifest.rs hold for them), and
/// the cleanup's are exactly what `fabricgate cleanup` uses. Every container runs without
/// privilege escalation, read-only, all capabilities dropped, unless it is the privileged
/// agent of agent.deviceAccess privileged.
#[test]
fn chart_rbac_and_containers_are_least_privilege_with_every_part() {
    if control_plane().is_none() {
        return;
    }
    let Some(helm) = helm() else { return };
    let text = rendered(&helm, &all_parts());
    let mut sources = String::new();
    for o in [
        "deploy/base/rbac.yaml",
        "deploy/base/breaker-ledger.yaml",
        "deploy/overlays/runtime-transport/rbac.yaml",
        "deploy/overlays/dra/claims-rbac.yaml",
    ] {
        sources.push_str(&std::fs::read_to_string(repo_root().join(o)).unwrap());
        sources.push_str("\n---\n");
    }
    for f in [
        "deploy/guard.yaml",
        "deploy/admission-check.yaml",
        "deploy/webhook.yaml",
    ] {
        sources.push_str(&std::fs::read_to_string(repo_root().join(f)).unwrap());
        sources.push_str("\n---\n");
    }
    let is_role = |d: &Value| d["kind"] == "ClusterRole" || d["kind"] == "Role";
    let not_cleanup = |d: &Value| is_role(d) && d["metadata"]["name"] != "fabricgate-cleanup";
    let chart_grants = rbac_grants(&text, not_cleanup);
    let source_grants = rbac_grants(&sources, is_role);
    let extra: BTreeSet<_> = chart_grants.difference(&source_grants).collect();
    assert!(
        extra.is_empty(),
        "the chart grants more than deploy/: {extra:?}"
    );
    let cleanup = rbac_grants(&text, |d| {
        is_role(d) && d["metadata"]["name"] == "fabricgate-cleanup"
    });
    let g = |group: &str, resource: &str, verb: &str| {
        (group.to_owned(), resource.to_owned(), verb.to_owned())
    };
    assert_eq!(
        cleanup,
        BTreeSet::from([
            g("", "nodes", "get"),
            g("", "nodes", "list"),
            g("", "nodes", "patch"),
            g("", "nodes/status", "get"),
            g("", "nodes/status", "patch"),
            g("", "pods", "list"),
            g("resource.k8s.io", "devicetaintrules", "list"),
            g("resource.k8s.io", "devicetaintrules", "delete"),
        ])
    );
    for d in documents(&text) {
        let pod = match d["kind"].as_str().unwrap() {
            "DaemonSet" | "Deployment" | "Job" => d["spec"]["template"]["spec"].clone(),
            _ => continue,
        };
        for c in pod["containers"].as_array().unwrap() {
            let sc = &c["securityContext"];
            let what = format!(
                "{} {} container {}",
                d["kind"], d["metadata"]["name"], c["name"]
            );
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
            if d["kind"] == "DaemonSet" {
                // agent.deviceAccess privileged: confined by fabricgate-privileged-agent-only.
                assert_eq!(sc["privileged"], true, "{what}");
                continue;
            }
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{what}");
            assert!(sc["capabilities"]["add"].is_null(), "{what}");
            let non_root =
                sc["runAsNonRoot"] == true || pod["securityContext"]["runAsNonRoot"] == true;
            assert!(non_root, "{what}");
        }
    }
    assert!(
        documents(&text)
            .iter()
            .any(|d| d["kind"] == "ValidatingAdmissionPolicy"
                && d["metadata"]["name"] == "fabricgate-privileged-agent-only")
    );
}

/// A wrong value fails at `helm install`, before anything reaches the cluster, with a
/// message naming the key: a negative interval, an unknown part, a malformed pool selector,
/// DRA without privileged device access, an unknown device access mode.
#[test]
fn helm_install_refuses_bad_values_naming_the_key() {
    let Some(cp) = control_plane() else { return };
    let Some(helm) = helm() else { return };
    let home = tempfile::tempdir().unwrap();
    for (set, key) in [
        ("agent.interval=-5s", "/agent/interval"),
        ("guard.staleAfter=-1m", "/guard/staleAfter"),
        (
            "gpuOperator.enabled=true",
            "additional properties 'gpuOperator' not allowed",
        ),
        ("poolSelector=nvidia.com/gpu.present", "/poolSelector"),
        ("poolSelector=a=b=c", "/poolSelector"),
        ("dra.enabled=true", "/agent/deviceAccess"),
        ("agent.deviceAccess=root", "/agent/deviceAccess"),
    ] {
        let out = Command::new(&helm)
            .args(["install", "fabricgate"])
            .arg(chart())
            .args(["--namespace", "fabricgate", "--kubeconfig"])
            .arg(&cp.admin_kubeconfig)
            .args(["--set", set])
            .env("HOME", home.path())
            .output()
            .unwrap();
        let text = crate::common::stdout_and_stderr(&out);
        assert!(!out.status.success(), "--set {set} was installed:\n{text}");
        assert!(
            text.contains("values don't meet the specifications of the schema")
                && text.contains(key),
            "--set {set}: the refusal does not name {key}:\n{text}"
        );
    }
    // Nothing was installed: Helm keeps a release in a Secret of the namespace.
    let secrets = cp.kubectl(&[
        "get",
        "secrets",
        "-n",
        "fabricgate",
        "-l",
        "owner=helm",
        "-o",
        "name",
    ]);
    assert_eq!(secrets.trim(), "", "a release was recorded");
    // Another namespace is refused too: the policies and service accounts name fabricgate.
    let (ok, _, err) = template(&helm, &json!({}), &["--namespace", "default"]);
    assert!(
        !ok && err.contains("install fabricgate into the namespace fabricgate"),
        "{err}"
    );
    // The same values, made right, pass the schema.
    let (ok, out, err) = template(
        &helm,
        &json!({ "agent": { "interval": "15s" }, "poolSelector": "pool=gpu" }),
        &[],
    );
    assert!(ok, "{err}");
    assert!(out.contains("--interval=15s"), "{out}");
}

/// `fabricgate cleanup` (the chart's post-delete hook) as the chart's fabricgate-cleanup
/// service account, under its RBAC and admission policy applied to the real apiserver:
/// exactly fabricgate's labels, taint and conditions go, and the Node's own DeviceTaintRules;
/// anything else stays, and the policy refuses that account any other change.
#[test]
fn cleanup_hook_removes_only_fabricgates_marks_under_its_policy() {
    let Some(cp) = control_plane() else { return };
    let Some(helm) = helm() else { return };
    let node = TestNode::seeded(cp, "helm-cleanup-a");
    let hca = FakeHca::new(false);
    let agent = node.start_agent(&hca, &["--interval", "100ms"]);
    agent.wait("the agent's marks", Duration::from_secs(30), || {
        node.condition("LustreReady").is_some() && node.label("fabricgate.io/ready").is_some()
    });
    let (status, _) = agent.stop();
    assert!(status.success());
    // The hooks: service account, RBAC, the policy.
    let (ok, out, err) = template(
        &helm,
        &json!({}),
        &["--show-only", "templates/cleanup.yaml"],
    );
    assert!(ok, "{err}");
    let hooks: Vec<Value> = documents(&out)
        .into_iter()
        .filter(|d| d["kind"] != "Job")
        .collect();
    assert_eq!(hooks.len(), 7, "{out}");
    let mut body = String::new();
    for d in &hooks {
        body.push_str("---\n");
        body.push_str(&serde_norway::to_string(d).unwrap());
    }
    cp.install_agent_rbac();
    cp.apply(&body);
    let rule = |name: &str, node_label: Option<&str>| {
        let mut r = json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule",
            "metadata": { "name": name },
            "spec": {
                "deviceSelector": { "driver": "dra.net", "pool": name, "device": "mlx5-0" },
                "taint": { "key": "fabricgate.io/unvalidated", "effect": "NoSchedule" },
            },
        });
        if let Some(n) = node_label {
            r["metadata"]["labels"] = json!({ "fabricgate.io/node": n });
        }
        cp.apply(&r.to_string());
    };
    rule("fabricgate-helm-cleanup-a-mlx5-0", Some(&node.name));
    rule(
        "fabricgate-helm-cleanup-other-mlx5-0",
        Some("helm-cleanup-other"),
    );
    rule("someone-elses-rule", None);

    let token = cp
        .kubectl(&["create", "token", "fabricgate-cleanup", "-n", "fabricgate"])
        .trim()
        .to_owned();
    let kubeconfig = cp.path("cleanup.kubeconfig");
    cp.write_kubeconfig(&kubeconfig, &cp.url, &token);
    // The policy is loaded asynchronously: until it denies the cleanup's write of another
    // label, nothing below would prove it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let refused = loop {
        let (ok, _, err) =
            cp.kubectl_as(&kubeconfig, &["label", "node", &node.name, "team-"], None);
        if ok {
            // Not loaded yet: put the label back and try again.
            cp.kubectl(&["label", "node", &node.name, "team=ml"]);
        } else if err.contains("fabricgate-cleanup") {
            break err;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the policy never denied the cleanup's write of label team: {err}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(
        refused.contains("may only remove labels and annotations under its prefix"),
        "{refused}"
    );
    let (ok, _, err) = cp.kubectl_as(
        &kubeconfig,
        &["taint", "node", &node.name, "nvidia.com/gpu-"],
        None,
    );
    assert!(
        !ok && err.contains("may only remove its own taint"),
        "{err}"
    );
    let (ok, _, err) = cp.kubectl_as(
        &kubeconfig,
        &["delete", "devicetaintrule", "someone-elses-rule"],
        None,
    );
    assert!(!ok && err.contains("fabricgate-cleanup"), "{err}");

    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["cleanup", &node.name])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    let text = crate::common::stdout_and_stderr(&out);
    assert!(out.status.success(), "fabricgate cleanup:\n{text}");
    assert!(
        text.contains(&format!("Node {}: removed label ", node.name))
            && text.contains("label fabricgate.io/ready")
            && text.contains("taint fabricgate.io/unvalidated")
            && text.contains("condition FabricReady")
            && text.contains("DeviceTaintRule fabricgate-helm-cleanup-a-mlx5-0: deleted")
            && text.contains("fabricgate cleanup: 1 of 1 Nodes had fabricgate marks"),
        "{text}"
    );
    let after = crate::cleanup::assert_only_others_marks_left(&node);
    let rules = cp.kubectl(&["get", "devicetaintrules", "-o", "name"]);
    assert!(
        !rules.contains("fabricgate-helm-cleanup-a-mlx5-0"),
        "{rules}"
    );
    assert!(
        rules.contains("fabricgate-helm-cleanup-other-mlx5-0"),
        "another Node's rule: {rules}"
    );
    assert!(rules.contains("someone-elses-rule"), "{rules}");
    // A second run finds nothing and writes nothing.
    let rv = after["metadata"]["resourceVersion"].clone();
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["cleanup", &node.name])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    let text = crate::common::stdout_and_stderr(&out);
    assert!(
        out.status.success() && text.contains("0 of 1 Nodes"),
        "{text}"
    );
    assert_eq!(node.json()["metadata"]["resourceVersion"], rv);
    for name in ["fabricgate-helm-cleanup-other-mlx5-0", "someone-elses-rule"] {
        cp.kubectl(&["delete", "devicetaintrule", name, "--ignore-not-found"]);
    }
}
