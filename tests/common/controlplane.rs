//! A real Kubernetes control plane for the tests: etcd, kube-apiserver and (on demand)
//! kube-scheduler, all from the `controlplane` multi-call binary that `.ci/controlplane.sh`
//! builds from Kubernetes' own Go modules (`tests/controlplane/`).
//!
//! One control plane per test binary ([`ControlPlane::shared`]), shared by its tests; each
//! test uses its own Node names. The apiserver runs with RBAC, ServiceAccount tokens signed by
//! a per-run key, an audit log of every request (user, verb, resource, name, code), and serving
//! certificates from a per-run CA that also names 10.0.3.2 (the host as a qemu guest sees it).
//! Children run in their own process group and are told to exit with their parent
//! (`CONTROLPLANE_EXIT_WITH_PARENT`), so a test binary that ends or is killed leaves nothing.

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

/// Where `.ci/controlplane.sh` installs the binary.
pub const DEFAULT_BINARY: &str = "/opt/fabricgate-controlplane/bin/controlplane";
/// Kubernetes 1.37's native gang scheduling: PodGroups (apiserver and scheduler) and their
/// topology constraints (scheduler).
pub const GANG_FEATURE_GATES: &str = "GenericWorkload=true,TopologyAwareWorkloadScheduling=true";

pub struct ControlPlane {
    dir: PathBuf,
    binary: PathBuf,
    /// `https://127.0.0.1:PORT`
    pub url: String,
    pub port: u16,
    pub admin_token: String,
    /// A second `system:masters` user, `fabricgate-fleet`, so a fleet of in-process agents is
    /// told apart from the tests' own admin reads in the audit log.
    pub fleet_token: String,
    pub ca_file: PathBuf,
    pub admin_kubeconfig: PathBuf,
    pub audit_log: PathBuf,
    children: Mutex<Vec<Child>>,
    scheduler: Mutex<Option<Child>>,
    admin_client: OnceLock<kube::Client>,
    apiserver_pid: std::sync::atomic::AtomicU32,
}

/// One line of the audit log, as much of it as the tests read.
#[derive(Debug, Clone)]
pub struct AuditEvent {
    pub user: String,
    pub verb: String,
    pub resource: String,
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    pub api_group: String,
    pub code: u16,
    /// `stageTimestamp`, RFC 3339 with microseconds.
    pub time: String,
    pub user_agent: String,
    pub request_uri: String,
    /// The node-name claim of the caller's token (`user.extra`), empty for other users.
    pub claim_node: String,
}

impl AuditEvent {
    /// `nodes`, `nodes/status`, `events.events.k8s.io`, ...
    pub fn resource_path(&self) -> String {
        let mut r = self.resource.clone();
        if !self.subresource.is_empty() {
            r = format!("{r}/{}", self.subresource);
        }
        if !self.api_group.is_empty() {
            r = format!("{r}.{}", self.api_group);
        }
        r
    }

    /// A request that writes (a server-side dry run writes nothing).
    pub fn is_write(&self) -> bool {
        matches!(
            self.verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        ) && !self.request_uri.contains("dryRun=All")
    }

    /// (apiGroup, resource[/subresource], verb): what RBAC had to grant for this request.
    pub fn grant(&self) -> Grant {
        let resource = if self.subresource.is_empty() {
            self.resource.clone()
        } else {
            format!("{}/{}", self.resource, self.subresource)
        };
        (self.api_group.clone(), resource, self.verb.clone())
    }
}

/// (apiGroup, resource[/subresource], verb).
pub type Grant = (String, String, String);

/// Every grant of the RBAC rules in the manifest documents `docs` that `pick` selects (a
/// ClusterRole, a Role).
pub fn rbac_grants(docs: &str, pick: impl Fn(&Value) -> bool) -> std::collections::BTreeSet<Grant> {
    use serde::Deserialize;
    let mut out = std::collections::BTreeSet::new();
    for doc in serde_norway::Deserializer::from_str(docs) {
        let v = Value::deserialize(doc).expect("manifest YAML");
        if !pick(&v) {
            continue;
        }
        let strings = |x: &Value| -> Vec<String> {
            x.as_array()
                .expect("a list")
                .iter()
                .map(|s| s.as_str().expect("a string").to_owned())
                .collect()
        };
        for rule in v["rules"].as_array().expect("rules") {
            for g in strings(&rule["apiGroups"]) {
                for r in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        out.insert((g.clone(), r.clone(), verb));
                    }
                }
            }
        }
    }
    out
}

