//! The Judge driven with literal reports: one row per reason a judgment can give, and the
//! sequences (hysteresis, stalls, events) that only a stateful judge can get wrong.

use super::*;
use crate::device_plugin::assess::{DEVICE_PLUGIN_UNAVAILABLE, PluginView};
use crate::policy::{AWAITING_VALIDATION, Scope, evaluate};
use agent_fault::Cause;
use fabricgate_probes::host::{HostReport, OwnMountMissing, SocketProblem};
use fabricgate_probes::rdma::{DeviceReport, LinkLayer, PhysState, PortReport, PortState, Rate};

const REQUIREMENTS: &str =
    "rdma:\n  min_active_ports: 2\n  min_rate_gbps: 400\nnode:\n  recover_after: 2\n";
const EMFILE: &str = "cannot read /sys/class/infiniband: Too many open files (os error 24)";

fn port(state: PortState) -> PortReport {
    PortReport {
        port: 1,
        state: Some(state),
        phys_state: Some(if state == PortState::Active {
            PhysState::LinkUp
        } else {
            PhysState::Disabled
        }),
        rate: Some(Rate {
            gbps: 400.0,
            width: 4,
            speed: "NDR".into(),
        }),
        link_layer: Some(LinkLayer::InfiniBand),
        ..PortReport::default()
    }
}

/// Two 400G InfiniBand HCAs; `down` names the ones whose port is down.
fn node(down: &[&str]) -> ProbeReport {
    let mut r = ProbeReport::default();
    r.rdma.subsystem_present = true;
    r.rdma.devices = ["mlx5_0", "mlx5_1"]
        .iter()
        .map(|name| DeviceReport {
            name: (*name).into(),
            ports: vec![port(if down.contains(name) {
                PortState::Down
            } else {
                PortState::Active
            })],
            ..DeviceReport::default()
        })
        .collect();
    r
}

/// A judge for a node an earlier run validated (the steady state of a healthy node).
fn validated(yaml: &str) -> Judge {
    let mut j = Judge::new(&Config::parse(yaml).unwrap());
    j.resume_validated();
    j
}

fn facts(report: &ProbeReport) -> Facts<'_> {
    Facts {
        report,
        peer_finding: None,
        devices: &[],
    }
}

fn finding(code: &'static str) -> Finding {
    Finding {
        scope: Scope::Rdma,
        code,
        message: format!("{code} (test)"),
    }
}

fn fabric_reason(v: &Verdict) -> &str {
    v.conditions
        .iter()
        .find(|c| c.type_ == "FabricReady")
        .map_or("", |c| c.reason.as_str())
}

fn tainted(v: &Verdict) -> bool {
    v.taints
        .iter()
        .any(|t| t.key == "fabricgate.io/unvalidated")
}

struct Row {
    name: &'static str,
    down: &'static [&'static str],
    rdma_error: Option<&'static str>,
    host: HostReport,
    node_plugin: Option<&'static str>,
    peer: Option<&'static str>,
    yaml: &'static str,
    ready: bool,
    reason: &'static str,
    cause: Option<Cause>,
}

fn row(name: &'static str) -> Row {
    Row {
        name,
        down: &[],
        rdma_error: None,
        host: HostReport::default(),
        node_plugin: None,
        peer: None,
        yaml: REQUIREMENTS,
        ready: true,
        reason: "FabricValidated",
        cause: None,
    }
}

#[test]
fn every_reason_of_a_full_probe_on_a_validated_node() {
    for r in reasons() {
        judge_row(r);
    }
}

