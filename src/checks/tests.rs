//! A subsystem registered the way a new one is (its collector, its part of the verdict, its
//! section, its metrics), followed from a fixture sysfs file to the Node condition, the
//! labels, the report's and the verdict's JSON and `/metrics`; and the registered list itself.

use super::*;
use crate::observe::metrics::Metrics;
use crate::policy::check::{Contribution, finding};
use crate::policy::judge::{Facts, Judge};
use crate::policy::{self, Verdict, agent_fault};
use fabricgate_probes::collect::{Fact, Pass, valid_name};
use fabricgate_probes::{ProbeConfig, ProbeReport, Prober};
use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

/// Free 1 GiB huge pages, from `kernel/mm/hugepages/hugepages-1048576kB/free_hugepages`.
struct Pages;

#[derive(Debug, Clone, PartialEq, Serialize)]
struct PagesFact {
    /// `None`: the file is absent (no 1 GiB pages configured).
    free: Option<u64>,
    readable: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct PagesSettings {
    min_free: u64,
    required: bool,
}

struct PagesCollector;

const FILE: &str = "kernel/mm/hugepages/hugepages-1048576kB/free_hugepages";

impl Collector for PagesCollector {
    fn name(&self) -> &'static str {
        "hugepages"
    }

    fn collect(&mut self, pass: &Pass<'_>) -> Fact {
        let path = pass.roots.sys(FILE);
        match std::fs::read_to_string(&path) {
            Ok(text) => Fact::new(PagesFact {
                free: text.trim().parse().ok(),
                readable: true,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Fact::new(PagesFact {
                free: None,
                readable: true,
            }),
            Err(e) => Fact::new(PagesFact {
                free: None,
                readable: false,
            })
            .with_errors(vec![format!("cannot read {}: {e}", path.display())]),
        }
    }
}

impl PagesSettings {
    fn of(config: &Config) -> Result<Self> {
        config
            .checks
            .get("hugepages")
            .map_or_else(|| Ok(Self::default()), |s| s.read("checks.hugepages"))
    }
}

impl NodeCheck for Pages {
    fn name(&self) -> &'static str {
        "hugepages"
    }

    fn condition(&self) -> (&'static str, &'static str) {
        ("HugepagesReady", "HugepagesFree")
    }

    fn judge(&self, report: &ProbeReport, config: &Config) -> Contribution {
        let settings = PagesSettings::of(config).unwrap_or_default();
        let mut c = Contribution {
            required: settings.required,
            ..Contribution::default()
        };
        let Some(fact) = report.facts.get::<PagesFact>("hugepages") else {
            return c;
        };
        if !fact.readable {
            c.agent_problems.push(format!("cannot read {FILE}"));
            return c;
        }
        let free = fact.free.unwrap_or(0);
        c.labels.push(("hugepages.free".into(), free.to_string()));
        if free < settings.min_free {
            c.findings.push(finding(
                "hugepages",
                "HugepagesLow",
                format!(
                    "{free} free 1 GiB huge pages, {} required",
                    settings.min_free
                ),
            ));
        }
        c
    }
}

#[derive(Debug)]
struct PagesMetrics(Gauge);

impl CheckMetrics for PagesMetrics {
    fn record(&self, report: &ProbeReport, _verdict: &Verdict, _grace: Duration) {
        if let Some(free) = report
            .facts
            .get::<PagesFact>("hugepages")
            .and_then(|f| f.free)
        {
            self.0.set(i64::try_from(free).unwrap_or(i64::MAX));
        }
    }
}

impl Subsystem for Pages {
    fn name(&self) -> &'static str {
        "hugepages"
    }

    fn collector(&self, _config: &Config, _roots: &Roots) -> Box<dyn Collector> {
        Box::new(PagesCollector)
    }

    fn check(&self) -> Option<Arc<dyn NodeCheck>> {
        Some(Arc::new(Pages))
    }

    fn metrics(&self, registry: &mut Registry, _config: &Config) -> Box<dyn CheckMetrics> {
        let gauge = Gauge::default();
        registry.register(
            "fabricgate_hugepages_free",
            "Free 1 GiB huge pages",
            gauge.clone(),
        );
        Box::new(PagesMetrics(gauge))
    }

    fn validate(&self, config: &Config) -> Result<()> {
        PagesSettings::of(config).map(drop)
    }
}

fn with_pages() -> Registered {
    let mut list = registered().0;
    list.push(Arc::new(Pages));
    Registered::new(list)
}

