//! The pure decision: a probe report and the requirements in, a verdict out. No I/O, no clock.

pub mod agent_fault;
pub mod failclosed;
pub mod judge;

use crate::config::{Config, LinkLayerRequirement};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::gpudirect::pci::{AcsState, Relation, acs_control_names};
use fabricgate_probes::gpudirect::transport::netdev_mtu_for_roce;
use fabricgate_probes::gpudirect::{GpudirectReport, MtuSource, PortTransport};
use fabricgate_probes::rdma::{
    DeviceReport, LinkLayer, PhysState, PortReport, PortState, RdmaReport, format_gbps,
};
use fabricgate_probes::storage::{LustreHealth, MountStatus, StorageReport};
use serde::Serialize;
use std::collections::BTreeMap;

/// Which part of the node a finding is about; each maps to one Node condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Rdma,
    Lustre,
    Gpudirect,
    Placement,
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
    pub fn ok() -> Self {
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

/// GPUDirect outcome (`gpudirect:` requirements), also feeding the topology labels.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpudirectVerdict {
    #[serde(flatten)]
    pub part: PartVerdict,
    /// `gpudirect.required`: when false every problem here is a warning.
    pub required: bool,
    pub gpus: usize,
    /// Worst relation between a GPU and its HCA.
    pub relation: Option<Relation>,
    /// The rail map as a label value: per GPU in PCI address order, the index of its HCA among
    /// the in-scope HCAs in name order (`0.1.2.3.4.5.6.7`); `x` for a GPU without one.
    pub rails: Option<String>,
}

impl Default for GpudirectVerdict {
    /// A node without GPUs and without `gpudirect.required`.
    fn default() -> Self {
        Self {
            part: PartVerdict::ok(),
            required: false,
            gpus: 0,
            relation: None,
            rails: None,
        }
    }
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
    pub gpudirect: GpudirectVerdict,
    /// `placement.required_labels` on the Node: only the agent (which reads its Node) fills
    /// this in, through [`apply_placement`]; `check` leaves it ready.
    pub placement: PartVerdict,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub conditions: Vec<Condition>,
    /// Leave our taint on the Node as it is (an agent error under `node.on_agent_error: keep`);
    /// `taints` is then not applied. Set only by [`crate::policy::agent_fault::gate`].
    #[serde(skip)]
    pub keep_taint: bool,
}

impl Verdict {
    /// One human sentence per problem, RDMA first.
    pub fn reasons(&self) -> Vec<String> {
        self.rdma
            .part
            .findings
            .iter()
            .chain(&self.lustre.findings)
            .chain(&self.gpudirect.part.findings)
            .chain(&self.placement.findings)
            .map(|f| f.message.clone())
            .collect()
    }

    pub fn warnings(&self) -> Vec<String> {
        self.rdma
            .part
            .warnings
            .iter()
            .chain(&self.lustre.warnings)
            .chain(&self.gpudirect.part.warnings)
            .chain(&self.placement.warnings)
            .map(|f| f.message.clone())
            .collect()
    }
}

/// The one taint fabricgate owns: `<label_prefix>unvalidated` with the configured effect,
/// present exactly while the node is not validated.
pub fn unvalidated_taint(config: &Config) -> Taint {
    Taint {
        key: config.node.taint_key(),
        value: None,
        effect: config.node.taint_effect.as_str().to_owned(),
    }
}

/// Judge one probe report against the requirements, with no memory of earlier probes.
pub fn evaluate(report: &ProbeReport, config: &Config) -> Verdict {
    evaluate_with(report, config, &[])
}

/// Reason of the findings about the Node's device-plugin resources (`kubernetes.rdma_resources`).
pub const DEVICE_PLUGIN_UNAVAILABLE: &str = "DevicePluginUnavailable";

