//! DRA (docs/dra.md): the HCAs a DRA driver publishes in this node's ResourceSlices, matched to
//! the HCAs the probe judged. Two outcomes: node findings (the driver is gone, an HCA is not
//! published) and device taints (a published HCA the probe finds bad), one `DeviceTaintRule`
//! each, kept with the same hysteresis as the node verdict
//! ([`crate::policy::devices::DeviceHysteresis`], the Judge's).
//!
//! Pure: the slices arrive as [`DraFacts`] (`slices.rs` reads them and holds a kubelet restart
//! back), the registration sockets in the probe's host report. Which device is tainted is
//! decided here and applied through the Judge only, on every path (full probe, kernel event).

use super::settings::{DraDriver, DraSettings, TaintScope};
use crate::config::Config;
use crate::policy::devices::{DeviceAssessment, DeviceTaint, DeviceView};
use crate::policy::{Finding, HcaHealth, Scope, hca_health};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::host::HostReport;
use fabricgate_probes::rdma::types::{PhysState, PortState};
use fabricgate_probes::transport::Observed;
use fabricgate_probes::transport::restrack::NetlinkPort;
use k8s_openapi::api::resource::v1::ResourceSlice;
use serde::Serialize;
use std::collections::BTreeMap;

/// The DRA driver of a configured name is not running on this node.
pub const DRA_DRIVER_UNAVAILABLE: &str = "DraDriverUnavailable";
/// An HCA the probe sees is published by none of the configured drivers.
pub const DRA_DEVICE_MISSING: &str = "DraDeviceMissing";
/// A published device that names an HCA the probe does not see, or two drivers' devices for
/// one HCA (warnings).
pub const DRA_DEVICE_UNMATCHED: &str = "DraDeviceUnmatched";
/// A published device whose HCA the probe does not see, held by a ResourceClaim allocated on
/// this node: in exclusive RDMA netns mode the driver moved it into the pod's network
/// namespace (docs/dra.md, "Exclusive RDMA network namespaces"). A warning, never a taint.
pub const DRA_DEVICE_IN_USE: &str = "DraDeviceInUse";
pub const DRA_DEVICE_CONFLICT: &str = "DraDeviceConflict";
/// Devices of a configured driver in a pool not named after the node (another driver's
/// naming, or a fault): skipped, since the admission policy lets an agent write rules for its
/// own node's pool only (a warning).
pub const DRA_FOREIGN_POOL: &str = "DraForeignPool";

/// The DeviceTaint rules of this node's bad HCAs cannot be written: the device path protects
/// nothing, so a bad HCA taints the Node instead.
pub const DRA_DEVICE_RULES_REFUSED: &str = "DraDeviceRulesRefused";

/// What the DeviceTaintRule writer (`rules.rs`) found out about the API: a fact
/// the Judge reads ([`rules_refused`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RulesState {
    /// Rules are written.
    On,
    /// The API server does not serve `DeviceTaintRule` (older than 1.37): the device path is
    /// off; the Node path goes on.
    NotServed,
    /// The API server refuses the rules (403 of RBAC or the admission policy, 422 or 400 of a
    /// webhook or a policy, 5xx past the writer's retries): retried slowly. The text names
    /// the rules and the errors.
    Refused(String),
}

/// The Node's side of [`RulesState::Refused`]: with rules wanted (`taints`, the devices in
/// force), a finding, since those HCAs are kept from no claim; without, a warning.
pub fn rules_refused(state: Option<&RulesState>, taints: &[DeviceTaint]) -> Option<Finding> {
    let Some(RulesState::Refused(why)) = state else {
        return None;
    };
    let message = if taints.is_empty() {
        format!(
            "this node's DeviceTaintRules cannot be written ({why}): a bad HCA would be kept \
             from no claim, so it would taint the Node instead \
             (fabricgate_dra_device_rules_writable 0)"
        )
    } else {
        let hcas = taints
            .iter()
            .map(|t| format!("{} ({}: {})", t.hca, t.device, t.reason))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "the DeviceTaintRules of {hcas} cannot be written ({why}): the device path is not \
             protecting anything, so the Node is tainted instead until they are \
             (fabricgate_dra_device_rules_writable 0)"
        )
    };
    Some(finding(DRA_DEVICE_RULES_REFUSED, message))
}

