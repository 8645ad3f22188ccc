//! The agent never harms the node it guards (docs/hardening.md): each case runs the real
//! binary — a connection flood against a low descriptor limit, panics in its tasks, a stalled
//! probe, bad values, non-regular config paths, a closed stdout, an absurd port rate and
//! renamed devices.

mod common;

use common::sysfs::FakeHca;
use common::{Agent, Launch, TestNode, control_plane, sample};
use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NODE: &str = "gpu-node-1";
const BIN: &str = env!("CARGO_BIN_EXE_fabricgate");

/// `fabricgate run` over `hca` at a known address, for Node `node`'s pod-bound token when
/// given (else without a cluster, as Node [`NODE`]), with `nofile` as its descriptor limit
/// (soft and hard) when given, extra flags and environment.
fn start(
    hca: &FakeHca,
    node: Option<&TestNode>,
    nofile: Option<u32>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Agent {
    let kubeconfig = node.map(|n| n.agent_kubeconfig(None));
    Launch::at(
        node.map_or(NODE, |n| n.name.as_str()),
        &hca.sysfs_root(),
        &hca.proc_root(),
        hca.scratch(),
    )
    .kubeconfig(kubeconfig.as_deref())
    .args(extra)
    .env(env)
    .nofile(nofile)
    .known_addr()
    .start()
}

/// [`common::wait_until`], polling every 20 ms.
fn wait_until(what: &str, limit: Duration, f: impl FnMut() -> bool) -> Duration {
    common::poll_until(what, limit, Duration::from_millis(20), f, String::new)
}

/// Node `name` registered with our taint, or `None` (after `SKIP:`) without a control plane.
fn seeded_node(name: &str) -> Option<TestNode> {
    Some(TestNode::seeded(control_plane()?, name))
}

fn sysfs_only() -> fabricgate_probes::ProbeConfig {
    fabricgate_probes::ProbeConfig {
        verbs: fabricgate_probes::rdma::VerbsMode::Off,
        ..fabricgate_probes::ProbeConfig::default()
    }
}

fn write_config(hca: &FakeHca, name: &str, text: &str) -> PathBuf {
    let path = hca.scratch().join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Node `node` (seeded with our taint) and an agent for it over a healthy HCA whose probes
/// stall after the first one (`FABRICGATE_FAILPOINT=probe-stall`): a probe every 200 ms with a
/// 1 s deadline, `extra` flags, and `config_yaml` as its config file. Returned once that first
/// probe validated the Node (our taint gone); `None` (after `SKIP:`) without a control plane.
fn start_validated_then_stalling(
    node: &str,
    config_yaml: &str,
    extra: &[&str],
) -> Option<(TestNode, FakeHca, Agent)> {
    let hca = FakeHca::new(true);
    let api = seeded_node(node)?;
    let config = write_config(&hca, "req.yaml", config_yaml);
    let mut args = vec!["--interval", "200ms", "--probe-deadline", "1s"];
    args.extend(extra);
    args.extend(["--config", config.to_str().unwrap()]);
    let agent = start(
        &hca,
        Some(&api),
        None,
        &args,
        &[("FABRICGATE_FAILPOINT", "probe-stall")],
    );
    wait_until("validated", Duration::from_secs(20), || {
        !api.has_our_taint()
    });
    Some((api, hca, agent))
}

// ---------------------------------------------------------------------------------------------
// 1. The HTTP server cannot be starved.

#[test]
fn connection_flood_against_a_low_descriptor_limit_leaves_probes_and_healthz_working() {
    let hca = FakeHca::new(true);
    let mut agent = start(
        &hca,
        None,
        Some(128),
        &["--interval", "100ms", "--dry-run"],
        &[],
    );
    agent.wait_first_probe();

    // 400 idle connections (never a byte sent), held open: three times the agent's limit.
    let mut flood = Vec::new();
    for _ in 0..400 {
        if let Ok(s) = TcpStream::connect_timeout(&agent.addr.unwrap(), Duration::from_secs(1)) {
            flood.push(s);
        }
    }
    assert!(flood.len() >= 300, "opened {}", flood.len());

    // During the flood: /healthz answers at once, probes keep succeeding.
    for _ in 0..5 {
        let (status, body) = agent
            .get("/healthz")
            .expect("/healthz answers during the flood");
        assert_eq!(status, 200, "{body}");
    }
    let before = agent.get("/metrics").expect("/metrics answers").1;
    let ts_before = sample(&before, "fabricgate_last_probe_timestamp_seconds").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let (status, metrics) = agent.get("/metrics").expect("/metrics answers");
    assert_eq!(status, 200);
    let ts_after = sample(&metrics, "fabricgate_last_probe_timestamp_seconds").unwrap();
    assert!(
        ts_after > ts_before,
        "probes go on: {ts_before} -> {ts_after}"
    );
    assert_eq!(
        sample(&metrics, "fabricgate_node_ready"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(sample(&metrics, "fabricgate_agent_error"), Some(0.0));
    for probe in ["rdma_sysfs", "storage", "netdev"] {
        assert_eq!(
            sample(
                &metrics,
                &format!("fabricgate_probe_errors_total{{probe=\"{probe}\"}}")
            ),
            Some(0.0),
            "{probe}: no probe failed for lack of descriptors"
        );
    }
    let evicted = sample(
        &metrics,
        "fabricgate_http_connections_dropped_total{why=\"evicted\"}",
    )
    .unwrap();
    assert!(evicted >= 300.0, "evicted {evicted}");
    let open = sample(&metrics, "fabricgate_http_connections").unwrap();
    assert!(open <= 32.0, "the cap follows the descriptor limit: {open}");
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200));

    // The idle ones still held are closed by the header-read timeout (5 s).
    std::thread::sleep(Duration::from_secs(6));
    let mut closed = 0;
    for s in &mut flood {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(0) => closed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
            _ => {}
        }
    }
    assert_eq!(closed, flood.len(), "every idle connection was closed");
    assert!(
        !agent.log().contains("Too many open files"),
        "{}",
        agent.log()
    );
    assert!(agent.child.try_wait().unwrap().is_none(), "still running");
}

// ---------------------------------------------------------------------------------------------
// 2. The agent's own trouble is never a node fault.

#[test]
fn a_panic_in_the_reconcile_task_ends_the_process_non_zero() {
    let hca = FakeHca::new(true);
    let Some(api) = seeded_node("hardening-reconcile-panic") else {
        return;
    };
    let mut agent = start(
        &hca,
        Some(&api),
        None,
        &["--interval", "100ms"],
        &[("FABRICGATE_FAILPOINT", "reconcile-panic")],
    );
    let status = agent.wait_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(70), "{}", agent.log());
    assert!(agent.log().contains("panicked"), "{}", agent.log());
}

