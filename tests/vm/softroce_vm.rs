//! Real RDMA end to end: boots a Debian kernel under qemu (tests/vm/), creates a Soft-RoCE
//! device `rxe0` over the guest's eth0 and runs this build's `fabricgate` against it. One boot
//! runs every scenario (tests/vm/scenarios.sh); each test below asserts one of them.
//!
//! Outside CI the tests skip, saying why, when qemu or the kernel package is unavailable;
//! with CI=true a missing prerequisite is a failure.

use crate::common;

use common::controlplane::ControlPlane;
use common::has_taint;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The results of the one boot: the output folder and what the host saw of the daemon, or
/// why the suite is skipped.
enum Boot {
    Ran(PathBuf, DaemonRun),
    Skipped(String),
}

const NODE: &str = "fabricgate-vm";

/// What the host saw on the real apiserver's Node while the daemon ran in the guest.
#[derive(Debug, Default)]
struct DaemonRun {
    /// First validation: daemon start to the Node labelled ready without the taint.
    start_to_ready: Option<Duration>,
    /// `ip link set eth0 down` (the guest's marker file) to the taint on the Node.
    down_to_taint: Option<Duration>,
    /// `ip link set eth0 up` to the taint gone (includes `node.recover_after` good probes).
    up_to_untaint: Option<Duration>,
    /// `rdma link delete rxe0` to the taint back.
    delete_to_taint: Option<Duration>,
    /// The agent restarted without /dev/infiniband: start to the Node saying AgentError with
    /// the taint, and that Node.
    hidden_to_agent_error: Option<Duration>,
    agent_error_node: Option<Value>,
    /// The Node while tainted, and after recovery.
    tainted_node: Option<Value>,
    recovered_node: Option<Value>,
    /// Why the host gave up, if it did.
    error: Option<String>,
}

/// The Node's condition `type_`, `null` when it has none (so that comparisons just fail).
fn condition<'a>(node: &'a Value, type_: &str) -> &'a Value {
    common::node_condition(node, type_).unwrap_or(&Value::Null)
}

fn is_validated(node: &Value) -> bool {
    node["metadata"]["labels"]["fabricgate.io/ready"] == "true" && !has_taint(node)
}

/// Drives the host side of scenario 6 in tests/vm/scenarios.sh: waits for the guest's
/// marker files, watches the Node, and acknowledges each phase with `host.NAME`.
struct Host<'a> {
    cp: &'a ControlPlane,
    out: &'a Path,
    child: &'a mut Child,
}