/// One device of a configured driver in a ResourceSlice of this node.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct PublishedDevice {
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// The driver's RDMA-device attribute (`mlx5_0`).
    pub rdma_device: Option<String>,
    /// The driver's PCI-address attribute (`0000:18:00.0`).
    pub pci_address: Option<String>,
}

/// What the API shows of the configured drivers on this node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraFacts {
    pub devices: Vec<PublishedDevice>,
    /// Configured drivers with no ResourceSlice for this node.
    pub drivers_without_slices: Vec<String>,
    /// Devices of this node's slices in a pool not named after the node: matched to no HCA,
    /// never tainted ([`DRA_FOREIGN_POOL`]).
    pub foreign_pool: Vec<PublishedDevice>,
    /// Devices of the configured drivers that ResourceClaims allocated on this node hold
    /// (empty until something reads the claims: see docs/dra.md).
    pub claimed: Vec<ClaimedDevice>,
    /// What the network namespaces of the claims' pods hold (the agent looks into them:
    /// `agent::pod_hcas`); empty when nothing looked.
    pub in_pods: Vec<PodNamespaceHcas>,
}

/// The RDMA ports one pod's own network namespace lists, or why it was not looked into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodNamespaceHcas {
    /// `namespace/name`.
    pub pod: String,
    pub ports: Observed<Vec<NetlinkPort>>,
}

/// One device of an allocation result (`status.allocation.devices.results[]`) of a
/// ResourceClaim, with the claim and the pods it is reserved for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ClaimedDevice {
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// `namespace/name` of the claim.
    pub claim: String,
    /// Each pod on this node that names the claim.
    pub pods: Vec<ClaimPod>,
}

/// A pod that names a claim.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct ClaimPod {
    /// `namespace/name`.
    pub name: String,
    /// Its UID: how its processes are found on the node (their cgroups name it).
    pub uid: String,
}

impl DraFacts {
    /// The claim that holds a published device, if any.
    pub fn holder(&self, d: &PublishedDevice) -> Option<&ClaimedDevice> {
        self.claimed
            .iter()
            .find(|c| c.driver == d.driver && c.pool == d.pool && c.device == d.device)
    }
}

/// The devices of `drivers` in `slices` (this node's), and the drivers with no slice. A slice
/// of a pool generation older than the newest one seen for that pool is left out (the driver
/// is replacing it); the devices of a pool not named after the slice's node are kept apart
/// (`foreign_pool`).
pub fn published(slices: &[ResourceSlice], drivers: &[DraDriver]) -> DraFacts {
    let mut newest: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for s in slices {
        let key = (s.spec.driver.as_str(), s.spec.pool.name.as_str());
        let g = newest.entry(key).or_insert(s.spec.pool.generation);
        *g = (*g).max(s.spec.pool.generation);
    }
    let mut facts = DraFacts::default();
    for d in drivers {
        let mut any = false;
        let rdma_attribute = d.rdma_device_attribute();
        let pci_attribute = d.pci_address_attribute();
        for s in slices.iter().filter(|s| s.spec.driver == d.name) {
            let key = (s.spec.driver.as_str(), s.spec.pool.name.as_str());
            if newest
                .get(&key)
                .is_some_and(|g| *g > s.spec.pool.generation)
            {
                continue;
            }
            any = true;
            let own_pool = s.spec.node_name.as_deref() == Some(s.spec.pool.name.as_str());
            for device in s.spec.devices.iter().flatten() {
                let attributes = device.attributes.as_ref();
                let string = |qualified: &str| {
                    let attributes = attributes?;
                    // An attribute's name may leave out the driver's own domain.
                    let short = qualified
                        .strip_prefix(&d.name)
                        .and_then(|rest| rest.strip_prefix('/'));
                    attributes
                        .get(qualified)
                        .or_else(|| short.and_then(|n| attributes.get(n)))
                        .and_then(|a| a.string.clone())
                        .filter(|v| !v.is_empty())
                };
                let published = PublishedDevice {
                    driver: d.name.clone(),
                    pool: s.spec.pool.name.clone(),
                    device: device.name.clone(),
                    rdma_device: string(&rdma_attribute),
                    pci_address: string(&pci_attribute).map(|a| a.to_ascii_lowercase()),
                };
                if own_pool {
                    facts.devices.push(published);
                } else {
                    facts.foreign_pool.push(published);
                }
            }
        }
        if !any {
            facts.drivers_without_slices.push(d.name.clone());
        }
    }
    facts.devices.sort();
    facts.devices.dedup();
    facts.foreign_pool.sort();
    facts.foreign_pool.dedup();
    facts
}

