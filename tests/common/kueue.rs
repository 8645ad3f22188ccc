//! Kueue for real, beside the shared control plane: kube-controller-manager (the Job controller
//! creates a Job's pods, the ServiceAccount controller gives each namespace its `default`
//! ServiceAccount) and Kueue's own manager (`cmd/kueue` of `sigs.k8s.io/kueue`, built by
//! `.ci/kueue.sh`), with Kueue's own CRDs (`kueue_crds`) and webhook configurations from the
//! module (`config/components/webhook/manifests.yaml`).
//!
//! Made once per test binary, on the first [`Kueue::shared`], and shared by the `kueue`
//! tests, which take [`Kueue::serial`] (they share Kueue's queues and the check controller):
//! the manager is started by the first and kept for the next. Tests that play Kueue's part
//! themselves (they write Workloads' status by hand) take [`Kueue::without`] instead, which
//! stops the manager, its webhooks removed first, while they run.
//! Kueue runs with a Configuration of this harness: Job integration only, no leader election,
//! no internal certificate management (its webhook server gets a per-run certificate for
//! 127.0.0.1, and its webhook configurations point at `https://127.0.0.1:PORT/...` with that
//! CA: there are no Services here), the metrics server off, Topology Aware Scheduling on and
//! the visibility API server off. kube-controller-manager runs only the Job and
//! ServiceAccount controllers: the node lifecycle controller would mark the kubelet-less
//! fixture Nodes of every other test NotReady, and the garbage collector would delete other
//! tests' pods whose owner does not exist (the tests delete what they made themselves). Both exit with the test binary (the
//! controller manager by `CONTROLPLANE_EXIT_WITH_PARENT`, Kueue through a shell that watches
//! its parent) and are stopped by pid.

use super::controlplane::{ControlPlane, spawn, tail};
use super::tls::TestPki;
use super::{require, try_http_get};
use serde::Deserialize;
use serde_json::{Value, json};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

/// Where `.ci/kueue.sh` installs Kueue's manager.
pub const KUEUE_BINARY: &str = "/opt/fabricgate-controlplane/bin/kueue";
/// The metrics certificate Kueue reads at start (see `.ci/kueue.sh`).
pub const KUEUE_METRICS_CERT: &str = "/etc/kueue/metrics/certs/tls.crt";
/// Kueue's own namespace (its Configuration's `namespace`).
pub const KUEUE_NAMESPACE: &str = "kueue-system";

pub struct Kueue {
    pub cp: &'static ControlPlane,
    dir: PathBuf,
    binary: PathBuf,
    config: PathBuf,
    /// Kueue's webhook configurations, pointed at its server (applied while it runs).
    webhooks: String,
    /// `127.0.0.1:PORT` of Kueue's health probes (`/readyz`).
    pub health: String,
    /// kube-controller-manager, for the binary's life.
    _controller_manager: Mutex<ChildGroup>,
    /// Kueue's manager, while a `kueue` test needs it (see [`Kueue::without`]).
    manager: Mutex<Option<ChildGroup>>,
}

/// A child in its own process group, ended (the group, SIGTERM) on drop.
struct ChildGroup(Child);

impl Drop for ChildGroup {
    fn drop(&mut self) {
        // killpg(2) itself: with `kill -TERM -PGID` (procps-ng 4.0.2's kill) the group was not
        // signalled and the wait below never ended.
        let group = i32::try_from(self.0.id())
            .ok()
            .filter(|pid| *pid > 1)
            .and_then(rustix::process::Pid::from_raw);
        if let Some(group) = group {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::TERM);
        }
        let _ = self.0.wait();
    }
}

static SHARED: OnceLock<Option<Kueue>> = OnceLock::new();

/// Kueue's lane: the `kueue` tests hold it alone (with Kueue running), the tests that play
/// Kueue's part themselves (`admission_check`) hold it together (with Kueue stopped: it would
/// reconcile their hand-written Workloads).
static LANE: RwLock<()> = RwLock::new(());

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