impl Host<'_> {
    const POLL: Duration = Duration::from_millis(20);

    fn guest_gone(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Wait for the guest's marker file; the instant it was seen.
    fn marker(&mut self, name: &str, limit: Duration) -> Result<Instant, String> {
        let start = Instant::now();
        loop {
            if self.out.join(name).exists() {
                return Ok(Instant::now());
            }
            if self.guest_gone() || start.elapsed() > limit {
                return Err(format!("the guest never wrote {name}"));
            }
            std::thread::sleep(Self::POLL);
        }
    }

    /// Wait until the Node satisfies `want`; the elapsed time since `since`.
    fn node_until(
        &mut self,
        what: &str,
        since: Instant,
        limit: Duration,
        want: impl Fn(&Value) -> bool,
    ) -> Result<(Duration, Value), String> {
        loop {
            if let Some(node) = self.cp.node(NODE).filter(|n| want(n)) {
                return Ok((since.elapsed(), node));
            }
            if self.guest_gone() || since.elapsed() > limit {
                return Err(format!(
                    "the Node never became {what}: {}",
                    self.cp.node(NODE).unwrap_or_default()
                ));
            }
            std::thread::sleep(Self::POLL);
        }
    }

    fn ack(&self, name: &str) {
        std::fs::write(self.out.join(format!("host.{name}")), b"").unwrap();
    }

    fn drive(&mut self, run: &mut DaemonRun) -> Result<(), String> {
        let long = Duration::from_secs(240);
        let started = self.marker("daemon.started", long)?;
        let (t, _) =
            self.node_until("validated", started, Duration::from_secs(120), is_validated)?;
        run.start_to_ready = Some(t);
        self.ack("ready");

        let down = self.marker("daemon.down", Duration::from_secs(30))?;
        let (t, _) = self.node_until("tainted", down, Duration::from_secs(60), has_taint)?;
        run.down_to_taint = Some(t);
        // Taint, labels and conditions are separate writes: wait for the whole picture.
        let (_, node) = self.node_until("not ready", down, Duration::from_secs(60), |n| {
            has_taint(n)
                && n["metadata"]["labels"]["fabricgate.io/ready"] == "false"
                && condition(n, "RDMAReady")["status"] == "False"
        })?;
        run.tainted_node = Some(node);
        self.ack("tainted");

        let up = self.marker("daemon.up", Duration::from_secs(60))?;
        let (t, _) =
            self.node_until("untainted", up, Duration::from_secs(90), |n| !has_taint(n))?;
        run.up_to_untaint = Some(t);
        let (_, node) = self.node_until("validated", up, Duration::from_secs(90), |n| {
            is_validated(n) && condition(n, "RDMAReady")["status"] == "True"
        })?;
        run.recovered_node = Some(node);
        self.ack("untainted");

        let hidden = self.marker("daemon.hidden", Duration::from_secs(60))?;
        let (t, node) = self.node_until("AgentError", hidden, Duration::from_secs(60), |n| {
            has_taint(n) && condition(n, "RDMAReady")["reason"] == "AgentError"
        })?;
        run.hidden_to_agent_error = Some(t);
        run.agent_error_node = Some(node);
        self.ack("agent_error");
        let restarted = self.marker("daemon.restarted", Duration::from_secs(60))?;
        self.node_until(
            "validated again",
            restarted,
            Duration::from_secs(90),
            is_validated,
        )?;
        self.ack("recovered");

        let deleted = self.marker("vanish.deleted", Duration::from_secs(60))?;
        let (t, _) =
            self.node_until("tainted again", deleted, Duration::from_secs(60), has_taint)?;
        run.delete_to_taint = Some(t);
        self.ack("tainted_again");
        Ok(())
    }
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn boot() -> &'static Boot {
    static BOOT: OnceLock<Boot> = OnceLock::new();
    BOOT.get_or_init(|| {
        let vm = manifest_dir().join("tests/vm");
        let missing = common::vm_prerequisites_missing();
        if let Some(why) = missing {
            common::require(false, &why, "run .ci/vm.sh");
            return Boot::Skipped(why);
        }
        let _slot = common::vm_slot();
        // console.log, every command's JSON and stderr stay in `out` for inspection.
        let (mut cmd, out) = common::vm_command("run.sh", 290, "softroce-vm", "scenarios.sh");

        // The real kube-apiserver on the host's loopback; the guest reaches it through its
        // second NIC (qemu user network 10.0.3.0/24, host 10.0.3.2, which the serving
        // certificate names). The daemon uses its pod-bound ServiceAccount token, so RBAC and
        // the own-node admission policy are in force.
        let Some(cp) = ControlPlane::shared() else {
            return Boot::Skipped("no control plane binary (run .ci/controlplane.sh)".into());
        };
        cp.create_node(
            NODE,
            serde_json::json!({}),
            serde_json::json!([]),
            serde_json::json!({}),
        );
        let kubeconfig = out.join("kubeconfig");
        let token = cp.agent_token(NODE);
        cp.write_kubeconfig(
            &kubeconfig,
            &format!("https://10.0.3.2:{}", cp.port),
            &token,
        );

        let mut child = cmd
            .env("FG_REQ", vm.join("rxe-requirements.yaml"))
            .env("FG_KUBECONFIG", &kubeconfig)
            .env("FG_NODE", NODE)
            .spawn()
            .expect("run tests/vm/run.sh");
        let mut run = DaemonRun::default();
        let mut host = Host {
            cp,
            out: &out,
            child: &mut child,
        };
        if let Err(e) = host.drive(&mut run) {
            host.ack("abort");
            run.error = Some(e);
        }
        let status = child.wait().expect("wait for tests/vm/run.sh");
        assert!(
            status.success(),
            "the VM run failed ({status}); see {}/console.log and stderr",
            out.display()
        );
        Boot::Ran(out, run)
    })
}