#[test]
fn a_panic_in_the_probe_thread_ends_the_process_non_zero() {
    let hca = FakeHca::new(true);
    let mut agent = start(
        &hca,
        None,
        None,
        &["--interval", "100ms", "--dry-run"],
        &[("FABRICGATE_FAILPOINT", "probe-panic")],
    );
    let status = agent.wait_exit(Duration::from_secs(20));
    assert_eq!(status.code(), Some(70), "{}", agent.log());
}

/// A probe that never returns: `/readyz` fails once it is past the deadline, `/healthz` after
/// the grace; the node says AgentError (one Event) and, by default, carries the taint.
#[test]
fn a_stalled_probe_is_an_agent_error_readyz_fails_then_healthz() {
    let Some((api, _hca, agent)) = start_validated_then_stalling(
        "hardening-stalled-probe",
        "node:\n  recover_after: 1\n",
        &["--liveness-grace", "3s"],
    ) else {
        return;
    };
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200));
    // The second probe stalls: not ready within the deadline (plus one interval).
    let took = wait_until("/readyz fails", Duration::from_secs(5), || {
        agent.get("/readyz").is_some_and(|(s, _)| s == 503)
    });
    // "At once": the deadline (1 s) plus scheduling slack on a loaded machine, well before
    // /healthz fails (deadline + grace = 4 s).
    assert!(took <= Duration::from_millis(2500), "{took:?}");
    let (_, why) = agent.get("/readyz").unwrap();
    // Whichever comes first: the probe past its deadline, or no probe for three intervals.
    assert!(why.contains("deadline") || why.contains("stalled"), "{why}");
    assert_eq!(
        agent.get("/healthz").map(|r| r.0),
        Some(200),
        "within the grace"
    );
    wait_until("the AgentError condition", Duration::from_secs(5), || {
        api.condition("FabricReady")
            .is_some_and(|c| c["reason"] == "AgentError")
    });
    let fabric = api.condition("FabricReady").unwrap();
    assert_eq!(fabric["status"], "False");
    assert!(
        fabric["message"]
            .as_str()
            .unwrap()
            .contains("probe deadline"),
        "{fabric}"
    );
    wait_until(
        "the taint (on_agent_error: taint)",
        Duration::from_secs(5),
        || api.has_our_taint(),
    );
    let metrics = agent.get("/metrics").unwrap().1;
    assert_eq!(sample(&metrics, "fabricgate_agent_error"), Some(1.0));
    let agent_events = || {
        api.events()
            .into_iter()
            .filter(|e| e["reason"] == "AgentError")
            .count()
    };
    // The Event is the last write of the transition.
    wait_until("the AgentError event", Duration::from_secs(5), || {
        agent_events() >= 1
    });
    // Past deadline + grace the kubelet is told to restart it.
    wait_until("/healthz fails", Duration::from_secs(5), || {
        agent.get("/healthz").is_some_and(|(s, _)| s == 503)
    });
    let (_, why) = agent.get("/healthz").unwrap();
    assert!(why.contains("wedged"), "{why}");
    assert_eq!(agent_events(), 1, "one Event: {:#?}", api.events());
}