impl Kueue {
    /// kube-controller-manager, Kueue's CRDs and the manager's configuration on the shared
    /// control plane, made on first use. `None` (after a printed `SKIP:`) when something is
    /// not built and this is not CI; under `CI=true` that is a failure.
    pub fn shared() -> Option<&'static Kueue> {
        SHARED
            .get_or_init(|| {
                let cp = ControlPlane::shared()?;
                let binary = kueue_binary();
                let built = binary.is_file() && Path::new(KUEUE_METRICS_CERT).is_file();
                if !require(
                    built,
                    &format!(
                        "Kueue is not built ({} and {KUEUE_METRICS_CERT})",
                        binary.display()
                    ),
                    "build it with .ci/kueue.sh",
                ) {
                    return None;
                }
                Kueue::prepare(cp, binary)
            })
            .as_ref()
    }

    /// Held by each `kueue` test for its whole run, with Kueue's manager running (started on
    /// the first, kept for the next): they share Kueue's ClusterQueue and kill the check
    /// controller, and no test that writes Workloads by hand runs meanwhile.
    pub fn serial(&self) -> RwLockWriteGuard<'static, ()> {
        let lane = LANE
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut manager = self
            .manager
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if manager.is_none() {
            *manager = Some(self.start_manager());
        }
        lane
    }

    /// Held by a test that plays Kueue's part itself (it writes Workloads' status by hand):
    /// Kueue's manager is not running meanwhile (stopped, its webhooks removed first, if a
    /// `kueue` test started it), so nothing reconciles those Workloads but the test.
    pub fn without() -> RwLockReadGuard<'static, ()> {
        let lane = LANE
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(Some(kueue)) = SHARED.get() {
            let mut manager = kueue
                .manager
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(running) = manager.take() {
                kueue.stop_manager(running);
            }
        }
        lane
    }

    fn prepare(cp: &'static ControlPlane, binary: PathBuf) -> Option<Kueue> {
        let dir = cp.run_dir().join("kueue");
        std::fs::create_dir_all(&dir).expect("mkdir kueue run dir");
        cp.start_scheduler();
        let controller_manager = ChildGroup(start_controller_manager(cp));
        let module = super::kueue_crds::install(cp)?;
        cp.apply(&format!(
            "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {KUEUE_NAMESPACE}\n"
        ));
        let pki = TestPki::generate(&dir);
        let webhook_port = free_port();
        let health = format!("127.0.0.1:{}", free_port());
        let config = dir.join("config.yaml");
        std::fs::write(
            &config,
            format!(
                "apiVersion: config.kueue.x-k8s.io/v1beta2\n\
                 kind: Configuration\n\
                 namespace: {KUEUE_NAMESPACE}\n\
                 health:\n  healthProbeBindAddress: {health}\n\
                 metrics:\n  bindAddress: \"0\"\n\
                 webhook:\n  host: 127.0.0.1\n  port: {webhook_port}\n  certDir: {}\n\
                 leaderElection:\n  leaderElect: false\n\
                 internalCertManagement:\n  enable: false\n\
                 manageJobsWithoutQueueName: false\n\
                 integrations:\n  frameworks:\n    - batch/job\n",
                dir.display()
            ),
        )
        .expect("write Kueue configuration");
        Some(Kueue {
            cp,
            dir,
            binary,
            config,
            webhooks: webhook_configurations(module, webhook_port, &pki.ca_pem),
            health,
            _controller_manager: Mutex::new(controller_manager),
            manager: Mutex::new(None),
        })
    }

    /// Kueue's manager, ready, with its webhooks registered and answering.
    fn start_manager(&self) -> ChildGroup {
        let started = std::time::Instant::now();
        let mut running = ChildGroup(spawn_kueue(self.cp, &self.binary, &self.dir, &self.config));
        self.wait_ready(&mut running.0, Duration::from_secs(180));
        self.cp.apply(&self.webhooks);
        self.wait_webhooks(true, Duration::from_secs(60));
        eprintln!(
            "kueue: Kueue's manager ready and its webhooks answering in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        running
    }

    /// Its webhooks removed (and no longer called), then the manager ended.
    fn stop_manager(&self, running: ChildGroup) {
        for (kind, name) in [
            (
                "mutatingwebhookconfiguration",
                "kueue-mutating-webhook-configuration",
            ),
            (
                "validatingwebhookconfiguration",
                "kueue-validating-webhook-configuration",
            ),
        ] {
            let _ = self.cp.kubectl_as(
                &self.cp.admin_kubeconfig,
                &["delete", kind, name, "--ignore-not-found"],
                None,
            );
        }
        self.wait_webhooks(false, Duration::from_secs(60));
        drop(running);
    }

    /// Kueue's log so far (its last `n` lines), for failure messages.
    pub fn log(&self, n: usize) -> String {
        tail(&self.dir.join("kueue.log"), n)
    }

    fn wait_ready(&self, child: &mut Child, limit: Duration) {
        let started = std::time::Instant::now();
        loop {
            if try_http_get(&self.health, "/readyz", None, Duration::from_secs(2))
                .is_some_and(|(code, _, _)| code == 200)
            {
                return;
            }
            let exited = !matches!(child.try_wait(), Ok(None));
            assert!(
                !exited && started.elapsed() < limit,
                "Kueue did not become ready within {limit:?} (exited: {exited}):\n{}\n\
                 kube-controller-manager:\n{}",
                self.log(40),
                tail(&self.cp.run_dir().join("controller-manager.log"), 20)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Until the apiserver calls Kueue's webhooks (`on`), or no longer does: a server-side
    /// dry run of a queued Job comes back suspended exactly when Kueue's mutating webhook
    /// ran (it suspends every Job with a queue name).
    fn wait_webhooks(&self, on: bool, limit: Duration) {
        let job = json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": { "name": "kueue-webhook-probe", "namespace": "default",
                          "labels": { "kueue.x-k8s.io/queue-name": "probe" } },
            "spec": { "suspend": false, "template": { "spec": {
                "restartPolicy": "Never",
                "containers": [{ "name": "c", "image": "probe:test" }],
            }}},
        });
        let started = std::time::Instant::now();
        loop {
            let (ok, out, err) = self.cp.kubectl_as(
                &self.cp.admin_kubeconfig,
                &["create", "--dry-run=server", "-o", "json", "-f", "-"],
                Some(&job.to_string()),
            );
            let suspended = serde_json::from_str::<Value>(&out)
                .is_ok_and(|v| v["spec"]["suspend"] == Value::Bool(true));
            if ok && suspended == on {
                return;
            }
            assert!(
                started.elapsed() < limit,
                "Kueue's Job webhook {} within {limit:?}: {err}{out}\n{}",
                if on {
                    "did not answer"
                } else {
                    "was still called"
                },
                self.log(30)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// `FABRICGATE_KUEUE` or [`KUEUE_BINARY`].
pub fn kueue_binary() -> PathBuf {
    std::env::var_os("FABRICGATE_KUEUE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(KUEUE_BINARY))
}

/// kube-controller-manager from the control plane binary, as admin, with only the
/// controllers the Kueue tests need (see the module comment).
fn start_controller_manager(cp: &ControlPlane) -> Child {
    spawn(
        cp.binary(),
        cp.run_dir(),
        "controller-manager",
        &[
            format!("--kubeconfig={}", cp.admin_kubeconfig.display()),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            "--use-service-account-credentials=false".into(),
            "--controllers=job-controller,serviceaccount-controller".into(),
            "--feature-gates=GenericWorkload=true".into(),
        ],
    )
}

/// Kueue's manager with `config`, logging to `dir/kueue.log`, in its own process group under
/// a shell that ends it when the test binary is gone.
fn spawn_kueue(cp: &ControlPlane, binary: &Path, dir: &Path, config: &Path) -> Child {
    use std::os::unix::process::CommandExt;
    let log = std::fs::File::create(dir.join("kueue.log")).expect("kueue log");
    let err = log.try_clone().expect("clone log");
    Command::new("sh")
        .arg("-c")
        .arg(
            "parent=$PPID; \"$0\" \"$@\" & k=$!; trap 'kill $k 2>/dev/null' TERM INT; \
             while kill -0 \"$parent\" 2>/dev/null && kill -0 $k 2>/dev/null; do sleep 0.5; done; \
             kill $k 2>/dev/null; wait $k",
        )
        .arg(binary)
        .arg(format!("--config={}", config.display()))
        .arg("--feature-gates=TopologyAwareScheduling=true,VisibilityOnDemand=false")
        .arg("--zap-log-level=2")
        .env("KUBECONFIG", &cp.admin_kubeconfig)
        .env("HOME", dir)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()))
}

/// Kueue's webhook configurations from the module (`config/components/webhook/
/// manifests.yaml`), with the webhooks of what this Kueue serves (batch/v1 Jobs and Kueue's own
/// kinds; the other integrations are off, and a webhook nobody serves would refuse those
/// objects), each pointing at `https://127.0.0.1:{port}{path}` with the per-run CA `ca_pem`,
/// named as Kueue's release names them (`kueue-...`).
pub fn webhook_configurations(module: &Path, port: u16, ca_pem: &str) -> String {
    let path = module.join("config/components/webhook/manifests.yaml");
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let ca_bundle =
        serde_json::to_value(k8s_openapi::ByteString(ca_pem.as_bytes().to_vec())).expect("CA");
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(&text) {
        let mut v = Value::deserialize(doc).expect("Kueue webhook manifest YAML");
        if v.is_null() {
            continue;
        }
        let name = v["metadata"]["name"].as_str().unwrap_or("").to_owned();
        v["metadata"]["name"] = Value::String(format!("kueue-{name}"));
        let hooks: Vec<Value> = v["webhooks"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(served)
            .map(|mut h| {
                let path = h["clientConfig"]["service"]["path"]
                    .as_str()
                    .unwrap_or("/")
                    .to_owned();
                h["clientConfig"] = json!({
                    "url": format!("https://127.0.0.1:{port}{path}"),
                    "caBundle": ca_bundle,
                });
                h
            })
            .collect();
        assert!(!hooks.is_empty(), "no served webhook in {name}");
        v["webhooks"] = Value::Array(hooks);
        out.push(v.to_string());
    }
    assert_eq!(
        out.len(),
        2,
        "{}: a mutating and a validating configuration",
        path.display()
    );
    out.join("\n---\n")
}

/// Whether this Kueue serves webhook `hook`: its rules are all on batch Jobs or Kueue's kinds.
fn served(hook: &Value) -> bool {
    hook["rules"].as_array().is_some_and(|rules| {
        rules.iter().all(|r| {
            r["apiGroups"].as_array().is_some_and(|g| {
                g.iter().all(|g| {
                    g == "kueue.x-k8s.io" || (g == "batch" && r["resources"] == json!(["jobs"]))
                })
            })
        })
    })
}
