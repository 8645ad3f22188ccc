//! `fabricgate check` through the real binary over storage fixtures: the `lustre` JSON
//! object, labels, reasons and exit codes.

use crate::common;

use common::fixture;
use common::storage::{ProcRoot, mountinfo_line};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

struct Run {
    code: i32,
    json: Value,
    stderr: String,
}

fn check(sys: &Path, proc: &Path, config_yaml: &str) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fabricgate.yaml");
    std::fs::write(&config, config_yaml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(common::check_json_args(sys, proc, &config))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    Run {
        code: out.status.code().unwrap(),
        json: serde_json::from_str(&stdout).unwrap_or(Value::Null),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn strs(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn lost_ost_fails_the_node_with_the_target_named() {
    let fx = fixture("lustre-ost-down");
    let r = check(
        &fx.join("sys"),
        &fx.join("proc"),
        "rdma: {min_active_ports: 0}\n",
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    let l = &r.json["lustre"];
    assert_eq!(l["ready"], false);
    assert!(
        strs(&l["reasons"]).contains(&"lustre scratch-OST0003 import DISCONN".to_owned()),
        "{l:#}"
    );
    assert!(strs(&r.json["reasons"]).contains(&"lustre scratch-OST0003 import DISCONN".to_owned()));
    assert_eq!(r.json["ready"], false);
    assert_eq!(r.json["labels"]["fabricgate.io/lustre.ready"], "false");
    assert_eq!(r.json["labels"]["fabricgate.io/ready"], "false");
    assert_eq!(r.json["taints"][0]["key"], "fabricgate.io/unvalidated");
    let imports = l["client"]["imports"].as_array().unwrap();
    assert_eq!(imports.len(), 5);
    let ost3 = imports
        .iter()
        .find(|i| i["target"] == "scratch-OST0003")
        .unwrap();
    assert_eq!(ost3["state"], "DISCONN");
    assert_eq!(ost3["healthy"], false);
    assert_eq!(l["client"]["health"], "healthy");
    assert_eq!(l["client"]["version"], "2.15.3");
    // The discovered Lustre mount is listed with the documented keys.
    let m = &l["mounts"][0];
    assert_eq!(m["path"], "/lustre/scratch");
    assert_eq!(m["fstype"], "lustre");
    for key in ["path", "fstype", "status", "message"] {
        assert!(m.get(key).is_some(), "mounts[0] lacks {key}: {m:#}");
    }
    let status = m["status"].as_str().unwrap();
    assert!(
        [
            "ok",
            "missing",
            "hung",
            "wrong_type",
            "read_only",
            "full",
            "error"
        ]
        .contains(&status),
        "{status}"
    );
}

#[test]
fn missing_required_mount_is_missing() {
    let fx = fixture("lustre-healthy");
    let r = check(
        &fx.join("sys"),
        &fx.join("proc"),
        "rdma: {min_active_ports: 0}\nlustre:\n  mounts: [/lustre/projects]\n  all_lustre: false\n",
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    let m = &r.json["lustre"]["mounts"][0];
    assert_eq!(m["path"], "/lustre/projects");
    assert_eq!(m["status"], "missing");
    assert_eq!(m["fstype"], Value::Null);
    assert!(m["message"].as_str().unwrap().starts_with("not mounted"));
    let cond = r.json["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "LustreReady")
        .unwrap();
    assert_eq!(cond["status"], "False");
    assert_eq!(cond["reason"], "MountMissing");
}

#[test]
fn healthy_required_mount_validates_with_exit_0() {
    // A real directory listed as an NFS mount in a scratch mount table: statfs answers.
    let dir = tempfile::tempdir().unwrap();
    let table = std::fs::read_to_string(fixture("lustre-healthy/proc/self/mountinfo")).unwrap()
        + &mountinfo_line(900, dir.path(), "nfs4", "nfs1:/export/data", "rw");
    let proc = ProcRoot::new(&table);
    let yaml = format!(
        "rdma: {{min_active_ports: 0}}\nlustre: {{all_lustre: false}}\n\
         mounts:\n  - path: \"{}\"\n    fstype: nfs4\n",
        dir.path().display()
    );
    let r = check(&fixture("lustre-healthy/sys"), proc.path(), &yaml);
    assert_eq!(r.code, 0, "{:#}\n{}", r.json, r.stderr);
    let l = &r.json["lustre"];
    assert_eq!(l["ready"], true);
    assert_eq!(l["mounts"][0]["status"], "ok");
    assert_eq!(l["mounts"][0]["fstype"], "nfs4");
    assert!(l["mounts"][0]["capacity"]["total_bytes"].as_u64().unwrap() > 0);
    assert_eq!(l["stuck_statfs"], 0);
    assert_eq!(r.json["labels"]["fabricgate.io/lustre.ready"], "true");
}

#[test]
fn bad_storage_config_is_exit_2_naming_the_key() {
    let fx = fixture("lustre-healthy");
    for (yaml, key) in [
        ("lustre:\n  statfs_timeout: soon\n", "statfs_timeout"),
        (
            "lustre:\n  min_free_percent: 150\n",
            "lustre.min_free_percent",
        ),
        ("mounts:\n  - path: relative/dir\n", "mounts[0].path"),
    ] {
        let r = check(&fx.join("sys"), &fx.join("proc"), yaml);
        assert_eq!(r.code, 2, "{yaml}: {}", r.stderr);
        assert!(r.stderr.contains(key), "{yaml}: {}", r.stderr);
    }
}

#[test]
fn table_output_lists_the_mounts() {
    let fx = fixture("lustre-healthy");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        "rdma: {min_active_ports: 0}\nlustre: {mounts: [/lustre/projects], all_lustre: false}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["check", "--verbs", "off"])
        .arg("--sysfs-root")
        .arg(fx.join("sys"))
        .arg("--proc-root")
        .arg(fx.join("proc"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("/lustre/projects  -  missing  not mounted"),
        "{text}"
    );
    assert!(text.contains("lustre client 2.15.3"), "{text}");
}

/// An import that moved to the servers' tcp NID while o2ib is required, and
/// the o2ib LNet interface down, with every import FULL and the client healthy.
#[test]
fn lnet_fallback_to_tcp_fails_the_node_only_where_o2ib_is_required() {
    let fx = fixture("lustre-lnet-fallback");
    let fallback = "lustre scratch-OST0002 import connected over 10.2.1.4@tcp (LNet tcp), not \
                    over a required network (o2ib): the client fell back; check the node's o2ib \
                    interfaces (`lnetctl net show`)";
    let ni_down = "LNet interface 10.1.1.21@o2ib is down (o2ib is required): check its IB port and \
         `lnetctl net show`";
    let r = check(
        &fx.join("sys"),
        &fx.join("proc"),
        "rdma: {min_active_ports: 0}\nstorage:\n  lustre:\n    require_lnet: [o2ib]\n",
    );
    assert_eq!(r.code, 1, "{}", r.stderr);
    let l = &r.json["lustre"];
    assert_eq!(l["ready"], false);
    let reasons = strs(&l["reasons"]);
    assert!(reasons.contains(&fallback.to_owned()), "{reasons:#?}");
    assert!(reasons.contains(&ni_down.to_owned()), "{reasons:#?}");
    assert_eq!(
        reasons.iter().filter(|r| r.contains("LNet")).count(),
        2,
        "only OST0002 fell back: {reasons:#?}"
    );
    let nis = l["client"]["lnet_nis"].as_array().unwrap();
    assert_eq!(nis.len(), 3, "{nis:#?}");
    assert_eq!(nis[1]["nid"], "10.1.1.21@o2ib");
    assert_eq!(nis[1]["up"], false);
    let ost2 = &l["client"]["imports"][3];
    assert_eq!(ost2["target"], "scratch-OST0002");
    assert_eq!(ost2["connection"], "10.2.1.4@tcp");

    // The default requires no LNet network: the same node has no LNet finding.
    let r = check(
        &fx.join("sys"),
        &fx.join("proc"),
        "rdma: {min_active_ports: 0}\n",
    );
    let reasons = strs(&r.json["lustre"]["reasons"]);
    assert!(!reasons.iter().any(|r| r.contains("LNet")), "{reasons:#?}");

    // A healthy client on o2ib passes the same requirement.
    let fx = fixture("lustre-healthy");
    let r = check(
        &fx.join("sys"),
        &fx.join("proc"),
        "rdma: {min_active_ports: 0}\nstorage: {lustre: {require_lnet: [o2ib]}}\n",
    );
    let reasons = strs(&r.json["lustre"]["reasons"]);
    assert!(!reasons.iter().any(|r| r.contains("LNet")), "{reasons:#?}");
    assert_eq!(r.json["lustre"]["client"]["lnet_nis"][1]["up"], true);
}

#[test]
fn lnet_fallback_shows_in_the_table_and_a_bad_network_is_exit_2() {
    let fx = fixture("lustre-lnet-fallback");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.yaml");
    std::fs::write(
        &config,
        "rdma: {min_active_ports: 0}\nstorage: {lustre: {require_lnet: [o2ib]}}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(["check", "--verbs", "off"])
        .arg("--sysfs-root")
        .arg(fx.join("sys"))
        .arg("--proc-root")
        .arg(fx.join("proc"))
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("lustre scratch-OST0002 import connected over 10.2.1.4@tcp"),
        "{text}"
    );
    let r = check(
        &fx.join("sys"),
        &fx.join("proc"),
        "storage: {lustre: {require_lnet: [\"10.1.1.1@o2ib\"]}}\n",
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("storage.lustre.require_lnet[0]"),
        "{}",
        r.stderr
    );
}
