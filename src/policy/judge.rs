//! The one place a node's verdict is decided. The probe loop, the stall path and the event fast
//! path all hand their facts to a [`Judge`] and publish what it returns; none of them combines
//! findings, hysteresis or agent faults on its own.
//!
//! Order of a full judgment (each step's reason in its comment below):
//! 1. the hardware: [`evaluate_with`] over the report and what the device views see of the
//!    node's HCAs ([`devices::DeviceView`]: the device plugins, DRA);
//! 2. the peer mesh's required finding, if `peers` are required;
//! 3. the agent's own faults ([`agent_fault::classify`], [`agent_fault::config_mismatch`]):
//!    a probe the agent could not judge bypasses the hysteresis;
//! 4. the hysteresis (fail fast, recover after `node.recover_after` good probes);
//! 5. the taint gate ([`agent_fault::gate`], `node.on_agent_error`).
//!
//! Pure: no I/O, no clock. The blast-radius breaker is the one mark decided later, by the Node
//! writer, because it needs the pool's state at the moment of the write
//! ([`crate::policy::breaker::taint_decision`]).

use super::agent_fault::{self, AgentFault};
use super::check::Checks;
use super::devices::{self, DeviceHysteresis, DeviceView};
use super::{Finding, Hysteresis, Scope, Verdict, evaluate_with, unvalidated_taint};
use crate::config::Config;
use fabricgate_probes::ProbeReport;
use std::sync::Arc;
use std::time::Duration;

/// What the agent knows when it judges a full probe.
#[derive(Debug, Clone)]
pub struct Facts<'a> {
    /// The probe, with what it saw on the host beside the hardware (device-plugin sockets and
    /// device nodes, the agent's own mounts).
    pub report: &'a ProbeReport,
    /// The peer mesh's finding when `peers` are required and a round failed.
    pub peer_finding: Option<Finding>,
    /// What the features handing the node's HCAs to pods see of them, in the order their
    /// findings are named (the device plugins: the watched Node's resources, the sockets and
    /// device nodes of the host report; DRA's slices and claims with `kubernetes.dra`).
    pub devices: &'a [Arc<dyn DeviceView>],
}

/// What one judgment gives: the verdict for the Node writer, the one metrics record, and the
/// agent fault (if any) for logs, `/readyz` and `fabricgate_agent_error`.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgment {
    /// The verdict to publish, taint gate applied.
    pub verdict: Verdict,
    /// What the probe metrics record: the verdict before the taint gate (the node's state as
    /// judged, whatever `on_agent_error` does with the taint).
    pub recorded: Verdict,
    /// The probe alone, before hysteresis, was ready.
    pub instant_ready: bool,
    pub fault: Option<AgentFault>,
}

/// Decides verdicts; owns the only state a verdict depends on (the hysteresis).
#[derive(Debug, Clone)]
pub struct Judge {
    config: Config,
    hysteresis: Hysteresis,
    devices: DeviceHysteresis,
    /// The device views of the last full judgment, for the event path.
    last_devices: Vec<Arc<dyn DeviceView>>,
    /// The registered subsystems, judged with the hardware.
    checks: Checks,
}

impl Judge {
    pub fn new(config: &Config) -> Self {
        Self {
            config: config.clone(),
            hysteresis: Hysteresis::new(config),
            devices: DeviceHysteresis::default(),
            last_devices: Vec::new(),
            checks: Checks::default(),
        }
    }

    /// With the registered subsystems' policy sides (the agent's one list of them).
    pub fn with_checks(mut self, checks: Checks) -> Self {
        self.checks = checks;
        self
    }

    /// Continue a validation an earlier agent run recorded on the Node.
    pub fn resume_validated(&mut self) {
        self.hysteresis.resume_validated();
    }

    /// Consecutive good probes so far.
    pub fn good_streak(&self) -> u32 {
        self.hysteresis.good_streak()
    }