#[test]
fn on_agent_error_keep_leaves_the_taint_as_it_is() {
    let Some((api, _hca, agent)) = start_validated_then_stalling(
        "hardening-keep",
        "node:\n  recover_after: 1\n  on_agent_error: keep\n",
        &[],
    ) else {
        return;
    };
    wait_until("the AgentError condition", Duration::from_secs(5), || {
        api.condition("FabricReady")
            .is_some_and(|c| c["reason"] == "AgentError")
    });
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        !api.has_our_taint(),
        "keep: no taint for the agent's own trouble"
    );
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(503));
}

#[test]
fn no_access_to_the_device_nodes_is_an_agent_error_not_a_hardware_reason() {
    // The verdict the agent gives when verbs cannot open the device from its container.
    use fabricgate::config::Config;
    use fabricgate_probes::rdma::VerbsDevice;
    use fabricgate_probes::{Prober, Roots};
    let hca = FakeHca::new(true);
    let mut prober = Prober::new(Roots::new(hca.sysfs_root(), hca.proc_root()), sysfs_only());
    let mut report = prober.probe();
    report.rdma.devices[0].verbs = Some(VerbsDevice {
        error: Some(
            "cannot open /dev/infiniband/uverbs0: permission denied; mount /dev/infiniband into \
             the container and allow access to it (device plugin or hostPath with a matching \
             device cgroup rule)"
                .into(),
        ),
        ..VerbsDevice::default()
    });
    let config = Config::default();
    let instant = fabricgate::policy::evaluate(&report, &config);
    assert!(
        instant
            .reasons()
            .iter()
            .any(|r| r.contains("verbs cannot open"))
    );
    let fault = fabricgate::policy::agent_fault::classify(&report, &[]).expect("an agent error");
    let v = fabricgate::policy::agent_fault::verdict(instant, &fault, &config);
    let v = fabricgate::policy::agent_fault::gate(v, Some(&fault), &config);
    for c in &v.conditions {
        if c.type_ == "FabricReady" || c.type_ == "RDMAReady" {
            assert_eq!(c.reason, "AgentError", "{c:?}");
            assert!(
                c.message.contains("device-plugin"),
                "the fix: {}",
                c.message
            );
        }
    }
    assert!(
        v.rdma.part.findings.iter().all(|f| f.code == "AgentError"),
        "no hardware reason: {:?}",
        v.rdma.part.findings
    );
    assert_eq!(
        v.taints.len(),
        1,
        "on_agent_error: taint (default) fails closed"
    );
    assert!(!v.keep_taint);

    let mut keep = Config::default();
    keep.node.on_agent_error = fabricgate::config::OnAgentError::Keep;
    let v = fabricgate::policy::agent_fault::gate(v, Some(&fault), &keep);
    assert!(v.keep_taint);

    // Descriptor exhaustion in any probe is the agent's too.
    let mut report = prober.probe();
    fabricgate_probes::storage::set(
        &mut report,
        fabricgate_probes::storage::StorageReport {
            errors: vec!["cannot read the mount table /proc/self/mountinfo: Too many open files (os error 24); check --proc-root".into()],
            ..Default::default()
        },
    );
    let fault = fabricgate::policy::agent_fault::classify(&report, &[]).unwrap();
    assert_eq!(
        fault.cause,
        fabricgate::policy::agent_fault::Cause::OutOfDescriptors
    );
}

