//! Kueue's own CRDs (`sigs.k8s.io/kueue`'s `config/components/crd/bases/`, from the Go module
//! cache) installed into the shared test apiserver, once per test binary. Used by the
//! admission-check tests (which play Kueue's part by writing Workload status) and by the
//! tests that run Kueue itself.
//!
//! ```ignore
//! let Some(cp) = control_plane() else { return };
//! let Some(kueue) = kueue_crds::install(cp) else { return };
//! ```

use super::controlplane::ControlPlane;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The Kueue release whose CRDs (and binaries, where built) the tests use.
pub const KUEUE_MODULE: &str = "sigs.k8s.io/kueue";
pub const KUEUE_VERSION: &str = "v0.19.2";

/// The module's source directory: `$FABRICGATE_KUEUE_DIR`, else `go mod download -json`
/// (from the module cache, or the proxy when it is not there yet).
pub fn module_dir() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("FABRICGATE_KUEUE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let out = Command::new("go")
        .args(["mod", "download", "-json"])
        .arg(format!("{KUEUE_MODULE}@{KUEUE_VERSION}"))
        // Outside any module: the download does not touch a go.mod.
        .current_dir(std::env::temp_dir())
        .output()
        .map_err(|e| format!("cannot run go ({e})"))?;
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "go mod download {KUEUE_MODULE}@{KUEUE_VERSION}: {e}: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    match info["Dir"].as_str() {
        Some(dir) if Path::new(dir).is_dir() => Ok(PathBuf::from(dir)),
        _ => Err(format!(
            "go mod download {KUEUE_MODULE}@{KUEUE_VERSION} gave no directory: {}",
            info["Error"].as_str().unwrap_or_default()
        )),
    }
}

