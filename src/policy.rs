//! The pure decision: a probe report and the requirements in, a verdict out. No I/O, no clock.

use crate::config::{Config, LinkLayerRequirement};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::rdma::{
    DeviceReport, LinkLayer, PhysState, PortReport, PortState, RdmaReport, format_gbps,
};
use fabricgate_probes::storage::{LustreHealth, MountStatus};
use serde::Serialize;
use std::collections::BTreeMap;

/// Which part of the node a finding is about; each maps to one Node condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Rdma,
    Lustre,
}

/// One problem found, with a machine-readable code (the Node condition's reason).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub scope: Scope,
    /// CamelCase, stable: used as the Node condition `reason`.
    pub code: &'static str,
    pub message: String,
}

/// The verdict on one part of the node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartVerdict {
    pub ready: bool,
    /// Why not ready (empty when ready).
    pub findings: Vec<Finding>,
    /// Problems that do not block readiness (e.g. a spare port down while enough are up).
    pub warnings: Vec<Finding>,
}

impl PartVerdict {
    fn ok() -> Self {
        Self {
            ready: true,
            findings: Vec::new(),
            warnings: Vec::new(),
        }
    }
}

/// RDMA-specific outcome, also feeding the labels.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RdmaVerdict {
    #[serde(flatten)]
    pub part: PartVerdict,
    /// Ports that meet every rule.
    pub usable_ports: u32,
    pub required_ports: u32,
    /// Slowest usable port.
    pub min_rate_gbps: Option<f64>,
    /// `InfiniBand`, `Ethernet` or `Mixed` over the usable ports.
    pub link_layer: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Taint {
    pub key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    pub effect: String,
}

/// A Node condition as fabricgate wants it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    pub reason: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    pub ready: bool,
    pub rdma: RdmaVerdict,
    pub lustre: PartVerdict,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub conditions: Vec<Condition>,
}

impl Verdict {
    /// One human sentence per problem, RDMA first.
    pub fn reasons(&self) -> Vec<String> {
        self.rdma
            .part
            .findings
            .iter()
            .chain(&self.lustre.findings)
            .map(|f| f.message.clone())
            .collect()
    }

    pub fn warnings(&self) -> Vec<String> {
        self.rdma
            .part
            .warnings
            .iter()
            .chain(&self.lustre.warnings)
            .map(|f| f.message.clone())
            .collect()
    }
}

/// Judge one probe report against the requirements, with no memory of earlier probes.
pub fn evaluate(report: &ProbeReport, config: &Config) -> Verdict {
    let rdma = evaluate_rdma(&report.rdma, config);
    let lustre = evaluate_lustre(report, config);
    let ready = rdma.part.ready && lustre.ready;
    let prefix = &config.node.label_prefix;

    let mut labels = BTreeMap::new();
    let b = |v: bool| if v { "true" } else { "false" }.to_owned();
    labels.insert(format!("{prefix}ready"), b(ready));
    labels.insert(format!("{prefix}rdma.ready"), b(rdma.part.ready));
    labels.insert(
        format!("{prefix}rdma.active-ports"),
        rdma.usable_ports.to_string(),
    );
    if let Some(ll) = &rdma.link_layer {
        labels.insert(format!("{prefix}rdma.link-layer"), ll.clone());
    }
    if let Some(rate) = rdma.min_rate_gbps {
        labels.insert(format!("{prefix}rdma.rate-gbps"), format_gbps(rate));
    }
    labels.insert(format!("{prefix}lustre.ready"), b(lustre.ready));

    let taints = if ready {
        Vec::new()
    } else {
        vec![Taint {
            key: config.node.taint_key(),
            value: None,
            effect: config.node.taint_effect.as_str().to_owned(),
        }]
    };

    let conditions = vec![
        condition(
            "FabricReady",
            ready,
            "FabricValidated",
            &[&rdma.part, &lustre],
        ),
        condition(
            "RDMAReady",
            rdma.part.ready,
            "RDMAPortsActive",
            &[&rdma.part],
        ),
        condition(
            "LustreReady",
            lustre.ready,
            "LustreMountsHealthy",
            &[&lustre],
        ),
    ];

    Verdict {
        ready,
        rdma,
        lustre,
        labels,
        taints,
        conditions,
    }
}