fn node(free: Option<&str>) -> (tempfile::TempDir, Roots) {
    let tmp = tempfile::tempdir().unwrap();
    let sys = tmp.path().join("sys");
    std::fs::create_dir_all(sys.join("class/net")).unwrap();
    if let Some(free) = free {
        let file = sys.join(FILE);
        std::fs::create_dir_all(file.parent().unwrap_or(Path::new("/"))).unwrap();
        std::fs::write(file, free).unwrap();
    }
    let proc_self = tmp.path().join("proc/self");
    std::fs::create_dir_all(&proc_self).unwrap();
    std::fs::write(
        proc_self.join("mountinfo"),
        "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n",
    )
    .unwrap();
    let roots = Roots::new(&sys, tmp.path().join("proc"));
    (tmp, roots)
}

fn probe(roots: &Roots, config: &Config, registered: &Registered) -> ProbeReport {
    let probe = ProbeConfig {
        collectors: registered.collectors(config),
        ..ProbeConfig::default()
    };
    Prober::new(roots.clone(), probe).probe()
}

fn config(text: &str) -> Config {
    // Only the subsystem is judged here: no RDMA port required.
    Config::parse(&format!("rdma:\n  min_active_ports: 0\n{text}")).unwrap()
}

fn condition<'a>(v: &'a Verdict, type_: &str) -> &'a policy::Condition {
    v.conditions.iter().find(|c| c.type_ == type_).unwrap()
}