/// The CRD files of the module (`config/components/crd/bases/*.yaml`), sorted.
pub fn crd_files(dir: &Path) -> Vec<PathBuf> {
    let bases = dir.join("config/components/crd/bases");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&bases)
        .map(|r| {
            r.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// Install Kueue's CRDs (server-side apply: the Workload CRD is too large for the
/// last-applied annotation) and wait until they are established. `None` (a `SKIP:`, or a
/// failure under CI) when the module is not available. Returns the module's directory.
pub fn install(cp: &ControlPlane) -> Option<&'static Path> {
    static DONE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let result = DONE.get_or_init(|| {
        let dir = module_dir()?;
        let files = crd_files(&dir);
        if files.is_empty() {
            return Err(format!("no CRDs under {}", dir.display()));
        }
        for f in &files {
            let path = f.to_string_lossy();
            cp.kubectl(&[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=test-kueue-crds",
                "-f",
                &path,
            ]);
        }
        for crd in [
            "workloads",
            "admissionchecks",
            "clusterqueues",
            "localqueues",
            "resourceflavors",
            "topologies",
        ] {
            wait_established(cp, &format!("{crd}.kueue.x-k8s.io"));
        }
        Ok(dir)
    });
    match result {
        Ok(dir) => Some(dir.as_path()),
        Err(e) => {
            super::require(
                false,
                &format!("Kueue's CRDs ({KUEUE_MODULE}@{KUEUE_VERSION}): {e}"),
                "the Go toolchain with the module in its cache (go mod download \
                 sigs.k8s.io/kueue@v0.19.2), or FABRICGATE_KUEUE_DIR",
            );
            None
        }
    }
}

/// deploy/admission-check.yaml applied as admin (server-side, so re-applying is harmless), and
/// its CRDs (FabricCheck, FabricCheckResult) established. Its Deployment stays inert: no
/// kubelet runs it on the test control plane.
///
/// Its ResourceQuota is left out: without kube-controller-manager's quota controller (not run
/// here) the apiserver refuses every create a quota covers ("status unknown for quota"), which
/// would fail every test's answers. `tests/cluster/admission_check.rs` applies it to a
/// namespace of its own, where it plays that controller.
pub fn apply_admission_check(cp: &ControlPlane) {
    let path = super::repo_root().join("deploy/admission-check.yaml");
    let manifest = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let manifest: Vec<&str> = manifest
        .split("\n---")
        .filter(|doc| !doc.contains("\nkind: ResourceQuota"))
        .collect();
    cp.apply(&manifest.join("\n---"));
    for crd in super::FABRICCHECK_CRDS {
        wait_established(cp, crd);
    }
}

/// A kubeconfig at `path` with a token of the admission check's shipped ServiceAccount (its
/// RBAC from deploy/admission-check.yaml).
pub fn admission_check_kubeconfig(cp: &ControlPlane, path: &Path) {
    let token = cp.kubectl(&[
        "-n",
        "fabricgate",
        "create",
        "token",
        "fabricgate-admission-check",
    ]);
    cp.write_kubeconfig(path, &cp.url, token.trim());
}

/// The operator leaf label the tests' TAS `Topology` uses as its first level.
pub const LEAF_LABEL: &str = "network.topology.nvidia.com/leaf";

/// Kueue's scheduler reserving quota for Workload `ns/name` (one pod set `main`, ClusterQueue
/// `gpu`) at `when` (RFC 3339), with admission check `check` `Pending` and a TAS assignment of
/// one pod per node of `nodes`: levels the leaf label and the hostname, all in leaf `leaf`, or
/// the hostname alone (`None`). Written as Kueue writes it: server-side apply on the status
/// subresource under its own field manager.
pub fn reserve<S: AsRef<str>>(
    cp: &ControlPlane,
    ns: &str,
    name: &str,
    check: &str,
    leaf: Option<&str>,
    nodes: &[S],
    when: &str,
) {
    reserve_retried(cp, ns, name, check, leaf, nodes, when, None);
}

/// [`reserve`], with the check's `retryCount` as Kueue keeps it: the number of times it moved
/// the check to `Retry` before (it resets the state to `Pending` and keeps the count).
#[allow(clippy::too_many_arguments)]
pub fn reserve_retried<S: AsRef<str>>(
    cp: &ControlPlane,
    ns: &str,
    name: &str,
    check: &str,
    leaf: Option<&str>,
    nodes: &[S],
    when: &str,
    retry_count: Option<u32>,
) {
    let roots: Vec<&str> = nodes.iter().map(AsRef::as_ref).collect();
    let hosts = json!({ "individual": { "roots": roots } });
    let (levels, values) = match leaf {
        Some(l) => (
            json!([LEAF_LABEL, "kubernetes.io/hostname"]),
            json!([{ "universal": l }, hosts]),
        ),
        None => (json!(["kubernetes.io/hostname"]), json!([hosts])),
    };
    let body = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": name, "namespace": ns },
        "status": {
            "conditions": [{ "type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
                "message": "Quota reserved in ClusterQueue gpu", "lastTransitionTime": when }],
            "admission": { "clusterQueue": "gpu", "podSetAssignments": [{
                "name": "main", "flavors": { "cpu": "gpu" }, "count": roots.len(),
                "resourceUsage": { "cpu": roots.len().to_string() },
                "topologyAssignment": { "levels": levels,
                    "slices": [{ "domainCount": roots.len(), "valuesPerLevel": values,
                        "podCounts": { "universal": 1 } }] } }] },
            "admissionChecks": [{ "name": check, "state": "Pending", "message": "",
                "lastTransitionTime": when }],
        },
    });
    let mut body = body;
    if let Some(n) = retry_count {
        body["status"]["admissionChecks"][0]["retryCount"] = json!(n);
    }
    let ar = kube::api::ApiResource::from_gvk_with_plural(
        &kube::core::GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "Workload"),
        "workloads",
    );
    let workloads: kube::Api<kube::api::DynamicObject> =
        kube::Api::namespaced_with(cp.admin(), ns, &ar);
    cp.block_on(workloads.patch_status(
        name,
        &kube::api::PatchParams::apply("kueue-admission").force(),
        &kube::api::Patch::Apply(&body),
    ))
    .unwrap_or_else(|e| panic!("reserve quota for {ns}/{name}: {e}"));
}

/// Wait until CRD `name` is `Established` (polled: `kubectl wait` fails on a CRD whose status
/// has no conditions yet).
pub fn wait_established(cp: &ControlPlane, name: &str) {
    let path = format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}");
    super::wait_until(
        &format!("CRD {name} established"),
        std::time::Duration::from_secs(60),
        || {
            cp.get_json(&path).is_some_and(|crd| {
                crd["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "Established" && c["status"] == "True")
            })
        },
    );
}

/// The `(state, message)` of the admission check `check` in a Workload's
/// `status.admissionChecks` (empty strings while it has no entry).
pub fn check_entry(workload: &serde_json::Value, check: &str) -> (String, String) {
    let entry = workload["status"]["admissionChecks"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == check);
    let field = |key: &str| {
        entry
            .and_then(|c| c[key].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    (field("state"), field("message"))
}