/// `reason` of the `FabricReady` condition while a node that has never been validated by this
/// agent collects its first good probes.
pub const AWAITING_VALIDATION: &str = "AwaitingValidation";

/// Fail fast, recover slowly: a bad probe makes the node not ready at once; it is ready again
/// only after `recover_after` consecutive good probes.
///
/// While recovering, the last not-ready verdict is repeated unchanged, so a flapping port
/// produces no label, condition or taint churn on the Node. Pure: no I/O, no clock.
#[derive(Debug, Clone)]
pub struct Hysteresis {
    recover_after: u32,
    ready_label: String,
    taint: Taint,
    good_streak: u32,
    validated: bool,
    /// The last not-ready verdict handed out, repeated while recovering.
    held: Option<Verdict>,
}

impl Hysteresis {
    /// A node starts not validated: it needs `node.recover_after` good probes first.
    pub fn new(config: &Config) -> Self {
        Self {
            recover_after: config.node.recover_after.max(1),
            ready_label: format!("{}ready", config.node.label_prefix),
            taint: Taint {
                key: config.node.taint_key(),
                value: None,
                effect: config.node.taint_effect.as_str().to_owned(),
            },
            good_streak: 0,
            validated: false,
            held: None,
        }
    }

    /// Continue a validation a previous agent run recorded on the Node (`FabricReady=True`, no
    /// taint): an agent restart then does not re-taint a healthy node. The next bad probe still
    /// fails it at once.
    pub fn resume_validated(&mut self) {
        self.validated = true;
        self.good_streak = self.recover_after;
        self.held = None;
    }

    /// Consecutive good probes seen so far (0 after a bad one).
    pub fn good_streak(&self) -> u32 {
        self.good_streak
    }

    /// Whether the node is currently validated (the last verdict handed out was ready).
    pub fn validated(&self) -> bool {
        self.validated
    }

    /// The verdict to act on, given the verdict of the probe just taken.
    pub fn apply(&mut self, instant: Verdict) -> Verdict {
        if !instant.ready {
            self.good_streak = 0;
            self.validated = false;
            self.held = Some(instant.clone());
            return instant;
        }
        self.good_streak = self.good_streak.saturating_add(1);
        if self.validated || self.good_streak >= self.recover_after {
            self.validated = true;
            self.held = None;
            return instant;
        }
        match &self.held {
            Some(held) => held.clone(),
            None => self.awaiting(instant),
        }
    }

    /// A good probe on a node not yet validated since the agent started: everything the probe
    /// found is reported, but the node stays tainted and `FabricReady` stays `False`. The
    /// message does not count probes, so it does not change (and cause a write) on each one.
    fn awaiting(&self, mut v: Verdict) -> Verdict {
        v.ready = false;
        v.labels
            .insert(self.ready_label.clone(), "false".to_owned());
        v.taints = vec![self.taint.clone()];
        for c in v.conditions.iter_mut().filter(|c| c.type_ == "FabricReady") {
            c.status = "False".to_owned();
            c.reason = AWAITING_VALIDATION.to_owned();
            c.message = format!(
                "all fabricgate checks pass; the node is validated after {} consecutive good probes",
                self.recover_after
            );
        }
        v
    }
}

