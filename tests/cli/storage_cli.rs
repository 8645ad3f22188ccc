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