static SHARED: OnceLock<Option<ControlPlane>> = OnceLock::new();

/// The agent's RBAC on the shared control plane is the base's (deploy/base/rbac.yaml) except
/// while a test that widens it (the runtime-transport component's cluster-wide Events) holds
/// this exclusively; tests that assert the base's exact grants hold it shared.
static AGENT_RBAC: RwLock<()> = RwLock::new(());

/// Hold while asserting the agent's base grants.
pub fn base_agent_rbac() -> RwLockReadGuard<'static, ()> {
    AGENT_RBAC
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Hold while the agent's RBAC is widened; undo the widening before dropping it.
pub fn widened_agent_rbac() -> RwLockWriteGuard<'static, ()> {
    AGENT_RBAC
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The runtime-transport component's RBAC (deploy/overlays/runtime-transport/rbac.yaml: pods,
/// pod status, Events in every namespace, ResourceClaims) while a test runs, holding
/// [`widened_agent_rbac`]; its ClusterRoleBinding taken away again however the test ends:
/// other tests assert the base's grants.
pub struct WidenedRbac {
    cp: &'static ControlPlane,
    binding: &'static str,
    _lock: RwLockWriteGuard<'static, ()>,
}

impl WidenedRbac {
    pub fn apply(cp: &'static ControlPlane) -> Self {
        Self::apply_file(
            cp,
            "deploy/overlays/runtime-transport/rbac.yaml",
            "fabricgate-agent-pods",
        )
    }

    /// The DRA overlay's own grants (deploy/overlays/dra/claims-rbac.yaml: this node's pods,
    /// their ResourceClaims), without runtime transport's.
    pub fn apply_dra_claims(cp: &'static ControlPlane) -> Self {
        Self::apply_file(
            cp,
            "deploy/overlays/dra/claims-rbac.yaml",
            "fabricgate-agent-dra-claims",
        )
    }

    fn apply_file(cp: &'static ControlPlane, file: &str, binding: &'static str) -> Self {
        let lock = widened_agent_rbac();
        let rbac = crate::common::repo_root().join(file);
        cp.apply(&std::fs::read_to_string(&rbac).unwrap_or_else(|e| panic!("read {file}: {e}")));
        Self {
            cp,
            binding,
            _lock: lock,
        }
    }
}