/// What the DRA facts make of one probe.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DraAssessment {
    /// The node's findings: a driver gone, an HCA not published; `both` scope: a bad HCA.
    pub findings: Vec<Finding>,
    /// Facts that block nothing: devices that match no probed HCA, two drivers for one HCA.
    pub warnings: Vec<Finding>,
    /// The agent cannot look: the registration directory is not mounted.
    pub own_problems: Vec<String>,
    /// The published devices of the HCAs the probe finds bad.
    pub taints: Vec<DeviceTaint>,
    /// HCAs a ResourceClaim holds that the probe cannot see (moved into a pod's network
    /// namespace): one port each that serves that pod and is not the node's to count.
    pub in_use: Vec<InUseHca>,
}

impl DraAssessment {
    /// The ports of the HCAs in use by pods (one each: a DRA device is one PCI function).
    pub fn in_use_ports(&self) -> u32 {
        u32::try_from(self.in_use.len()).unwrap_or(u32::MAX)
    }
}

/// What the DRA side sees at one moment, handed to the Judge: the slices and claims, and the
/// rule writer's state.
#[derive(Debug, Clone)]
pub struct DraView {
    /// DRA's section of the config (`kubernetes.dra`), read once.
    pub settings: std::sync::Arc<DraSettings>,
    /// `None` until the slice watch has listed (the slices are then not judged, the
    /// registration sockets are).
    pub facts: Option<DraFacts>,
    /// `None` where no rule writer runs.
    pub rules: Option<RulesState>,
    /// The first assessment made through this view (the full probe's, which the Judge makes
    /// first): DRA's figures of that judgment are recorded from it, not assessed again.
    first: std::sync::OnceLock<DraAssessment>,
}

impl DraView {
    pub fn new(
        settings: std::sync::Arc<DraSettings>,
        facts: Option<DraFacts>,
        rules: Option<RulesState>,
    ) -> Self {
        Self {
            settings,
            facts,
            rules,
            first: std::sync::OnceLock::new(),
        }
    }

    /// What this view made of the first report it assessed, or of `report` when it assessed
    /// none yet.
    pub fn first_assessment(&self, report: &ProbeReport, config: &Config) -> &DraAssessment {
        self.first
            .get_or_init(|| assess(report, self.facts.as_ref(), &self.settings, config))
    }
}

impl DeviceView for DraView {
    fn assess(&self, report: &ProbeReport, config: &Config) -> DeviceAssessment {
        let judged = assess(report, self.facts.as_ref(), &self.settings, config);
        if self.first.get().is_none() {
            let _ = self.first.set(judged.clone());
        }
        DeviceAssessment {
            ports_in_use: judged.in_use_ports(),
            findings: judged.findings,
            warnings: judged.warnings,
            own_problems: judged.own_problems,
            taints: judged.taints,
            explains_missing_devices: false,
        }
    }

    fn taints_refused(&self, taints: &[DeviceTaint]) -> Option<Finding> {
        rules_refused(self.rules.as_ref(), taints)
    }
}

/// An HCA in use by a pod's claim, not in the node's probe (`fabricgate_dra_device_in_use`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct InUseHca {
    pub hca: String,
    /// `namespace/name` of the claim.
    pub claim: String,
}

fn finding(code: &'static str, message: String) -> Finding {
    Finding {
        scope: Scope::Rdma,
        code,
        message,
    }
}

