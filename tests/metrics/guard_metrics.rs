//! The guard's `/metrics`, `/healthz` and `/readyz`: its exposition against golden files, and
//! its endpoints served by the agent's bounded server (`observe::server`).

use crate::common::{have_tool, http_get, sample};
use crate::exposition::{check_golden, promtool_check};
use fabricgate::cluster::guard::{EvictionResult, GuardMetrics, Outcome, POOL_REFUSAL, WriteKind};
use std::sync::Arc;

/// A leader that swept a pool of 6 Nodes with one agent gone, tainted it, and then found its
/// writes refused by its admission policy's pool.
fn refused_leader() -> GuardMetrics {
    let m = GuardMetrics::new();
    m.turned(true);
    m.wrote(WriteKind::DryRun, Outcome::Ok, None);
    m.swept(6, 0);
    m.swept(6, 1);
    m.wrote(WriteKind::Taint, Outcome::Ok, None);
    m.wrote(WriteKind::Condition, Outcome::Ok, None);
    m.wrote(WriteKind::Taint, Outcome::Failed, None);
    m.swept(6, 2);
    let refusal = format!(
        "ValidatingAdmissionPolicy 'fabricgate-guard' denied request: the fabricgate guard \
         {POOL_REFUSAL} {{fabricgate.io/other=true}}; gpu-3 is not"
    );
    m.wrote(WriteKind::Taint, Outcome::Refused("pool"), Some(&refusal));
    // runtime.on_sockets: evict: one pod refused by its budget, then evicted; one held.
    m.evicted(EvictionResult::PdbBlocked);
    m.evicted(EvictionResult::Evicted);
    m.evicted(EvictionResult::BreakerHeld);
    m
}

#[test]
fn guard_golden_prometheus_text_and_openmetrics() {
    let m = refused_leader();
    let text = m.encode(false);
    check_golden("guard-metrics.prom", &text);
    check_golden("guard-metrics.openmetrics", &m.encode(true));
    for (series, want) in [
        ("fabricgate_guard_leader", 1.0),
        ("fabricgate_guard_blocked", 1.0),
        ("fabricgate_guard_sweeps_total", 3.0),
        ("fabricgate_guard_stale_agents", 2.0),
        ("fabricgate_guard_pool_nodes", 6.0),
        (
            r#"fabricgate_guard_writes_total{kind="taint",result="ok"}"#,
            1.0,
        ),
        (
            r#"fabricgate_guard_writes_total{kind="taint",result="refused"}"#,
            1.0,
        ),
        (
            r#"fabricgate_guard_writes_total{kind="taint",result="failed"}"#,
            1.0,
        ),
        (
            r#"fabricgate_guard_writes_total{kind="dry_run",result="ok"}"#,
            1.0,
        ),
        (
            r#"fabricgate_guard_refused_writes_total{reason="pool"}"#,
            1.0,
        ),
        (
            r#"fabricgate_guard_refused_writes_total{reason="rbac"}"#,
            0.0,
        ),
        (r#"fabricgate_guard_evictions_total{result="evicted"}"#, 1.0),
        (
            r#"fabricgate_guard_evictions_total{result="pdb_blocked"}"#,
            1.0,
        ),
        (
            r#"fabricgate_guard_evictions_total{result="breaker_held"}"#,
            1.0,
        ),
        (r#"fabricgate_guard_evictions_total{result="failed"}"#, 0.0),
    ] {
        assert_eq!(sample(&text, series), Some(want), "{series}\n{text}");
    }
}

#[test]
fn guard_endpoints_answer_through_the_bounded_server() {
    let m = Arc::new(GuardMetrics::new());
    m.turned(true);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    rt.spawn(fabricgate::observe::server::serve(
        listener,
        Arc::clone(&m).router(),
        fabricgate::observe::server::Limits::default(),
        Arc::new(()),
        async {
            let _ = rx.await;
        },
    ));
    assert_eq!(http_get(&addr, "/healthz", None).0, 200);
    assert_eq!(http_get(&addr, "/readyz", None).0, 200);
    m.wrote(
        WriteKind::DryRun,
        Outcome::Refused("pool"),
        Some("the fabricgate guard may modify only Nodes of the pool {a=b}; gpu-1 is not"),
    );
    let (status, _, body) = http_get(&addr, "/readyz", None);
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("not ready") && body.contains("{a=b}"),
        "{body}"
    );
    let (status, head, text) = http_get(&addr, "/metrics", None);
    assert_eq!(status, 200);
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    assert_eq!(sample(&text, "fabricgate_guard_blocked"), Some(1.0));
    let (_, head, om) = http_get(&addr, "/metrics", Some("application/openmetrics-text"));
    assert!(head.contains("application/openmetrics-text"), "{head}");
    assert!(om.ends_with("# EOF\n"), "{om}");
    if have_tool("promtool") {
        let (ok, msg) = promtool_check(&text);
        assert!(ok, "promtool check metrics: {msg}\n{text}");
    }
    m.wrote(WriteKind::Taint, Outcome::Ok, None);
    assert_eq!(http_get(&addr, "/readyz", None).0, 200);
    let _ = tx.send(());
}
