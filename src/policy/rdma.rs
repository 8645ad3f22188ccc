//! RDMA: devices, ports, verbs and transport settings against `rdma:`.

use super::*;

pub(super) fn rdma_finding(code: &'static str, message: String) -> Finding {
    Finding {
        scope: Scope::Rdma,
        code,
        message,
    }
}

/// The ports that meet every rule of `rdma:` (the ones `rdma.usable_ports` counts), as
/// `(device, port)` in report order: what NCCL may be pinned to.
pub fn usable_ports(report: &ProbeReport, config: &Config) -> Vec<(String, u32)> {
    assess_rdma(
        &report.rdma,
        fabricgate_probes::gpudirect::transport_of(report),
        config,
    )
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
    /// Every in-scope device with an in-scope port or a device problem, with its problems
    /// (device and ports): what a DRA device taint is decided from.
    devices: Vec<HcaHealth>,
}

/// One in-scope HCA as the RDMA rules judge it: no problem, or why it is bad.
#[derive(Debug, Clone, PartialEq)]
pub struct HcaHealth {
    pub name: String,
    /// The PCI function (`0000:18:00.0`), when resolved.
    pub pci_address: Option<String>,
    pub problems: Vec<Finding>,
}

/// [`HcaHealth`] of every in-scope HCA, in report order.
pub fn hca_health(report: &ProbeReport, config: &Config) -> Vec<HcaHealth> {
    assess_rdma(
        &report.rdma,
        fabricgate_probes::gpudirect::transport_of(report),
        config,
    )
    .devices
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
    let mut devices = Vec::new();
    for dev in in_scope {
        let device_problems = device_problems(dev, config, &mut notes);
        let blocked = !device_problems.is_empty();
        let mut health = HcaHealth {
            name: dev.name.clone(),
            pci_address: dev.pci.as_ref().map(|p| p.address.clone()),
            problems: device_problems.clone(),
        };
        let mut in_scope_ports = false;
        problems.extend(device_problems);
        for port in &dev.ports {
            if !link_layer_in_scope(port, req.link_layer) {
                continue;
            }
            in_scope_ports = true;
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
            health.problems.extend(port_problems.iter().cloned());
            problems.extend(port_problems);
        }
        if in_scope_ports || !health.problems.is_empty() {
            devices.push(health);
        }
    }
    RdmaAssessment {
        problems,
        usable,
        notes,
        devices,
    }
}

pub(super) fn evaluate_rdma(
    report: &RdmaReport,
    transport: &[PortTransport],
    config: &Config,
) -> RdmaVerdict {
    let req = &config.rdma;
    let RdmaAssessment {
        problems,
        usable: usable_pairs,
        notes,
        ..
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