    /// Judge a full probe (or, with the same report, a change of the Node's facts).
    pub fn probe(&mut self, facts: Facts<'_>) -> Judgment {
        let config = &self.config;
        let devices = devices::assess_all(facts.devices, facts.report, config);
        let mut own_mounts = agent_fault::own_mount_problems(&facts.report.host);
        own_mounts.extend(devices.own_problems);
        self.last_devices = facts.devices.to_vec();
        let in_use_ports = devices.ports_in_use;
        let mut instant = if in_use_ports == 0 {
            evaluate_with(facts.report, config, &devices.findings, &self.checks)
        } else {
            // The ports of HCAs a claim holds serve that pod: the node is judged on the rest.
            let mut rest = config.clone();
            rest.rdma.min_active_ports = rest.rdma.min_active_ports.saturating_sub(in_use_ports);
            evaluate_with(facts.report, &rest, &devices.findings, &self.checks)
        };
        instant.rdma.part.warnings.extend(devices.warnings);
        if let Some(finding) = facts.peer_finding {
            instant = apply_required_finding(instant, finding, config);
        }
        let fault = agent_fault::classify(facts.report, &own_mounts)
            // Devices missing from an incomplete plugin set are the plugin's fault.
            .filter(|f| {
                !(f.cause == agent_fault::Cause::NoDeviceAccess && devices.explains_missing_devices)
            })
            .or_else(|| agent_fault::config_mismatch(facts.report, config))
            .or_else(|| agent_fault::subsystem_unreadable(&instant));
        // The agent's own trouble neither taints nor untaints a device.
        let device_taints = match &fault {
            None => self
                .devices
                .apply(&devices.taints, config.node.recover_after),
            Some(_) => self.devices.current(),
        };
        // Device taints whose rules cannot be written protect nothing: the Node is tainted.
        if let Some(refused) = devices::taints_refused(facts.devices, &device_taints) {
            if device_taints.is_empty() {
                instant.rdma.part.warnings.push(refused);
            } else {
                instant = apply_required_finding(instant, refused, config);
            }
        }
        let instant_ready = instant.ready;
        // An agent error says nothing about the node: the hysteresis does not see that probe,
        // so the node continues where it was once the agent can judge again.
        let mut recorded = match &fault {
            None => self.hysteresis.apply(instant),
            Some(f) => agent_fault::verdict(instant, f, config),
        };
        recorded.device_taints = device_taints;
        let verdict = agent_fault::gate(recorded.clone(), fault.as_ref(), config);
        Judgment {
            verdict,
            recorded,
            instant_ready,
            fault,
        }
    }

    /// A probe running past its deadline: an agent error on top of the last verdict (or of an
    /// empty node when no probe has completed yet). The hysteresis does not move.
    pub fn stalled(&self, last: Option<&Verdict>, deadline: Duration) -> Judgment {
        let fault = AgentFault::stalled(deadline);
        let base = last.cloned().unwrap_or_else(|| {
            evaluate_with(&ProbeReport::default(), &self.config, &[], &self.checks)
        });
        let mut recorded = agent_fault::verdict(base, &fault, &self.config);
        recorded.device_taints = self.devices.current();
        let verdict = agent_fault::gate(recorded.clone(), Some(&fault), &self.config);
        Judgment {
            verdict,
            recorded,
            instant_ready: false,
            fault: Some(fault),
        }
    }

    /// A kernel event re-read the ports' states into the last full probe's report; `last` is
    /// the verdict published last (ready: the event path runs only then). Every mark of the
    /// event is decided here:
    /// - the ports alone make the node not ready: that verdict (published before the full
    ///   probe finishes), with the device taints below;
    /// - the node stays ready (only a full probe may say a node is good, so nothing else of
    ///   `last` changes) but the HCAs the event finds bad are tainted at once (with the last
    ///   full judgment's slices): `last` with those device taints, when they differ from its;
    /// - otherwise `None`. An event never untaints a device.
    pub fn port_event(&mut self, patched: &ProbeReport, last: &Verdict) -> Option<Verdict> {
        let instant = evaluate_with(patched, &self.config, &[], &self.checks);
        let bad = devices::assess_all(&self.last_devices, patched, &self.config).taints;
        if !instant.ready {
            let mut verdict = self.hysteresis.apply(instant);
            verdict.device_taints = self.devices.add(&bad);
            return Some(agent_fault::gate(verdict, None, &self.config));
        }
        let device_taints = self.devices.add(&bad);
        (device_taints != last.device_taints).then(|| Verdict {
            device_taints,
            ..last.clone()
        })
    }
}

/// A required check outside the probe (the peer mesh) failed: the RDMA part is not ready, the
/// node tainted, and `FabricReady`/`RDMAReady` name the first finding of their scope.
pub fn apply_required_finding(mut v: Verdict, finding: Finding, config: &Config) -> Verdict {
    let prefix = &config.node.label_prefix;
    v.rdma.part.ready = false;
    v.rdma.part.findings.push(finding);
    v.ready = false;
    v.labels.insert(format!("{prefix}ready"), "false".into());
    v.labels
        .insert(format!("{prefix}rdma.ready"), "false".into());
    v.taints = vec![unvalidated_taint(config)];
    let findings: Vec<Finding> = v.parts().flat_map(|p| p.findings.clone()).collect();
    for c in &mut v.conditions {
        let mine: Vec<&Finding> = match c.type_.as_str() {
            "FabricReady" => findings.iter().collect(),
            "RDMAReady" => findings.iter().filter(|f| f.scope == Scope::Rdma).collect(),
            _ => continue,
        };
        c.status = "False".into();
        c.reason = mine.first().map_or("NotValidated", |f| f.code).to_owned();
        c.message = mine
            .iter()
            .map(|f| f.message.as_str())
            .collect::<Vec<_>>()
            .join("; ");
    }
    v
}

#[cfg(test)]
mod tests;