impl Drop for WidenedRbac {
    fn drop(&mut self) {
        let _ = self.cp.kubectl_as(
            &self.cp.admin_kubeconfig,
            &[
                "delete",
                "clusterrolebinding",
                self.binding,
                "--ignore-not-found",
                "--wait",
            ],
            None,
        );
    }
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

fn run_ok(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    let mut f = std::fs::File::open("/dev/urandom").expect("/dev/urandom");
    std::io::Read::read_exact(&mut f, &mut buf).expect("read /dev/urandom");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

impl ControlPlane {
    /// The control plane of this test binary, started on first use. `None` (after a printed
    /// `SKIP:`) when the binary is not built and this is not CI; under `CI=true` a missing
    /// binary fails the test.
    pub fn shared() -> Option<&'static ControlPlane> {
        SHARED
            .get_or_init(|| {
                let binary = std::env::var_os("FABRICGATE_CONTROLPLANE")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_BINARY));
                if !super::require(
                    binary.is_file(),
                    &format!("no control plane binary at {}", binary.display()),
                    "build it with .ci/controlplane.sh",
                ) {
                    return None;
                }
                Some(ControlPlane::start(&binary))
            })
            .as_ref()
    }

    fn start(binary: &Path) -> ControlPlane {
        let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("controlplane");
        std::fs::create_dir_all(&base).expect("mkdir controlplane base");
        // Runs of earlier test binaries whose process is gone.
        for entry in std::fs::read_dir(&base).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("run-")
                && !Path::new(&format!("/proc/{pid}")).exists()
            {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let dir = base.join(format!("run-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir run dir");
        make_pki(&dir);

        let admin_token = random_hex(16);
        let fleet_token = random_hex(16);
        std::fs::write(
            dir.join("tokens.csv"),
            format!(
                "{admin_token},admin,admin-uid,system:masters\n\
                 {fleet_token},fabricgate-fleet,fleet-uid,system:masters\n"
            ),
        )
        .expect("tokens.csv");
        std::fs::write(
            dir.join("audit-policy.yaml"),
            "apiVersion: audit.k8s.io/v1\nkind: Policy\n\
             omitStages: [RequestReceived, ResponseStarted]\n\
             rules:\n  - level: Metadata\n",
        )
        .expect("audit policy");

        let mut children = Vec::new();
        let etcd_client = free_port();
        let etcd_peer = free_port();
        let etcd = spawn(
            binary,
            &dir,
            "etcd",
            &[
                "--name=default".into(),
                format!("--data-dir={}", dir.join("etcd").display()),
                format!("--listen-client-urls=http://127.0.0.1:{etcd_client}"),
                format!("--advertise-client-urls=http://127.0.0.1:{etcd_client}"),
                format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
                format!("--initial-cluster=default=http://127.0.0.1:{etcd_peer}"),
                "--unsafe-no-fsync".into(),
                "--log-level=warn".into(),
            ],
        );
        children.push(etcd);

        let audit_log = dir.join("audit.log");
        let ca_file = dir.join("ca.crt");
        // The apiserver's port cannot be 0: pick one, retry on a clash.
        let mut last_err = String::new();
        for _attempt in 0..5 {
            let port = free_port();
            let mut apiserver = spawn(
                binary,
                &dir,
                "apiserver",
                &[
                    format!("--etcd-servers=http://127.0.0.1:{etcd_client}"),
                    "--bind-address=127.0.0.1".into(),
                    "--advertise-address=127.0.0.1".into(),
                    format!("--secure-port={port}"),
                    format!("--cert-dir={}", dir.join("certs").display()),
                    format!("--tls-cert-file={}", dir.join("apiserver.crt").display()),
                    format!(
                        "--tls-private-key-file={}",
                        dir.join("apiserver.key").display()
                    ),
                    format!("--client-ca-file={}", ca_file.display()),
                    "--service-cluster-ip-range=10.0.0.0/24".into(),
                    "--authorization-mode=RBAC".into(),
                    format!("--token-auth-file={}", dir.join("tokens.csv").display()),
                    "--service-account-issuer=https://kubernetes.default.svc".into(),
                    format!(
                        "--service-account-key-file={}",
                        dir.join("sa.pub").display()
                    ),
                    format!(
                        "--service-account-signing-key-file={}",
                        dir.join("sa.key").display()
                    ),
                    // No controller-manager would ever lift the not-ready taint it adds.
                    "--disable-admission-plugins=TaintNodesByCondition".into(),
                    format!(
                        "--audit-policy-file={}",
                        dir.join("audit-policy.yaml").display()
                    ),
                    format!("--audit-log-path={}", audit_log.display()),
                    "--audit-log-mode=blocking".into(),
                    "--endpoint-reconciler-type=none".into(),
                    "--allow-privileged=true".into(),
                    "--profiling=false".into(),
                    // Native gang scheduling (`scheduling.k8s.io/v1beta1` PodGroup), as the
                    // gang tests' scheduler runs it.
                    format!("--feature-gates={GANG_FEATURE_GATES}"),
                    "--runtime-config=scheduling.k8s.io/v1beta1=true".into(),
                ],
            );
            let cp = ControlPlane {
                dir: dir.clone(),
                binary: binary.to_owned(),
                url: format!("https://127.0.0.1:{port}"),
                port,
                admin_token: admin_token.clone(),
                fleet_token: fleet_token.clone(),
                ca_file: ca_file.clone(),
                admin_kubeconfig: dir.join("admin.kubeconfig"),
                audit_log: audit_log.clone(),
                children: Mutex::new(Vec::new()),
                scheduler: Mutex::new(None),
                admin_client: OnceLock::new(),
                apiserver_pid: std::sync::atomic::AtomicU32::new(apiserver.id()),
            };
            match cp.wait_ready(&mut apiserver, Duration::from_secs(120)) {
                Ok(()) => {
                    children.push(apiserver);
                    *cp.children.lock().expect("children") = children;
                    cp.write_kubeconfig(&cp.admin_kubeconfig, &cp.url, &admin_token);
                    return cp;
                }
                Err(e) => {
                    last_err = e;
                    let _ = apiserver.kill();
                    let _ = apiserver.wait();
                }
            }
        }
        panic!(
            "kube-apiserver did not become ready: {last_err}\n{}",
            tail(&dir.join("apiserver.log"), 40)
        );
    }

    fn wait_ready(&self, apiserver: &mut Child, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = apiserver.try_wait() {
                return Err(format!("kube-apiserver exited: {status}"));
            }
            let out = Command::new("curl")
                .args(["-sS", "--max-time", "2", "--cacert"])
                .arg(&self.ca_file)
                .arg("-H")
                .arg(format!("Authorization: Bearer {}", self.admin_token))
                .arg(format!("{}/readyz", self.url))
                .output();
            if let Ok(out) = out
                && out.status.success()
                && out.stdout == b"ok"
            {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(format!("/readyz not ok after {limit:?}"));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// A kubeconfig for `server` (the apiserver, or a proxy in front of it) and `token`.
    pub fn write_kubeconfig(&self, path: &Path, server: &str, token: &str) {
        let ca = if server.starts_with("https://") {
            format!("    certificate-authority: {}\n", self.ca_file.display())
        } else {
            String::new()
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n{ca}\
             users:\n- name: test\n  user:\n    token: {token}\n\
             contexts:\n- name: test\n  context:\n    cluster: test\n    user: test\n\
             current-context: test\n"
        );
        std::fs::write(path, text).expect("write kubeconfig");
    }

    /// CPU seconds (user + system) the kube-apiserver process has used so far.
    pub fn apiserver_cpu_seconds(&self) -> f64 {
        let pid = self
            .apiserver_pid
            .load(std::sync::atomic::Ordering::Relaxed);
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the parenthesised command name; utime and stime are 14th and 15th.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (ticks(11) + ticks(12)) / 100.0
    }

    /// The kube-apiserver's resident memory now, in bytes.
    pub fn apiserver_rss_bytes(&self) -> u64 {
        (self.apiserver_rss_reader())()
    }

    /// A reader of [`Self::apiserver_rss_bytes`] for another thread.
    pub fn apiserver_rss_reader(&self) -> impl Fn() -> u64 + Send + 'static {
        let pid = self
            .apiserver_pid
            .load(std::sync::atomic::Ordering::Relaxed);
        move || {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map_or(0, |kb| kb * 1024)
        }
    }

    /// The kube-apiserver's `/metrics`, as admin.
    pub fn metrics_text(&self) -> String {
        let req = http::Request::get("/metrics")
            .body(Vec::new())
            .expect("GET request");
        self.block_on(self.admin().request_text(req))
            .expect("the apiserver's /metrics")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A fresh scratch path inside the run directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// `kubectl` (Kubernetes' own, from the same binary) as admin; returns stdout, panics
    /// with stderr on failure.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let (ok, out, err) = self.kubectl_as(&self.admin_kubeconfig, args, None);
        assert!(ok, "kubectl {args:?}: {err}");
        out
    }

    /// `kubectl apply --dry-run=server -f file` as admin: refused by nothing, and each of its
    /// `objects` accepted (`what` names the file in a failure).
    pub fn assert_dry_run_accepts(&self, file: &Path, objects: usize, what: &str) {
        let (ok, out, err) = self.kubectl_as(
            &self.admin_kubeconfig,
            &["apply", "--dry-run=server", "-f", file.to_str().unwrap()],
            None,
        );
        assert!(ok, "{what}: server-side dry run refused:\n{out}{err}");
        assert_eq!(
            out.lines().count(),
            objects,
            "{what}: every object accepted:\n{out}"
        );
    }

    /// `kubectl` with `kubeconfig`, optional stdin; (success, stdout, stderr).
    pub fn kubectl_as(
        &self,
        kubeconfig: &Path,
        args: &[&str],
        stdin: Option<&str>,
    ) -> (bool, String, String) {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("kubectl")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .env("HOME", &self.dir)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn kubectl");
        if let Some(input) = stdin {
            use std::io::Write;
            let mut pipe = child.stdin.take().expect("stdin");
            pipe.write_all(input.as_bytes()).expect("write stdin");
        }
        let out = child.wait_with_output().expect("kubectl output");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `kubectl apply -f -` of `manifest` as admin (server-side, so re-applying is harmless).
    pub fn apply(&self, manifest: &str) {
        let (ok, out, err) = self.kubectl_as(
            &self.admin_kubeconfig,
            &[
                "apply",
                "--server-side",
                "--force-conflicts",
                "--field-manager=test-admin",
                "-f",
                "-",
            ],
            Some(manifest),
        );
        assert!(ok, "kubectl apply: {err}\n{out}");
    }

    /// Run `f` on the control plane's own runtime (the admin client lives there).
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        runtime().block_on(f)
    }

    /// A client as admin (`system:masters`), bound to [`Self::block_on`]'s runtime.
    pub fn admin(&self) -> kube::Client {
        self.admin_client
            .get_or_init(|| self.block_on(client_from(&self.admin_kubeconfig)))
            .clone()
    }

    /// GET of an API path as admin, as JSON (`None` on 404).
    pub fn get_json(&self, path: &str) -> Option<Value> {
        let client = self.admin();
        let req = http::Request::get(path)
            .body(Vec::new())
            .expect("GET request");
        match self.block_on(client.request::<Value>(req)) {
            Ok(v) => Some(v),
            Err(kube::Error::Api(s)) if s.code == 404 => None,
            Err(e) => panic!("GET {path}: {e}"),
        }
    }

    /// The events.k8s.io Events about Node `node`, oldest first.
    pub fn node_events(&self, node: &str) -> Vec<Value> {
        let list = self
            .get_json("/apis/events.k8s.io/v1/namespaces/default/events")
            .unwrap_or_default();
        let mut out: Vec<Value> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["regarding"]["kind"] == "Node" && e["regarding"]["name"] == node)
            .cloned()
            .collect();
        out.sort_by_key(|e| {
            e["metadata"]["resourceVersion"]
                .as_str()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        });
        out
    }

    /// A namespace with its `default` ServiceAccount, which no kube-controller-manager makes
    /// here.
    pub fn create_namespace(&self, ns: &str) {
        self.apply(
            &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}).to_string(),
        );
        self.apply(
            &json!({"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": "default", "namespace": ns}})
            .to_string(),
        );
    }

    /// DraNet's DeviceClass (`dra.net`: every device of that driver) and the scheduler that
    /// allocates ResourceClaims against it.
    pub fn serve_dra_net_claims(&self) {
        self.apply(
            &json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": "dra.net"},
                "spec": {"selectors": [{"cel": {"expression": "device.driver == \"dra.net\""}}]},
            })
            .to_string(),
        );
        self.start_scheduler();
    }

    /// Free a ResourceClaim whose pod is gone, as the resourceclaim controller of
    /// kube-controller-manager (not run here) would: allocation, reservation and finalizer
    /// dropped, so it can be deleted and its devices allocated again.
    pub fn release_claim(&self, ns: &str, name: &str) {
        for args in [
            &[
                "-n",
                ns,
                "patch",
                "resourceclaim",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                r#"{"status":{"allocation":null,"reservedFor":null}}"#,
            ][..],
            &[
                "-n",
                ns,
                "patch",
                "resourceclaim",
                name,
                "--type=merge",
                "-p",
                r#"{"metadata":{"finalizers":null}}"#,
            ],
        ] {
            let _ = self.kubectl_as(&self.admin_kubeconfig, args, None);
        }
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        self.get_json(&format!("/api/v1/nodes/{name}"))
    }

    /// A Node as the kubelet registers it: Ready, with capacity and allocatable (cpu, memory,
    /// pods, and `extra` resources), `labels` and `taints`. Replaces any Node of that name.
    pub fn create_node(&self, name: &str, labels: Value, taints: Value, extra: Value) {
        let _ = self.kubectl_as(
            &self.admin_kubeconfig,
            &["delete", "node", name, "--ignore-not-found", "--wait=false"],
            None,
        );
        let mut resources = json!({ "cpu": "64", "memory": "512Gi", "pods": "110" });
        if let (Some(r), Some(e)) = (resources.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                r.insert(k.clone(), v.clone());
            }
        }
        let mut all_labels = json!({ "kubernetes.io/hostname": name, "kubernetes.io/os": "linux" });
        if let (Some(l), Some(e)) = (all_labels.as_object_mut(), labels.as_object()) {
            for (k, v) in e {
                l.insert(k.clone(), v.clone());
            }
        }
        let node = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": name, "labels": all_labels },
            "spec": { "taints": taints },
        });
        let (ok, _, err) = self.kubectl_as(
            &self.admin_kubeconfig,
            &["create", "-f", "-"],
            Some(&node.to_string()),
        );
        assert!(ok, "create node {name}: {err}");
        let now = "2026-11-30T00:00:00Z";
        let status = json!({ "status": {
            "capacity": resources, "allocatable": resources,
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "kubelet is posting ready status",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
        }});
        self.patch_node_status(name, &status);
    }

    /// Merge `status` (`{"status": {...}}`) into Node `name`'s status subresource, as admin.
    pub fn patch_node_status(&self, name: &str, status: &Value) {
        let (ok, _, err) = self.kubectl_as(
            &self.admin_kubeconfig,
            &[
                "patch",
                "node",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                &status.to_string(),
            ],
            None,
        );
        assert!(ok, "node {name} status: {err}");
    }

    /// Apply the Namespace, ServiceAccount, RBAC and admission policy of `daemonset.yaml`
    /// (everything but the ConfigMap and the DaemonSet, which need no kubelet here). Once.
    pub fn install_agent_rbac(&self) {
        static DONE: OnceLock<()> = OnceLock::new();
        DONE.get_or_init(|| {
            let manifest = std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("daemonset.yaml"),
            )
            .expect("read daemonset.yaml");
            // The requirements ConfigMap too: its key pool-selector is the parameter of the
            // guard's admission policy (deploy/guard.yaml, fabricgate-guard-pool).
            let docs: Vec<&str> = manifest
                .split("\n---")
                .filter(|d| !d.contains("\nkind: DaemonSet"))
                .collect();
            self.apply(&docs.join("\n---"));
            // The policy is enforced only once the apiserver has loaded it: wait until a
            // denied write is really denied (see `wait_policy_loaded`).
        });
    }

    /// A token of the agent's ServiceAccount bound to a Pod on `node` (as the kubelet's
    /// projected token is): it carries the node-name claim the admission policy checks.
    pub fn agent_token(&self, node: &str) -> String {
        self.install_agent_rbac();
        let pod = format!("fabricgate-{node}");
        let body = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": { "name": pod, "namespace": "fabricgate",
                          "labels": { "app.kubernetes.io/name": "fabricgate" } },
            "spec": {
                "nodeName": node,
                "serviceAccountName": "fabricgate",
                "automountServiceAccountToken": false,
                "containers": [{ "name": "agent", "image": "fabricgate:test" }],
            },
        });
        let _ = self.kubectl_as(
            &self.admin_kubeconfig,
            &[
                "-n",
                "fabricgate",
                "delete",
                "pod",
                &pod,
                "--ignore-not-found",
                "--grace-period=0",
                "--force",
            ],
            None,
        );
        let (ok, _, err) = self.kubectl_as(
            &self.admin_kubeconfig,
            &["create", "-f", "-"],
            Some(&body.to_string()),
        );
        assert!(ok, "create agent pod {pod}: {err}");
        let (ok, out, err) = self.kubectl_as(
            &self.admin_kubeconfig,
            &[
                "-n",
                "fabricgate",
                "create",
                "token",
                "fabricgate",
                "--bound-object-kind=Pod",
                &format!("--bound-object-name={pod}"),
                "--duration=2h",
            ],
            None,
        );
        assert!(ok, "token request for {pod}: {err}");
        out.trim().to_owned()
    }

    /// A kubeconfig for the agent on `node` (pod-bound ServiceAccount token), pointing at
    /// `server` (default: the apiserver itself).
    pub fn agent_kubeconfig(&self, node: &str, server: Option<&str>) -> PathBuf {
        let token = self.agent_token(node);
        let path = self
            .dir
            .join(format!("agent-{node}-{}.kubeconfig", random_hex(4)));
        self.write_kubeconfig(&path, server.unwrap_or(&self.url), &token);
        path
    }

    /// Every audit event so far.
    pub fn audit(&self) -> Vec<AuditEvent> {
        self.audit_since(0)
    }

    /// Where the audit log's complete lines end now (a byte offset): read what comes after it
    /// with [`Self::audit_since`].
    pub fn audit_mark(&self) -> usize {
        let bytes = std::fs::read(&self.audit_log).unwrap_or_default();
        bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1)
    }

    /// The audit events logged after `mark` (from [`Self::audit_mark`]).
    pub fn audit_since(&self, mark: usize) -> Vec<AuditEvent> {
        use std::io::{Seek, SeekFrom};
        let Ok(mut file) = std::fs::File::open(&self.audit_log) else {
            return Vec::new();
        };
        if file.seek(SeekFrom::Start(mark as u64)).is_err() {
            return Vec::new();
        }
        BufReader::new(file)
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| serde_json::from_str::<Value>(&line).ok())
            .map(|v| {
                let s = |p: &str| {
                    v.pointer(p)
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned()
                };
                AuditEvent {
                    user: s("/user/username"),
                    verb: s("/verb"),
                    resource: s("/objectRef/resource"),
                    subresource: s("/objectRef/subresource"),
                    namespace: s("/objectRef/namespace"),
                    name: s("/objectRef/name"),
                    api_group: s("/objectRef/apiGroup"),
                    code: v
                        .pointer("/responseStatus/code")
                        .and_then(Value::as_u64)
                        .and_then(|c| u16::try_from(c).ok())
                        .unwrap_or(0),
                    time: s("/stageTimestamp"),
                    user_agent: s("/userAgent"),
                    request_uri: s("/requestURI"),
                    claim_node: v
                        .pointer("/user/extra/authentication.kubernetes.io~1node-name/0")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_owned(),
                }
            })
            .collect()
    }

    /// The `controlplane` multi-call binary this control plane runs.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// This run's directory: PKI (`ca.crt`, `ca.key`, `sa.key`), kubeconfigs, component logs.
    pub fn run_dir(&self) -> &Path {
        &self.dir
    }

    /// Start kube-scheduler (once), with the admin kubeconfig.
    pub fn start_scheduler(&self) {
        let mut slot = self.scheduler.lock().expect("scheduler lock");
        if slot.is_some() {
            return;
        }
        let child = spawn(
            &self.binary,
            &self.dir,
            "scheduler",
            &[
                format!("--kubeconfig={}", self.admin_kubeconfig.display()),
                "--leader-elect=false".into(),
                "--secure-port=0".into(),
                format!("--feature-gates={GANG_FEATURE_GATES}"),
                "-v=2".into(),
            ],
        );
        *slot = Some(child);
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        let mut all: Vec<Child> = self
            .children
            .lock()
            .map(|mut c| c.drain(..).collect())
            .unwrap_or_default();
        if let Ok(mut s) = self.scheduler.lock()
            && let Some(c) = s.take()
        {
            all.push(c);
        }
        for mut child in all {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(format!("-{}", child.id()))
                .status();
            let _ = child.wait();
        }
    }
}

