//! The storage probe and policy over fixture trees shaped like real Lustre clients
//! (tests/fixtures/lustre-*, made by make-lustre-fixtures.py). Needs no root.

use crate::common;

use common::fixture;
use common::storage::{ProcRoot, mountinfo_line};
use fabricgate::config::Config;
use fabricgate::policy::{self, Scope};
use fabricgate_probes::storage::{self, LustreHealth, MountStatus, StorageProber};
use fabricgate_probes::{ProbeConfig, ProbeReport, Prober, Roots};

fn roots(name: &str) -> Roots {
    Roots::new(fixture(name).join("sys"), fixture(name).join("proc"))
}

fn probe_with(roots: Roots, yaml: &str) -> (ProbeReport, Config) {
    let config = Config::parse(yaml).unwrap();
    let mut prober = Prober::new(
        roots,
        ProbeConfig {
            collectors: fabricgate::checks::registered().collectors(&config),
            ..ProbeConfig::default()
        },
    );
    (prober.probe(), config)
}

#[test]
fn healthy_2_15_client_reads_back() {
    let c = storage::lustre::probe(&roots("lustre-healthy"));
    assert!(c.present);
    assert_eq!(c.version.as_deref(), Some("2.15.3"));
    assert_eq!(c.health, Some(LustreHealth::Healthy));
    assert_eq!(c.health_text, None);
    assert!(c.errors.is_empty(), "{:?}", c.errors);
    let names: Vec<&str> = c.imports.iter().map(|i| i.target.as_str()).collect();
    assert_eq!(
        names,
        [
            "scratch-MDT0000",
            "scratch-OST0000",
            "scratch-OST0001",
            "scratch-OST0002",
            "scratch-OST0003"
        ]
    );
    assert!(c.imports.iter().all(|i| i.healthy), "{:?}", c.imports);
    // IDLE (idle disconnect) counts as healthy.
    assert_eq!(c.imports[3].state.as_deref(), Some("IDLE"));
    assert_eq!(c.imports[0].kind, "mdc");
    assert_eq!(c.imports[1].fsname.as_deref(), Some("scratch"));
    assert_eq!(c.imports[1].connection.as_deref(), Some("10.1.1.3@o2ib"));
    assert_eq!(c.imports[1].active, Some(true));
}

#[test]
fn lost_ost_is_named() {
    let c = storage::lustre::probe(&roots("lustre-ost-down"));
    let down: Vec<_> = c.imports.iter().filter(|i| !i.healthy).collect();
    assert_eq!(down.len(), 1);
    assert_eq!(down[0].target, "scratch-OST0003");
    assert_eq!(down[0].state.as_deref(), Some("DISCONN"));
    assert_eq!(down[0].device, "scratch-OST0003-osc-ffff8f7c4a9e1000");

    let (report, config) = probe_with(roots("lustre-ost-down"), "rdma: {min_active_ports: 0}\n");
    let v = common::evaluate(&report, &config);
    assert!(!common::lustre(&v).ready);
    let f = common::lustre(&v)
        .findings
        .iter()
        .find(|f| f.code == "LustreImportDown")
        .expect("an import finding");
    assert_eq!(f.message, "lustre scratch-OST0003 import DISCONN");
    assert_eq!(f.scope, Scope::Check(policy::LUSTRE));
    assert_eq!(v.labels["fabricgate.io/lustre.ready"], "false");
    let cond = v
        .conditions
        .iter()
        .find(|c| c.type_ == "LustreReady")
        .unwrap();
    assert_eq!(cond.status, "False");
    assert!(
        cond.message
            .contains("lustre scratch-OST0003 import DISCONN")
    );
}

#[test]
fn deactivated_ost_is_a_warning_not_a_failure() {
    let (report, config) = probe_with(
        roots("lustre-ost-deactivated"),
        "rdma: {min_active_ports: 0}\n",
    );
    let v = common::evaluate(&report, &config);
    assert!(
        !common::lustre(&v)
            .findings
            .iter()
            .any(|f| f.code == "LustreImportDown"),
        "{:?}",
        common::lustre(&v).findings
    );
    assert!(
        common::lustre(&v).warnings.iter().any(|w| w
            .message
            .starts_with("lustre scratch-OST0001 import DISCONN")),
        "{:?}",
        common::lustre(&v).warnings
    );
}

#[test]
fn legacy_procfs_health_check_not_healthy() {
    let c = storage::lustre::probe(&roots("lustre-legacy"));
    assert!(c.present);
    assert_eq!(c.version.as_deref(), Some("2.7.0"));
    assert_eq!(c.health, Some(LustreHealth::NotHealthy));
    assert!(c.health_text.unwrap().contains("scratch-OST0001"));
    // No sysfs `active` files on this client.
    assert!(c.imports.iter().all(|i| i.active.is_none()));

    let (report, config) = probe_with(roots("lustre-legacy"), "rdma: {min_active_ports: 0}\n");
    let v = common::evaluate(&report, &config);
    assert!(
        common::lustre(&v)
            .findings
            .iter()
            .any(|f| f.code == "LustreUnhealthy" && f.message.contains("NOT HEALTHY"))
    );
}

