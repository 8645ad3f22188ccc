//! The agent's own trouble is never a node fault (docs/hardening.md, "AgentError").
//!
//! When the agent cannot do its job — it ran out of descriptors or memory, a probe stalled,
//! its container has no access to the RDMA device nodes or lacks a mount it needs — the
//! verdict says so with the condition reason [`REASON`] (`AgentError`), the cause and the fix,
//! instead of a reason about the hardware. [`gate`] is the one place where the decision "the
//! node carries the taint now" is taken; `node.on_agent_error` (`taint` | `keep`) chooses what
//! an agent error does to the taint there.

use crate::config::{Config, OnAgentError};
use crate::policy::{Finding, Scope, Verdict};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::host::HostReport;
use std::time::Duration;

/// Condition reason (and `fabricgate_findings` reason) of an agent error.
pub const REASON: &str = "AgentError";

/// What kind of agent trouble.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// EMFILE / ENFILE: out of file descriptors.
    OutOfDescriptors,
    /// ENOMEM: out of memory (or locked memory for verbs).
    OutOfMemory,
    /// A probe did not finish within the probe deadline.
    ProbeStalled,
    /// The container cannot open the RDMA device nodes.
    NoDeviceAccess,
    /// The container lacks a mount it needs (its procfs, a required mount's parent).
    MissingOwnMount,
    /// The requirements were written for other hardware: RDMA devices exist, none matches
    /// `rdma.devices`.
    ConfigMismatch,
    /// A registered subsystem cannot read what it judges (its `agent_problems`).
    SubsystemUnreadable,
}

impl Cause {
    /// Stable snake_case name (logs, docs).
    pub fn name(self) -> &'static str {
        match self {
            Self::OutOfDescriptors => "out_of_descriptors",
            Self::OutOfMemory => "out_of_memory",
            Self::ProbeStalled => "probe_stalled",
            Self::NoDeviceAccess => "no_device_access",
            Self::MissingOwnMount => "missing_own_mount",
            Self::ConfigMismatch => "config_mismatch",
            Self::SubsystemUnreadable => "subsystem_unreadable",
        }
    }

    /// The parts of the node whose verdict the agent cannot give.
    fn scopes(self) -> &'static [Scope] {
        match self {
            Self::NoDeviceAccess | Self::ConfigMismatch => &[Scope::Rdma],
            Self::MissingOwnMount => &[Scope::Check(super::LUSTRE)],
            // The subsystem's own part already says so (check::CheckVerdict).
            Self::SubsystemUnreadable => &[],
            Self::OutOfDescriptors | Self::OutOfMemory | Self::ProbeStalled => {
                &[Scope::Rdma, Scope::Check(super::LUSTRE)]
            }
        }
    }
}

/// One agent error: what happened and what to do, in one sentence each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentFault {
    pub cause: Cause,
    /// "<what happened>; <the fix>", shown as the condition message.
    pub message: String,
}

impl AgentFault {
    /// A probe still running after `deadline`.
    pub fn stalled(deadline: Duration) -> Self {
        Self {
            cause: Cause::ProbeStalled,
            message: format!(
                "fabricgate agent error: a probe has not finished within the probe deadline of \
                 {}s (a blocked read or a hung verbs call in the agent); the kubelet restarts the \
                 agent when /healthz fails after the liveness grace; if it recurs, look for a \
                 hung mount or driver on the node and raise --probe-deadline only if probes are \
                 legitimately slow",
                deadline.as_secs_f64()
            ),
        }
    }
}

