//! The pure decision: a probe report and the requirements in, a verdict out. No I/O, no clock.

pub mod agent_fault;
pub mod breaker;
pub mod check;
pub mod devices;
mod hysteresis;
pub mod judge;
mod placement;
mod rdma;
#[cfg(test)]
mod tests;

pub use hysteresis::{AWAITING_VALIDATION, Hysteresis};
pub use placement::apply_placement;
use rdma::evaluate_rdma;
pub use rdma::{HcaHealth, hca_health, usable_ports};

use crate::config::{Config, LinkLayerRequirement};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::gpudirect::transport::netdev_mtu_for_roce;
use fabricgate_probes::gpudirect::{MtuSource, PortTransport};
use fabricgate_probes::rdma::{
    DeviceReport, LinkLayer, PhysState, PortReport, PortState, RdmaReport, format_gbps,
};
use serde::Serialize;
use std::collections::BTreeMap;

/// The storage subsystem's part (src/checks/storage/): the agent's own trouble with its mounts
/// speaks for it ([`agent_fault`]).
pub const LUSTRE: &str = "lustre";

/// Which part of the node a finding is about; each maps to one Node condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Rdma,
    Placement,
    /// A registered subsystem's ([`check::NodeCheck`]), by its name.
    #[serde(untagged)]
    Check(&'static str),
}

impl Scope {
    /// As the `scope` label of `fabricgate_findings` and in `check`'s JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rdma => "rdma",
            Self::Placement => "placement",
            Self::Check(name) => name,
        }
    }
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
    /// The DRA devices of bad HCAs to keep a `DeviceTaintRule` on (`kubernetes.dra`); set
    /// only by the [`judge::Judge`], after its device hysteresis.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub device_taints: Vec<devices::DeviceTaint>,
    /// The registered subsystems' parts ([`check::NodeCheck`]), by name, in registration order.
    #[serde(flatten)]
    pub checks: check::Parts,
}

impl Verdict {
    /// One human sentence per problem, RDMA first.
    pub fn reasons(&self) -> Vec<String> {
        self.parts()
            .flat_map(|p| &p.findings)
            .map(|f| f.message.clone())
            .collect()
    }

    pub fn warnings(&self) -> Vec<String> {
        self.parts()
            .flat_map(|p| &p.warnings)
            .map(|f| f.message.clone())
            .collect()
    }

    /// Every part of the verdict: RDMA, the registered subsystems' in registration order
    /// (Lustre's, GPUDirect's), placement.
    pub fn parts(&self) -> impl Iterator<Item = &PartVerdict> {
        [&self.rdma.part]
            .into_iter()
            .chain(self.checks.values().map(|c| &c.part))
            .chain([&self.placement])
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

/// Judge one probe report against the requirements, with no memory of earlier probes: the RDMA
/// part alone, without the registered subsystems (storage, GPUDirect: [`evaluate_checked`]).
pub fn evaluate(report: &ProbeReport, config: &Config) -> Verdict {
    evaluate_with(report, config, &[], &check::Checks::default())
}

/// [`evaluate`] with the registered subsystems judged too (what `check` and `preflight` give).
pub fn evaluate_checked(report: &ProbeReport, config: &Config, checks: &check::Checks) -> Verdict {
    evaluate_with(report, config, &[], checks)
}

/// [`evaluate`], plus findings on the RDMA part from outside the probe (`rdma_findings`: what
/// the device views saw, [`devices::DeviceView`]), after the hardware's own findings, so a
/// healthy fabric with a dead device plugin is not ready and the condition names the
/// resource. Each registered subsystem judges its own fact; a required one that does not pass
/// makes the node not ready and names itself in `FabricReady`.
pub fn evaluate_with(
    report: &ProbeReport,
    config: &Config,
    rdma_findings: &[Finding],
    checks: &check::Checks,
) -> Verdict {
    let transport = fabricgate_probes::gpudirect::transport_of(report);
    let mut rdma = evaluate_rdma(&report.rdma, transport, config);
    if !rdma_findings.is_empty() {
        rdma.part.ready = false;
        rdma.part.findings.extend(rdma_findings.iter().cloned());
    }
    let judged = check::judge_all(checks, report, config);
    let ready = rdma.part.ready && judged.iter().all(|j| j.verdict.part.ready);
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
    check::put_labels(&mut labels, prefix, &judged);

    let taints = if ready {
        Vec::new()
    } else {
        vec![unvalidated_taint(config)]
    };

    let mut fabric_parts = vec![&rdma.part];
    fabric_parts.extend(judged.iter().map(|j| &j.verdict.part));
    let mut conditions = vec![
        condition("FabricReady", ready, "FabricValidated", &fabric_parts),
        condition(
            "RDMAReady",
            rdma.part.ready,
            "RDMAPortsActive",
            &[&rdma.part],
        ),
    ];
    conditions.extend(judged.iter().filter_map(check::Judged::condition));

    Verdict {
        ready,
        rdma,
        placement: PartVerdict::ok(),
        labels,
        taints,
        conditions,
        keep_taint: false,
        device_taints: Vec::new(),
        checks: judged.into_iter().map(|j| (j.name, j.verdict)).collect(),
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

/// Exit code of a completed `check` (and of preflight's verdict): 3 when nothing could be probed at all.
pub fn exit_code(report: &ProbeReport, verdict: &Verdict) -> u8 {
    if verdict.ready {
        crate::EXIT_VALIDATED
    } else if report.rdma.devices.is_empty() && !report.rdma.errors.is_empty() {
        crate::EXIT_CANNOT_PROBE
    } else {
        crate::EXIT_NOT_VALIDATED
    }
}