#[test]
fn no_lustre_client_and_no_requirement_is_fine() {
    let proc = ProcRoot::new("28 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n");
    let sys = tempfile::tempdir().unwrap();
    let (report, config) = probe_with(
        Roots::new(sys.path(), proc.path()),
        "rdma: {min_active_ports: 0}\n",
    );
    assert!(!common::storage_of(&report).client.present);
    assert!(common::storage_of(&report).mounts.is_empty());
    let v = common::evaluate(&report, &config);
    assert!(common::lustre(&v).ready, "{:?}", common::lustre(&v));
    assert_eq!(v.labels["fabricgate.io/lustre.ready"], "true");
}

#[test]
fn all_lustre_off_ignores_imports_of_file_systems_not_required() {
    let (report, config) = probe_with(
        roots("lustre-ost-down"),
        "rdma: {min_active_ports: 0}\nlustre: {all_lustre: false}\n",
    );
    assert!(common::storage_of(&report).mounts.is_empty());
    let v = common::evaluate(&report, &config);
    assert!(common::lustre(&v).ready, "{:?}", common::lustre(&v));
}

#[test]
fn missing_and_wrong_type_come_from_the_table_without_statfs() {
    let (report, config) = probe_with(
        roots("lustre-healthy"),
        "rdma: {min_active_ports: 0}\nlustre:\n  mounts: [/lustre/projects, /raid]\n  all_lustre: false\n\
         mounts:\n  - path: /datasets\n    fstype: nfs\n",
    );
    let m = &common::storage_of(&report).mounts;
    assert_eq!(m.len(), 3);
    assert_eq!(m[0].path, "/lustre/projects");
    assert_eq!(m[0].status, MountStatus::Missing);
    assert_eq!(m[0].fstype, None);
    assert!(
        m[0].message.contains("the path is on / (ext4)"),
        "{}",
        m[0].message
    );
    assert_eq!(m[1].status, MountStatus::WrongType);
    assert_eq!(m[1].fstype.as_deref(), Some("xfs"));
    assert!(
        m[1].message.contains("lustre is required"),
        "{}",
        m[1].message
    );
    assert_eq!(m[2].status, MountStatus::WrongType, "nfs4 is not nfs");
    assert!(m.iter().all(|m| m.statfs_seconds.is_none()));
    let v = common::evaluate(&report, &config);
    let codes: Vec<&str> = common::lustre(&v).findings.iter().map(|f| f.code).collect();
    assert_eq!(
        codes,
        ["MountMissing", "WrongFilesystemType", "WrongFilesystemType"]
    );
    assert!(
        common::lustre(&v).findings[0]
            .message
            .starts_with("/lustre/projects: not mounted")
    );
}

#[test]
fn discovered_lustre_mount_is_statted_at_its_real_path() {
    // The fixture's table lists /lustre/scratch; statfs goes to the real path, which does not
    // exist on a test machine, so the mount is an error with the OS reason.
    if !common::require(
        !std::path::Path::new("/lustre/scratch").exists(),
        "this machine has a real /lustre/scratch, which the fixture's mount table names",
        "run on a machine without Lustre",
    ) {
        return;
    }
    let mut p = StorageProber::new(storage::StorageConfig::default());
    let r = p.probe(&roots("lustre-healthy"));
    assert_eq!(r.mount_table_entries, 14);
    assert_eq!(r.mounts.len(), 1);
    let m = &r.mounts[0];
    assert!(!m.required);
    assert_eq!(m.status, MountStatus::Error);
    assert_eq!(m.lustre_fsname.as_deref(), Some("scratch"));
    assert_eq!(
        m.source.as_deref(),
        Some("10.1.1.1@o2ib:10.1.1.2@o2ib:/scratch")
    );
    assert!(
        m.message.contains("No such file or directory"),
        "{}",
        m.message
    );
}

