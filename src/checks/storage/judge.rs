//! Shared storage's part of the verdict: required mounts and the Lustre client.

use super::CHECK;
use crate::config::Config;
use crate::policy::Finding;
use crate::policy::check::{Contribution, NodeCheck, finding};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::storage::{
    self, Import, LustreClient, LustreHealth, MountStatus, StorageReport, lnet,
};

fn lustre_finding(code: &'static str, message: String) -> Finding {
    finding(CHECK, code, message)
}

/// `LustreReady` and the label `lustre.ready`; in `check`'s JSON under `lustre`, beside what
/// the storage probe found.
pub struct LustreCheck;

impl NodeCheck for LustreCheck {
    fn name(&self) -> &'static str {
        CHECK
    }

    fn fact(&self) -> &'static str {
        storage::NAME
    }

    fn condition(&self) -> (&'static str, &'static str) {
        ("LustreReady", "LustreMountsHealthy")
    }

    fn judge(&self, report: &ProbeReport, config: &Config) -> Contribution {
        let empty = StorageReport::default();
        evaluate_lustre(storage::of(report).unwrap_or(&empty), config)
    }
}

/// Storage: the required mounts (`lustre.mounts` and `mounts`), every Lustre mount found when
/// `lustre.all_lustre`, and the Lustre client's health and imports. All of it feeds the one
/// `lustre` part, so `LustreReady` and `fabricgate.io/lustre.ready` cover all shared storage.
/// Always required: a requirement that is not met makes the node not ready.
pub(super) fn evaluate_lustre(storage: &StorageReport, config: &Config) -> Contribution {
    let mut findings = Vec::new();
    let mut warnings = Vec::new();
    mount_findings(storage, config, &mut findings, &mut warnings);
    // The Lustre client matters when Lustre is required or all_lustre asks for it.
    let lustre_wanted = !config.lustre.mounts.is_empty() || config.lustre.all_lustre;
    if lustre_wanted && storage.client.present {
        lustre_client_findings(storage, config, &mut findings, &mut warnings);
    }
    Contribution {
        required: true,
        findings,
        warnings,
        ..Contribution::default()
    }
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
    let in_scope: Vec<&Import> = client
        .imports
        .iter()
        .filter(|imp| {
            config.lustre.all_lustre || imp.fsname.as_deref().is_some_and(|f| fsnames.contains(&f))
        })
        .collect();
    lnet_findings(
        client,
        &in_scope,
        &config.storage.lustre.require_lnet,
        findings,
    );
    for imp in in_scope {
        if imp.healthy {
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

/// `storage.lustre.require_lnet`: each import in scope connected over a network not listed
/// (`LustreLnetFallback`, naming the import and its NID), and each listed network whose local
/// LNet interfaces are down or absent (`LustreLnetDown`; only when LNet's `nis` was readable).
/// A deactivated import is left out: it carries no traffic.
fn lnet_findings(
    client: &LustreClient,
    in_scope: &[&Import],
    require: &[String],
    findings: &mut Vec<Finding>,
) {
    if require.is_empty() {
        return;
    }
    let required = require.join(", ");
    for imp in in_scope.iter().filter(|imp| imp.active != Some(false)) {
        let Some(nid) = imp.connection.as_deref() else {
            continue;
        };
        let net = lnet::nid_net(nid).unwrap_or("");
        if !require.iter().any(|r| lnet::net_matches(r, net)) {
            findings.push(lustre_finding(
                "LustreLnetFallback",
                format!(
                    "lustre {} import connected over {nid} (LNet {net}), not over a required \
                     network ({required}): the client fell back; check the node's {required} \
                     interfaces (`lnetctl net show`)",
                    imp.target
                ),
            ));
        }
    }
    let Some(nis) = &client.lnet_nis else {
        return;
    };
    for want in require {
        let mut of_net = nis
            .iter()
            .filter(|ni| lnet::net_matches(want, &ni.net))
            .peekable();
        if of_net.peek().is_none() {
            findings.push(lustre_finding(
                "LustreLnetDown",
                format!("no LNet interface on {want}, which storage.lustre.require_lnet requires"),
            ));
        }
        for ni in of_net.filter(|ni| !ni.up) {
            findings.push(lustre_finding(
                "LustreLnetDown",
                format!(
                    "LNet interface {} is down ({want} is required): check its IB port and \
                     `lnetctl net show`",
                    ni.nid
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabricgate_probes::storage::LnetNi;

    fn import(target: &str, nid: Option<&str>, active: Option<bool>) -> Import {
        Import {
            device: format!("{target}-osc-ffff8f7c4a9e1000"),
            kind: "osc".into(),
            target: target.into(),
            fsname: Some("scratch".into()),
            state: Some("FULL".into()),
            healthy: true,
            connection: nid.map(str::to_owned),
            active,
            error: None,
        }
    }

    fn ni(nid: &str, up: bool) -> LnetNi {
        LnetNi {
            nid: nid.into(),
            net: lnet::nid_net(nid).unwrap().into(),
            up,
        }
    }

    fn run(client: &LustreClient, require: &[&str]) -> Vec<(&'static str, String)> {
        let in_scope: Vec<&Import> = client.imports.iter().collect();
        let require: Vec<String> = require.iter().map(|s| s.to_string()).collect();
        let mut findings = Vec::new();
        lnet_findings(client, &in_scope, &require, &mut findings);
        findings.into_iter().map(|f| (f.code, f.message)).collect()
    }

    #[test]
    fn an_import_on_tcp_where_o2ib_is_required_is_named_with_its_nid() {
        let client = LustreClient {
            present: true,
            imports: vec![
                import("scratch-OST0000", Some("10.1.1.3@o2ib"), Some(true)),
                import("scratch-OST0001", Some("10.1.1.3@o2ib1"), Some(true)),
                import("scratch-OST0002", Some("10.2.1.4@tcp"), Some(true)),
                import("scratch-OST0003", Some("10.2.1.5@tcp"), Some(false)),
                import("scratch-OST0004", None, None),
            ],
            lnet_nis: Some(vec![ni("0@lo", true), ni("10.1.1.21@o2ib", true)]),
            ..LustreClient::default()
        };
        let got = run(&client, &["o2ib"]);
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].0, "LustreLnetFallback");
        assert!(
            got[0].1.starts_with(
                "lustre scratch-OST0002 import connected over 10.2.1.4@tcp (LNet tcp)"
            ),
            "{}",
            got[0].1
        );
        // The default (no requirement) finds nothing; with tcp allowed too, no fallback.
        assert!(run(&client, &[]).is_empty());
        let both = run(&client, &["o2ib", "tcp"]);
        assert!(
            both.iter().all(|(code, _)| *code != "LustreLnetFallback"),
            "{both:?}"
        );
    }

    #[test]
    fn a_required_network_down_or_absent_is_a_finding_an_unreadable_nis_is_not() {
        let mut client = LustreClient {
            present: true,
            lnet_nis: Some(vec![
                ni("0@lo", true),
                ni("10.1.1.21@o2ib", false),
                ni("10.1.2.21@o2ib1", true),
            ]),
            ..LustreClient::default()
        };
        let got = run(&client, &["o2ib"]);
        assert_eq!(
            got,
            vec![(
                "LustreLnetDown",
                "LNet interface 10.1.1.21@o2ib is down (o2ib is required): check its IB port \
                 and `lnetctl net show`"
                    .to_owned()
            )]
        );
        assert!(run(&client, &["o2ib1"]).is_empty());
        let got = run(&client, &["tcp"]);
        assert_eq!(got[0].0, "LustreLnetDown");
        assert!(
            got[0].1.starts_with("no LNet interface on tcp"),
            "{}",
            got[0].1
        );
        client.lnet_nis = None;
        assert!(run(&client, &["tcp"]).is_empty());
    }
}
