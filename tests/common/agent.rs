//! `fabricgate run` as a child process, the one way the agent, cluster and hardening tests
//! start it: over a fixture tree, with a kubeconfig or none, its stderr in a log file, its
//! HTTP endpoints reachable when started at a known address.

use super::sysfs::FakeHca;
use super::{last_lines, poll_until, try_http_get};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// How to start one `fabricgate run` ([`Launch::start`]).
pub struct Launch<'a> {
    node: &'a str,
    sysfs: &'a Path,
    proc_root: &'a Path,
    scratch: &'a Path,
    kubeconfig: Option<&'a Path>,
    args: &'a [&'a str],
    env: &'a [(&'a str, &'a str)],
    nofile: Option<u32>,
    known_addr: bool,
}

impl<'a> Launch<'a> {
    /// Node `node` over `sysfs`/`proc_root`, its log and `HOME` in `scratch`; no cluster
    /// configuration at all unless [`Launch::kubeconfig`] says otherwise.
    pub fn at(node: &'a str, sysfs: &'a Path, proc_root: &'a Path, scratch: &'a Path) -> Self {
        Launch {
            node,
            sysfs,
            proc_root,
            scratch,
            kubeconfig: None,
            args: &[],
            env: &[],
            nofile: None,
            known_addr: false,
        }
    }

    pub fn kubeconfig(mut self, kubeconfig: Option<&'a Path>) -> Self {
        self.kubeconfig = kubeconfig;
        self
    }

    /// Flags after the defaults; a `--proc-root` among them replaces the tree's.
    pub fn args(mut self, args: &'a [&'a str]) -> Self {
        self.args = args;
        self
    }

    /// Environment variables on top of the cleaned one (`FABRICGATE_FAILPOINT`, ...).
    pub fn env(mut self, env: &'a [(&'a str, &'a str)]) -> Self {
        self.env = env;
        self
    }

    /// `ulimit -n` (soft and hard) for the agent: it cannot raise its soft limit past it.
    pub fn nofile(mut self, nofile: Option<u32>) -> Self {
        self.nofile = nofile;
        self
    }

    /// Serve `/metrics`, `/healthz` and `/readyz` on a port this test knows
    /// ([`Agent::get`]) instead of port 0.
    pub fn known_addr(mut self) -> Self {
        self.known_addr = true;
        self
    }

    pub fn start(self) -> Agent {
        static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = self.scratch.join(format!("agent-{}-{n}.log", self.node));
        // A port nobody listens on right now (bound and released): the agent's own listener
        // does not say which port it got.
        let addr = self.known_addr.then(|| {
            TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
        });
        let metrics_addr = addr.map_or("127.0.0.1:0".to_owned(), |a| a.to_string());
        // `ulimit -n` in the shell that execs the agent sets both limits.
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(match self.nofile {
                Some(n) => format!("ulimit -n {n} && exec \"$0\" \"$@\""),
                None => "exec \"$0\" \"$@\"".to_owned(),
            })
            .arg(env!("CARGO_BIN_EXE_fabricgate"))
            .arg("run")
            .arg("--sysfs-root")
            .arg(self.sysfs);
        if !self.args.contains(&"--proc-root") {
            cmd.arg("--proc-root").arg(self.proc_root);
        }
        cmd.args(["--verbs", "off", "--metrics-addr", &metrics_addr])
            .args(self.args)
            .env("HOME", self.scratch)
            .env("NODE_NAME", self.node)
            .env(
                "KUBECONFIG",
                self.kubeconfig
                    .map_or_else(|| self.scratch.join("no-such-kubeconfig"), Path::to_owned),
            )
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT")
            .env_remove("RUST_LOG")
            .env_remove("FABRICGATE_FAILPOINT")
            .envs(self.env.iter().copied())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("agent log"));
        Agent {
            child: cmd.spawn().expect("start fabricgate run"),
            log,
            addr,
        }
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
    Launch::at(node, sysfs, proc_root, scratch)
        .kubeconfig(kubeconfig)
        .args(extra)
        .start()
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

/// A running `fabricgate run`, killed on drop.
pub struct Agent {
    pub child: Child,
    pub log: PathBuf,
    /// Where it serves HTTP, when started with [`Launch::known_addr`].
    pub addr: Option<SocketAddr>,
}

impl Agent {
    /// SIGTERM, then its exit status and how long it took to exit.
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

    /// [`super::wait_until`], with the end of this agent's log in the failure message.
    pub fn wait(&self, what: &str, limit: Duration, f: impl FnMut() -> bool) -> Duration {
        poll_until(what, limit, Duration::from_millis(10), f, || {
            format!("; agent log:\n{}", last_lines(&self.log(), 30))
        })
    }

    /// Its exit status once it exits by itself within `limit` (the test fails otherwise,
    /// with its log).
    pub fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "the agent did not exit within {limit:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One GET of its HTTP server with a 3 s budget: status and body, `None` when it did not
    /// answer.
    pub fn get(&self, path: &str) -> Option<(u16, String)> {
        let addr = self
            .addr
            .expect("the agent was started with Launch::known_addr");
        try_http_get(&addr.to_string(), path, None, Duration::from_secs(3))
            .map(|(status, _, body)| (status, body))
    }

    /// Waits (20 s at most) until the first probe is done: `/readyz` answers 200.
    pub fn wait_first_probe(&self) {
        self.wait("first probe", Duration::from_secs(20), || {
            self.get("/readyz").is_some_and(|(s, _)| s == 200)
        });
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