/// Every error text of a report, with where it came from.
fn error_texts(report: &ProbeReport) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    out.extend(report.rdma.errors.iter().map(String::as_str));
    if let Some(e) = report.rdma.verbs.as_ref().and_then(|v| v.error.as_deref()) {
        out.push(e);
    }
    for dev in &report.rdma.devices {
        out.extend(dev.errors.iter().map(String::as_str));
        if let Some(e) = dev.verbs.as_ref().and_then(|v| v.error.as_deref()) {
            out.push(e);
        }
        for port in &dev.ports {
            out.extend(port.errors.iter().map(String::as_str));
            if let Some(m) = port.selftest.as_ref().and_then(|s| s.message.as_deref()) {
                out.push(m);
            }
        }
    }
    // The storage probe's errors among them (the mount table, the client, failed statfs).
    for (_, fact) in report.facts.iter() {
        out.extend(fact.errors().iter().map(String::as_str));
    }
    out
}

/// `(os error N)` as `std::io::Error` prints it, exactly (not `os error 122`, EDQUOT).
fn has_os_error(text: &str, errno: i32) -> bool {
    text.contains(&format!("(os error {errno})"))
}

fn is_out_of_descriptors(text: &str) -> bool {
    has_os_error(text, libc::EMFILE)
        || has_os_error(text, libc::ENFILE)
        || text.contains("Too many open files")
        || text.contains("(EMFILE)")
        || text.contains("(ENFILE)")
}

fn is_out_of_memory(text: &str) -> bool {
    has_os_error(text, libc::ENOMEM)
        || text.contains("Cannot allocate memory")
        || text.contains("(ENOMEM)")
}

/// Verbs could not open a device node from inside the container (the probes' advice names
/// the container and /dev/infiniband for exactly these errnos).
fn is_no_device_access(text: &str) -> bool {
    (text.contains("cannot open") && text.contains("into the container"))
        || text.contains("libibverbs does not see it")
}

/// Classify a probe report: `Some` when what went wrong is the agent's own trouble.
/// `own_mounts` are the problems [`own_mount_problems`] found.
pub fn classify(report: &ProbeReport, own_mounts: &[String]) -> Option<AgentFault> {
    let texts = error_texts(report);
    if let Some(t) = texts.iter().find(|t| is_out_of_descriptors(t)) {
        return Some(AgentFault {
            cause: Cause::OutOfDescriptors,
            message: format!(
                "fabricgate agent error: the agent ran out of file descriptors ({t}); this says \
                 nothing about the node; fix: raise the agent container's open-file limit \
                 (nofile) or report a descriptor leak in fabricgate"
            ),
        });
    }
    if let Some(t) = texts.iter().find(|t| is_out_of_memory(t)) {
        return Some(AgentFault {
            cause: Cause::OutOfMemory,
            message: format!(
                "fabricgate agent error: the agent ran out of memory ({t}); fix: raise the agent \
                 container's memory limit, and for verbs memory registration its locked-memory \
                 limit (memlock) with the IPC_LOCK capability"
            ),
        });
    }
    let no_access: Vec<&str> = texts
        .iter()
        .copied()
        .filter(|t| is_no_device_access(t))
        .collect();
    if !no_access.is_empty() {
        return Some(AgentFault {
            cause: Cause::NoDeviceAccess,
            message: format!(
                "fabricgate agent error: the agent's container cannot use the RDMA device nodes \
                 ({}); this is how the agent is deployed, not the fabric; fix: give the agent \
                 the shared RDMA device-plugin resource, or mount /dev/infiniband with a device \
                 cgroup rule that allows it",
                no_access.join("; ")
            ),
        });
    }
    if let Some(e) = fabricgate_probes::storage::of(report)
        .into_iter()
        .flat_map(|s| &s.errors)
        .find(|e| e.starts_with("cannot read the mount table"))
    {
        return Some(AgentFault {
            cause: Cause::MissingOwnMount,
            message: format!(
                "fabricgate agent error: {e}; the agent cannot see the node's mounts; fix: give \
                 the container a procfs at --proc-root"
            ),
        });
    }
    if !own_mounts.is_empty() {
        return Some(AgentFault {
            cause: Cause::MissingOwnMount,
            message: format!(
                "fabricgate agent error: {}; fix: add a hostPath volume for it to the DaemonSet \
                 (same path, mountPropagation: HostToContainer)",
                own_mounts.join("; ")
            ),
        });
    }
    None
}

