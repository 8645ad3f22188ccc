//! `fabricgate guard` as a child process: one replica, electing its leader on a Lease in the
//! agent's namespace, its log in a file. Used by the guard's own tests and by the breaker's
//! (the guard publishes the pool summary the agents' breakers read).

use super::controlplane::ControlPlane;
use super::wait::{last_lines, poll_until};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The namespace of deploy/guard.yaml's Role: the agent pods and the Lease live there.
pub const GUARD_NS: &str = "fabricgate";

pub struct Guard {
    child: Child,
    log: PathBuf,
    pub identity: String,
}

impl Guard {
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// [`super::wait_until`], with the end of this guard's log in the failure message.
    pub fn wait(&self, what: &str, limit: Duration, f: impl FnMut() -> bool) -> Duration {
        poll_until(what, limit, Duration::from_millis(10), f, || {
            let tail = last_lines(&self.log(), 40);
            format!("; log of {}:\n{tail}", self.identity)
        })
    }

    /// Where its `/metrics`, `/healthz` and `/readyz` listen (from its log; waits for it).
    pub fn metrics_addr(&self) -> String {
        let mut found = None;
        self.wait(
            "the guard's metrics address",
            Duration::from_secs(20),
            || {
                found = self
                    .log()
                    .lines()
                    .filter(|l| l.contains("guard metrics serving"))
                    .find_map(|l| {
                        let at = l.find("addr=")?;
                        l[at + 5..].split_whitespace().next().map(str::to_owned)
                    });
                found.is_some()
            },
        );
        found.unwrap_or_default()
    }

    /// SIGTERM, as a rollout stops a replica: the guard releases its Lease on the way out, so
    /// the next test's guard on the same Lease leads at once (a killed one holds it for its
    /// whole `--lease-duration`).
    pub fn stop(mut self) {
        crate::common::signal(&self.child, "TERM");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < deadline {
            if !self.alive() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn child(&self) -> &Child {
        &self.child
    }

    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A guard over the agent pods `selector` selects (`None`: its default), electing its leader
/// on Lease `lease`, with `timing` (`--stale-after`, `--poll-interval`, `--lease-duration`
/// and their values).
pub fn start_guard(
    identity: &str,
    selector: Option<&str>,
    lease: &str,
    config: &Path,
    kubeconfig: &Path,
    scratch: &Path,
    timing: &[&str],
) -> Guard {
    let log = scratch.join(format!("{identity}.log"));
    let selector: Vec<&str> = selector.map_or(Vec::new(), |s| vec!["--pod-selector", s]);
    let child = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["guard", "--config"])
        .arg(config)
        .args(["--namespace", GUARD_NS])
        .args(&selector)
        .args(["--lease-name", lease])
        .args(timing)
        .args(["--identity", identity])
        // Any free port: tests run several guards at once.
        .args(["--metrics-addr", "127.0.0.1:0"])
        .env("KUBECONFIG", kubeconfig)
        .env("HOME", scratch)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("guard log"))
        .spawn()
        .expect("start fabricgate guard");
    Guard {
        child,
        log,
        identity: identity.to_owned(),
    }
}

/// The guard's Lease as the agents read it (the shipped name, in the agent's namespace).
pub fn shipped_guard_lease(cp: &ControlPlane) -> Option<serde_json::Value> {
    cp.get_json(&format!(
        "/apis/coordination.k8s.io/v1/namespaces/{GUARD_NS}/leases/{}",
        fabricgate::config::DEFAULT_GUARD_LEASE
    ))
}

/// The pool summary the guard's leader publishes there (`fabricgate.io/pool`), parsed.
pub fn published_pool(cp: &ControlPlane) -> Option<serde_json::Value> {
    let lease = shipped_guard_lease(cp)?;
    let text = lease["metadata"]["annotations"]["fabricgate.io/pool"].as_str()?;
    serde_json::from_str(text).ok()
}

/// Held by a test that runs a guard on the shipped Lease name (`fabricgate-guard`, the only
/// one the agent's Role lets it read): one such guard at a time, or their pools' summaries
/// would take turns on it.
pub fn shipped_lease() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
