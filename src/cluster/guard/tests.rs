//! Unit tests of the cache and of what counts as a missing agent.

use super::cache::Update;
use super::cache::{Cache, slim_pod, slim_transport_pod};
use super::sweep::agent_problem;
use crate::cluster::slim_node;
use k8s_openapi::api::core::v1::{
    ContainerImage, Node, NodeCondition, NodeSpec, NodeStatus, Pod, PodCondition, PodSpec,
    PodStatus, Taint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};
use kube::runtime::watcher::{Error, Event};
use std::sync::Arc;

fn pod(node: &str, ready: bool) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(format!("agent-{node}")),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
    }
}

fn node(name: &str, rv: &str, tainted: bool) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            resource_version: Some(rv.into()),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: tainted.then(|| {
                vec![Taint {
                    key: "fabricgate.io/unvalidated".into(),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        }),
        ..Node::default()
    }
}

/// A completed list of `nodes`, as the watcher reports it.
fn list_nodes(c: &mut Cache, nodes: Vec<Node>) {
    c.apply(Update::Node(Box::new(Ok(Event::Init))));
    for n in nodes {
        c.apply(Update::Node(Box::new(Ok(Event::InitApply(n)))));
    }
    c.apply(Update::Node(Box::new(Ok(Event::InitDone))));
}

fn list_pods(c: &mut Cache, pods: Vec<Pod>) {
    c.apply(Update::Pod(Box::new(Ok(Event::Init))));
    for p in pods {
        c.apply(Update::Pod(Box::new(Ok(Event::InitApply(p)))));
    }
    c.apply(Update::Pod(Box::new(Ok(Event::InitDone))));
}

fn applied(c: &mut Cache, n: Node) {
    c.apply(Update::Node(Box::new(Ok(Event::Apply(n)))));
}

/// A watch that broke (the connection dropped mid-stream).
fn broke() -> Error {
    Error::WatchFailed(kube::Error::LinesCodecMaxLineLengthExceeded)
}

fn names(cache: &Cache) -> Vec<String> {
    cache
        .nodes()
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect()
}

fn rv_of(cache: &Cache, name: &str) -> Option<String> {
    cache
        .nodes()
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(name))
        .and_then(|n| n.metadata.resource_version.clone())
}

fn problem(c: &Cache, node: &str) -> Option<String> {
    let pods = c.pods_by_node();
    agent_problem(node, pods.get(node).into_iter().flatten().map(Arc::as_ref))
}

#[test]
fn the_cache_follows_lists_and_watch_events_and_is_ready_only_while_both_watches_are_up() {
    let mut c = Cache::default();
    assert!(!c.ready());
    list_nodes(
        &mut c,
        vec![
            node("c", "1", false),
            node("a", "1", false),
            node("b", "1", false),
        ],
    );
    assert!(!c.ready(), "the pods are not listed yet");
    list_pods(&mut c, vec![pod("a", true)]);
    assert!(c.ready());
    assert_eq!(
        names(&c),
        ["a", "b", "c"],
        "in the order the apiserver lists"
    );
    c.apply(Update::Node(Box::new(Ok(Event::Delete(node(
        "a", "2", false,
    ))))));
    assert_eq!(names(&c), ["b", "c"]);
    assert!(!c.has_node("a") && c.has_node("b"));
    applied(&mut c, node("d", "3", false));
    applied(&mut c, node("b", "4", true));
    assert_eq!(names(&c), ["b", "c", "d"]);
    assert_eq!(rv_of(&c, "b").as_deref(), Some("4"));

    // A broken watch: no sweeps on what may be stale, until the watch is accepted again
    // (quietly: nothing changed meanwhile) or shows an event.
    c.apply(Update::Pod(Box::new(Err(broke()))));
    assert!(!c.ready(), "a broken watch: no sweeps on what may be stale");
    c.apply(Update::PodsWatching);
    assert!(c.ready());
    c.apply(Update::Node(Box::new(Err(broke()))));
    assert!(!c.ready());
    applied(&mut c, node("c", "5", false));
    assert!(c.ready(), "an event shows the watch is live");

    // A relist: the old state serves until the list is complete, then it is replaced.
    c.apply(Update::Node(Box::new(Ok(Event::Init))));
    c.apply(Update::Node(Box::new(Ok(Event::InitApply(node(
        "z", "9", false,
    ))))));
    assert_eq!(names(&c), ["b", "c", "d"]);
    c.apply(Update::Node(Box::new(Ok(Event::InitDone))));
    assert_eq!(names(&c), ["z"]);
    assert!(c.ready());
}