#[test]
fn a_required_subsystem_below_its_requirement_makes_the_node_not_ready_and_says_why() {
    let registered = with_pages();
    let config = config("checks:\n  hugepages: {min_free: 4, required: true}\n");
    registered.validate(&config).unwrap();
    let (_tmp, roots) = node(Some("2\n"));
    let report = probe(&roots, &config, &registered);
    let v = policy::evaluate_checked(&report, &config, &registered.checks());

    assert!(!v.ready);
    let own = condition(&v, "HugepagesReady");
    assert_eq!(
        (own.status.as_str(), own.reason.as_str()),
        ("False", "HugepagesLow")
    );
    assert_eq!(own.message, "2 free 1 GiB huge pages, 4 required");
    let fabric = condition(&v, "FabricReady");
    assert_eq!(
        (fabric.status.as_str(), fabric.reason.as_str()),
        ("False", "HugepagesLow")
    );
    assert_eq!(v.labels["fabricgate.io/hugepages.ready"], "false");
    assert_eq!(v.labels["fabricgate.io/hugepages.free"], "2");
    assert_eq!(v.labels["fabricgate.io/ready"], "false");
    assert_eq!(v.taints.len(), 1, "tainted");
    assert_eq!(v.reasons(), ["2 free 1 GiB huge pages, 4 required"]);

    let verdict_json = serde_json::to_value(&v).unwrap();
    assert_eq!(verdict_json["hugepages"]["ready"], false);
    assert_eq!(
        verdict_json["hugepages"]["findings"][0]["scope"],
        "hugepages"
    );
    assert_eq!(
        verdict_json["hugepages"]["findings"][0]["code"],
        "HugepagesLow"
    );
    let report_json = serde_json::to_value(&report).unwrap();
    assert_eq!(
        report_json["hugepages"],
        serde_json::json!({"free": 2, "readable": true})
    );
    assert!(report_json["netdevs"].is_array(), "{report_json}");
    assert!(report_json["timings"]["hugepages_seconds"].is_f64());
    assert!(report_json["timings"]["netdev_seconds"].is_f64());

    let metrics = registered.metrics(Metrics::with_config(&config), &config);
    metrics.record_probe(&report, &v);
    let text = metrics.encode(false);
    assert!(text.contains("fabricgate_hugepages_free 2\n"), "{text}");
    assert!(
        text.contains(r#"fabricgate_probe_errors_total{probe="hugepages"} 0"#),
        "{text}"
    );
    assert!(
        text.contains(r#"fabricgate_probe_duration_seconds_count{probe="hugepages"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(r#"fabricgate_findings{scope="hugepages",reason="HugepagesLow"} 1"#),
        "{text}"
    );
}

#[test]
fn enough_passes_and_a_subsystem_not_required_only_warns() {
    let registered = with_pages();
    let (_tmp, roots) = node(Some("8\n"));
    let config_ok = config("checks:\n  hugepages: {min_free: 4, required: true}\n");
    let report = probe(&roots, &config_ok, &registered);
    let v = policy::evaluate_checked(&report, &config_ok, &registered.checks());
    assert!(v.ready, "{:?}", v.reasons());
    let own = condition(&v, "HugepagesReady");
    assert_eq!(
        (own.status.as_str(), own.reason.as_str()),
        ("True", "HugepagesFree")
    );
    assert_eq!(v.labels["fabricgate.io/hugepages.ready"], "true");

    let config_warn = config("checks:\n  hugepages: {min_free: 16}\n");
    let v = policy::evaluate_checked(&report, &config_warn, &registered.checks());
    assert!(v.ready, "not required: never blocks");
    assert_eq!(
        v.checks.get("hugepages").unwrap().part.warnings[0].message,
        "8 free 1 GiB huge pages, 16 required"
    );
    assert!(
        v.warnings()
            .contains(&"8 free 1 GiB huge pages, 16 required".to_owned())
    );
    assert_eq!(v.checks.get("hugepages").unwrap().part.findings, []);

    let without = policy::evaluate(&report, &config_ok);
    assert!(
        !without.labels.contains_key("fabricgate.io/hugepages.ready")
            && without
                .conditions
                .iter()
                .all(|c| c.type_ != "HugepagesReady"),
        "only a registered subsystem is judged"
    );
}

#[test]
fn what_the_agent_cannot_read_is_an_agent_error_never_a_verdict() {
    let registered = with_pages();
    let config = config("checks:\n  hugepages: {min_free: 4, required: true}\n");
    let (tmp, roots) = node(None);
    // A directory where the file should be: unreadable, not absent.
    std::fs::create_dir_all(tmp.path().join("sys").join(FILE)).unwrap();
    let report = probe(&roots, &config, &registered);
    assert_eq!(
        report.facts.of_probe("hugepages").map(|f| f.errors().len()),
        Some(1)
    );
    let mut judge = Judge::new(&config).with_checks(registered.checks());
    let judgment = judge.probe(Facts {
        report: &report,
        peer_finding: None,
        devices: &[],
    });
    let fault = judgment.fault.unwrap();
    assert_eq!(fault.cause, agent_fault::Cause::SubsystemUnreadable);
    assert!(
        fault.message.contains("hugepages: cannot read"),
        "{}",
        fault.message
    );
    let own = condition(&judgment.verdict, "HugepagesReady");
    assert_eq!(own.reason, agent_fault::REASON);
    assert!(
        judgment
            .verdict
            .checks
            .get("hugepages")
            .unwrap()
            .part
            .findings
            .iter()
            .all(|f| f.code == agent_fault::REASON)
    );
}

#[test]
fn a_wrong_section_names_its_key_and_an_unknown_subsystem_is_refused() {
    let registered = with_pages();
    let wrong = Config::parse("checks:\n  hugepages: {min_fre: 4}\n").unwrap();
    let e = registered.validate(&wrong).unwrap_err().to_string();
    assert!(e.contains("checks.hugepages"), "{e}");
    assert!(e.contains("min_fre"), "{e}");
    let unknown = Config::parse("checks:\n  hugepage: {}\n").unwrap();
    let e = registered.validate(&unknown).unwrap_err().to_string();
    assert!(e.contains("checks.hugepage: no such subsystem"), "{e}");
    assert!(
        e.contains("hugepages"),
        "the registered ones are named: {e}"
    );
    assert!(registered.validate(&Config::default()).is_ok());
}

#[test]
fn the_registered_subsystems_have_valid_unique_names_their_collectors_carry() {
    let roots = Roots::new("/nonexistent", "/nonexistent");
    let config = Config::default();
    let list = &with_pages().0;
    let mut names = Vec::new();
    let mut keys = Vec::new();
    for s in list {
        let collector = s.collector(&config, &roots);
        assert_eq!(collector.name(), s.name(), "one name for both sides");
        assert!(valid_name(s.name()), "{}", s.name());
        assert!(valid_name(collector.key()), "{}", collector.key());
        names.push(s.name());
        keys.push(collector.key());
    }
    let unique = |v: &mut Vec<&str>| {
        let n = v.len();
        v.sort_unstable();
        v.dedup();
        v.len() == n
    };
    assert!(
        unique(&mut names) && unique(&mut keys),
        "{names:?} {keys:?}"
    );
    assert!(
        crate::observe::metrics::PROBE_KINDS
            .iter()
            .all(|p| !names.contains(p)),
        "no built-in probe's name"
    );
}
