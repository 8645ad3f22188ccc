//! `fabricgate selftest` exit codes and output that do not need an RDMA device (the data path
//! itself is exercised against a real rxe device in tests/softroce_vm.rs).

use std::process::Command;

fn fabricgate(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fabricgate"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn nothing_to_test_is_exit_3_with_the_reason_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let (code, stdout, _) = fabricgate(&[
        "selftest",
        "--sysfs-root",
        root,
        "--proc-root",
        root,
        "--format",
        "json",
    ]);
    assert_eq!(code, 3, "{stdout}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(doc["ok"], false);
    assert_eq!(doc["ports"], serde_json::json!([]));
    assert!(
        doc["errors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e.as_str().unwrap().contains("class/infiniband is absent")),
        "{doc}"
    );
}

#[test]
fn bad_schedule_timeout_or_flag_is_exit_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("fabricgate.yaml");
    std::fs::write(&cfg, "rdma:\n  selftest: sometimes\n").unwrap();
    let (code, _, stderr) = fabricgate(&["selftest", "--config", cfg.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(stderr.contains("rdma.selftest"), "{stderr}");
    let (code, _, stderr) = fabricgate(&["selftest", "--timeout", "soon"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--timeout"), "{stderr}");
}