#[test]
fn an_expired_version_relists_without_stopping_the_sweeps_and_a_failed_list_stops_them() {
    let mut c = Cache::default();
    list_nodes(&mut c, vec![node("a", "1", false)]);
    list_pods(&mut c, vec![pod("a", true)]);
    let gone = kube::core::Status::failure("too old resource version", "Expired").with_code(410);
    c.apply(Update::Node(Box::new(Err(Error::WatchError(Box::new(
        gone,
    ))))));
    assert!(
        c.ready(),
        "410: the cache serves while the watcher lists again"
    );
    c.apply(Update::Node(Box::new(Ok(Event::Init))));
    let refused = kube::Error::LinesCodecMaxLineLengthExceeded;
    c.apply(Update::Node(Box::new(Err(Error::InitialListFailed(
        refused,
    )))));
    assert!(!c.ready());
    // Accepting a watch does not count while the list is still due.
    c.apply(Update::NodesWatching);
    assert!(!c.ready());
    list_nodes(&mut c, vec![node("a", "2", false)]);
    assert!(c.ready());
}

#[test]
fn pods_are_found_by_the_node_they_are_bound_to() {
    let mut c = Cache::default();
    let mut unbound = pod("x", false);
    unbound.spec = Some(PodSpec::default());
    list_pods(&mut c, vec![unbound, pod("b", true)]);
    assert!(!c.pods_by_node().contains_key("x"));
    assert_eq!(problem(&c, "b"), None);
    // Bound to x now, then not Ready, then gone.
    c.apply(Update::Pod(Box::new(Ok(Event::Apply(pod("x", true))))));
    assert_eq!(problem(&c, "x"), None);
    assert_eq!(
        c.pods_by_node().get("").map(Vec::len),
        None,
        "moved, not copied"
    );
    c.apply(Update::Pod(Box::new(Ok(Event::Apply(pod("x", false))))));
    assert!(problem(&c, "x").unwrap().contains("not Ready"));
    c.apply(Update::Pod(Box::new(Ok(Event::Delete(pod("x", false))))));
    assert!(
        problem(&c, "x")
            .unwrap()
            .contains("no fabricgate agent pod")
    );
    assert_eq!(c.pods_by_node().get("b").map(Vec::len), Some(1));
}

#[test]
fn after_its_own_write_the_cache_ignores_older_versions_until_the_watch_echoes_it() {
    let mut c = Cache::default();
    list_nodes(&mut c, vec![node("a", "5", false)]);
    c.wrote(node("a", "8", true));
    // The watch is still delivering versions older than the write: ignored.
    applied(&mut c, node("a", "6", false));
    assert_eq!(rv_of(&c, "a").as_deref(), Some("8"));
    // The echo of the write, then anyone's later change, are taken.
    applied(&mut c, node("a", "8", true));
    applied(&mut c, node("a", "9", false));
    assert_eq!(rv_of(&c, "a").as_deref(), Some("9"));
    // A relist forgets what was awaited.
    c.wrote(node("a", "12", true));
    list_nodes(&mut c, vec![node("a", "11", false)]);
    applied(&mut c, node("a", "13", false));
    assert_eq!(rv_of(&c, "a").as_deref(), Some("13"));
}

