//! `fabricgate selftest` exit codes and output that do not need an RDMA device (the data path
//! itself is exercised against a real rxe device in tests/vm/softroce_vm.rs).

use crate::common;

use common::fabricgate;

#[test]
fn nothing_to_test_is_exit_3_with_the_reason_in_json() {
    let (code, stdout) = common::json_over_an_empty_node(&["selftest"]);
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