#[test]
fn read_only_and_escaped_paths_on_real_directories() {
    let base = tempfile::tempdir().unwrap();
    let ro = base.path().join("read only");
    let rw = base.path().join("with\\back");
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::create_dir_all(&rw).unwrap();
    let proc = ProcRoot::new(&format!(
        "28 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw\n{}{}",
        mountinfo_line(500, &ro, "nfs4", "nfs1:/export/ro", "ro"),
        mountinfo_line(501, &rw, "nfs4", "nfs1:/export/rw", "rw"),
    ));
    let yaml = format!(
        "mounts:\n  - path: \"{}\"\n    fstype: nfs4\n  - path: \"{}\"\n  - path: \"{}\"\n    writable: false\n",
        ro.display(),
        rw.display().to_string().replace('\\', "\\\\"),
        ro.display()
    );
    let config = Config::parse(&yaml).unwrap();
    let mut p = StorageProber::new(config.storage_config());
    let r = p.probe(&Roots::new(base.path(), proc.path()));
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    // The same path twice is checked once.
    assert_eq!(r.mounts.len(), 2, "{:?}", r.mounts);
    assert_eq!(
        r.mounts[0].status,
        MountStatus::ReadOnly,
        "{}",
        r.mounts[0].message
    );
    assert_eq!(r.mounts[0].read_only, Some(true));
    assert!(r.mounts[0].message.contains("ro in the mount options"));
    assert_eq!(
        r.mounts[1].status,
        MountStatus::Ok,
        "{}",
        r.mounts[1].message
    );
    assert!(r.mounts[1].capacity.as_ref().unwrap().total_bytes > 0);
    assert!(r.mounts[1].statfs_seconds.is_some());
    assert_eq!(r.stuck_statfs, 0);
}

#[test]
fn unreadable_mount_table_is_an_error_not_missing() {
    let sys = tempfile::tempdir().unwrap();
    let proc = tempfile::tempdir().unwrap();
    let (report, config) = probe_with(
        Roots::new(sys.path(), proc.path()),
        "rdma: {min_active_ports: 0}\nlustre: {mounts: [/lustre/scratch]}\n",
    );
    assert_eq!(
        common::storage_of(&report).mounts[0].status,
        MountStatus::Error
    );
    assert!(common::storage_of(&report).errors[0].contains("self/mountinfo"));
    let v = common::evaluate(&report, &config);
    assert_eq!(common::lustre(&v).findings[0].code, "MountTableUnreadable");
}

#[test]
fn every_mount_status_maps_to_its_finding_code() {
    use fabricgate_probes::storage::{MountReport, StorageReport};
    let mount = |path: &str, status: MountStatus| MountReport {
        path: path.into(),
        fstype: Some("nfs4".into()),
        status,
        message: format!("{} here", status.as_str()),
        required: true,
        expected_fstype: None,
        source: None,
        lustre_fsname: None,
        read_only: None,
        fs_magic: None,
        capacity: None,
        statfs_seconds: None,
    };
    let statuses = [
        (MountStatus::Ok, None),
        (MountStatus::Missing, Some("MountMissing")),
        (MountStatus::Hung, Some("MountHung")),
        (MountStatus::WrongType, Some("WrongFilesystemType")),
        (MountStatus::ReadOnly, Some("MountReadOnly")),
        (MountStatus::Full, Some("MountFull")),
        (MountStatus::Error, Some("MountError")),
    ];
    let mut yaml = String::from("rdma: {min_active_ports: 0}\nmounts:\n");
    let mut mounts = Vec::new();
    for (i, (status, _)) in statuses.iter().enumerate() {
        yaml.push_str(&format!("  - path: /m{i}\n"));
        mounts.push(mount(&format!("/m{i}"), *status));
    }
    let config = Config::parse(&yaml).unwrap();
    let mut report = ProbeReport::default();
    storage::set(
        &mut report,
        StorageReport {
            mounts,
            ..StorageReport::default()
        },
    );
    let v = common::evaluate(&report, &config);
    let codes: Vec<&str> = common::lustre(&v).findings.iter().map(|f| f.code).collect();
    let want: Vec<&str> = statuses.iter().filter_map(|(_, c)| *c).collect();
    assert_eq!(codes, want);
    assert_eq!(common::lustre(&v).findings[1].message, "/m2: hung here");
    let cond = v
        .conditions
        .iter()
        .find(|c| c.type_ == "LustreReady")
        .unwrap();
    assert_eq!(cond.reason, "MountMissing");
    assert!(!v.ready);

    // Only ok mounts: ready, and a required mount absent from the report is not.
    storage::set(
        &mut report,
        StorageReport {
            mounts: vec![mount("/m0", MountStatus::Ok)],
            ..StorageReport::default()
        },
    );
    let config = Config::parse("rdma: {min_active_ports: 0}\nmounts:\n  - path: /m0\n").unwrap();
    assert!(common::lustre(&common::evaluate(&report, &config)).ready);
    let config = Config::parse("rdma: {min_active_ports: 0}\nmounts:\n  - path: /m9\n").unwrap();
    let v = common::evaluate(&report, &config);
    assert_eq!(
        common::lustre(&v).findings[0].message,
        "/m9: required but not probed"
    );
}