fn condition(type_: &str, ready: bool, ok_reason: &str, parts: &[&PartVerdict]) -> Condition {
    let findings: Vec<&Finding> = parts.iter().flat_map(|p| &p.findings).collect();
    let (reason, message) = if ready {
        (
            ok_reason.to_owned(),
            "all fabricgate checks passed".to_owned(),
        )
    } else {
        let reason = findings
            .first()
            .map_or("NotValidated", |f| f.code)
            .to_owned();
        let message = findings
            .iter()
            .map(|f| f.message.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        (reason, message)
    };
    Condition {
        type_: type_.to_owned(),
        status: if ready { "True" } else { "False" }.to_owned(),
        reason,
        message,
    }
}

fn lustre_finding(code: &'static str, message: String) -> Finding {
    Finding {
        scope: Scope::Lustre,
        code,
        message,
    }
}

/// Storage: the required mounts (`lustre.mounts` and `mounts`), every Lustre mount found when
/// `lustre.all_lustre`, and the Lustre client's health and imports. All of it feeds the one
/// `lustre` part, so `LustreReady` and `fabricgate.io/lustre.ready` cover all shared storage.
fn evaluate_lustre(report: &ProbeReport, config: &Config) -> PartVerdict {
    let storage = &report.storage;
    let mut findings = Vec::new();
    let mut warnings = Vec::new();

    for err in &storage.errors {
        let code = if storage.mount_table_entries == 0 {
            "MountTableUnreadable"
        } else {
            "MountTableMalformed"
        };
        // A few unparsable lines do not hide the mounts we need; an unreadable table does.
        if code == "MountTableUnreadable" {
            findings.push(lustre_finding(code, err.clone()));
        } else {
            warnings.push(lustre_finding(code, err.clone()));
        }
    }

    for m in &storage.mounts {
        let code = match m.status {
            MountStatus::Ok => continue,
            MountStatus::Missing => "MountMissing",
            MountStatus::Hung => "MountHung",
            MountStatus::WrongType => "WrongFilesystemType",
            MountStatus::ReadOnly => "MountReadOnly",
            MountStatus::Full => "MountFull",
            MountStatus::Error => "MountError",
        };
        findings.push(lustre_finding(code, format!("{}: {}", m.path, m.message)));
    }

    // A requirement the probe did not check (report made with another config) is not met.
    let required = config
        .lustre
        .mounts
        .iter()
        .chain(config.mounts.iter().map(|m| &m.path));
    for path in required {
        let want = fabricgate_probes::storage::mountinfo::normalize(std::path::Path::new(path));
        let probed = storage.mounts.iter().any(|m| {
            fabricgate_probes::storage::mountinfo::normalize(std::path::Path::new(&m.path)) == want
        });
        if !probed {
            findings.push(lustre_finding(
                "MountMissing",
                format!("{path}: required but not probed"),
            ));
        }
    }

    // The Lustre client matters when Lustre is required or all_lustre asks for it.
    let lustre_wanted = !config.lustre.mounts.is_empty() || config.lustre.all_lustre;
    let client = &storage.client;
    if lustre_wanted && client.present {
        let text = client
            .health_text
            .as_deref()
            .unwrap_or("")
            .replace('\n', "; ");
        match client.health {
            Some(LustreHealth::Healthy) => {}
            Some(LustreHealth::Lbug) => findings.push(lustre_finding(
                "LustreUnhealthy",
                format!(
                    "lustre client hit an LBUG (health_check: {text}); the node needs a reboot"
                ),
            )),
            Some(LustreHealth::NotHealthy) => findings.push(lustre_finding(
                "LustreUnhealthy",
                format!("lustre client is NOT HEALTHY (health_check: {text})"),
            )),
            Some(LustreHealth::Unknown) => warnings.push(lustre_finding(
                "LustreUnhealthy",
                format!("lustre health_check says {text:?}, which fabricgate does not know"),
            )),
            None => warnings.push(lustre_finding(
                "LustreUnhealthy",
                "lustre client modules are loaded but health_check could not be read".into(),
            )),
        }
        for e in &client.errors {
            warnings.push(lustre_finding("LustreUnhealthy", e.clone()));
        }

        // Imports of the file systems in scope: all of them with all_lustre, otherwise those
        // of the required Lustre mounts.
        let fsnames: Vec<&str> = storage
            .mounts
            .iter()
            .filter(|m| m.required)
            .filter_map(|m| m.lustre_fsname.as_deref())
            .collect();
        for imp in &client.imports {
            let in_scope = config.lustre.all_lustre
                || imp.fsname.as_deref().is_some_and(|f| fsnames.contains(&f));
            if !in_scope || imp.healthy {
                continue;
            }
            let state = imp.state.as_deref().unwrap_or("unreadable");
            let message = format!("lustre {} import {state}", imp.target);
            if imp.active == Some(false) {
                warnings.push(lustre_finding(
                    "LustreImportDown",
                    format!("{message} (deactivated by an administrator)"),
                ));
            } else if imp.state.is_none() {
                warnings.push(lustre_finding(
                    "LustreImportDown",
                    imp.error.clone().unwrap_or(message),
                ));
            } else {
                findings.push(lustre_finding("LustreImportDown", message));
            }
        }
    }

    let mut part = PartVerdict::ok();
    part.ready = findings.is_empty();
    part.findings = findings;
    part.warnings = warnings;
    part
}

fn rdma_finding(code: &'static str, message: String) -> Finding {
    Finding {
        scope: Scope::Rdma,
        code,
        message,
    }
}

/// The ports that meet every rule of `rdma:` (the ones `rdma.usable_ports` counts), as
/// `(device, port)` in report order: what NCCL may be pinned to.
pub fn usable_ports(report: &RdmaReport, config: &Config) -> Vec<(String, u32)> {
    assess_rdma(report, config)
        .1
        .iter()
        .map(|(dev, port)| (dev.name.clone(), port.port))
        .collect()
}

fn evaluate_rdma(report: &RdmaReport, config: &Config) -> RdmaVerdict {
    let req = &config.rdma;
    let (problems, usable_pairs) = assess_rdma(report, config);
    let usable: Vec<&PortReport> = usable_pairs.iter().map(|(_, p)| *p).collect();

    let usable_ports = u32::try_from(usable.len()).unwrap_or(u32::MAX);
    let ready = usable_ports >= req.min_active_ports;
    let mut part = PartVerdict {
        ready,
        findings: Vec::new(),
        warnings: Vec::new(),
    };
    if ready {
        part.warnings = problems;
    } else {
        let code = problems.first().map_or("InsufficientPorts", |f| f.code);
        part.findings = problems;
        part.findings.push(rdma_finding(
            code,
            format!(
                "{usable_ports} usable RDMA port{} of {} required",
                if usable_ports == 1 { "" } else { "s" },
                req.min_active_ports
            ),
        ));
    }

    let min_rate_gbps = usable
        .iter()
        .filter_map(|p| p.rate.as_ref().map(|r| r.gbps))
        .min_by(f64::total_cmp);
    let mut layers: Vec<&str> = usable
        .iter()
        .filter_map(|p| p.link_layer.as_ref().map(LinkLayer::name))
        .collect();
    layers.sort_unstable();
    layers.dedup();
    let link_layer = match layers.as_slice() {
        [] => None,
        [one] => Some((*one).to_owned()),
        _ => Some("Mixed".to_owned()),
    };

    RdmaVerdict {
        part,
        usable_ports,
        required_ports: req.min_active_ports,
        min_rate_gbps,
        link_layer,
    }
}

/// Every RDMA problem found, and the usable ports with their devices.
fn assess_rdma<'r>(
    report: &'r RdmaReport,
    config: &Config,
) -> (Vec<Finding>, Vec<(&'r DeviceReport, &'r PortReport)>) {
    let req = &config.rdma;
    let matcher = config.device_matcher();
    let mut problems: Vec<Finding> = Vec::new();
    let mut usable: Vec<(&DeviceReport, &PortReport)> = Vec::new();

    for err in &report.errors {
        problems.push(rdma_finding("RDMAProbeFailed", err.clone()));
    }

    let in_scope: Vec<&DeviceReport> = report
        .devices
        .iter()
        .filter(|d| matcher.is_match(&d.name))
        .collect();

    if !report.subsystem_present {
        let mut msg = "no RDMA devices: the kernel exposes no RDMA subsystem \
                       (class/infiniband is absent; no RDMA driver loaded)"
            .to_owned();
        if let Some(err) = report.verbs.as_ref().and_then(|v| v.error.as_ref()) {
            msg.push_str("; ");
            msg.push_str(err);
        }
        problems.push(rdma_finding("NoRDMADevices", msg));
    } else if in_scope.is_empty() && report.errors.is_empty() {
        let names: Vec<&str> = report.devices.iter().map(|d| d.name.as_str()).collect();
        problems.push(rdma_finding(
            "NoRDMADevices",
            if names.is_empty() {
                "no RDMA devices: class/infiniband is empty".to_owned()
            } else {
                format!(
                    "no RDMA device matches rdma.devices {:?} (found: {})",
                    req.devices,
                    names.join(", ")
                )
            },
        ));
    }

    for dev in in_scope {
        let device_problems = device_problems(dev, config);
        let blocked = !device_problems.is_empty();
        problems.extend(device_problems);
        for port in &dev.ports {
            if !link_layer_in_scope(port, req.link_layer) {
                continue;
            }
            let port_problems = port_problems(dev, port, config);
            if port_problems.is_empty() && !blocked {
                usable.push((dev, port));
            }
            problems.extend(port_problems);
        }
    }
    (problems, usable)
}

