use super::*;
use crate::config::{Config, FeatureSection};
use crate::transport::verdict::judge_pod;
use fabricgate_probes::transport::{InternodeTcp, Observed, PodTransportFacts};
use std::time::Duration;

fn pod(json: Value) -> Pod {
    serde_json::from_value(json).unwrap()
}

fn trainer(resource: &str, labels: Value) -> Pod {
    pod(json!({
        "metadata": {"name": "w-0", "namespace": "ml", "uid": "u-1", "labels": labels,
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "llm",
                "uid": "j-1", "controller": true}]},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {resource: "1"}}}]},
        "status": {"phase": "Running"}
    }))
}

fn config() -> Config {
    Config::parse(
        "kubernetes:\n  rdma_resources: [\"rdma/hca_shared_devices_a\"]\nruntime:\n  \
         pod_selector: app=trainer\n",
    )
    .unwrap()
}

fn sockets_verdict(c: &Config) -> PodVerdict {
    let facts = PodTransportFacts {
        pod_uid: "u-1".into(),
        qps: Observed::Seen(Vec::new()),
        internode_tcp: Observed::Seen(InternodeTcp {
            bytes: 41_000_000_000,
            window: Duration::from_secs(30),
            peers: vec!["10.0.0.2".parse().unwrap()],
            interfaces: vec!["ib0".into()],
            other_bytes: 0,
        }),
        ports: Vec::new(),
    };
    judge_pod(&facts, &RuntimeSettings::of(c).unwrap(), |_, _| true, None)
}

#[test]
fn pods_requesting_the_rdma_resource_or_matching_the_selector_are_judged_others_never() {
    let c = config();
    let runtime = RuntimeSettings::of(&c).unwrap();
    let judged = |p: &Pod| is_judged(p, &c.kubernetes, false, &runtime, "fabricgate");
    assert!(judged(&trainer("rdma/hca_shared_devices_a", json!({}))));
    assert!(judged(&trainer("cpu", json!({"app": "trainer"}))));
    assert!(!judged(&trainer("cpu", json!({"app": "web"}))));
    assert!(!judged(&trainer("nvidia.com/gpu", json!({}))));
    let mut done = trainer("rdma/hca_shared_devices_a", json!({}));
    done.status.as_mut().unwrap().phase = Some("Succeeded".into());
    assert!(!judged(&done), "a finished pod is never judged");
    // The agent's own pod requests the RDMA resource (shipped daemonset.yaml): never judged.
    let agent = pod(json!({
        "metadata": {"name": "fabricgate-x1", "namespace": "fabricgate", "uid": "a-1",
            "labels": {"app.kubernetes.io/name": "fabricgate"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                "name": "fabricgate", "uid": "d-1", "controller": true}]},
        "spec": {"containers": [{"name": "agent",
            "resources": {"limits": {"rdma/hca_shared_devices_a": "1"}}}]},
        "status": {"phase": "Running"}
    }));
    assert!(!judged(&agent), "fabricgate's own pods are never judged");
    assert!(
        is_judged(&agent, &c.kubernetes, false, &runtime, "other"),
        "only in the agent's own namespace"
    );
    // A tenant's pod claiming to be fabricgate by its labels, or by an owner reference to a
    // DaemonSet of that name in its own namespace, is judged like any other.
    let tenant = trainer(
        "rdma/hca_shared_devices_a",
        json!({"app.kubernetes.io/name": "fabricgate", "app.kubernetes.io/component": "agent"}),
    );
    assert!(judged(&tenant), "a label opts no pod out");
    let mut owned = agent.clone();
    owned.metadata.namespace = Some("ml".into());
    assert!(
        judged(&owned),
        "a DaemonSet owner outside fabricgate's namespace"
    );
    // A resource claim counts only while DRA drivers are configured.
    let claim = pod(
        json!({"metadata": {"name": "d", "namespace": "ml", "uid": "u"},
        "spec": {"containers": [{"name": "c"}],
            "resourceClaims": [{"name": "hca", "resourceClaimName": "hca-0"}]}}),
    );
    assert!(!judged(&claim));
    assert!(is_judged(
        &claim,
        &c.kubernetes,
        true,
        &runtime,
        "fabricgate"
    ));
}

#[test]
fn the_condition_is_written_once_per_change_and_the_event_once_per_transition() {
    let c = config();
    let mut p = JudgedPod::of(&trainer("rdma/hca_shared_devices_a", json!({}))).unwrap();
    assert_eq!(p.owner.as_ref().unwrap().kind, "Job");
    let v = sockets_verdict(&c);
    let patch = condition_patch(&p, &v, "2026-12-05T00:00:00Z").unwrap();
    let cond = &patch["status"]["conditions"][0];
    assert_eq!(
        patch["metadata"]["uid"], "u-1",
        "the pod's UID as a precondition"
    );
    assert_eq!(cond["type"], CONDITION_TYPE);
    assert_eq!(cond["status"], "False");
    assert_eq!(cond["reason"], "SocketsFallback");
    assert!(is_fallback_transition(&p, &v));
    assert!(fallback_note(&p, &v, true).starts_with("pod ml/w-0 is on sockets: "));
    // As the watch then shows it: no second write, no second Event.
    p.condition = Some(("False".into(), "SocketsFallback".into()));
    assert_eq!(condition_patch(&p, &v, "later"), None);
    assert!(!is_fallback_transition(&p, &v));
    // Idle keeps what the pod shows; with nothing yet it is Unknown.
    let idle = PodVerdict {
        transport: Transport::Idle,
        reason: crate::transport::verdict::REASON_IDLE,
        why: "0 data-path QPs; no TCP".into(),
        data_path_qps: Some(0),
        internode_tcp_bytes: Some(0),
        other_tcp_bytes: Some(0),
        rdma_bytes: None,
        clears: false,
    };
    assert_eq!(condition_patch(&p, &idle, "t"), None);
    // Quiet for runtime.clear_after: the False goes to Unknown/NoInterNodeTraffic, and a True
    // stays (a job on RDMA that pauses is still on RDMA).
    let cleared = PodVerdict {
        clears: true,
        ..idle.clone()
    };
    let cond = &condition_patch(&p, &cleared, "t").unwrap()["status"]["conditions"][0];
    assert_eq!(
        (cond["status"].as_str(), cond["reason"].as_str()),
        (Some("Unknown"), Some("NoInterNodeTraffic"))
    );
    let mut on_rdma = p.clone();
    on_rdma.condition = Some(("True".into(), "DataPathQueuePairs".into()));
    assert_eq!(condition_patch(&on_rdma, &cleared, "t"), None);
    p.condition = None;
    assert_eq!(
        condition_patch(&p, &idle, "t").unwrap()["status"]["conditions"][0]["status"],
        "Unknown"
    );
    // An earlier `unknown` (the agent could not see then) gives way to what it sees now,
    // once; NoInterNodeTraffic is then kept.
    p.condition = Some(("Unknown".into(), "TransportUnknown".into()));
    let cond = &condition_patch(&p, &idle, "t").unwrap()["status"]["conditions"][0];
    assert_eq!(
        (cond["status"].as_str(), cond["reason"].as_str()),
        (Some("Unknown"), Some("NoInterNodeTraffic"))
    );
    p.condition = Some(("Unknown".into(), "NoInterNodeTraffic".into()));
    assert_eq!(condition_patch(&p, &idle, "t"), None);
}
