//! Everything fabricgate does to Kubernetes, against a real control plane: Kubernetes' own
//! etcd, kube-apiserver and kube-scheduler (`tests/support/controlplane.rs`), shared by all
//! tests of this binary, each with its own Node names. Faults come from a proxy in front of
//! the real apiserver (`tests/support/faultproxy.rs`). Request counts come from the
//! apiserver's audit log, never from the agent's own counters.
//!
//! Without the control plane binary (`.ci/controlplane.sh` builds it) each test prints
//! `SKIP:` and passes, except under `CI=true`, where that is a failure.

mod common;
mod support;

#[path = "cluster/agent.rs"]
mod agent;
#[path = "cluster/agenterror.rs"]
mod agenterror;
#[path = "cluster/breaker.rs"]
mod breaker;
#[path = "cluster/cleanup.rs"]
mod cleanup;
#[path = "cluster/deviceplugin.rs"]
mod deviceplugin;
#[path = "cluster/fleet.rs"]
mod fleet;
#[path = "cluster/guard.rs"]
mod guard;
#[path = "cluster/overlays.rs"]
mod overlays;
#[path = "cluster/placement.rs"]
mod placement;
#[path = "cluster/scheduler.rs"]
mod scheduler;
#[path = "cluster/security.rs"]
mod security;
#[path = "cluster/vap.rs"]
mod vap;
#[path = "cluster/webhook.rs"]
mod webhook;

use common::{last_lines, poll_until};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};
use support::controlplane::{AuditEvent, ControlPlane};
use support::sysfs::FakeHca;

pub const TAINT: &str = "fabricgate.io/unvalidated";
/// The agent's user, as RBAC and the audit log name it.
pub const AGENT_USER: &str = "system:serviceaccount:fabricgate:fabricgate";

/// The shared control plane, or `None` after a `SKIP:` line (a failure under CI).
pub fn control_plane() -> Option<&'static ControlPlane> {
    ControlPlane::shared()
}

/// A running `fabricgate run`.
pub struct Agent {
    pub child: Child,
    pub log: PathBuf,
}