fn link_layer_in_scope(port: &PortReport, want: LinkLayerRequirement) -> bool {
    match want {
        LinkLayerRequirement::Any => true,
        LinkLayerRequirement::InfiniBand => port.link_layer == Some(LinkLayer::InfiniBand),
        LinkLayerRequirement::Ethernet => port.link_layer == Some(LinkLayer::Ethernet),
    }
}

/// Problems that make every port of the device unusable.
fn device_problems(dev: &DeviceReport, config: &Config) -> Vec<Finding> {
    let mut out = Vec::new();
    for err in &dev.errors {
        out.push(rdma_finding(
            "DeviceUnreadable",
            format!("{}: {err}", dev.name),
        ));
    }
    if dev.ports.is_empty() && dev.errors.is_empty() {
        out.push(rdma_finding(
            "DeviceUnreadable",
            format!("{}: the device has no ports", dev.name),
        ));
    }
    if let Some(verbs) = &dev.verbs
        && !verbs.opened
    {
        let why = verbs.error.as_deref().unwrap_or("unknown error");
        out.push(rdma_finding(
            "VerbsUnavailable",
            format!(
                "{}: sysfs shows the device but verbs cannot open it: {why}",
                dev.name
            ),
        ));
    }
    if config.rdma.require_full_pcie_link
        && let Some(pci) = dev.pci.as_ref().filter(|p| p.is_degraded())
    {
        let link = |w: Option<u32>, s: Option<f64>| {
            format!(
                "x{} at {} GT/s",
                w.map_or("?".into(), |w| w.to_string()),
                s.map_or("?".into(), format_gbps)
            )
        };
        out.push(rdma_finding(
            "PCIeLinkDegraded",
            format!(
                "{} ({}): PCIe link trained at {}, capable of {}; the HCA's bandwidth is \
                     cut; reseat the card or check the slot and BIOS settings",
                dev.name,
                pci.address,
                link(pci.current_width, pci.current_speed_gts),
                link(pci.max_width, pci.max_speed_gts)
            ),
        ));
    }
    out
}

