//! GPUDirect RDMA's part of the verdict: GPUs, their HCAs, ACS and the peer-memory path.

use super::NAME;
use crate::config::Config;
use crate::policy::Finding;
use crate::policy::check::{Contribution, NodeCheck, finding};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::gpudirect::pci::{AcsState, Relation, acs_control_names};
use fabricgate_probes::gpudirect::{self, GpudirectReport};
use serde_json::json;

fn gpudirect_finding(code: &'static str, message: String) -> Finding {
    finding(NAME, code, message)
}

/// `GPUDirectReady`, the labels `gpudirect.ready` and `gpudirect.relation` and `rails`, and in
/// `check`'s JSON `present`, `relation`, `rails`.
pub struct GpudirectCheck;

impl NodeCheck for GpudirectCheck {
    fn name(&self) -> &'static str {
        NAME
    }

    fn condition(&self) -> (&'static str, &'static str) {
        ("GPUDirectReady", "GPUDirectUsable")
    }

    fn judge(&self, report: &ProbeReport, config: &Config) -> Contribution {
        let empty = GpudirectReport::default();
        evaluate_gpudirect(gpudirect::of(report).unwrap_or(&empty), config)
    }
}

/// GPUs, their HCAs, ACS on the paths and the peer-memory path. With `gpudirect.required`
/// false every problem is a warning (the fold's rule for a subsystem not required); a node
/// without GPUs has nothing to say (no condition, no label) unless they are required.
pub(super) fn evaluate_gpudirect(report: &GpudirectReport, config: &Config) -> Contribution {
    let req = &config.gpudirect;
    let mut problems = Vec::new();
    let mut notes = Vec::new();

    problems.extend(presence_problem(report, config));
    for pair in &report.pairs {
        pair_findings(pair, config, &mut problems, &mut notes);
    }
    notes.extend(acs_unknown_note(report));
    problems.extend(peer_memory_problem(report));
    for e in &report.errors {
        notes.push(gpudirect_finding("GPUDirectProbeError", e.clone()));
    }
    let rails = rails_label(report, &mut notes);

    let mut labels = Vec::new();
    if let Some(rel) = report.worst_relation {
        labels.push(("gpudirect.relation".to_owned(), rel.name().to_owned()));
    }
    if let Some(rails) = &rails {
        labels.push(("rails".to_owned(), rails.clone()));
    }
    let mut details = serde_json::Map::new();
    details.insert("present".into(), json!(!report.gpus.is_empty()));
    if report.gpus.is_empty() {
        details.insert(
            "message".into(),
            json!("no NVIDIA GPUs found (PCI vendor 0x10de, display/3D class)"),
        );
    }
    details.insert("relation".into(), json!(report.worst_relation));
    details.insert("rails".into(), json!(rails));
    Contribution {
        required: req.required,
        silent: report.gpus.is_empty() && !req.required,
        findings: problems,
        warnings: notes,
        labels,
        details,
        agent_problems: Vec::new(),
    }
}

/// No GPU where they are required, or GPUs without an HCA in scope.
fn presence_problem(report: &GpudirectReport, config: &Config) -> Option<Finding> {
    if report.gpus.is_empty() {
        return config.gpudirect.required.then(|| {
            gpudirect_finding(
                "NoGPUs",
                "gpudirect.required is true but no NVIDIA GPU (PCI vendor 0x10de, display or \
                 3D class) is listed under bus/pci/devices; check the GPU is seated and visible \
                 to the kernel (lspci -d 10de:)"
                    .into(),
            )
        });
    }
    report.hcas.is_empty().then(|| {
        gpudirect_finding(
            "NoHCAForGPUs",
            format!(
                "{} GPU{} but no RDMA device matching rdma.devices {:?} on a PCI function: \
                 GPUDirect RDMA has no HCA to use",
                report.gpus.len(),
                if report.gpus.len() == 1 { "" } else { "s" },
                config.rdma.devices
            ),
        )
    })
}

/// One GPU and its nearest HCA: too far apart for `gpudirect.max_relation`, and ACS
/// redirection on a switch-local path between them (a note with `gpudirect.allow_acs`).
fn pair_findings(
    pair: &fabricgate_probes::gpudirect::Pair,
    config: &Config,
    problems: &mut Vec<Finding>,
    notes: &mut Vec<Finding>,
) {
    let req = &config.gpudirect;
    let max = req.max_relation();
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

/// Bridges on the GPU–HCA paths whose ACS could not be read.
fn acs_unknown_note(report: &GpudirectReport) -> Option<Finding> {
    let unknown: Vec<&str> = report
        .pairs
        .iter()
        .flat_map(|p| &p.bridges)
        .filter(|b| matches!(b.acs, AcsState::Unknown { .. }))
        .map(|b| b.address.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    (!unknown.is_empty()).then(|| {
        gpudirect_finding(
            "ACSUnknown",
            format!(
                "ACS of {} bridge{} on GPU–HCA paths is unknown ({}): the config space read \
                 stopped before the extended capabilities (unprivileged reads get 64 bytes); \
                 run the agent with CAP_SYS_ADMIN to check ACS",
                unknown.len(),
                if unknown.len() == 1 { "" } else { "s" },
                unknown.join(", ")
            ),
        )
    })
}

/// GPUs whose memory the HCA cannot register: neither `nvidia_peermem` nor DMA-BUF.
fn peer_memory_problem(report: &GpudirectReport) -> Option<Finding> {
    if report.gpus.is_empty() || report.peermem.usable() {
        return None;
    }
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
    Some(gpudirect_finding(
        "PeerMemoryUnavailable",
        format!(
            "GPUDirect RDMA is off: {module} and {dmabuf}; NCCL stages every transfer \
             through host memory. Load it (`modprobe nvidia_peermem`; GPU operator: \
             driver.rdma.enabled=true) or use the open kernel modules for DMA-BUF"
        ),
    ))
}

/// The rails label: per GPU, the index of its nearest HCA (`x`: none), joined by dots;
/// `None` without pairs, or (with a note) when it does not fit a label value.
fn rails_label(report: &GpudirectReport, notes: &mut Vec<Finding>) -> Option<String> {
    if report.pairs.is_empty() {
        return None;
    }
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
        return Some(value);
    }
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