/// The folder of results, or `None` (after printing why) when skipped.
fn results() -> Option<&'static Path> {
    match boot() {
        Boot::Ran(dir, _) => Some(dir),
        Boot::Skipped(why) => {
            common::require(false, why, "run .ci/vm.sh");
            None
        }
    }
}

fn json(dir: &Path, name: &str) -> Value {
    let path = dir.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}: {text}", path.display()))
}

fn rc(dir: &Path, name: &str) -> i32 {
    let path = dir.join(format!("{name}.rc"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

fn reasons(doc: &Value) -> Vec<String> {
    doc["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect()
}

fn rxe0(doc: &Value) -> &Value {
    doc["rdma"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "rxe0")
        .unwrap_or_else(|| panic!("no rxe0 in {doc}"))
}

#[test]
fn rxe0_up_is_ready_with_verbs_opened_for_real() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "up");
    assert_eq!(rc(dir, "up"), 0, "{doc}");
    assert_eq!(doc["ready"], true, "{doc}");
    assert_eq!(doc["rdma"]["ready"], true);
    assert_eq!(doc["rdma"]["usable_ports"], 1);
    assert_eq!(doc["rdma"]["verbs"]["error"], Value::Null);
    assert!(
        doc["rdma"]["verbs"]["devices"]
            .as_array()
            .unwrap()
            .contains(&Value::from("rxe0"))
    );
    let dev = rxe0(&doc);
    assert_eq!(dev["verbs"]["opened"], true, "{dev}");
    assert_eq!(dev["verbs"]["phys_port_cnt"], 1);
    assert!(dev["errors"].as_array().unwrap().is_empty(), "{dev}");
    let port = &dev["ports"][0];
    assert_eq!(port["port"], 1);
    assert_eq!(port["state"], "ACTIVE");
    assert_eq!(port["phys_state"], "LinkUp");
    assert_eq!(port["link_layer"], "Ethernet");
    assert_eq!(port["verbs"]["state"], "ACTIVE", "{port}");
    assert_eq!(port["netdevs"], serde_json::json!(["eth0"]));
    assert!(
        port["gids"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["gid_type"] == "RoCE v2" && g["netdev"] == "eth0"),
        "{port}"
    );
    assert_eq!(doc["labels"]["fabricgate.io/rdma.link-layer"], "Ethernet");
    assert_eq!(doc["labels"]["fabricgate.io/rdma.rate-gbps"], "2.5");
    assert!(doc["taints"].as_array().unwrap().is_empty());
    // rdma.selftest: on-start ran the data path in the same probe.
    assert_eq!(port["selftest"]["ok"], true, "{port}");
    assert!(port["selftest"]["latency_us"].as_f64().unwrap() > 0.0);
}

#[test]
fn selftest_moves_and_verifies_bytes_over_rc_loopback() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "selftest");
    assert_eq!(rc(dir, "selftest"), 0, "{doc}");
    assert_eq!(doc["ok"], true);
    let port = &doc["ports"][0];
    assert_eq!(port["device"], "rxe0");
    assert_eq!(port["port"], 1);
    assert_eq!(port["ok"], true);
    assert_eq!(port["failed_step"], Value::Null);
    let latency = port["latency_us"].as_f64().unwrap();
    assert!(latency > 0.0 && latency < 2_000_000.0, "{latency}");
    // rxe0's GID table: the IPv4-mapped RoCE v2 GID of 10.0.2.15 is index 1.
    assert_eq!(port["gid_index"], 1);
    eprintln!("self-test RDMA WRITE round trip under TCG: {latency:.1} µs");
}