#[test]
fn cached_objects_keep_only_what_the_guard_reads() {
    let mut n = node("a", "1", true);
    n.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
    n.status = Some(NodeStatus {
        images: Some(vec![ContainerImage::default()]),
        allocatable: Some([("nvidia.com/gpu".to_owned(), Quantity("8".to_owned()))].into()),
        conditions: Some(vec![NodeCondition {
            type_: "FabricReady".into(),
            status: "False".into(),
            ..NodeCondition::default()
        }]),
        ..NodeStatus::default()
    });
    slim_node(&mut n);
    assert_eq!(n.metadata.managed_fields, None);
    let status = n.status.clone().expect("the conditions' status");
    assert_eq!(status.images, None);
    assert_eq!(status.allocatable, None);
    assert_eq!(
        status.conditions.map(|cs| cs.len()),
        Some(1),
        "FabricReady kept"
    );
    assert!(n.spec.and_then(|s| s.taints).is_some(), "taints kept");

    let mut p = pod("a", true);
    p.metadata.managed_fields = Some(vec![ManagedFieldsEntry::default()]);
    if let Some(spec) = p.spec.as_mut() {
        spec.service_account_name = Some("sa".into());
    }
    slim_pod(&mut p);
    assert_eq!(p.metadata.managed_fields, None);
    let spec = p.spec.unwrap_or_default();
    assert_eq!(spec.node_name.as_deref(), Some("a"));
    assert_eq!(spec.service_account_name, None);
    assert!(
        p.status.and_then(|s| s.conditions).is_some(),
        "conditions kept"
    );
}

#[test]
fn missing_or_not_ready_agent_pods_are_problems() {
    let pods = vec![pod("a", true), pod("b", false)];
    assert_eq!(agent_problem("a", &pods), None);
    assert!(agent_problem("b", &pods).unwrap().contains("not Ready"));
    assert!(
        agent_problem("c", &pods)
            .unwrap()
            .contains("no fabricgate agent pod")
    );
}

/// A running pod with a Ready condition and, when `transport` says so, the transport
/// condition with that status.
fn training_pod(name: &str, transport: Option<&str>) -> Pod {
    let mut p = pod("gpu-1", true);
    p.metadata.name = Some(name.into());
    p.metadata.namespace = Some("train".into());
    p.metadata.uid = Some(format!("uid-{name}"));
    p.metadata.labels = Some([("app".to_owned(), "trainer".to_owned())].into());
    if let Some(status) = transport {
        p.status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .push(PodCondition {
                type_: crate::transport::eviction::TRANSPORT_READY.into(),
                status: status.into(),
                reason: Some("SocketsFallback".into()),
                ..PodCondition::default()
            });
    }
    slim_transport_pod(&mut p);
    p
}

fn transport_names(c: &Cache) -> Option<Vec<String>> {
    let mut names: Vec<String> = c
        .transport_pods()?
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    names.sort();
    Some(names)
}

#[test]
fn the_running_pods_cache_keeps_only_pods_whose_transport_condition_is_false() {
    let mut c = Cache::default();
    assert_eq!(transport_names(&c), None, "not listed yet");
    c.apply(Update::Transport(Box::new(Ok(Event::Init))));
    for p in [
        training_pod("sockets", Some("False")),
        training_pod("rdma", Some("True")),
        training_pod("unjudged", None),
    ] {
        c.apply(Update::Transport(Box::new(Ok(Event::InitApply(p)))));
    }
    c.apply(Update::Transport(Box::new(Ok(Event::InitDone))));
    assert_eq!(transport_names(&c).unwrap(), ["sockets"]);
    let kept = &c.transport_pods().unwrap()[0];
    // Slimmed: no labels, only the transport condition.
    assert!(kept.metadata.labels.is_none());
    let conditions = kept.status.as_ref().unwrap().conditions.as_ref().unwrap();
    assert_eq!(conditions.len(), 1);
    assert_eq!(
        kept.spec.as_ref().unwrap().node_name.as_deref(),
        Some("gpu-1")
    );
    assert_eq!(kept.metadata.uid.as_deref(), Some("uid-sockets"));
    // Back to True: it leaves; another turns False: it joins.
    let back = training_pod("sockets", Some("True"));
    c.apply(Update::Transport(Box::new(Ok(Event::Apply(back)))));
    let turned = training_pod("rdma", Some("False"));
    c.apply(Update::Transport(Box::new(Ok(Event::Apply(turned)))));
    assert_eq!(transport_names(&c).unwrap(), ["rdma"]);
    // A broken watch: not trusted until it is up again.
    c.apply(Update::Transport(Box::new(Err(broke()))));
    assert_eq!(transport_names(&c), None);
    c.apply(Update::TransportWatching);
    assert_eq!(transport_names(&c).unwrap(), ["rdma"]);
}
