//! `fabricgate check`: one probe, one verdict, printed as a table or as JSON.

use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::rdma::{DeviceReport, format_gbps};
use serde_json::{Value, json};
use std::fmt::Write as _;

/// The JSON document of `fabricgate check --format json`: the verdict and the report merged
/// under `rdma` and each registered part's name (`lustre`, `gpudirect`), so `rdma.ready` sits
/// beside `rdma.devices`.
pub fn to_json(report: &ProbeReport, verdict: &Verdict) -> Value {
    let mut rdma = serde_json::to_value(&report.rdma).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut rdma {
        map.insert("ready".into(), json!(verdict.rdma.part.ready));
        map.insert("usable_ports".into(), json!(verdict.rdma.usable_ports));
        map.insert("required_ports".into(), json!(verdict.rdma.required_ports));
        map.insert(
            "reasons".into(),
            json!(messages(&verdict.rdma.part.findings)),
        );
        map.insert(
            "warnings".into(),
            json!(messages(&verdict.rdma.part.warnings)),
        );
    }
    // `check` reads no Node, so `placement.required_labels` is the agent's to check.
    let placement = json!({
        "evaluated": !verdict.placement.findings.is_empty(),
        "ready": verdict.placement.ready,
        "reasons": messages(&verdict.placement.findings),
    });
    let mut doc = json!({
        "ready": verdict.ready,
        "reasons": verdict.reasons(),
        "warnings": verdict.warnings(),
        "rdma": rdma,
        "placement": placement,
        "labels": verdict.labels,
        "taints": verdict.taints,
        "conditions": verdict.conditions,
        "timestamp": report.timestamp,
        "timings": report.timings,
    });
    if let Value::Object(map) = &mut doc {
        add_subsystems(map, report, verdict);
    }
    doc
}

/// The registered subsystems (src/checks/): each fact under its key, and each part of the
/// verdict merged into its name's object as for `rdma` (`ready`, `required`, `reasons`,
/// `warnings` and its own details; a fact that is not an object is then its `value`).
fn add_subsystems(
    doc: &mut serde_json::Map<String, Value>,
    report: &ProbeReport,
    verdict: &Verdict,
) {
    for (key, fact) in report.facts.iter() {
        // A fact a part of another name is shown with goes under that name (storage's under
        // `lustre`).
        let key = verdict
            .checks
            .iter()
            .find(|(_, part)| part.fact == key)
            .map_or(key, |(name, _)| name);
        doc.insert(key.to_owned(), json!(fact));
    }
    for (name, part) in verdict.checks.iter() {
        let entry = doc.entry(name).or_insert_with(|| json!({}));
        if !entry.is_object() {
            *entry = json!({ "value": entry.take() });
        }
        if let Value::Object(map) = entry {
            map.insert("ready".into(), json!(part.part.ready));
            map.insert("required".into(), json!(part.required));
            map.insert("reasons".into(), json!(messages(&part.part.findings)));
            map.insert("warnings".into(), json!(messages(&part.part.warnings)));
            map.extend(part.details.clone());
        }
    }
}

fn messages(findings: &[crate::policy::Finding]) -> Vec<&str> {
    findings.iter().map(|f| f.message.as_str()).collect()
}

/// A readable report for a terminal.
pub fn to_table(report: &ProbeReport, verdict: &Verdict) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "fabricgate: node {}",
        if verdict.ready {
            "VALIDATED"
        } else {
            "NOT VALIDATED"
        }
    );
    for reason in verdict.reasons() {
        let _ = writeln!(out, "  ✗ {reason}");
    }
    for warning in verdict.warnings() {
        let _ = writeln!(out, "  ! {warning}");
    }
    let _ = writeln!(
        out,
        "\nRDMA: {} ({} usable port{}, {} required)",
        if verdict.rdma.part.ready {
            "ready"
        } else {
            "not ready"
        },
        verdict.rdma.usable_ports,
        if verdict.rdma.usable_ports == 1 {
            ""
        } else {
            "s"
        },
        verdict.rdma.required_ports
    );
    if report.rdma.devices.is_empty() {
        let _ = writeln!(out, "  (no RDMA devices)");
    } else {
        crate::text::write_columns(&mut out, &HEADER, device_rows(&report.rdma.devices));
    }
    for subsystem in crate::checks::registered().iter() {
        subsystem.table(&mut out, report, verdict);
    }
    let _ = writeln!(out, "\nLabels:");
    for (k, v) in &verdict.labels {
        let _ = writeln!(out, "  {k}={v}");
    }
    let _ = writeln!(out, "Taints:");
    if verdict.taints.is_empty() {
        let _ = writeln!(out, "  (none)");
    }
    for t in &verdict.taints {
        let _ = match &t.value {
            Some(v) => writeln!(out, "  {}={v}:{}", t.key, t.effect),
            None => writeln!(out, "  {}:{}", t.key, t.effect),
        };
    }
    out
}

const HEADER: [&str; 9] = [
    "DEVICE", "PORT", "STATE", "PHYS", "RATE", "LINK", "NETDEV", "PCIE", "VERBS",
];

fn device_rows(devices: &[DeviceReport]) -> Vec<Vec<String>> {
    let dash = || "-".to_owned();
    let mut rows = Vec::new();
    for dev in devices {
        let unknown_or_dash = || {
            if dev.pci_error.is_some() {
                "unknown".to_owned()
            } else {
                dash()
            }
        };
        let pcie = dev.pci.as_ref().map_or_else(unknown_or_dash, |p| {
            let w = |v: Option<u32>| v.map_or("?".into(), |v| v.to_string());
            let s = |v: Option<f64>| v.map_or("?".into(), format_gbps);
            let mut text = format!("x{} {}GT/s", w(p.current_width), s(p.current_speed_gts));
            if p.is_degraded() {
                let _ = write!(text, " (of x{} {}GT/s)", w(p.max_width), s(p.max_speed_gts));
            }
            text
        });
        let verbs = dev.verbs.as_ref().map_or_else(dash, |v| {
            if v.opened {
                "ok".into()
            } else {
                "FAILED".into()
            }
        });
        if dev.ports.is_empty() {
            rows.push(vec![
                dev.name.clone(),
                dash(),
                "(no ports)".into(),
                dash(),
                dash(),
                dash(),
                dash(),
                pcie.clone(),
                verbs.clone(),
            ]);
        }
        for p in &dev.ports {
            rows.push(vec![
                dev.name.clone(),
                p.port.to_string(),
                p.state.map_or("?".into(), |s| s.name()),
                p.phys_state.map_or("?".into(), |s| s.name()),
                p.rate.as_ref().map_or_else(dash, ToString::to_string),
                p.link_layer
                    .as_ref()
                    .map_or_else(dash, |l| l.name().to_owned()),
                {
                    let n = p.netdevs();
                    if n.is_empty() { dash() } else { n.join(",") }
                },
                pcie.clone(),
                verbs.clone(),
            ]);
        }
    }
    rows
}