/// Requirements that cannot be about this node: it has RDMA devices, but none matches
/// `rdma.devices` (a ConfigMap written for another pool's HCAs, `mlx5_*` on a `bnxt_re` node).
/// Not the hardware's fault, so an agent error; `None` when RDMA is not required, when sysfs
/// shows no device at all (a missing driver is the node's fault) or could not be read.
pub fn config_mismatch(report: &ProbeReport, config: &Config) -> Option<AgentFault> {
    let rdma = &report.rdma;
    if config.rdma.min_active_ports == 0 || rdma.devices.is_empty() || !rdma.errors.is_empty() {
        return None;
    }
    let matcher = config.device_matcher();
    if rdma.devices.iter().any(|d| matcher.is_match(&d.name)) {
        return None;
    }
    let names: Vec<&str> = rdma.devices.iter().map(|d| d.name.as_str()).collect();
    Some(AgentFault {
        cause: Cause::ConfigMismatch,
        message: format!(
            "fabricgate agent error: the requirements select RDMA devices {:?} but this node \
             has {}: they were written for other hardware, which says nothing about this node; \
             fix: set rdma.devices to this node's HCAs, or give this pool its own DaemonSet and \
             requirements (node.pool_selector)",
            config.rdma.devices.as_str(),
            names.join(", ")
        ),
    })
}

/// A registered subsystem that cannot read what it judges: its part says `AgentError`
/// already; this makes it the agent's fault for the hysteresis and the taint gate too.
pub fn subsystem_unreadable(verdict: &Verdict) -> Option<AgentFault> {
    let problems: Vec<String> = verdict
        .checks
        .iter()
        .flat_map(|(name, c)| c.agent_problems.iter().map(move |p| format!("{name}: {p}")))
        .collect();
    (!problems.is_empty()).then(|| AgentFault {
        cause: Cause::SubsystemUnreadable,
        message: format!(
            "fabricgate agent error: {}; this says nothing about the node; fix: give the agent's \
             container what the message names",
            problems.join("; ")
        ),
    })
}

/// Required mounts reported missing whose top-level directory does not exist in the agent's
/// own file system (the probe's host report): the container was not given the host directory,
/// so "missing" is the agent's blindness, not the node's.
pub fn own_mount_problems(host: &HostReport) -> Vec<String> {
    host.own_mounts_missing
        .iter()
        .map(|m| {
            format!(
                "{} is required but {} does not exist inside the agent's container",
                m.path,
                m.top.display()
            )
        })
        .collect()
}

/// The verdict of a probe the agent could not judge: the affected parts say `AgentError`
/// with the cause and the fix instead of any reason about the hardware.
pub fn verdict(mut v: Verdict, fault: &AgentFault, config: &Config) -> Verdict {
    let finding = |scope| Finding {
        scope,
        code: REASON,
        message: fault.message.clone(),
    };
    let prefix = &config.node.label_prefix;
    v.ready = false;
    v.labels.insert(format!("{prefix}ready"), "false".into());
    let mut affected = vec!["FabricReady"];
    for &scope in fault.cause.scopes() {
        match scope {
            Scope::Rdma => {
                v.rdma.part.ready = false;
                v.rdma.part.findings = vec![finding(Scope::Rdma)];
                v.labels
                    .insert(format!("{prefix}rdma.ready"), "false".into());
                affected.push("RDMAReady");
            }
            Scope::Check(name) => {
                let Some(part) = v.checks.get_mut(name) else {
                    continue;
                };
                part.part.ready = false;
                part.part.findings = vec![finding(scope)];
                if !part.silent {
                    v.labels
                        .insert(format!("{prefix}{name}.ready"), "false".into());
                }
                affected.push(part.condition);
            }
            // The agent's own faults are about the fabric probes and its mounts only.
            Scope::Placement => {}
        }
    }
    for c in &mut v.conditions {
        let affected = affected.contains(&c.type_.as_str());
        if affected {
            c.status = "False".into();
            c.reason = REASON.into();
            c.message = fault.message.clone();
        }
    }
    v
}