/// [`evaluate`], plus what the agent's own Node object shows (device-plugin resources,
/// [`crate::policy::failclosed::device_plugin_findings`]): those findings make the RDMA part not ready after
/// the hardware's own findings, so a healthy fabric with a dead plugin is not ready and the
/// condition names the resource.
pub fn evaluate_with(report: &ProbeReport, config: &Config, node_findings: &[Finding]) -> Verdict {
    let mut rdma = evaluate_rdma(&report.rdma, &report.gpudirect.transport, config);
    if !node_findings.is_empty() {
        rdma.part.ready = false;
        rdma.part.findings.extend(node_findings.iter().cloned());
    }
    let lustre = evaluate_lustre(report, config);
    let gpudirect = evaluate_gpudirect(&report.gpudirect, config);
    let ready = rdma.part.ready && lustre.ready && gpudirect.part.ready;
    let prefix = &config.node.label_prefix;

    let mut labels = BTreeMap::new();
    let b = |v: bool| if v { "true" } else { "false" };
    put_label(&mut labels, format!("{prefix}ready"), b(ready));
    put_label(
        &mut labels,
        format!("{prefix}rdma.ready"),
        b(rdma.part.ready),
    );
    put_label(
        &mut labels,
        format!("{prefix}rdma.active-ports"),
        &rdma.usable_ports.to_string(),
    );
    if let Some(ll) = &rdma.link_layer {
        put_label(&mut labels, format!("{prefix}rdma.link-layer"), ll);
    }
    if let Some(rate) = rdma.min_rate_gbps {
        put_label(
            &mut labels,
            format!("{prefix}rdma.rate-gbps"),
            &format_gbps(rate),
        );
    }
    put_label(
        &mut labels,
        format!("{prefix}lustre.ready"),
        b(lustre.ready),
    );
    let gpu_node = gpudirect.gpus > 0 || gpudirect.required;
    if gpu_node {
        put_label(
            &mut labels,
            format!("{prefix}gpudirect.ready"),
            b(gpudirect.part.ready),
        );
    }
    if let Some(rel) = gpudirect.relation {
        put_label(
            &mut labels,
            format!("{prefix}gpudirect.relation"),
            rel.name(),
        );
    }
    if let Some(rails) = &gpudirect.rails {
        put_label(&mut labels, format!("{prefix}rails"), rails);
    }

    let taints = if ready {
        Vec::new()
    } else {
        vec![unvalidated_taint(config)]
    };

    let mut conditions = vec![
        condition(
            "FabricReady",
            ready,
            "FabricValidated",
            &[&rdma.part, &lustre, &gpudirect.part],
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
    if gpu_node {
        conditions.push(condition(
            "GPUDirectReady",
            gpudirect.part.ready,
            "GPUDirectUsable",
            &[&gpudirect.part],
        ));
    }

    Verdict {
        ready,
        rdma,
        lustre,
        gpudirect,
        placement: PartVerdict::ok(),
        labels,
        taints,
        conditions,
        keep_taint: false,
    }
}

/// Longest Kubernetes label value.
pub const MAX_LABEL_VALUE: usize = 63;

/// A valid Kubernetes label value by construction: at most 63 characters of `[A-Za-z0-9._-]`,
/// beginning and ending with an alphanumeric (or empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelValue(String);

impl LabelValue {
    /// `None` when `raw` is not a valid label value (the raw value then lives only in the
    /// metrics, e.g. `fabricgate_rdma_port_rate_gbps`).
    pub fn new(raw: &str) -> Option<Self> {
        let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        let ends_ok = raw.is_empty()
            || (raw.starts_with(|c: char| c.is_ascii_alphanumeric())
                && raw.ends_with(|c: char| c.is_ascii_alphanumeric()));
        (raw.len() <= MAX_LABEL_VALUE && raw.chars().all(ok_char) && ends_ok)
            .then(|| Self(raw.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

/// Set `key` to `value` when `value` is a valid label value; otherwise leave the label out:
/// a label is a summary, the metrics carry the raw figure.
fn put_label(labels: &mut BTreeMap<String, String>, key: String, value: &str) {
    if let Some(v) = LabelValue::new(value) {
        labels.insert(key, v.into_string());
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
            taint: unvalidated_taint(config),
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
    mount_findings(storage, config, &mut findings, &mut warnings);
    // The Lustre client matters when Lustre is required or all_lustre asks for it.
    let lustre_wanted = !config.lustre.mounts.is_empty() || config.lustre.all_lustre;
    if lustre_wanted && storage.client.present {
        lustre_client_findings(storage, config, &mut findings, &mut warnings);
    }
    let mut part = PartVerdict::ok();
    part.ready = findings.is_empty();
    part.findings = findings;
    part.warnings = warnings;
    part
}

/// The mount table, each checked mount's status, and required mounts the probe did not check.
fn mount_findings(
    storage: &StorageReport,
    config: &Config,
    findings: &mut Vec<Finding>,
    warnings: &mut Vec<Finding>,
) {
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
}

/// The Lustre client's health and the imports of the file systems in scope.
fn lustre_client_findings(
    storage: &StorageReport,
    config: &Config,
    findings: &mut Vec<Finding>,
    warnings: &mut Vec<Finding>,
) {
    let client = &storage.client;
    let text = client
        .health_text
        .as_deref()
        .unwrap_or("")
        .replace('\n', "; ");
    match client.health {
        Some(LustreHealth::Healthy) => {}
        Some(LustreHealth::Lbug) => findings.push(lustre_finding(
            "LustreUnhealthy",
            format!("lustre client hit an LBUG (health_check: {text}); the node needs a reboot"),
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
        let in_scope =
            config.lustre.all_lustre || imp.fsname.as_deref().is_some_and(|f| fsnames.contains(&f));
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

fn rdma_finding(code: &'static str, message: String) -> Finding {
    Finding {
        scope: Scope::Rdma,
        code,
        message,
    }
}

/// The ports that meet every rule of `rdma:` (the ones `rdma.usable_ports` counts), as
/// `(device, port)` in report order: what NCCL may be pinned to.
pub fn usable_ports(report: &ProbeReport, config: &Config) -> Vec<(String, u32)> {
    assess_rdma(&report.rdma, &report.gpudirect.transport, config)
        .usable
        .iter()
        .map(|(dev, port)| (dev.name.clone(), port.port))
        .collect()
}

/// Every RDMA problem found, the usable ports with their devices, and the facts that block
/// nothing (an unknown PCIe link with the rule off, an MTU that cannot be read with
/// --verbs off).
struct RdmaAssessment<'r> {
    problems: Vec<Finding>,
    usable: Vec<(&'r DeviceReport, &'r PortReport)>,
    notes: Vec<Finding>,
}

fn assess_rdma<'r>(
    report: &'r RdmaReport,
    transport: &[PortTransport],
    config: &Config,
) -> RdmaAssessment<'r> {
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
                    req.devices.as_str(),
                    names.join(", ")
                )
            },
        ));
    }

    let mut notes: Vec<Finding> = Vec::new();
    for dev in in_scope {
        let device_problems = device_problems(dev, config, &mut notes);
        let blocked = !device_problems.is_empty();
        problems.extend(device_problems);
        for port in &dev.ports {
            if !link_layer_in_scope(port, req.link_layer) {
                continue;
            }
            let mut port_problems = port_problems(dev, port, config);
            let t = transport
                .iter()
                .find(|t| t.device == dev.name && t.port == port.port);
            if port.is_up() {
                port_problems.extend(transport_problems(dev, port, t, config, &mut notes));
            }
            if port_problems.is_empty() && !blocked {
                usable.push((dev, port));
            }
            problems.extend(port_problems);
        }
    }
    RdmaAssessment {
        problems,
        usable,
        notes,
    }
}

fn evaluate_rdma(report: &RdmaReport, transport: &[PortTransport], config: &Config) -> RdmaVerdict {
    let req = &config.rdma;
    let RdmaAssessment {
        problems,
        usable: usable_pairs,
        notes,
    } = assess_rdma(report, transport, config);
    let usable: Vec<&PortReport> = usable_pairs.iter().map(|(_, p)| *p).collect();

    let usable_ports = u32::try_from(usable.len()).unwrap_or(u32::MAX);
    let ready = usable_ports >= req.min_active_ports;
    let mut part = PartVerdict {
        ready,
        findings: Vec::new(),
        warnings: Vec::new(),
    };
    let notes_later = notes;
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
    part.warnings.extend(notes_later);

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

fn link_layer_in_scope(port: &PortReport, want: LinkLayerRequirement) -> bool {
    match want {
        LinkLayerRequirement::Any => true,
        LinkLayerRequirement::InfiniBand => port.link_layer == Some(LinkLayer::InfiniBand),
        LinkLayerRequirement::Ethernet => port.link_layer == Some(LinkLayer::Ethernet),
    }
}

/// Problems that make every port of the device unusable; `notes` gets those that do not
/// (an unresolvable PCI function while `require_full_pcie_link` is off).
fn device_problems(dev: &DeviceReport, config: &Config, notes: &mut Vec<Finding>) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(why) = &dev.pci_error {
        let finding = rdma_finding(
            "PCIeLinkUnknown",
            format!(
                "{}: {why}, so rdma.require_full_pcie_link fails for it (set it to false \
                 for an HCA that is not on PCIe)",
                dev.name
            ),
        );
        if config.rdma.require_full_pcie_link {
            out.push(finding);
        } else {
            notes.push(finding);
        }
    }
    // The PCI error is judged above, by the PCIe rule.
    for err in dev
        .errors
        .iter()
        .filter(|e| Some(*e) != dev.pci_error.as_ref())
    {
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

/// Transport settings of an up port: active MTU against `rdma.min_mtu`, the RoCE netdev MTU
/// against the RDMA MTU, and ECN on the RoCE priority (`rdma.roce`). Problems block the port;
/// what cannot be known goes to `notes`.
fn transport_problems(
    dev: &DeviceReport,
    port: &PortReport,
    t: Option<&PortTransport>,
    config: &Config,
    notes: &mut Vec<Finding>,
) -> Vec<Finding> {
    let req = &config.rdma;
    let name = format!("{} port {}", dev.name, port.port);
    let mut out = Vec::new();
    let roce = port.link_layer == Some(LinkLayer::Ethernet);
    let active = t.and_then(|t| t.active_mtu);
    let netdev = t.and_then(|t| t.netdev.as_deref());
    let netdev_mtu = t.and_then(|t| t.netdev_mtu);

    if let Some(min) = req.min_mtu {
        match active {
            Some(mtu) if mtu < min => {
                let fix = match (roce, netdev, netdev_mtu) {
                    (true, Some(nd), Some(nd_mtu)) if nd_mtu < netdev_mtu_for_roce(min) => {
                        format!(
                            "the netdev {nd} has MTU {nd_mtu}, which carries at most RDMA MTU \
                             {mtu}; raise it to at least {} (e.g. `ip link set {nd} mtu 9000`, \
                             and the switch ports to match)",
                            netdev_mtu_for_roce(min)
                        )
                    }
                    (true, ..) => "raise the netdev MTU (9000) and the RDMA MTU the \
                                   application requests"
                        .to_owned(),
                    (false, ..) => format!(
                        "raise the subnet manager's MTU for the partition (opensm \
                         partitions.conf `mtu=5` is 4096) and check the switch port's MTU \
                         cap (ibportstate) so the port comes up at {min}"
                    ),
                };
                out.push(rdma_finding(
                    "MTUBelowRequired",
                    format!("{name}: active MTU {mtu} below rdma.min_mtu {min}: {fix}"),
                ));
            }
            Some(_) => {}
            None => notes.push(rdma_finding(
                "MTUUnknown",
                format!(
                    "{name}: active MTU unknown, rdma.min_mtu {min} not checked ({})",
                    if roce {
                        "the RoCE netdev's MTU could not be read"
                    } else {
                        "sysfs has no MTU for InfiniBand ports; it comes from verbs \
                         (ibv_query_port), which --verbs off skips"
                    }
                ),
            )),
        }
    }

    // With verbs, the RDMA MTU is the port's own; the netdev must carry it plus RoCE headers.
    if roce
        && let (Some(mtu), Some(MtuSource::Verbs), Some(nd), Some(nd_mtu)) = (
            active,
            t.and_then(|t| t.active_mtu_source),
            netdev,
            netdev_mtu,
        )
        && nd_mtu < netdev_mtu_for_roce(mtu)
    {
        out.push(rdma_finding(
            "NetdevMTUTooSmall",
            format!(
                "{name}: the netdev {nd} has MTU {nd_mtu}, too small for the port's RDMA MTU \
                 {mtu} plus {} bytes of RoCE headers; set it to at least {} \
                 (`ip link set {nd} mtu 9000`)",
                netdev_mtu_for_roce(mtu) - mtu,
                netdev_mtu_for_roce(mtu)
            ),
        ));
    }

    if roce
        && req.roce.require_ecn
        && let Some(ecn) = t.and_then(|t| t.ecn.as_ref())
    {
        let prio = req.roce.ecn_priority;
        let off: Vec<&str> = [("roce_np", &ecn.np), ("roce_rp", &ecn.rp)]
            .into_iter()
            .filter(|(_, m)| m.get(&prio) != Some(&true))
            .map(|(n, _)| n)
            .collect();
        if !off.is_empty() {
            let nd = netdev.unwrap_or("<netdev>");
            let cmds: Vec<String> = off
                .iter()
                .map(|p| format!("echo 1 > /sys/class/net/{nd}/ecn/{p}/enable/{prio}"))
                .collect();
            out.push(rdma_finding(
                "ECNDisabled",
                format!(
                    "{name}: ECN is off for priority {prio} on {nd} ({}); RoCE without ECN \
                     collapses under congestion: {} (or set it in the NIC's QoS tooling)",
                    off.iter()
                        .map(|p| format!("{p}/enable/{prio}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    cmds.join("; ")
                ),
            ));
        }
    }
    out
}

fn gpudirect_finding(code: &'static str, message: String) -> Finding {
    Finding {
        scope: Scope::Gpudirect,
        code,
        message,
    }
}

/// GPUs, their HCAs, ACS on the paths and the peer-memory path. With `gpudirect.required`
/// false every problem is a warning; a node without GPUs passes unless required.
fn evaluate_gpudirect(report: &GpudirectReport, config: &Config) -> GpudirectVerdict {
    let req = &config.gpudirect;
    let max = req.max_relation();
    let mut problems = Vec::new();
    let mut notes = Vec::new();

    if report.gpus.is_empty() {
        if req.required {
            problems.push(gpudirect_finding(
                "NoGPUs",
                "gpudirect.required is true but no NVIDIA GPU (PCI vendor 0x10de, display or \
                 3D class) is listed under bus/pci/devices; check the GPU is seated and visible \
                 to the kernel (lspci -d 10de:)"
                    .into(),
            ));
        }
    } else if report.hcas.is_empty() {
        problems.push(gpudirect_finding(
            "NoHCAForGPUs",
            format!(
                "{} GPU{} but no RDMA device matching rdma.devices {:?} on a PCI function: \
                 GPUDirect RDMA has no HCA to use",
                report.gpus.len(),
                if report.gpus.len() == 1 { "" } else { "s" },
                config.rdma.devices
            ),
        ));
    }

    for pair in &report.pairs {
        let who = format!("GPU {} and {} ({})", pair.gpu, pair.hca, pair.hca_address);
        if pair.relation > max {
            let numa = |n: Option<u32>| n.map_or("?".to_owned(), |n| n.to_string());
            let why = match pair.relation {
                Relation::Sys => format!(
                    "across sockets: the GPU is on NUMA node {}, the HCA on NUMA node {}, so \
                     traffic crosses the CPU interconnect",
                    numa(pair.numa),
                    numa(pair.hca_numa)
                ),
                Relation::Node => "on different host bridges of one NUMA node".to_owned(),
                Relation::Phb => "connected only through the CPU's host bridge".to_owned(),
                _ => "connected through several PCIe switches".to_owned(),
            };
            problems.push(gpudirect_finding(
                "GPUHCATooFar",
                format!(
                    "{who} are {}, {why}; that is worse than gpudirect.max_relation {}: move \
                     the HCA to a slot on the GPU's PCIe switch or socket, or relax \
                     gpudirect.max_relation",
                    pair.relation,
                    max.name()
                ),
            ));
        }
        // A path through the host bridge goes via the root complex anyway: ACS there changes
        // nothing, so only switch-local paths (PIX, PXB) are judged.
        let switch_local = pair.relation <= Relation::Pxb;
        for bridge in pair.redirecting_bridges().filter(|_| switch_local) {
            let AcsState::Present { control, .. } = bridge.acs else {
                continue;
            };
            let finding = gpudirect_finding(
                "ACSRedirect",
                format!(
                    "{who}: bridge {} on their PCIe path has ACS {} (control 0x{control:04x}): \
                     peer-to-peer goes up to the root complex; disable ACS in the BIOS or clear \
                     it (`setpci -s {} ECAP_ACS+0x6.w=0000`), or set gpudirect.allow_acs: true \
                     if the platform needs it",
                    bridge.address,
                    acs_control_names(control).join("+"),
                    bridge.address
                ),
            );
            if req.allow_acs {
                notes.push(finding);
            } else {
                problems.push(finding);
            }
        }
    }
    let unknown: Vec<&str> = report
        .pairs
        .iter()
        .flat_map(|p| &p.bridges)
        .filter(|b| matches!(b.acs, AcsState::Unknown { .. }))
        .map(|b| b.address.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !unknown.is_empty() {
        notes.push(gpudirect_finding(
            "ACSUnknown",
            format!(
                "ACS of {} bridge{} on GPU–HCA paths is unknown ({}): the config space read \
                 stopped before the extended capabilities (unprivileged reads get 64 bytes); \
                 run the agent with CAP_SYS_ADMIN to check ACS",
                unknown.len(),
                if unknown.len() == 1 { "" } else { "s" },
                unknown.join(", ")
            ),
        ));
    }

    if !report.gpus.is_empty() && !report.peermem.usable() {
        let pm = &report.peermem;
        let module = match (&pm.module, &pm.module_state) {
            (Some(m), Some(state)) => format!("{m} is {state}, not Live"),
            _ => "nvidia_peermem is not loaded (not in /proc/modules)".to_owned(),
        };
        let dmabuf = match (&pm.driver_version, pm.open_kernel_modules) {
            (Some(v), Some(true)) => format!(
                "the open kernel modules {v} on kernel {} do not give DMA-BUF (needs >= 515 \
                 on Linux >= 5.12)",
                pm.kernel_release.as_deref().unwrap_or("?")
            ),
            (Some(v), _) => format!("driver {v} is the proprietary flavour (no DMA-BUF)"),
            (None, _) => "no NVIDIA driver version in /proc/driver/nvidia/version".to_owned(),
        };
        problems.push(gpudirect_finding(
            "PeerMemoryUnavailable",
            format!(
                "GPUDirect RDMA is off: {module} and {dmabuf}; NCCL stages every transfer \
                 through host memory. Load it (`modprobe nvidia_peermem`; GPU operator: \
                 driver.rdma.enabled=true) or use the open kernel modules for DMA-BUF"
            ),
        ));
    }
    for e in &report.errors {
        notes.push(gpudirect_finding("GPUDirectProbeError", e.clone()));
    }

    let rails = if report.pairs.is_empty() {
        None
    } else {
        let parts: Vec<String> = report
            .gpus
            .iter()
            .map(|g| {
                report
                    .pairs
                    .iter()
                    .find(|p| p.gpu == g.address)
                    .and_then(|p| report.hcas.iter().position(|h| h.name == p.hca))
                    .map_or("x".to_owned(), |i| i.to_string())
            })
            .collect();
        let value = parts.join(".");
        if crate::config::is_label_value(&value) {
            Some(value)
        } else {
            notes.push(gpudirect_finding(
                "RailsLabelTooLong",
                format!(
                    "the rail map of {} GPUs does not fit a label value (63 characters); \
                     the rails label is left out",
                    report.gpus.len()
                ),
            ));
            None
        }
    };

    let mut part = PartVerdict::ok();
    if req.required {
        part.ready = problems.is_empty();
        part.findings = problems;
    } else {
        part.warnings = problems;
    }
    part.warnings.extend(notes);
    GpudirectVerdict {
        part,
        required: req.required,
        gpus: report.gpus.len(),
        relation: report.worst_relation,
        rails,
    }
}

/// Fold `placement.required_labels` into a verdict, given the Node's current labels: a missing
/// key makes the node not ready (with the taint and a `FabricReady=False` reason naming it).
/// The agent calls this with the labels of its Node on every reconcile; `check`, which reads no
/// Node, does not.
pub fn apply_placement(
    verdict: &Verdict,
    node_labels: &BTreeMap<String, String>,
    required_labels: &[String],
    node: &crate::config::NodeSettings,
) -> Verdict {
    let missing: Vec<&str> = required_labels
        .iter()
        .filter(|k| !node_labels.contains_key(k.as_str()))
        .map(String::as_str)
        .collect();
    if missing.is_empty() {
        return verdict.clone();
    }
    let mut v = verdict.clone();
    v.placement = PartVerdict {
        ready: false,
        findings: vec![Finding {
            scope: Scope::Placement,
            code: "PlacementLabelsMissing",
            message: format!(
                "the Node lacks placement label{} {} (placement.required_labels): topology-aware \
                 schedulers (Kueue TAS) cannot place pods on it; label the Node",
                if missing.len() == 1 { "" } else { "s" },
                missing.join(", ")
            ),
        }],
        warnings: Vec::new(),
    };
    v.ready = false;
    v.labels
        .insert(format!("{}ready", node.label_prefix), "false".into());
    v.taints = vec![Taint {
        key: node.taint_key(),
        value: None,
        effect: node.taint_effect.as_str().to_owned(),
    }];
    let parts = [&v.rdma.part, &v.lustre, &v.gpudirect.part, &v.placement];
    let fabric = condition("FabricReady", false, "FabricValidated", &parts);
    for c in v.conditions.iter_mut().filter(|c| c.type_ == "FabricReady") {
        *c = fabric.clone();
    }
    v
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
            gpudirect: Default::default(),
            timings: ProbeTimings::default(),
        }
    }

    fn config(yaml: &str) -> Config {
        Config::parse(yaml).unwrap()
    }

    fn gpu_report(gpus: &[&str], pairs: &[(&str, &str, Relation)]) -> GpudirectReport {
        use fabricgate_probes::gpudirect::{Gpu, Hca, Pair, PeerMemory};
        let mut hcas: Vec<&str> = pairs.iter().map(|p| p.1).collect();
        hcas.sort_unstable();
        hcas.dedup();
        GpudirectReport {
            gpus: gpus
                .iter()
                .map(|a| Gpu {
                    address: (*a).into(),
                    device: None,
                    class: "0x030200".into(),
                    numa_node: Some(0),
                    path: String::new(),
                })
                .collect(),
            hcas: hcas
                .iter()
                .map(|h| Hca {
                    name: (*h).into(),
                    address: String::new(),
                    numa_node: Some(0),
                    path: String::new(),
                })
                .collect(),
            pairs: pairs
                .iter()
                .map(|(g, h, r)| Pair {
                    gpu: (*g).into(),
                    hca: (*h).into(),
                    hca_address: String::new(),
                    relation: *r,
                    numa: Some(0),
                    hca_numa: Some(1),
                    bridges: Vec::new(),
                })
                .collect(),
            worst_relation: pairs.iter().map(|p| p.2).max(),
            peermem: PeerMemory {
                method: Some("dma-buf".into()),
                ..PeerMemory::default()
            },
            ..GpudirectReport::default()
        }
    }

    #[test]
    fn rails_label_maps_gpus_to_hca_indices_and_marks_gpus_without_one() {
        let gd = gpu_report(
            &["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"],
            &[
                ("0000:01:00.0", "mlx5_1", Relation::Pix),
                ("0000:03:00.0", "mlx5_0", Relation::Phb),
            ],
        );
        let v = evaluate_gpudirect(&gd, &config(""));
        assert_eq!(v.rails.as_deref(), Some("1.x.0"));
        assert_eq!(v.relation, Some(Relation::Phb));
        assert!(v.part.ready, "not required: warnings only");
        assert_eq!(v.part.warnings[0].code, "GPUHCATooFar");
        let v = evaluate_gpudirect(&gd, &config("gpudirect:\n  max_relation: PHB\n"));
        assert!(v.part.warnings.is_empty(), "{:?}", v.part.warnings);
        let v = evaluate_gpudirect(&gd, &config("gpudirect:\n  required: true\n"));
        assert!(!v.part.ready);
        assert_eq!(v.part.findings[0].code, "GPUHCATooFar");
        // GPUs without any HCA.
        let gd = gpu_report(&["0000:01:00.0"], &[]);
        let v = evaluate_gpudirect(&gd, &config("gpudirect:\n  required: true\n"));
        assert_eq!(v.part.findings[0].code, "NoHCAForGPUs");
        assert_eq!(v.rails, None);
        // 40 GPUs do not fit a label value: no label, a warning.
        let names: Vec<String> = (0..40).map(|i| format!("0000:{i:02x}:00.0")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let pairs: Vec<(&str, &str, Relation)> =
            refs.iter().map(|g| (*g, "mlx5_0", Relation::Pix)).collect();
        let v = evaluate_gpudirect(&gpu_report(&refs, &pairs), &config(""));
        assert_eq!(v.rails, None);
        assert!(
            v.part
                .warnings
                .iter()
                .any(|w| w.code == "RailsLabelTooLong")
        );
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
            gpudirect: GpudirectVerdict::default(),
            placement: PartVerdict::ok(),
            labels,
            taints: if ready {
                Vec::new()
            } else {
                vec![unvalidated_taint(&config)]
            },
            conditions: vec![condition("FabricReady", ready, "FabricValidated", &[&part])],
            keep_taint: false,
        }
    }

    #[test]
    fn missing_placement_labels_taint_a_ready_node_and_name_the_keys() {
        let config = Config::parse(
            "placement:\n  required_labels: [cloud.example.com/block, cloud.example.com/rack]\n",
        )
        .unwrap();
        let ready = verdict(true, "mlx5_0");
        let required = &config.placement.required_labels;
        let mut labels = BTreeMap::new();
        labels.insert("cloud.example.com/block".to_owned(), "b1".to_owned());
        let v = apply_placement(&ready, &labels, required, &config.node);
        assert!(!v.ready);
        assert!(!v.placement.ready);
        assert_eq!(v.labels["fabricgate.io/ready"], "false");
        assert_eq!(v.taints.len(), 1);
        assert_eq!(v.taints[0].key, "fabricgate.io/unvalidated");
        let fabric = &v.conditions[0];
        assert_eq!(
            (fabric.status.as_str(), fabric.reason.as_str()),
            ("False", "PlacementLabelsMissing")
        );
        assert!(fabric.message.contains("cloud.example.com/rack"));
        assert!(!fabric.message.contains("cloud.example.com/block,"));
        assert_eq!(v.reasons().len(), 1);
        // Every key present: the verdict is unchanged.
        labels.insert("cloud.example.com/rack".to_owned(), "r7".to_owned());
        assert_eq!(
            apply_placement(&ready, &labels, required, &config.node),
            ready
        );
        // Nothing required: unchanged even without labels.
        assert_eq!(
            apply_placement(&ready, &BTreeMap::new(), &[], &config.node),
            ready
        );
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
