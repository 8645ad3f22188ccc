//! Shared storage's section of `check --format table`: the mounts and the Lustre client.

use super::CHECK;
use crate::policy::Verdict;
use fabricgate_probes::ProbeReport;
use fabricgate_probes::storage;
use std::fmt::Write as _;

pub(super) fn table(out: &mut String, report: &ProbeReport, verdict: &Verdict) {
    let (Some(storage), Some(part)) = (storage::of(report), verdict.checks.get(CHECK)) else {
        return;
    };
    let _ = writeln!(
        out,
        "\nLustre: {}",
        if part.part.ready {
            "ready"
        } else {
            "not ready"
        }
    );
    if storage.mounts.is_empty() {
        let _ = writeln!(out, "  (no mounts to check)");
    }
    for m in &storage.mounts {
        let _ = writeln!(
            out,
            "  {}  {}  {}  {}",
            m.path,
            m.fstype.as_deref().unwrap_or("-"),
            m.status.as_str(),
            m.message
        );
    }
    if let Some(version) = &storage.client.version {
        let _ = writeln!(out, "  lustre client {version}");
    }
}