/// Mounts the agent's container lacks: an unreadable mount table, or (live /proc) a required
/// mount whose top-level directory does not exist inside the container.
#[test]
fn missing_mounts_of_the_agent_itself_are_agent_errors() {
    let hca = FakeHca::new(true);
    let config = write_config(
        &hca,
        "req.yaml",
        "mounts:\n  - path: /fabricgate-test-absent-dir/data\n",
    );
    let empty_proc = hca.scratch().join("empty-proc");
    std::fs::create_dir(&empty_proc).unwrap();
    for (proc_root, needle) in [
        (
            Path::new("/proc"),
            "does not exist inside the agent's container",
        ),
        (empty_proc.as_path(), "cannot read the mount table"),
    ] {
        let mut cmd_args = vec![
            "--interval".to_owned(),
            "100ms".to_owned(),
            "--dry-run".to_owned(),
            "--config".to_owned(),
            config.to_str().unwrap().to_owned(),
        ];
        cmd_args.push("--proc-root".into());
        cmd_args.push(proc_root.to_str().unwrap().into());
        let args: Vec<&str> = cmd_args.iter().map(String::as_str).collect();
        let agent = start(&hca, None, None, &args, &[]);
        wait_until("the agent error", Duration::from_secs(20), || {
            agent
                .get("/metrics")
                .is_some_and(|(_, m)| sample(&m, "fabricgate_agent_error") == Some(1.0))
        });
        let (status, why) = agent.get("/readyz").unwrap();
        assert_eq!(status, 503);
        assert!(why.contains(needle), "{why}");
        let metrics = agent.get("/metrics").unwrap().1;
        assert!(
            metrics.contains("fabricgate_findings{scope=\"lustre\",reason=\"AgentError\"} 1"),
            "{metrics}"
        );
        assert!(
            !metrics.contains("reason=\"MountMissing\""),
            "no node reason"
        );
        assert_eq!(
            agent.get("/healthz").map(|r| r.0),
            Some(200),
            "no restart for this"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Values are checked where they enter.

/// All that `child` wrote to its piped stderr, read to the end.
fn piped_stderr(child: &mut Child) -> String {
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    stderr
}

/// `--sysfs-root` and `--proc-root` of `hca`'s tree.
fn root_flags(hca: &FakeHca) -> [String; 4] {
    [
        "--sysfs-root".to_owned(),
        hca.sysfs_root().to_str().unwrap().to_owned(),
        "--proc-root".to_owned(),
        hca.proc_root().to_str().unwrap().to_owned(),
    ]
}

/// Run the binary with `args`, expecting exit 2 within 5 s and `needle` on stderr.
fn expect_usage_error(args: &[&str], needle: &str) -> Duration {
    let started = Instant::now();
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove("FABRICGATE_FAILPOINT")
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env("NODE_NAME", NODE)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            panic!("{args:?}: still running after 5 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let took = started.elapsed();
    let stderr = piped_stderr(&mut child);
    assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(needle), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    took
}

#[test]
fn bad_flag_values_are_exit_2_at_once() {
    let hca = FakeHca::new(true);
    let roots = root_flags(&hca);
    for (flag, value) in [
        ("--interval", "1ns"),
        ("--interval", "300000000000y"),
        ("--resync-interval", "0s"),
        ("--resync-interval", "300000000000y"),
        ("--probe-deadline", "0s"),
        ("--stale-series-grace", "300000000000y"),
        ("--metrics-max-connections", "0"),
    ] {
        let mut args = vec!["run", flag, value];
        args.extend(roots.iter().map(String::as_str));
        args.extend([
            "--verbs",
            "off",
            "--dry-run",
            "--metrics-addr",
            "127.0.0.1:0",
        ]);
        expect_usage_error(&args, flag);
    }
    expect_usage_error(&["selftest", "--timeout", "300000000000y"], "--timeout");
}

#[test]
fn bad_config_values_are_exit_2_fast_and_name_the_key() {
    let hca = FakeHca::new(true);
    let roots = root_flags(&hca);
    let glob = "a".repeat(400 * 1024);
    let glob_100k = "a".repeat(100 * 1024);
    let deep = format!("rdma: {}{}\n", "[".repeat(100_000), "]".repeat(100_000));
    for (name, text, needle) in [
        (
            "statfs.yaml",
            "lustre:\n  statfs_timeout: 300000000000y\n".to_owned(),
            "lustre.statfs_timeout",
        ),
        (
            "window.yaml",
            "fallback:\n  window: soon\n".to_owned(),
            "fallback.window",
        ),
        (
            "glob.yaml",
            format!("rdma:\n  devices: \"{glob}\"\n"),
            "bytes is more than",
        ),
        (
            "glob100k.yaml",
            format!("rdma:\n  devices: \"{glob_100k}\"\n"),
            "rdma.devices",
        ),
        ("deep.yaml", deep, "nested"),
        (
            "selftest.yaml",
            "rdma:\n  selftest_timeout: 300000000000y\n".to_owned(),
            "rdma.selftest_timeout",
        ),
    ] {
        let path = write_config(&hca, name, &text);
        for cmd in ["check", "selftest"] {
            let mut args = vec![cmd, "--config", path.to_str().unwrap()];
            args.extend(roots.iter().map(String::as_str));
            let took = expect_usage_error(&args, needle);
            assert!(took < Duration::from_secs(5), "{name}: {took:?}");
        }
    }
}

#[test]
fn a_config_path_that_is_not_a_regular_file_is_exit_2_without_blocking() {
    let hca = FakeHca::new(true);
    let fifo = hca.scratch().join("fifo.yaml");
    let made = Command::new("mkfifo").arg(&fifo).status();
    assert!(made.is_ok_and(|s| s.success()), "mkfifo");
    let dir = hca.scratch().join("dir.yaml");
    std::fs::create_dir(&dir).unwrap();
    let sys = hca.sysfs_root();
    for (path, what) in [
        (fifo.as_path(), "a FIFO"),
        (dir.as_path(), "a directory"),
        (Path::new("/dev/zero"), "a device"),
    ] {
        expect_usage_error(
            &[
                "check",
                "--config",
                path.to_str().unwrap(),
                "--sysfs-root",
                sys.to_str().unwrap(),
                "--verbs",
                "off",
            ],
            what,
        );
    }
}

#[test]
fn an_absurd_port_rate_makes_no_invalid_label_and_stays_in_the_metrics() {
    let hca = FakeHca::new(true);
    let rate = hca
        .sysfs_root()
        .join("devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0/ports/1/rate");
    std::fs::write(&rate, "1e308 Gb/sec (4X NDR)\n").unwrap();
    let agent = start(&hca, None, None, &["--interval", "100ms", "--dry-run"], &[]);
    agent.wait_first_probe();
    let metrics = agent.get("/metrics").unwrap().1;
    let raw = sample(
        &metrics,
        "fabricgate_rdma_port_rate_gbps{device=\"mlx5_0\",port=\"1\"}",
    );
    assert_eq!(raw, Some(1e308), "the raw value is in the metrics");

    // The labels the agent writes: valid Kubernetes label values, the rate left out.
    use fabricgate_probes::{Prober, Roots};
    let mut prober = Prober::new(Roots::new(hca.sysfs_root(), hca.proc_root()), sysfs_only());
    let v = fabricgate::policy::evaluate(&prober.probe(), &fabricgate::config::Config::default());
    for (k, value) in &v.labels {
        assert!(
            fabricgate::policy::LabelValue::new(value).is_some() && value.len() <= 63,
            "{k}={value}"
        );
    }
    assert!(
        !v.labels.contains_key("fabricgate.io/rdma.rate-gbps"),
        "{:?}",
        v.labels
    );
    assert_eq!(v.labels["fabricgate.io/rdma.ready"], "true");
}

#[test]
fn series_of_vanished_devices_are_dropped_after_the_grace() {
    let hca = FakeHca::new(true);
    let class = hca.sysfs_root().join("class/infiniband");
    let dev_rel = "devices/pci0000:00/0000:00:02.0/infiniband/mlx5_0";
    let counters = hca.sysfs_root().join(dev_rel).join("ports/1/counters");
    std::fs::create_dir_all(&counters).unwrap();
    std::fs::write(counters.join("port_xmit_data"), "1000\n").unwrap();
    std::fs::write(counters.join("port_rcv_data"), "1000\n").unwrap();
    std::fs::write(counters.join("symbol_error"), "0\n").unwrap();
    let agent = start(
        &hca,
        None,
        None,
        &[
            "--interval",
            "50ms",
            "--dry-run",
            "--stale-series-grace",
            "300ms",
        ],
        &[],
    );
    agent.wait_first_probe();
    let first = agent.get("/metrics").unwrap().1;
    assert!(first.contains("device=\"mlx5_0\""));
    // 30 renames, each seen by a probe: the old names' series go once past the grace.
    let mut name = "mlx5_0".to_owned();
    for i in 1..=30 {
        let next = format!("mlx5_{i}");
        std::fs::rename(class.join(&name), class.join(&next)).unwrap();
        name = next;
        let want = format!("device=\"{name}\"");
        wait_until(
            "the renamed device in /metrics",
            Duration::from_secs(5),
            || {
                agent
                    .get("/metrics")
                    .is_some_and(|(_, m)| m.contains(&want))
            },
        );
    }
    std::thread::sleep(Duration::from_millis(600));
    let last = agent.get("/metrics").unwrap().1;
    let devices: std::collections::BTreeSet<&str> = last
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split("device=\"").nth(1))
        .filter_map(|r| r.split('"').next())
        .filter(|d| d.starts_with("mlx5_"))
        .collect();
    assert_eq!(
        devices.into_iter().collect::<Vec<_>>(),
        vec![name.as_str()],
        "only the current name remains"
    );
    assert!(
        last.len() < first.len() + 2048,
        "/metrics did not grow: {} -> {} bytes",
        first.len(),
        last.len()
    );
}

// ---------------------------------------------------------------------------------------------
// 4. A closed stdout.

#[test]
fn a_closed_stdout_ends_check_and_selftest_quietly_with_their_exit_codes() {
    let hca = FakeHca::new(true);
    let args = root_flags(&hca);
    for (cmd, extra) in [("check", &["--verbs", "off"][..]), ("selftest", &[][..])] {
        let normal = Command::new(BIN)
            .arg(cmd)
            .args(&args)
            .args(extra)
            .output()
            .unwrap();
        assert!(!normal.stdout.is_empty(), "{cmd} prints something");
        let mut child = Command::new(BIN)
            .arg(cmd)
            .args(&args)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before a byte is written (`| head -c0`).
        drop(child.stdout.take());
        let stderr = piped_stderr(&mut child);
        let status = child.wait().unwrap();
        assert_eq!(status.code(), normal.status.code(), "{cmd}: {stderr}");
        assert_ne!(status.code(), Some(101), "{cmd}: {stderr}");
        assert!(!stderr.contains("panicked"), "{cmd}: {stderr}");
    }
}

proptest::proptest! {
    /// Whatever the port reports, a rate label is valid or absent; every realistic rate has one.
    #[test]
    fn any_rate_gives_a_valid_label_value_or_none(gbps in proptest::num::f64::ANY) {
        let text = fabricgate_probes::rdma::format_gbps(gbps);
        if let Some(v) = fabricgate::policy::LabelValue::new(&text) {
            proptest::prop_assert!(valid_label_value(v.as_str()), "{}", text);
        }
        if (0.0..1e6).contains(&gbps) && gbps.is_sign_positive() {
            proptest::prop_assert!(fabricgate::policy::LabelValue::new(&text).is_some(), "{}", text);
        }
    }

    #[test]
    fn label_values_are_valid_by_construction(s in ".{0,80}") {
        match fabricgate::policy::LabelValue::new(&s) {
            Some(v) => proptest::prop_assert!(valid_label_value(v.as_str())),
            None => proptest::prop_assert!(!valid_label_value(&s)),
        }
    }
}

/// Kubernetes' rule, written out independently: `(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?`,
/// at most 63 characters.
fn valid_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_alphanumeric();
    b.len() <= 63
        && (b.is_empty()
            || (b.first().is_some_and(alnum)
                && b.last().is_some_and(alnum)
                && b.iter()
                    .all(|c| alnum(c) || matches!(c, b'-' | b'_' | b'.'))))
}

// ---------------------------------------------------------------------------------------------
// 3. A small descriptor limit: the kept-open budget leaves room for everything else.

/// Requirements that only a fully probed bench-12x2 tree meets: all 24 ports.
const ALL_24_PORTS: &str = "rdma:\n  min_active_ports: 24\n";

/// `check` over the 12-HCA, 24-port fixture at `ulimit -n 256`, with `taken` descriptors
/// already open when it starts (inherited from the shell, as a runtime or a wrapper may leave
/// them): exit code and output.
fn check_at_256(config: &Path, taken: u32) -> (Option<i32>, String) {
    let tree = common::fixture("bench-12x2");
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -n 256 && for i in $(seq 1 {taken}); do exec {{fd}}</dev/null; done && \
             exec \"$0\" \"$@\""
        ))
        .arg(BIN)
        .args(["check", "--verbs", "off", "--sysfs-root"])
        .arg(tree.join("sys"))
        .arg("--proc-root")
        .arg(tree.join("proc"))
        .arg("--config")
        .arg(config)
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code(), text)
}

