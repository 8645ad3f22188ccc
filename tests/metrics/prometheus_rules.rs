//! The alert rules with the real Prometheus tools: `promtool check rules`, `promtool test
//! rules` (tests/prometheus/*.yaml), and the PrometheusRule variant carrying the same groups.

use crate::common;

use common::have_tool;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    serde_norway::from_str(&text).unwrap()
}

fn promtool(args: &[&str]) -> (bool, String) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn promtool_check_rules_passes() {
    if !have_tool("promtool") {
        return;
    }
    let (ok, out) = promtool(&["check", "rules", "deploy/prometheus-rules.yaml"]);
    assert!(ok, "{out}");
    assert!(out.contains("SUCCESS"), "{out}");
}

#[test]
fn promtool_rule_unit_tests_pass() {
    if !have_tool("promtool") {
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("tests/prometheus"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty());
    let mut args = vec!["test".to_owned(), "rules".to_owned()];
    args.extend(files.iter().map(|p| p.display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out) = promtool(&args);
    assert!(ok, "{out}");
    assert!(!out.contains("FAILED"), "{out}");
}

#[test]
fn operator_variant_has_the_same_groups() {
    let plain = yaml("deploy/prometheus-rules.yaml");
    let operator = yaml("deploy/prometheus-rule-operator.yaml");
    assert_eq!(operator["kind"], "PrometheusRule");
    assert_eq!(operator["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(
        operator["spec"]["groups"], plain["groups"],
        "deploy/prometheus-rule-operator.yaml drifted from deploy/prometheus-rules.yaml"
    );
}

#[test]
fn every_alert_says_what_to_do_and_is_tested_firing_and_not_firing() {
    let plain = yaml("deploy/prometheus-rules.yaml");
    let tests = yaml("tests/prometheus/rules_test.yaml");
    let checks: Vec<&Value> = tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().unwrap())
        .collect();
    let rules = plain["groups"][0]["rules"].as_array().unwrap();
    let names: Vec<&str> = rules.iter().map(|r| r["alert"].as_str().unwrap()).collect();
    for want in [
        "FabricgateNodeNotValidated",
        "FabricgateRDMAPortDown",
        "FabricgateRDMALinkRateDegraded",
        "FabricgateRDMAErrorsRising",
        "FabricgateLustreMountHung",
        "FabricgateSilentTCPFallback",
        "FabricgateAgentDown",
        "FabricgateAgentStale",
    ] {
        assert!(names.contains(&want), "missing alert {want}");
    }
    for rule in rules {
        let name = rule["alert"].as_str().unwrap();
        for key in ["summary", "description"] {
            let text = rule["annotations"][key].as_str().unwrap_or("");
            assert!(text.len() > 20, "{name}: {key} too thin: {text:?}");
        }
        assert!(
            rule["labels"]["severity"].is_string(),
            "{name}: no severity"
        );
        let mine: Vec<&&Value> = checks.iter().filter(|c| c["alertname"] == name).collect();
        assert!(
            mine.iter()
                .any(|c| !c["exp_alerts"].as_array().unwrap().is_empty()),
            "{name}: no test where it fires"
        );
        assert!(
            mine.iter()
                .any(|c| c["exp_alerts"].as_array().unwrap().is_empty()),
            "{name}: no test where it stays quiet"
        );
    }
}
