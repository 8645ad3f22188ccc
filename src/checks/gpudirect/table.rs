//! GPUDirect's section of `check --format table`.

use super::NAME;
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::gpudirect;
use std::fmt::Write as _;

/// Its section of `check`'s table: the GPUs and their HCAs.
pub(super) fn table(out: &mut String, report: &ProbeReport, verdict: &Verdict) {
    let (Some(gd), Some(v)) = (gpudirect::of(report), verdict.checks.get(NAME)) else {
        return;
    };
    if gd.gpus.is_empty() {
        let _ = writeln!(
            out,
            "\nGPUDirect: no NVIDIA GPUs found{}",
            if v.required {
                " (gpudirect.required)"
            } else {
                ", not checked"
            }
        );
        return;
    }
    let _ = writeln!(
        out,
        "\nGPUDirect: {} ({} GPU{}, worst relation {}, peer memory {})",
        if v.part.ready { "ready" } else { "not ready" },
        gd.gpus.len(),
        if gd.gpus.len() == 1 { "" } else { "s" },
        gd.worst_relation.map_or("-", |r| r.name()),
        gd.peermem.method.as_deref().unwrap_or("unavailable")
    );
    for p in &gd.pairs {
        let acs = if p.redirecting_bridges().next().is_some() {
            "ACS redirect"
        } else if p.bridges.iter().any(|b| {
            matches!(
                b.acs,
                fabricgate_probes::gpudirect::pci::AcsState::Unknown { .. }
            )
        }) {
            "ACS unknown"
        } else {
            "ACS ok"
        };
        let _ = writeln!(
            out,
            "  GPU {}  {}  {}  numa {}  {}",
            p.gpu,
            p.hca,
            p.relation,
            p.numa.map_or("?".into(), |n| n.to_string()),
            acs
        );
    }
}