/// Whether a published device is the HCA: by the RDMA-device attribute, else by the PCI
/// address.
fn maps_to(device: &PublishedDevice, hca: &HcaHealth) -> bool {
    match (&device.rdma_device, &device.pci_address) {
        (Some(name), _) => *name == hca.name,
        (None, Some(pci)) => hca.pci_address.as_deref() == Some(pci.as_str()),
        (None, None) => false,
    }
}

/// Judge the DRA side of a probe. `facts`: `None` until the slice watch has listed (the slices
/// are then not judged, the sockets are).
pub fn assess(
    report: &ProbeReport,
    facts: Option<&DraFacts>,
    dra: &DraSettings,
    config: &Config,
) -> DraAssessment {
    let mut out = DraAssessment::default();
    if !dra.enabled() {
        return out;
    }
    registration_findings(&report.host, &dra.registry_dir, &mut out);
    let Some(facts) = facts else { return out };
    for driver in &facts.drivers_without_slices {
        out.findings.push(finding(
            DRA_DRIVER_UNAVAILABLE,
            format!(
                "the DRA driver {driver} publishes no ResourceSlice for this node: its kubelet \
                 plugin is not running or cannot reach the API server (the kubelet deletes a \
                 driver's slices 30 s after its plugin goes away); check the driver's \
                 DaemonSet pod on this node (kubectl get resourceslices \
                 --field-selector spec.driver={driver})"
            ),
        ));
    }
    foreign_pool_warnings(facts, &mut out);
    let hcas = hca_health(report, config);
    unprobed_devices(report, facts, &mut out);
    let taint_both = dra.taint_scope == TaintScope::Both;
    for hca in &hcas {
        let mine: Vec<&PublishedDevice> =
            facts.devices.iter().filter(|d| maps_to(d, hca)).collect();
        if mine.is_empty() {
            let drivers: Vec<&str> = dra.drivers.iter().map(|d| d.name.as_str()).collect();
            out.findings.push(finding(
                DRA_DEVICE_MISSING,
                format!(
                    "{}{} is not published by the DRA driver{} {}: pods cannot claim it; \
                     check the driver's log on this node (it may have started before the HCA's \
                     driver, or filter it out)",
                    hca.name,
                    hca.pci_address
                        .as_deref()
                        .map(|p| format!(" ({p})"))
                        .unwrap_or_default(),
                    if drivers.len() == 1 { "" } else { "s" },
                    drivers.join(", ")
                ),
            ));
            continue;
        }
        let owners: Vec<&str> = {
            let mut o: Vec<&str> = mine.iter().map(|d| d.driver.as_str()).collect();
            o.dedup();
            o
        };
        if owners.len() > 1 {
            out.warnings.push(finding(
                DRA_DEVICE_CONFLICT,
                format!(
                    "{} is published by more than one DRA driver ({}): pods of both may get \
                     it at once; configure one of them to leave it out",
                    hca.name,
                    owners.join(", ")
                ),
            ));
        }
        let Some(first) = hca.problems.first() else {
            continue;
        };
        let message = hca
            .problems
            .iter()
            .map(|f| f.message.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        for d in mine {
            out.taints.push(DeviceTaint {
                driver: d.driver.clone(),
                pool: d.pool.clone(),
                device: d.device.clone(),
                hca: hca.name.clone(),
                reason: first.code.to_owned(),
                message: message.clone(),
            });
        }
        if taint_both {
            out.findings.push(finding(
                first.code,
                format!("{}: {message} (kubernetes.dra.taint_scope: both)", hca.name),
            ));
        }
    }
    if !dra.taint_scope.device_rules() {
        out.taints.clear();
    }
    out.taints.sort();
    out.taints.dedup();
    out
}

/// Published devices naming an RDMA device the probe does not see: in use when a claim holds
/// it (one port each the node is not judged on; judged in its pod's namespace where that was
/// looked into), else unmatched.
fn unprobed_devices(report: &ProbeReport, facts: &DraFacts, out: &mut DraAssessment) {
    let probed: Vec<&str> = report
        .rdma
        .devices
        .iter()
        .map(|d| d.name.as_str())
        .collect();
    for device in &facts.devices {
        let Some(name) = &device.rdma_device else {
            continue;
        };
        if probed.contains(&name.as_str()) {
            continue;
        }
        if let Some(held) = facts.holder(device) {
            let seen = in_pod_namespace(facts, held, name);
            if let InPod::Ports { pod, ports } = &seen {
                let problems: Vec<(&'static str, String)> = ports
                    .iter()
                    .filter_map(|p| namespace_port_problem(p, pod, &held.claim))
                    .collect();
                if let Some((code, _)) = problems.first() {
                    out.taints.push(DeviceTaint {
                        driver: device.driver.clone(),
                        pool: device.pool.clone(),
                        device: device.device.clone(),
                        hca: name.clone(),
                        reason: (*code).to_owned(),
                        message: problems
                            .iter()
                            .map(|(_, m)| m.as_str())
                            .collect::<Vec<_>>()
                            .join("; "),
                    });
                }
            }
            out.warnings.push(in_use(device, name, held, &seen));
            out.in_use.push(InUseHca {
                hca: name.clone(),
                claim: held.claim.clone(),
            });
            continue;
        }
        out.warnings.push(finding(
            DRA_DEVICE_UNMATCHED,
            format!(
                "DRA device {} of {} (pool {}) names RDMA device {name}, which this node does \
                 not have; it gets no device taint (a stale slice, or the driver names HCAs \
                 differently: set kubernetes.dra.drivers[].rdma_device_attribute)",
                device.device, device.driver, device.pool
            ),
        ));
    }
}

/// What the namespaces of a claim's pods show of one HCA.
#[derive(Debug)]
enum InPod<'a> {
    /// Nothing looked (the pods' namespaces are not looked into without the runtime task).
    NotLooked,
    /// Found in this pod's namespace, with its ports.
    Ports {
        pod: &'a str,
        ports: Vec<&'a NetlinkPort>,
    },
    /// Looked, not found there: what each pod's look said.
    NotFound(Vec<String>),
}

fn in_pod_namespace<'a>(facts: &'a DraFacts, held: &ClaimedDevice, hca: &str) -> InPod<'a> {
    let mut said = Vec::new();
    for view in facts
        .in_pods
        .iter()
        .filter(|v| held.pods.iter().any(|p| p.name == v.pod))
    {
        match &view.ports {
            Observed::Seen(ports) => {
                let mine: Vec<&NetlinkPort> = ports.iter().filter(|p| p.device == hca).collect();
                if !mine.is_empty() {
                    return InPod::Ports {
                        pod: &view.pod,
                        ports: mine,
                    };
                }
                let listed: Vec<&str> = ports.iter().map(|p| p.device.as_str()).collect();
                said.push(format!(
                    "{}'s namespace lists {}",
                    view.pod,
                    if listed.is_empty() {
                        "no RDMA device".to_owned()
                    } else {
                        listed.join(", ")
                    }
                ));
            }
            Observed::Unseen { reason } => said.push(format!("{}: {reason}", view.pod)),
        }
    }
    if said.is_empty() {
        InPod::NotLooked
    } else {
        InPod::NotFound(said)
    }
}

