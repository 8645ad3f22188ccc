//! `fabricgate selftest`: only the loopback RC data-path test, on every port of every device
//! the requirements select, whatever `rdma.selftest` says. For operators and init containers.

use crate::config::Config;
use fabricgate_probes::Roots;
use fabricgate_probes::rdma::{self, SelftestResult};
use serde::Serialize;
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::time::Duration;

/// One tested port.
#[derive(Debug, Clone, Serialize)]
pub struct PortOutcome {
    pub device: String,
    pub port: u32,
    #[serde(flatten)]
    pub result: SelftestResult,
}

/// Everything `fabricgate selftest` prints.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub ports: Vec<PortOutcome>,
    /// Why nothing could be tested (no RDMA subsystem, no matching device, verbs unusable).
    pub errors: Vec<String>,
}

impl Outcome {
    pub fn all_ok(&self) -> bool {
        !self.ports.is_empty() && self.ports.iter().all(|p| p.result.ok)
    }

    /// 0 every port passed, 1 a port failed, 3 nothing could be tested: no port, or no
    /// device could even be opened (no RDMA in the kernel, no access to /dev/infiniband).
    pub fn exit_code(&self) -> u8 {
        let unopened = |p: &PortOutcome| {
            matches!(
                p.result.failed_step.as_deref(),
                Some("get_device_list" | "open_device")
            )
        };
        if self.ports.is_empty() || self.ports.iter().all(unopened) {
            crate::EXIT_CANNOT_PROBE
        } else if self.all_ok() {
            crate::EXIT_VALIDATED
        } else {
            crate::EXIT_NOT_VALIDATED
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "ok": self.all_ok(),
            "ports": self.ports,
            "errors": self.errors,
        })
    }

    pub fn to_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "fabricgate selftest: {}",
            if self.all_ok() { "PASSED" } else { "FAILED" }
        );
        for e in &self.errors {
            let _ = writeln!(out, "  ✗ {e}");
        }
        if self.ports.is_empty() {
            return out;
        }
        let _ = writeln!(
            out,
            "  {:<10} {:<4} {:<6} {:>12}  DETAIL",
            "DEVICE", "PORT", "RESULT", "LATENCY"
        );
        for p in &self.ports {
            let r = &p.result;
            let latency = r
                .latency_us
                .map_or_else(|| "-".to_owned(), |us| format!("{us:.1} µs"));
            let detail = if r.ok {
                r.gid_index
                    .map_or_else(|| "LID".to_owned(), |g| format!("GID index {g}"))
            } else {
                r.message.clone().unwrap_or_default()
            };
            let _ = writeln!(
                out,
                "  {:<10} {:<4} {:<6} {:>12}  {detail}",
                p.device,
                p.port,
                if r.ok { "ok" } else { "FAILED" },
                latency
            );
        }
        out
    }
}

/// Probe sysfs and verbs, then test every port of every device `rdma.devices` matches.
pub fn run(roots: &Roots, config: &Config, timeout: Duration) -> Outcome {
    let mut report = rdma::sysfs::probe(roots);
    rdma::verbs::probe_into(&mut report);
    let matcher = config.device_matcher();
    let mut errors: Vec<String> = report.errors.clone();
    if let Some(err) = report.verbs.as_ref().and_then(|v| v.error.clone()) {
        errors.push(err);
    }
    if !report.subsystem_present {
        errors
            .push("no RDMA devices: class/infiniband is absent (no RDMA driver loaded)".to_owned());
    } else if !report.devices.iter().any(|d| matcher.is_match(&d.name)) {
        let names: Vec<&str> = report.devices.iter().map(|d| d.name.as_str()).collect();
        errors.push(format!(
            "no RDMA device matches rdma.devices {:?} (found: {})",
            config.rdma.devices.as_str(),
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(", ")
            }
        ));
    }
    rdma::verbs::selftest::run(
        &mut report,
        &mut |dev, _port| matcher.is_match(&dev.name),
        timeout,
    );
    let ports = report
        .devices
        .into_iter()
        .flat_map(|dev| {
            let name = dev.name;
            dev.ports.into_iter().filter_map(move |p| {
                p.selftest.map(|result| PortOutcome {
                    device: name.clone(),
                    port: p.port,
                    result,
                })
            })
        })
        .collect();
    Outcome { ports, errors }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(results: &[bool]) -> Outcome {
        Outcome {
            ports: results
                .iter()
                .enumerate()
                .map(|(i, &ok)| PortOutcome {
                    device: "rxe0".into(),
                    port: u32::try_from(i).unwrap() + 1,
                    result: SelftestResult {
                        ok,
                        failed_step: (!ok).then(|| "reg_mr".into()),
                        errno: (!ok).then_some(12),
                        message: (!ok).then(|| "reg_mr: errno 12 (ENOMEM): ...".into()),
                        latency_us: ok.then_some(190.0),
                        gid_index: Some(1),
                        duration_us: Some(900.0),
                    },
                })
                .collect(),
            errors: Vec::new(),
        }
    }

    #[test]
    fn exit_codes_follow_the_results() {
        assert_eq!(outcome(&[true, true]).exit_code(), 0);
        assert_eq!(outcome(&[true, false]).exit_code(), 1);
        assert_eq!(outcome(&[]).exit_code(), 3);
        let mut unopened = outcome(&[false, false]);
        for p in &mut unopened.ports {
            p.result.failed_step = Some("open_device".into());
        }
        assert_eq!(unopened.exit_code(), 3);
        unopened.ports[1].result.failed_step = Some("reg_mr".into());
        assert_eq!(unopened.exit_code(), 1);
    }

    #[test]
    fn json_and_table_name_the_failing_step() {
        let o = outcome(&[true, false]);
        let j = o.to_json();
        assert_eq!(j["ok"], false);
        assert_eq!(j["ports"][0]["device"], "rxe0");
        assert_eq!(j["ports"][0]["latency_us"], 190.0);
        assert_eq!(j["ports"][1]["failed_step"], "reg_mr");
        assert_eq!(j["ports"][1]["errno"], 12);
        let t = o.to_table();
        assert!(t.starts_with("fabricgate selftest: FAILED"), "{t}");
        assert!(t.contains("reg_mr: errno 12 (ENOMEM)"), "{t}");
        assert!(t.contains("190.0 µs"), "{t}");
    }

    /// On this host (no RDMA, or fixture-free): nothing to test is "could not probe".
    #[test]
    fn empty_sysfs_root_cannot_probe() {
        let dir = tempfile::tempdir().unwrap();
        let o = run(
            &Roots::new(dir.path(), dir.path()),
            &Config::default(),
            Duration::from_secs(2),
        );
        assert_eq!(o.exit_code(), 3);
        assert!(
            o.errors.iter().any(|e| e.contains("class/infiniband")),
            "{:?}",
            o.errors
        );
    }
}
