//! Shared storage: required mounts and the Lustre client.

use super::*;

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
pub(super) fn evaluate_lustre(report: &ProbeReport, config: &Config) -> PartVerdict {
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