/// One row per reason a full probe can give on a validated node.
fn reasons() -> Vec<Row> {
    let eacces = "cannot open /dev/infiniband/uverbs0: permission denied; mount /dev/infiniband \
                  into the container";
    vec![
        row("healthy"),
        Row {
            down: &["mlx5_1"],
            ready: false,
            reason: "PortDown",
            ..row("a port down")
        },
        Row {
            node_plugin: Some(DEVICE_PLUGIN_UNAVAILABLE),
            ready: false,
            reason: DEVICE_PLUGIN_UNAVAILABLE,
            ..row("the Node's device-plugin resource gone")
        },
        Row {
            host: HostReport {
                socket_problems: vec![SocketProblem {
                    name: "rdma.sock".into(),
                    problem: "/var/lib/kubelet/device-plugins/rdma.sock does not exist".into(),
                }],
                ..HostReport::default()
            },
            ready: false,
            reason: DEVICE_PLUGIN_UNAVAILABLE,
            ..row("the device plugin's socket gone")
        },
        Row {
            host: HostReport {
                plugin_dir_missing: true,
                ..HostReport::default()
            },
            ready: false,
            reason: agent_fault::REASON,
            cause: Some(Cause::MissingOwnMount),
            ..row("the agent cannot see the device-plugins directory")
        },
        Row {
            peer: Some("PeersUnreachable"),
            ready: false,
            reason: "PeersUnreachable",
            ..row("peers required and unreachable")
        },
        Row {
            rdma_error: Some(EMFILE),
            ready: false,
            reason: agent_fault::REASON,
            cause: Some(Cause::OutOfDescriptors),
            ..row("out of descriptors")
        },
        Row {
            rdma_error: Some("ibv_reg_mr on mlx5_0: Cannot allocate memory (os error 12)"),
            ready: false,
            reason: agent_fault::REASON,
            cause: Some(Cause::OutOfMemory),
            ..row("out of memory")
        },
        Row {
            rdma_error: Some(eacces),
            ready: false,
            reason: agent_fault::REASON,
            cause: Some(Cause::NoDeviceAccess),
            ..row("no device access")
        },
        Row {
            rdma_error: Some(eacces),
            host: HostReport {
                missing_device_nodes: vec!["/dev/infiniband/uverbs1 (mlx5_1)".into()],
                ..HostReport::default()
            },
            ready: false,
            reason: DEVICE_PLUGIN_UNAVAILABLE,
            ..row("an incomplete device set is the plugin's fault, not the agent's")
        },
        Row {
            host: HostReport {
                own_mounts_missing: vec![OwnMountMissing {
                    path: "/lustre/scratch".into(),
                    top: "/lustre".into(),
                }],
                ..HostReport::default()
            },
            ready: false,
            reason: agent_fault::REASON,
            cause: Some(Cause::MissingOwnMount),
            ..row("the agent lacks a mount")
        },
        Row {
            yaml: "rdma:\n  devices: bnxt_re*\n  min_active_ports: 2\n",
            ready: false,
            reason: agent_fault::REASON,
            cause: Some(Cause::ConfigMismatch),
            ..row("requirements for other hardware")
        },
    ]
}

/// Judge one row's probe on a validated node and check every mark of its verdict.
fn judge_row(r: Row) {
    let mut report = node(r.down);
    if let Some(e) = r.rdma_error {
        report.rdma.errors.push(e.into());
    }
    report.host = r.host;
    // The device plugins as the agent hands them over: the watched Node's findings, the
    // host's sockets and device nodes read from the report.
    let plugins = PluginView {
        node_findings: r.node_plugin.into_iter().map(finding).collect(),
    };
    let mut j = validated(r.yaml);
    let got = j.probe(Facts {
        report: &report,
        peer_finding: r.peer.map(finding),
        devices: &[Arc::new(plugins)],
    });
    let name = r.name;
    assert_eq!(
        got.verdict.ready,
        r.ready,
        "{name}: {:?}",
        got.verdict.reasons()
    );
    assert_eq!(fabric_reason(&got.verdict), r.reason, "{name}");
    assert_eq!(got.fault.as_ref().map(|f| f.cause), r.cause, "{name}");
    assert_eq!(tainted(&got.verdict), !r.ready, "{name}");
    let ready_label = got.verdict.labels.get("fabricgate.io/ready");
    assert_eq!(
        ready_label.map(String::as_str),
        Some(if r.ready { "true" } else { "false" }),
        "{name}"
    );
    // Metrics record the judged verdict; only the taint gate may differ from it.
    let mut gated = got.recorded.clone();
    gated.keep_taint = got.verdict.keep_taint;
    gated.taints.clone_from(&got.verdict.taints);
    assert_eq!(gated, got.verdict, "{name}");
}

#[test]
fn a_new_node_awaits_recover_after_good_probes_and_a_bad_one_resets_the_count() {
    let mut j = Judge::new(&Config::parse(REQUIREMENTS).unwrap());
    let good = node(&[]);
    let bad = node(&["mlx5_0"]);
    let first = j.probe(facts(&good));
    assert!(!first.verdict.ready && first.instant_ready);
    assert_eq!(fabric_reason(&first.verdict), AWAITING_VALIDATION);
    assert!(tainted(&first.verdict));
    assert!(j.probe(facts(&good)).verdict.ready);
    let failed = j.probe(facts(&bad));
    assert_eq!(fabric_reason(&failed.verdict), "PortDown");
    // Recovering repeats the failure unchanged until recover_after good probes.
    assert_eq!(j.probe(facts(&good)).verdict, failed.verdict);
    assert!(j.probe(facts(&good)).verdict.ready);
}

#[test]
fn an_agent_error_neither_counts_as_a_good_probe_nor_resets_the_hysteresis() {
    let mut j = Judge::new(&Config::parse(REQUIREMENTS).unwrap());
    let good = node(&[]);
    let mut blind = node(&[]);
    blind.rdma.errors.push(EMFILE.into());
    j.probe(facts(&good));
    assert_eq!(j.good_streak(), 1);
    let e = j.probe(facts(&blind));
    assert_eq!(fabric_reason(&e.verdict), agent_fault::REASON);
    assert_eq!(j.good_streak(), 1, "an agent error moved the hysteresis");
    assert!(
        j.probe(facts(&good)).verdict.ready,
        "two good probes validate"
    );
}