impl Agent {
    pub fn stop(mut self) -> (ExitStatus, Duration) {
        let started = Instant::now();
        signal(&self.child, "TERM");
        let status = wait_exit(&mut self.child, Duration::from_secs(10));
        (status, started.elapsed())
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// [`wait_until`], with the end of this agent's log in the failure message.
    pub fn wait(&self, what: &str, limit: Duration, f: impl FnMut() -> bool) -> Duration {
        poll_until(what, limit, Duration::from_millis(10), f, || {
            format!("; agent log:\n{}", last_lines(&self.log(), 30))
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn signal(child: &Child, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig}");
}

pub fn wait_exit(child: &mut Child, limit: Duration) -> ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Start `fabricgate run` for Node `node` over `sysfs`/`proc`, with `kubeconfig` (none: no
/// cluster configuration at all).
pub fn start_agent_at(
    node: &str,
    sysfs: &Path,
    proc_root: &Path,
    scratch: &Path,
    kubeconfig: Option<&Path>,
    extra: &[&str],
) -> Agent {
    static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let log = scratch.join(format!("agent-{node}-{n}.log"));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_fabricgate"));
    cmd.arg("run")
        .arg("--sysfs-root")
        .arg(sysfs)
        .arg("--proc-root")
        .arg(proc_root)
        .args(["--verbs", "off", "--metrics-addr", "127.0.0.1:0"])
        .args(extra)
        .env("HOME", scratch)
        .env("NODE_NAME", node)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("agent log"));
    match kubeconfig {
        Some(k) => cmd.env("KUBECONFIG", k),
        None => cmd.env("KUBECONFIG", scratch.join("no-such-kubeconfig")),
    };
    Agent {
        child: cmd.spawn().expect("start fabricgate run"),
        log,
    }
}

pub fn start_agent(node: &str, hca: &FakeHca, kubeconfig: Option<&Path>, extra: &[&str]) -> Agent {
    start_agent_at(
        node,
        &hca.sysfs_root(),
        &hca.proc_root(),
        hca.scratch(),
        kubeconfig,
        extra,
    )
}

pub use common::wait_until;

/// One Node of a test on the shared control plane.
pub struct TestNode {
    pub cp: &'static ControlPlane,
    pub name: String,
}

impl TestNode {
    /// Register `name` as the docs recommend (with our taint), plus what other owners put
    /// there: a label, a GPU taint, the kubelet's Ready condition.
    pub fn seeded(cp: &'static ControlPlane, name: &str) -> TestNode {
        cp.create_node(
            name,
            json!({ "team": "ml" }),
            json!([
                { "key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule" },
                { "key": TAINT, "effect": "NoSchedule" },
            ]),
            json!({}),
        );
        TestNode {
            cp,
            name: name.to_owned(),
        }
    }

    pub fn json(&self) -> Value {
        self.cp
            .node(&self.name)
            .unwrap_or_else(|| panic!("node {} is gone", self.name))
    }

    pub fn taints(&self) -> Vec<String> {
        taint_keys(&self.json())
    }

    pub fn has_our_taint(&self) -> bool {
        self.taints().iter().any(|k| k == TAINT)
    }

    pub fn label(&self, key: &str) -> Option<String> {
        self.json()["metadata"]["labels"][key]
            .as_str()
            .map(str::to_owned)
    }

    pub fn condition(&self, type_: &str) -> Option<Value> {
        self.json()["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == json!(type_))
            .cloned()
    }

    pub fn events(&self) -> Vec<Value> {
        self.cp.node_events(&self.name)
    }

    /// Validated, and the Event for it recorded (the last write of a transition).
    pub fn ready(&self) -> bool {
        let node = self.json();
        !taint_keys(&node).iter().any(|k| k == TAINT)
            && node["metadata"]["labels"]["fabricgate.io/ready"] == "true"
            && self
                .events()
                .last()
                .is_some_and(|e| e["reason"] == "FabricReady")
    }

    /// An agent for this Node over a one-HCA tree whose port is `up`, with its pod-bound
    /// token, talking to `server` (a fault proxy) or the apiserver itself. The agent is
    /// dropped (killed) before the tree when both go out of scope together.
    pub fn run_agent(&self, up: bool, server: Option<&str>, extra: &[&str]) -> (FakeHca, Agent) {
        let hca = FakeHca::new(up);
        let kubeconfig = self.agent_kubeconfig(server);
        let agent = start_agent(&self.name, &hca, Some(&kubeconfig), extra);
        (hca, agent)
    }

    /// An agent for this Node over `hca`, with its pod-bound token, talking to the apiserver
    /// itself.
    pub fn start_agent(&self, hca: &FakeHca, extra: &[&str]) -> Agent {
        let kubeconfig = self.agent_kubeconfig(None);
        start_agent(&self.name, hca, Some(&kubeconfig), extra)
    }

    /// Whether this Node has condition `type_` with reason `reason`.
    pub fn has_reason(&self, type_: &str, reason: &str) -> bool {
        self.condition(type_).is_some_and(|c| c["reason"] == reason)
    }

    /// A kubeconfig of this Node's agent (pod-bound token), to the apiserver or `server`.
    pub fn agent_kubeconfig(&self, server: Option<&str>) -> PathBuf {
        self.cp.agent_kubeconfig(&self.name, server)
    }

    /// Requests this Node's agent made since `mark` (attributed by its token's node claim).
    pub fn agent_requests(&self, mark: usize) -> Vec<AuditEvent> {
        self.cp
            .audit_since(mark)
            .into_iter()
            .filter(|e| e.user == AGENT_USER && e.claim_node == self.name)
            .collect()
    }

    /// Successful writes among them.
    pub fn agent_writes(&self, mark: usize) -> Vec<AuditEvent> {
        self.agent_requests(mark)
            .into_iter()
            .filter(|e| e.is_write() && e.code < 300)
            .collect()
    }

    /// Successful taint writes: JSON patches of the Node (the label apply is forced SSA).
    pub fn taint_writes(&self, mark: usize) -> usize {
        self.agent_writes(mark)
            .iter()
            .filter(|e| {
                e.verb == "patch"
                    && e.resource == "nodes"
                    && e.subresource.is_empty()
                    && !e.request_uri.contains("force=")
            })
            .count()
    }
}

pub fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t["key"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

pub fn committed_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}