/// The runtime the tests' own clients run on (a kube client stays on the runtime it was
/// made on).
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("test runtime")
    })
}

/// A kube client from a kubeconfig file.
pub async fn client_from(kubeconfig: &Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("read kubeconfig");
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .expect("kubeconfig");
    kube::Client::try_from(config).expect("client")
}

/// Start `binary COMPONENT args...` in its own process group, logging to `dir/COMPONENT.log`.
pub fn spawn(binary: &Path, dir: &Path, component: &str, args: &[String]) -> Child {
    use std::os::unix::process::CommandExt;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{component}.log")))
        .expect("component log");
    let err = log.try_clone().expect("clone log");
    Command::new(binary)
        .arg(component)
        .args(args)
        .env("CONTROLPLANE_EXIT_WITH_PARENT", "1")
        .env("HOME", dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("start {component}: {e}"))
}

/// Last `n` lines of a log, for failure messages.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A CA, a serving certificate for 127.0.0.1, localhost and 10.0.3.2, and the ServiceAccount
/// signing key pair, with the system's `openssl`.
fn make_pki(dir: &Path) {
    let o = |args: &[&str], what: &str| {
        run_ok(Command::new("openssl").args(args).current_dir(dir), what);
    };
    o(
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "ca.key",
        ],
        "CA key",
    );
    o(
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            "ca.key",
            "-subj",
            "/CN=fabricgate-test-ca",
            "-days",
            "2",
            "-out",
            "ca.crt",
        ],
        "CA certificate",
    );
    o(
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "apiserver.key",
        ],
        "serving key",
    );
    o(
        &[
            "req",
            "-new",
            "-key",
            "apiserver.key",
            "-subj",
            "/CN=kube-apiserver",
            "-out",
            "apiserver.csr",
        ],
        "serving CSR",
    );
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,IP:10.0.3.2,DNS:localhost,DNS:kubernetes.default.svc\n\
         extendedKeyUsage=serverAuth\n",
    )
    .expect("san.ext");
    o(
        &[
            "x509",
            "-req",
            "-in",
            "apiserver.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "apiserver.crt",
        ],
        "serving certificate",
    );
    o(
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "sa.key",
        ],
        "ServiceAccount key",
    );
    o(
        &["ec", "-in", "sa.key", "-pubout", "-out", "sa.pub"],
        "ServiceAccount public key",
    );
}