#[test]
fn redteam_a_healthy_twelve_hca_node_validates_at_ulimit_256() {
    let scratch = tempfile::tempdir().unwrap();
    let config = scratch.path().join("req.yaml");
    std::fs::write(&config, ALL_24_PORTS).unwrap();
    // 0 taken: the budget alone must fit; 200 and 240 taken: only shedding kept files and
    // reading by reopening gets every attribute read.
    for taken in [0, 200, 240] {
        let (code, text) = check_at_256(&config, taken);
        assert_eq!(code, Some(0), "{taken} descriptors taken: {text}");
        assert!(
            !text.contains("Too many open files") && !text.contains("out_of_descriptors"),
            "{taken} descriptors taken: {text}"
        );
    }
}

#[test]
fn redteam_run_validates_a_twelve_hca_node_at_ulimit_256_through_a_connection_flood() {
    let tree = common::fixture("bench-12x2");
    let scratch = tempfile::tempdir().unwrap();
    let config = scratch.path().join("req.yaml");
    std::fs::write(&config, ALL_24_PORTS).unwrap();
    let config = config.to_str().unwrap().to_owned();
    let mut agent = Launch::at(NODE, &tree.join("sys"), &tree.join("proc"), scratch.path())
        .args(&["--interval", "100ms", "--dry-run", "--config", &config])
        .nofile(Some(256))
        .known_addr()
        .start();
    agent.wait_first_probe();
    // As many idle connections as the server will ever hold, and more.
    let flood: Vec<TcpStream> = (0..300)
        .filter_map(|_| {
            TcpStream::connect_timeout(&agent.addr.unwrap(), Duration::from_secs(1)).ok()
        })
        .collect();
    assert!(flood.len() >= 200, "opened {}", flood.len());
    let ts = |m: &str| sample(m, "fabricgate_last_probe_timestamp_seconds").unwrap_or(0.0);
    let before = ts(&agent.get("/metrics").expect("/metrics answers").1);
    std::thread::sleep(Duration::from_millis(600));
    let metrics = agent.get("/metrics").expect("/metrics answers").1;
    assert!(ts(&metrics) > before, "probes go on during the flood");
    assert_eq!(
        sample(&metrics, "fabricgate_node_ready"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "fabricgate_agent_error"),
        Some(0.0),
        "{metrics}"
    );
    let ports_up = metrics
        .lines()
        .filter(|l| l.starts_with("fabricgate_rdma_port_up{") && l.ends_with(" 1"))
        .count();
    assert_eq!(ports_up, 24, "every port probed: {metrics}");
    drop(flood);
    assert!(
        !agent.log().contains("Too many open files"),
        "{}",
        agent.log()
    );
    assert!(agent.child.try_wait().unwrap().is_none(), "still running");
}