/// Problems that make this port unusable.
fn port_problems(dev: &DeviceReport, port: &PortReport, config: &Config) -> Vec<Finding> {
    let req = &config.rdma;
    let name = format!("{} port {}", dev.name, port.port);
    let mut out = Vec::new();

    match (port.state, port.phys_state) {
        (None, _) => {
            let detail = port
                .errors
                .iter()
                .find(|e| e.contains("/state"))
                .cloned()
                .unwrap_or_else(|| "state file missing".into());
            out.push(rdma_finding(
                "PortStateUnknown",
                format!("{name}: cannot tell the port state: {detail}"),
            ));
            return out;
        }
        (Some(PortState::Init | PortState::Armed), phys) => {
            let state = port.state.map(|s| s.name()).unwrap_or_default();
            out.push(rdma_finding(
                "PortNotActivatedBySM",
                format!(
                    "{name}: state {state}{}: the subnet manager has not activated this port; \
                     check that a subnet manager (opensm, UFM) is running and reaches it",
                    phys.map_or(String::new(), |p| format!(" (phys {p})"))
                ),
            ));
            return out;
        }
        (Some(PortState::Active), Some(PhysState::LinkUp)) => {}
        (Some(state), phys) => {
            out.push(rdma_finding(
                "PortDown",
                format!(
                    "{name}: state {state}, phys {}: the link is down; check the cable, \
                     transceiver and switch port",
                    phys.map_or("unknown".into(), |p| p.name())
                ),
            ));
            return out;
        }
    }

    if let Some(vp) = &port.verbs
        && vp.state != PortState::Active
    {
        out.push(rdma_finding(
            "PortDown",
            format!(
                "{name}: sysfs says ACTIVE but ibv_query_port says {}",
                vp.state
            ),
        ));
    }

    match &port.rate {
        Some(rate) if rate.gbps + 1e-9 < req.min_rate_gbps => out.push(rdma_finding(
            "RateBelowRequired",
            format!(
                "{name}: rate {rate} below required {} Gb/s",
                format_gbps(req.min_rate_gbps)
            ),
        )),
        None if req.min_rate_gbps > 0.0 => out.push(rdma_finding(
            "RateBelowRequired",
            format!(
                "{name}: rate unknown, required {} Gb/s",
                format_gbps(req.min_rate_gbps)
            ),
        )),
        _ => {}
    }

    if req.require_roce_v2
        && port.link_layer == Some(LinkLayer::Ethernet)
        && !port.has_roce_v2_gid()
    {
        let netdevs = port.netdevs();
        out.push(rdma_finding(
            "NoRoCEv2GID",
            format!(
                "{name}: no RoCE v2 GID{}; RoCE v2 needs an IP address on the port's netdev \
                 (NCCL picks RoCE v2 GIDs for routable traffic)",
                if netdevs.is_empty() {
                    String::new()
                } else {
                    format!(" on {}", netdevs.join(", "))
                }
            ),
        ));
    }

    if let Some(sel) = port.selftest.as_ref().filter(|s| !s.ok) {
        out.push(rdma_finding(
            "SelftestFailed",
            match (&sel.message, &sel.failed_step) {
                // The probe's own messages start with the step and errno already.
                (Some(message), Some(step)) if message.starts_with(step.as_str()) => {
                    format!("{name}: data-path self-test failed: {message}")
                }
                (message, step) => format!(
                    "{name}: data-path self-test failed at {}{}: {}",
                    step.as_deref().unwrap_or("an unknown step"),
                    sel.errno.map_or(String::new(), |e| format!(" (errno {e})")),
                    message.as_deref().unwrap_or("no detail")
                ),
            },
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::rdma::{
        Gid, GidType, Rate, SelftestResult, VerbsDevice, VerbsPort, VerbsStatus,
    };
    use fabricgate_probes::{ProbeTimings, storage::StorageReport};

    fn port(n: u32, layer: LinkLayer, gbps: f64) -> PortReport {
        PortReport {
            port: n,
            state: Some(PortState::Active),
            phys_state: Some(PhysState::LinkUp),
            rate: Some(Rate {
                gbps,
                width: 4,
                speed: "NDR".into(),
            }),
            gids: if layer == LinkLayer::Ethernet {
                vec![Gid {
                    index: 1,
                    gid: "fe80::1".into(),
                    gid_type: Some(GidType::RoceV2),
                    netdev: Some("eth1".into()),
                }]
            } else {
                Vec::new()
            },
            link_layer: Some(layer),
            ..PortReport::default()
        }
    }

    fn device(name: &str, ports: Vec<PortReport>) -> DeviceReport {
        DeviceReport {
            name: name.into(),
            ports,
            ..DeviceReport::default()
        }
    }

    fn report(devices: Vec<DeviceReport>) -> ProbeReport {
        ProbeReport {
            timestamp: 0.0,
            rdma: RdmaReport {
                subsystem_present: true,
                devices,
                verbs: None,
                errors: Vec::new(),
            },
            storage: StorageReport::default(),
            netdevs: Vec::new(),
            timings: ProbeTimings::default(),
        }
    }

    fn config(yaml: &str) -> Config {
        Config::parse(yaml).unwrap()
    }

    fn reasons(v: &Verdict) -> String {
        v.reasons().join("\n")
    }

    #[test]
    fn counts_only_ports_of_matching_devices_and_link_layer() {
        let r = report(vec![
            device("mlx5_0", vec![port(1, LinkLayer::InfiniBand, 400.0)]),
            device("mlx5_1", vec![port(1, LinkLayer::Ethernet, 200.0)]),
            device("rxe0", vec![port(1, LinkLayer::Ethernet, 2.5)]),
        ]);
        let v = evaluate(
            &r,
            &config("rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 2\n"),
        );
        assert!(v.ready, "{}", reasons(&v));
        assert_eq!(v.rdma.usable_ports, 2);
        assert_eq!(v.rdma.min_rate_gbps, Some(200.0));
        assert_eq!(v.rdma.link_layer.as_deref(), Some("Mixed"));

        let v = evaluate(
            &r,
            &config("rdma:\n  min_active_ports: 2\n  link_layer: InfiniBand\n"),
        );
        assert!(!v.ready);
        assert_eq!(v.rdma.usable_ports, 1);
        assert!(reasons(&v).contains("1 usable RDMA port of 2 required"));

        let v = evaluate(&r, &config("rdma:\n  devices: \"bnxt_*\"\n"));
        assert!(!v.ready);
        assert!(reasons(&v).contains("no RDMA device matches rdma.devices \"bnxt_*\""));
    }

    #[test]
    fn verbs_failures_and_disagreement_block_the_device() {
        let mut dev = device("mlx5_0", vec![port(1, LinkLayer::InfiniBand, 400.0)]);
        dev.verbs = Some(VerbsDevice {
            error: Some("cannot open /dev/infiniband/uverbs0: permission denied".into()),
            ..VerbsDevice::default()
        });
        let mut r = report(vec![dev]);
        r.rdma.verbs = Some(VerbsStatus {
            devices: vec!["mlx5_0".into()],
            error: None,
        });
        let v = evaluate(&r, &Config::default());
        assert!(!v.ready);
        assert!(
            reasons(&v).contains(
                "mlx5_0: sysfs shows the device but verbs cannot open it: cannot open /dev/infiniband/uverbs0"
            ),
            "{}",
            reasons(&v)
        );
        assert_eq!(v.conditions[1].reason, "VerbsUnavailable");

        let mut p = port(1, LinkLayer::InfiniBand, 400.0);
        p.verbs = Some(VerbsPort {
            state: PortState::Down,
            phys_state: PhysState::Polling,
            link_layer: LinkLayer::InfiniBand,
            rate_gbps: None,
            active_width: 0,
            active_speed: 0,
            lid: 0,
            sm_lid: 0,
            active_mtu: 0,
            gid_tbl_len: 0,
        });
        let v = evaluate(&report(vec![device("mlx5_0", vec![p])]), &Config::default());
        assert!(!v.ready);
        assert!(reasons(&v).contains("sysfs says ACTIVE but ibv_query_port says DOWN"));
    }

    #[test]
    fn failed_selftest_names_step_and_errno() {
        let mut p = port(1, LinkLayer::Ethernet, 100.0);
        p.selftest = Some(SelftestResult {
            ok: false,
            failed_step: Some("reg_mr".into()),
            errno: Some(12),
            message: Some("RLIMIT_MEMLOCK too low".into()),
            latency_us: None,
            gid_index: None,
            duration_us: None,
        });
        let v = evaluate(&report(vec![device("rxe0", vec![p])]), &Config::default());
        assert!(!v.ready);
        assert!(
            reasons(&v).contains("rxe0 port 1: data-path self-test failed at reg_mr (errno 12)"),
            "{}",
            reasons(&v)
        );
    }

    #[test]
    fn not_ready_means_taint_and_false_conditions_with_custom_prefix() {
        let mut p = port(1, LinkLayer::InfiniBand, 400.0);
        p.state = Some(PortState::Armed);
        let v = evaluate(
            &report(vec![device("mlx5_0", vec![p])]),
            &config("node:\n  label_prefix: example.com/\n  taint_effect: NoExecute\n"),
        );
        assert_eq!(
            v.taints,
            vec![Taint {
                key: "example.com/unvalidated".into(),
                value: None,
                effect: "NoExecute".into()
            }]
        );
        assert_eq!(
            v.labels.get("example.com/ready").map(String::as_str),
            Some("false")
        );
        assert!(!v.labels.contains_key("example.com/rdma.rate-gbps"));
        let fabric = &v.conditions[0];
        assert_eq!(
            (fabric.type_.as_str(), fabric.status.as_str()),
            ("FabricReady", "False")
        );
        assert_eq!(fabric.reason, "PortNotActivatedBySM");
        assert!(fabric.message.contains("state ARMED"));
    }
}

/// Hysteresis tests with hand-built verdicts.
#[cfg(test)]
mod hysteresis_tests {
    use super::*;

    fn verdict(ready: bool, port: &str) -> Verdict {
        let config = Config::default();
        let part = PartVerdict {
            ready,
            findings: if ready {
                Vec::new()
            } else {
                vec![rdma_finding("PortDown", format!("{port} is down"))]
            },
            warnings: Vec::new(),
        };
        let rdma = RdmaVerdict {
            part: part.clone(),
            usable_ports: u32::from(ready),
            required_ports: 1,
            min_rate_gbps: ready.then_some(400.0),
            link_layer: ready.then(|| "InfiniBand".to_owned()),
        };
        let mut labels = BTreeMap::new();
        labels.insert("fabricgate.io/ready".to_owned(), ready.to_string());
        Verdict {
            ready,
            rdma,
            lustre: PartVerdict::ok(),
            labels,
            taints: if ready {
                Vec::new()
            } else {
                vec![Taint {
                    key: config.node.taint_key(),
                    value: None,
                    effect: "NoSchedule".into(),
                }]
            },
            conditions: vec![condition("FabricReady", ready, "FabricValidated", &[&part])],
        }
    }

    fn hysteresis(n: u32) -> Hysteresis {
        let mut config = Config::default();
        config.node.recover_after = n;
        Hysteresis::new(&config)
    }

    #[test]
    fn a_new_node_is_validated_only_after_recover_after_good_probes() {
        let mut h = hysteresis(3);
        for i in 1..3 {
            let v = h.apply(verdict(true, "p"));
            assert!(!v.ready, "probe {i}");
            assert_eq!(v.labels["fabricgate.io/ready"], "false");
            assert_eq!(v.taints.len(), 1);
            assert_eq!(v.taints[0].key, "fabricgate.io/unvalidated");
            assert_eq!(v.conditions[0].status, "False");
            assert_eq!(v.conditions[0].reason, AWAITING_VALIDATION);
        }
        let v = h.apply(verdict(true, "p"));
        assert!(v.ready);
        assert!(v.taints.is_empty());
        assert_eq!(v.conditions[0].status, "True");
        assert!(h.validated());
    }

    #[test]
    fn one_bad_probe_fails_at_once() {
        let mut h = hysteresis(3);
        for _ in 0..3 {
            h.apply(verdict(true, "p"));
        }
        let v = h.apply(verdict(false, "mlx5_0 port 1"));
        assert!(!v.ready);
        assert_eq!(v.conditions[0].reason, "PortDown");
        assert_eq!(h.good_streak(), 0);
    }

    #[test]
    fn recovery_repeats_the_last_failure_unchanged_then_validates() {
        let mut h = hysteresis(3);
        for _ in 0..3 {
            h.apply(verdict(true, "p"));
        }
        let bad = h.apply(verdict(false, "mlx5_0 port 1"));
        assert_eq!(h.apply(verdict(true, "p")), bad);
        assert_eq!(h.apply(verdict(true, "p")), bad);
        assert!(h.apply(verdict(true, "p")).ready);
    }

    #[test]
    fn a_flapping_port_yields_one_unchanging_not_ready_verdict() {
        let mut h = hysteresis(3);
        let first = h.apply(verdict(false, "mlx5_0 port 1"));
        for i in 0..50 {
            let v = h.apply(verdict(i % 2 == 0, "mlx5_0 port 1"));
            assert_eq!(v, first, "probe {i}");
        }
    }

    #[test]
    fn a_resumed_validation_stays_ready_on_a_good_probe_and_fails_on_a_bad_one() {
        let mut h = hysteresis(3);
        h.resume_validated();
        assert!(h.apply(verdict(true, "p")).ready);
        assert!(!h.apply(verdict(false, "p")).ready);
        assert!(!h.apply(verdict(true, "p")).ready, "recovery needs 3 again");
    }

    #[test]
    fn recover_after_one_validates_on_the_first_good_probe() {
        let mut h = hysteresis(1);
        h.apply(verdict(false, "p"));
        assert!(h.apply(verdict(true, "p")).ready);
    }
}