#[test]
fn selftest_names_reg_mr_and_errno_when_memlock_is_too_low() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "selftest_memlock");
    assert_eq!(rc(dir, "selftest_memlock"), 1, "{doc}");
    let port = &doc["ports"][0];
    assert_eq!(port["ok"], false);
    assert_eq!(port["failed_step"], "reg_mr");
    assert_eq!(port["errno"], 12);
    let msg = port["message"].as_str().unwrap();
    assert!(
        msg.starts_with("reg_mr: errno 12 (ENOMEM): RLIMIT_MEMLOCK too low"),
        "{msg}"
    );
    // The same failure through `check`: the port is not ready, the reason says why.
    let check = json(dir, "check_memlock");
    assert_eq!(rc(dir, "check_memlock"), 1);
    assert_eq!(check["ready"], false);
    assert!(
        reasons(&check)
            .iter()
            .any(|r| r
                .starts_with("rxe0 port 1: data-path self-test failed: reg_mr: errno 12 (ENOMEM)")),
        "{:?}",
        reasons(&check)
    );
    assert_eq!(check["conditions"][1]["reason"], "SelftestFailed");
}

#[test]
fn eth0_down_flips_the_verdict_naming_the_port_and_up_restores_it() {
    let Some(dir) = results() else { return };
    let down = json(dir, "down");
    assert_eq!(rc(dir, "down"), 1);
    assert_eq!(down["ready"], false);
    let r = reasons(&down);
    assert!(
        r.iter().any(|m| m.starts_with("rxe0 port 1: state DOWN")),
        "{r:?}"
    );
    assert_eq!(down["conditions"][1]["reason"], "PortDown");
    assert_eq!(down["taints"][0]["key"], "fabricgate.io/unvalidated");
    let t = common::vm_timings(dir);
    // The very first probe after `ip link set eth0 down` already sees it.
    assert_eq!(t["down_checks"], 1, "{t:?}");

    // `fabricgate selftest` on the down port fails at the first step, saying so.
    let st = json(dir, "selftest_down");
    assert_eq!(rc(dir, "selftest_down"), 1, "{st}");
    assert_eq!(st["ports"][0]["failed_step"], "query_port");
    let msg = st["ports"][0]["message"].as_str().unwrap();
    assert!(msg.contains("port is DOWN"), "{msg}");

    let up = json(dir, "up_again");
    assert_eq!(rc(dir, "up_again"), 0, "{up}");
    assert_eq!(up["ready"], true);
    assert_eq!(rxe0(&up)["ports"][0]["selftest"]["ok"], true);
    eprintln!(
        "eth0 down -> sysfs DOWN {} ms, -> verdict not ready {} ms (one check takes {} ms \
         under TCG); eth0 up -> ACTIVE {} ms, -> ready {} ms",
        t["down_to_sysfs_ms"],
        t["down_to_not_ready_ms"],
        t["check_ms"],
        t["up_to_active_ms"],
        t["up_to_ready_ms"]
    );
}

#[test]
fn hidden_dev_infiniband_is_not_ready_because_verbs_cannot_open_what_sysfs_shows() {
    let Some(dir) = results() else { return };
    let doc = json(dir, "hidden");
    assert_eq!(rc(dir, "hidden"), 1);
    assert_eq!(doc["ready"], false);
    let dev = rxe0(&doc);
    assert_eq!(dev["verbs"]["opened"], false);
    // sysfs still shows the port up...
    assert_eq!(dev["ports"][0]["state"], "ACTIVE");
    // ...and the reason says verbs cannot open it.
    let r = reasons(&doc);
    assert!(
        r.iter().any(
            |m| m.starts_with("rxe0: sysfs shows the device but verbs cannot open it")
                && m.contains("/dev/infiniband")
        ),
        "{r:?}"
    );
    assert_eq!(doc["conditions"][1]["reason"], "VerbsUnavailable");
}

