//! Shared storage as a registered subsystem: its part, condition and label from the storage
//! fact, and the agent's own mount trouble speaking for that part.

use crate::checks::registered;
use crate::config::Config;
use crate::policy::judge::{Facts, Judge};
use crate::policy::{LUSTRE, Verdict, agent_fault, evaluate_checked};
use fabricgate_probes::ProbeReport;
use fabricgate_probes::storage::{self, MountReport, MountStatus, StorageReport};

fn report(storage: StorageReport) -> ProbeReport {
    let mut report = ProbeReport::default();
    storage::set(&mut report, storage);
    report
}

fn condition<'a>(v: &'a Verdict, type_: &str) -> (&'a str, &'a str) {
    let c = v.conditions.iter().find(|c| c.type_ == type_).unwrap();
    (c.status.as_str(), c.reason.as_str())
}

#[test]
fn a_hung_required_mount_fails_lustre_ready_and_the_node() {
    let config = Config::parse("rdma: {min_active_ports: 0}\nlustre:\n  mounts: [/lustre]\n").unwrap();
    let hung = MountReport {
        path: "/lustre".into(),
        fstype: Some("lustre".into()),
        status: MountStatus::Hung,
        message: "statfs started 5s ago has still not returned".into(),
        required: true,
        expected_fstype: Some("lustre".into()),
        source: None,
        lustre_fsname: None,
        read_only: None,
        fs_magic: None,
        capacity: None,
        statfs_seconds: None,
    };
    let r = report(StorageReport {
        mounts: vec![hung],
        ..StorageReport::default()
    });
    let v = evaluate_checked(&r, &config, &registered().checks());
    assert!(!v.ready);
    assert_eq!(condition(&v, "LustreReady"), ("False", "MountHung"));
    assert_eq!(condition(&v, "FabricReady"), ("False", "MountHung"));
    assert_eq!(v.labels["fabricgate.io/lustre.ready"], "false");
    let types: Vec<&str> = v.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(types, ["FabricReady", "RDMAReady", "LustreReady"], "the order users know");
}

#[test]
fn an_unreadable_mount_table_is_the_agents_trouble_on_the_lustre_part() {
    let config = Config::parse("rdma: {min_active_ports: 0}\n").unwrap();
    let r = report(StorageReport {
        errors: vec![
            "cannot read the mount table /proc/self/mountinfo: No such file or directory \
             (os error 2); check --proc-root"
                .into(),
        ],
        ..StorageReport::default()
    });
    let mut judge = Judge::new(&config).with_checks(registered().checks());
    let j = judge.probe(Facts {
        report: &r,
        peer_finding: None,
        devices: &[],
    });
    let fault = j.fault.unwrap();
    assert_eq!(fault.cause, agent_fault::Cause::MissingOwnMount);
    let v = &j.verdict;
    assert_eq!(condition(v, "LustreReady"), ("False", agent_fault::REASON));
    assert_eq!(condition(v, "FabricReady"), ("False", agent_fault::REASON));
    assert_eq!(v.labels["fabricgate.io/lustre.ready"], "false");
    let part = &v.checks.get(LUSTRE).unwrap().part;
    assert!(part.findings.iter().all(|f| f.code == agent_fault::REASON), "{part:?}");
}