/// The single place where the decision "this node carries the taint now" is taken: every
/// verdict passes here right before it is handed to the Node writer.
///
/// - no agent error: the taint the policy and its hysteresis chose;
/// - an agent error and `node.on_agent_error: taint` (default, fail closed): the taint;
/// - an agent error and `keep`: the taint stays as it is on the Node (added or removed by
///   nobody until the agent can judge again).
///
/// A blast-radius breaker that holds back new taints belongs here too.
pub fn gate(mut v: Verdict, fault: Option<&AgentFault>, config: &Config) -> Verdict {
    let Some(_) = fault else {
        v.keep_taint = false;
        return v;
    };
    match config.node.on_agent_error {
        OnAgentError::Taint => {
            v.keep_taint = false;
            v.taints = vec![crate::policy::unvalidated_taint(config)];
        }
        OnAgentError::Keep => {
            v.keep_taint = true;
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_and_memory_exhaustion_are_agent_errors() {
        assert!(is_out_of_descriptors(
            "cannot read /sys/class/infiniband: Too many open files (os error 24)"
        ));
        assert!(is_out_of_memory(
            "reg_mr: errno 12 (ENOMEM): cannot register"
        ));
        assert!(is_no_device_access(
            "cannot open /dev/infiniband/uverbs0: permission denied; mount /dev/infiniband into \
             the container and allow access to it"
        ));
        assert!(!is_no_device_access("mlx5_0 port 1: state DOWN"));
        // Other errnos that merely start with the same digits are the node's business.
        assert!(!is_out_of_memory(
            "/lustre/x: write check: Disk quota exceeded (os error 122)"
        ));
        assert!(!is_out_of_descriptors("statfs: (os error 240)"));
        assert!(is_out_of_memory(
            "read_dir: Cannot allocate memory (os error 12)"
        ));
    }

    #[test]
    fn requirements_for_other_hardware_are_an_agent_error_a_missing_driver_is_not() {
        use fabricgate_probes::rdma::DeviceReport;
        let mut report = ProbeReport::default();
        report.rdma.subsystem_present = true;
        report.rdma.devices = ["bnxt_re0", "bnxt_re1"]
            .iter()
            .map(|n| DeviceReport {
                name: (*n).to_owned(),
                ..Default::default()
            })
            .collect();
        let config = Config::parse("rdma:\n  devices: \"mlx5_*\"\n").unwrap();
        let fault = config_mismatch(&report, &config).expect("an agent error");
        assert_eq!(fault.cause, Cause::ConfigMismatch);
        assert!(
            fault.message.contains("\"mlx5_*\"") && fault.message.contains("bnxt_re0, bnxt_re1"),
            "{}",
            fault.message
        );
        let v = verdict(crate::policy::evaluate(&report, &config), &fault, &config);
        assert!(v.rdma.part.findings.iter().all(|f| f.code == REASON));
        // A matching device: the node is judged as usual.
        let any = Config::parse("rdma:\n  devices: \"bnxt_*\"\n").unwrap();
        assert_eq!(config_mismatch(&report, &any), None);
        // RDMA not required: nothing to mismatch.
        let off = Config::parse("rdma:\n  devices: \"mlx5_*\"\n  min_active_ports: 0\n").unwrap();
        assert_eq!(config_mismatch(&report, &off), None);
        // No device at all (no driver loaded): the node's fault, not the requirements'.
        report.rdma.devices.clear();
        assert_eq!(config_mismatch(&report, &config), None);
    }
}