#[test]
fn rdma_link_delete_mid_run_is_reported_not_a_crash() {
    let Some(dir) = results() else { return };
    let rcs = std::fs::read_to_string(dir.join("vanish.rcs")).unwrap();
    let rcs: Vec<i32> = rcs.lines().map(|l| l.trim().parse().unwrap()).collect();
    assert_eq!(rcs.len(), 6, "{rcs:?}");
    // 0 or 1 only: no panic (101), no signal, no "could not probe".
    assert!(rcs.iter().all(|&c| c == 0 || c == 1), "{rcs:?}");
    let stderr = std::fs::read_to_string(dir.join("vanish.stderr")).unwrap_or_default();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let gone = json(dir, "gone");
    assert_eq!(rc(dir, "gone"), 1);
    assert_eq!(gone["ready"], false);
    assert!(
        reasons(&gone)
            .iter()
            .any(|m| m.starts_with("no RDMA devices")),
        "{:?}",
        reasons(&gone)
    );
}

#[test]
fn daemon_in_the_vm_taints_and_untaints_its_node_on_the_real_apiserver_as_eth0_goes_down_and_up() {
    let Some(dir) = results() else { return };
    let Boot::Ran(_, run) = boot() else { return };
    let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
    assert!(
        run.error.is_none(),
        "{:?}\n{run:?}\ndaemon log:\n{log}",
        run.error
    );
    let tainted = run.tainted_node.as_ref().unwrap();
    assert_eq!(
        tainted["metadata"]["labels"]["fabricgate.io/ready"],
        "false"
    );
    let rdma_ready = condition(tainted, "RDMAReady");
    assert_eq!(rdma_ready["status"], "False");
    assert_eq!(rdma_ready["reason"], "PortDown");
    assert!(
        rdma_ready["message"]
            .as_str()
            .unwrap()
            .contains("rxe0 port 1"),
        "{rdma_ready}"
    );
    let recovered = run.recovered_node.as_ref().unwrap();
    assert_eq!(
        recovered["metadata"]["labels"]["fabricgate.io/rdma.active-ports"],
        "1"
    );
    // The kubelet's own label survives the agent's writes.
    assert_eq!(
        recovered["metadata"]["labels"]["kubernetes.io/hostname"],
        NODE
    );
    // Validated twice: at start and after eth0 came back, each time only after
    // node.recover_after (3) consecutive good probes.
    let validations: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("node validated"))
        .collect();
    assert_eq!(validations.len(), 2, "{log}");
    assert!(
        validations.iter().all(|l| l.contains("good_probes=3")),
        "{log}"
    );
    // Without access to the device nodes: the agent's own trouble, not the hardware's.
    let agent_error = run.agent_error_node.as_ref().unwrap();
    for kind in ["FabricReady", "RDMAReady"] {
        let c = condition(agent_error, kind);
        assert_eq!(c["status"], "False", "{c}");
        assert_eq!(c["reason"], "AgentError", "{c}");
        let message = c["message"].as_str().unwrap();
        assert!(
            message.contains("/dev/infiniband") && message.contains("device-plugin"),
            "names the device and the fix: {message}"
        );
    }
    // rdma link delete: tainted again, and the daemon kept running until SIGTERM.
    assert!(run.delete_to_taint.is_some());
    assert!(dir.join("daemon.alive_after_delete").exists(), "{log}");
    let rc = std::fs::read_to_string(dir.join("daemon.rc")).unwrap();
    assert_eq!(rc.trim(), "0", "daemon exit after SIGTERM; log:\n{log}");
    eprintln!(
        "daemon (interval 1s): start -> validated {:?}; eth0 down -> taint on the real apiserver \
         {:?}; eth0 up -> taint removed {:?}; no /dev/infiniband -> AgentError + taint {:?}; \
         rdma link delete -> taint {:?}",
        run.start_to_ready,
        run.down_to_taint,
        run.up_to_untaint,
        run.hidden_to_agent_error,
        run.delete_to_taint
    );
}

// ---- fabricgate preflight in the VM (scenario P) -------------------------------------------

fn text(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_default()
}

/// Preflight's wall time in the VM, exec to exit (printed for docs/preflight.md).
fn preflight_ms(dir: &Path, name: &str) -> u64 {
    common::vm_timings(dir)[&format!("{name}_ms")]
}