#[test]
fn on_agent_error_keep_leaves_the_taint_alone_and_taint_fails_closed() {
    let mut blind = node(&[]);
    blind.rdma.errors.push(EMFILE.into());
    let mut keep = validated(&format!("{REQUIREMENTS}  on_agent_error: keep\n"));
    assert!(keep.probe(facts(&blind)).verdict.keep_taint);
    let mut closed = validated(REQUIREMENTS);
    let taint = closed.probe(facts(&blind)).verdict;
    assert!(!taint.keep_taint && tainted(&taint));
}

#[test]
fn a_stall_is_an_agent_error_on_the_last_verdict_or_on_an_empty_node() {
    let mut j = validated(REQUIREMENTS);
    let first = j.stalled(None, Duration::from_secs(30));
    assert_eq!(
        first.fault.as_ref().map(|f| f.cause),
        Some(Cause::ProbeStalled)
    );
    assert_eq!(fabric_reason(&first.verdict), agent_fault::REASON);
    assert!(tainted(&first.verdict));
    let good = j.probe(facts(&node(&[]))).verdict;
    assert!(good.ready);
    let stalled = j.stalled(Some(&good), Duration::from_secs(30));
    assert!(!stalled.verdict.ready);
    // What the last probe found stays (ports, rates); only the fault is added.
    assert_eq!(stalled.verdict.rdma.usable_ports, good.rdma.usable_ports);
    let fabric = stalled
        .verdict
        .conditions
        .iter()
        .find(|c| c.type_ == "FabricReady");
    assert!(
        fabric.is_some_and(|c| c.message.contains("30s")),
        "{fabric:?}"
    );
    // A stall does not move the hysteresis: the next good probe is still ready.
    assert!(j.probe(facts(&node(&[]))).verdict.ready);
}

#[test]
fn a_port_event_fails_fast_but_never_validates() {
    let mut j = validated(REQUIREMENTS);
    let last = evaluate(&node(&[]), &Config::parse(REQUIREMENTS).unwrap());
    assert!(last.ready);
    assert_eq!(
        j.port_event(&node(&[]), &last),
        None,
        "a quick read never says good"
    );
    let v = j.port_event(&node(&["mlx5_0"]), &last).unwrap();
    assert!(!v.ready && tainted(&v));
    assert_eq!(fabric_reason(&v), "PortDown");
    // The failure reset the hysteresis like a full probe's.
    assert_eq!(j.good_streak(), 0);
    assert!(!j.probe(facts(&node(&[]))).verdict.ready);
}

#[test]
fn a_required_finding_taints_and_names_itself_in_the_conditions() {
    let config = Config::default();
    let report = fabricgate_probes::ProbeReport {
        timestamp: 0.0,
        rdma: Default::default(),
        timings: Default::default(),
        host: Default::default(),
        facts: Default::default(),
    };
    let v = crate::policy::evaluate(&report, &config);
    let v = apply_required_finding(
        v,
        Finding {
            scope: Scope::Rdma,
            code: "PeersUnreachable",
            message: "peers.required: ...".into(),
        },
        &config,
    );
    assert!(!v.ready);
    assert_eq!(v.taints[0].key, "fabricgate.io/unvalidated");
    let rdma = v
        .conditions
        .iter()
        .find(|c| c.type_ == "RDMAReady")
        .unwrap();
    assert_eq!(rdma.status, "False");
    assert!(rdma.message.contains("peers.required"), "{}", rdma.message);
    assert_eq!(v.labels["fabricgate.io/rdma.ready"], "false");
}

/// A registered subsystem that always passes, with its own condition and label.
struct Passing;

impl crate::policy::check::NodeCheck for Passing {
    fn name(&self) -> &'static str {
        "extra"
    }

    fn condition(&self) -> (&'static str, &'static str) {
        ("ExtraReady", "ExtraFine")
    }

    fn judge(&self, _: &ProbeReport, _: &Config) -> crate::policy::check::Contribution {
        crate::policy::check::Contribution {
            required: true,
            ..Default::default()
        }
    }
}

#[test]
fn a_port_event_keeps_the_registered_subsystems_parts() {
    let checks = Checks::new(vec![std::sync::Arc::new(Passing)]);
    let mut j = validated(REQUIREMENTS).with_checks(checks);
    let full = j.probe(facts(&node(&[]))).verdict;
    assert!(full.ready);
    let v = j.port_event(&node(&["mlx5_0"]), &full).unwrap();
    assert!(!v.ready);
    let extra: Vec<(&str, &str)> = v
        .conditions
        .iter()
        .filter(|c| c.type_ == "ExtraReady")
        .map(|c| (c.status.as_str(), c.reason.as_str()))
        .collect();
    assert_eq!(
        extra,
        [("True", "ExtraFine")],
        "its condition is not dropped"
    );
    assert_eq!(v.labels["fabricgate.io/extra.ready"], "true");
}