/// A port of an in-use HCA, seen in its pod's namespace, that cannot carry traffic: the
/// code a DeviceTaintRule carries (as for a port the node's probe finds so) and the facts.
fn namespace_port_problem(
    port: &NetlinkPort,
    pod: &str,
    claim: &str,
) -> Option<(&'static str, String)> {
    let state = port
        .state
        .map_or_else(|| "unknown".to_owned(), PortState::name);
    let phys = port
        .physical_state
        .map_or_else(|| "unknown".to_owned(), PhysState::name);
    let code = match (port.state, port.physical_state) {
        (Some(PortState::Active), Some(PhysState::LinkUp)) => return None,
        (Some(PortState::Init | PortState::Armed), _) => "PortNotActivatedBySM",
        _ => "PortDown",
    };
    Some((
        code,
        format!(
            "{}/{}: state {state}, phys {phys} in pod {pod}'s network namespace, where claim \
             {claim} holds it",
            port.device, port.port
        ),
    ))
}

/// A published device the probe cannot see because a claim holds it: in use, never a node
/// finding; what its pod's namespace showed of it, if looked.
fn in_use(device: &PublishedDevice, hca: &str, held: &ClaimedDevice, seen: &InPod) -> Finding {
    let pods = if held.pods.is_empty() {
        "none reserved".to_owned()
    } else {
        held.pods
            .iter()
            .map(|p| p.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let head = format!(
        "{hca} (DRA device {} of {}) is in use by claim {} (pod{} {pods}): not visible in the \
         node's network namespace (in RDMA netns mode exclusive the driver moves it into the \
         pod's)",
        device.device,
        device.driver,
        held.claim,
        if held.pods.len() == 1 { "" } else { "s" },
    );
    let tail = match seen {
        InPod::NotLooked => {
            "; it is not judged: this says nothing about its hardware (the pods' namespaces \
             are looked into with runtime.enabled)"
                .to_owned()
        }
        InPod::Ports { pod, ports } => {
            let states: Vec<String> = ports
                .iter()
                .map(|p| {
                    format!(
                        "port {} {} ({})",
                        p.port,
                        p.state
                            .map_or_else(|| "unknown".to_owned(), PortState::name),
                        p.physical_state
                            .map_or_else(|| "unknown".to_owned(), PhysState::name)
                    )
                })
                .collect();
            format!(
                "; seen in pod {pod}'s network namespace: {}{}",
                states.join(", "),
                if ports.iter().all(|p| p.is_active()) {
                    ""
                } else {
                    " (a fault of that HCA: its DRA device gets a DeviceTaintRule unless taint_scope is \
                     node; the node is not failed for it)"
                }
            )
        }
        InPod::NotFound(said) => format!(
            "; not found in its pods' network namespaces either ({}): not judged",
            said.join("; ")
        ),
    };
    finding(DRA_DEVICE_IN_USE, format!("{head}{tail}"))
}

/// One warning per driver and pool not named after the node.
fn foreign_pool_warnings(facts: &DraFacts, out: &mut DraAssessment) {
    let mut pools: BTreeMap<(&str, &str), Vec<&str>> = BTreeMap::new();
    for d in &facts.foreign_pool {
        pools
            .entry((d.driver.as_str(), d.pool.as_str()))
            .or_default()
            .push(d.device.as_str());
    }
    for ((driver, pool), devices) in pools {
        out.warnings.push(finding(
            DRA_FOREIGN_POOL,
            format!(
                "the DRA driver {driver} publishes device{} {} of this node in pool {pool}, \
                 which is not named after the node: skipped (matched to no HCA, never given a \
                 DeviceTaintRule, which the admission policy allows only for the node's own \
                 pool); a driver that names its pools otherwise is not supported \
                 (docs/dra.md)",
                if devices.len() == 1 { "" } else { "s" },
                devices.join(", ")
            ),
        ));
    }
}

/// Each configured driver: up when its registration socket answers (no `DraDriverUnavailable`
/// from [`registration_findings`]) and, once the slices are known, it publishes one for this
/// node (`fabricgate_dra_driver_up`).
pub fn drivers_up(
    report: &ProbeReport,
    facts: Option<&DraFacts>,
    dra: &DraSettings,
) -> Vec<(String, bool)> {
    dra.drivers
        .iter()
        .map(|d| {
            let registered = !report.host.dra_problems.iter().any(|p| p.name == d.name);
            let publishes = facts.is_none_or(|f| !f.drivers_without_slices.contains(&d.name));
            (d.name.clone(), registered && publishes)
        })
        .collect()
}

fn registration_findings(host: &HostReport, dir: &str, out: &mut DraAssessment) {
    if host.dra_registry_missing {
        out.own_problems.push(format!(
            "kubernetes.dra.drivers' registration sockets are checked in {dir} but it is not a \
             directory inside the agent's container (mount the kubelet's plugins_registry \
             directory there read-only)"
        ));
    }
    for p in &host.dra_problems {
        out.findings.push(finding(
            DRA_DRIVER_UNAVAILABLE,
            format!(
                "the DRA driver {}'s kubelet plugin is not registered: {}; the driver's pod \
                 is not running on this node (pods cannot get its devices); restart it",
                p.name, p.problem
            ),
        ));
    }
}

#[cfg(test)]
mod tests;