#[test]
fn preflight_with_rxe0_up_pins_nccl_to_rxe0_port_1() {
    let Some(dir) = results() else { return };
    let stderr = text(dir, "preflight_ok.stderr");
    assert_eq!(rc(dir, "preflight_ok"), 0, "{stderr}");
    let conf = text(dir, "preflight_ok.nccl/nccl.conf");
    let vars: Vec<&str> = conf.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(vars, ["NCCL_NET=IB", "NCCL_IB_HCA==rxe0:1"], "{conf}");
    let env = text(dir, "preflight_ok.nccl/nccl.env");
    assert!(env.contains("export NCCL_IB_HCA='=rxe0:1'"), "{env}");
    assert!(
        text(dir, "preflight_ok.termlog").starts_with("fabricgate preflight: validated rxe0:1"),
        "{}",
        text(dir, "preflight_ok.termlog")
    );
    eprintln!(
        "preflight in the VM (TCG), rxe0 up, self-test on: {} ms",
        preflight_ms(dir, "preflight_ok")
    );
}

#[test]
fn preflight_without_dev_infiniband_fails_within_2s_naming_the_device_nodes() {
    let Some(dir) = results() else { return };
    assert_eq!(rc(dir, "preflight_hidden"), 1);
    let log = text(dir, "preflight_hidden.termlog");
    assert!(
        log.starts_with("no RDMA device node in this container: /dev/infiniband/uverbs0 (rxe0)"),
        "{log}"
    );
    assert!(text(dir, "preflight_hidden.stderr").contains(&log));
    assert!(!dir.join("preflight_hidden.nccl/nccl.conf").exists());
    // Fail fast: with no device node there is nothing to open, so verbs (and the provider
    // libraries it loads) are skipped, and the run ends within the 2 s, measured by
    // preflight itself from start to verdict. Exec of this debug binary over 9p under TCG is
    // not part of it; the whole command's wall time is printed beside it.
    let (verbs, total) = own_timings(&text(dir, "preflight_hidden.stderr"));
    assert_eq!(verbs, 0.0, "verbs must not run without device nodes");
    assert!(total < 2.0, "{total} s");
    eprintln!(
        "preflight in the VM, /dev/infiniband not injected: {:.0} ms in preflight, {} ms \
         with exec",
        total * 1000.0,
        preflight_ms(dir, "preflight_hidden")
    );
}

/// The verbs time and the total from preflight's `timings:` line (seconds).
fn own_timings(stderr: &str) -> (f64, f64) {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("timings: "))
        .unwrap_or_else(|| panic!("no timings line in {stderr}"));
    let secs = |label: &str| -> f64 {
        let rest = &line[line
            .find(label)
            .unwrap_or_else(|| panic!("{label}: {line}"))
            + label.len()..];
        rest.trim_start()
            .split('s')
            .next()
            .unwrap()
            .parse()
            .unwrap_or_else(|e| panic!("{label} in {line}: {e}"))
    };
    (secs("verbs and self-test"), secs("total"))
}

#[test]
fn preflight_with_memlock_64k_names_memlock() {
    let Some(dir) = results() else { return };
    assert_eq!(rc(dir, "preflight_memlock"), 1);
    let log = text(dir, "preflight_memlock.termlog");
    assert!(
        log.lines()
            .any(|l| l.starts_with("memlock limit (RLIMIT_MEMLOCK) is 64 KiB (hard 64 KiB)")),
        "{log}"
    );
    assert!(!dir.join("preflight_memlock.nccl/nccl.conf").exists());
    eprintln!(
        "preflight in the VM, memlock 64 KiB: {} ms",
        preflight_ms(dir, "preflight_memlock")
    );
}

#[test]
fn preflight_with_a_required_path_missing_names_the_path() {
    let Some(dir) = results() else { return };
    assert_eq!(rc(dir, "preflight_no_path"), 1);
    let log = text(dir, "preflight_no_path.termlog");
    assert_eq!(log.lines().count(), 1, "{log}");
    assert!(log.starts_with("/data/missing: "), "{log}");
    eprintln!(
        "preflight in the VM, required path missing: {} ms",
        preflight_ms(dir, "preflight_no_path")
    );
}
