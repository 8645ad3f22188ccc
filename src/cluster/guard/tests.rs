//! Unit tests of the cache and of what counts as a missing agent.

use super::cache::Cache;
use super::sweep::agent_problem;
use super::watch::{Change, Update};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

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
        spec: Some(k8s_openapi::api::core::v1::NodeSpec {
            taints: tainted.then(|| {
                vec![k8s_openapi::api::core::v1::Taint {
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

fn names(cache: &Cache) -> Vec<String> {
    let mut v: Vec<String> = cache
        .nodes
        .iter()
        .filter_map(|n| n.metadata.name.clone())
        .collect();
    v.sort();
    v
}

fn rv_of(cache: &Cache, name: &str) -> Option<String> {
    let i = *cache.node_at.get(name)?;
    cache.nodes[i].metadata.resource_version.clone()
}

#[test]
fn the_cache_follows_lists_and_watch_events_and_is_ready_only_while_both_watches_are_up() {
    let mut c = Cache::default();
    assert!(!c.ready());
    c.apply(Update::Node(Change::Listed(vec![
        node("a", "1", false),
        node("b", "1", false),
        node("c", "1", false),
    ])));
    assert!(!c.ready(), "the pods are not listed yet");
    c.apply(Update::Pod(Change::Listed(vec![pod("a", true)])));
    assert!(c.ready());
    // A delete in the middle keeps every other Node findable (swap_remove).
    c.apply(Update::Node(Change::Deleted(Box::new(node(
        "a", "2", false,
    )))));
    assert_eq!(names(&c), ["b", "c"]);
    for n in ["b", "c"] {
        assert_eq!(c.nodes[c.node_at[n]].metadata.name.as_deref(), Some(n));
    }
    c.apply(Update::Node(Change::Applied(Box::new(node(
        "d", "3", false,
    )))));
    c.apply(Update::Node(Change::Applied(Box::new(node(
        "b", "4", true,
    )))));
    assert_eq!(names(&c), ["b", "c", "d"]);
    assert_eq!(rv_of(&c, "b").as_deref(), Some("4"));
    c.apply(Update::Pod(Change::Down));
    assert!(!c.ready(), "a broken watch: no sweeps on what may be stale");
    c.apply(Update::Pod(Change::Up));
    assert!(c.ready());
    // A relist replaces everything.
    c.apply(Update::Node(Change::Listed(vec![node("z", "9", false)])));
    assert_eq!(names(&c), ["z"]);
}

#[test]
fn pods_are_found_by_the_node_they_are_bound_to() {
    let mut c = Cache::default();
    let mut unbound = pod("x", false);
    unbound.spec = Some(PodSpec::default());
    c.apply(Update::Pod(Change::Listed(vec![unbound, pod("b", true)])));
    assert!(c.pods_on("x").is_empty());
    assert_eq!(agent_problem("b", c.pods_on("b")), None);
    // Bound to x now, then not Ready, then gone.
    c.apply(Update::Pod(Change::Applied(Box::new(pod("x", true)))));
    assert_eq!(agent_problem("x", c.pods_on("x")), None);
    assert_eq!(c.pods.get("").map(Vec::len), None, "moved, not copied");
    c.apply(Update::Pod(Change::Applied(Box::new(pod("x", false)))));
    assert!(
        agent_problem("x", c.pods_on("x"))
            .unwrap()
            .contains("not Ready")
    );
    c.apply(Update::Pod(Change::Deleted(Box::new(pod("x", false)))));
    assert!(
        agent_problem("x", c.pods_on("x"))
            .unwrap()
            .contains("no fabricgate agent pod")
    );
    assert_eq!(c.pods_on("b").len(), 1);
}

#[test]
fn after_its_own_write_the_cache_ignores_older_versions_until_the_watch_echoes_it() {
    let mut c = Cache::default();
    c.apply(Update::Node(Change::Listed(vec![node("a", "5", false)])));
    c.wrote(node("a", "8", true));
    // The watch is still delivering versions older than the write: ignored.
    c.apply(Update::Node(Change::Applied(Box::new(node(
        "a", "6", false,
    )))));
    assert_eq!(rv_of(&c, "a").as_deref(), Some("8"));
    // The echo of the write, then anyone's later change, are taken.
    c.apply(Update::Node(Change::Applied(Box::new(node(
        "a", "8", true,
    )))));
    c.apply(Update::Node(Change::Applied(Box::new(node(
        "a", "9", false,
    )))));
    assert_eq!(rv_of(&c, "a").as_deref(), Some("9"));
    // A relist forgets what was awaited.
    c.wrote(node("a", "12", true));
    c.apply(Update::Node(Change::Listed(vec![node("a", "11", false)])));
    c.apply(Update::Node(Change::Applied(Box::new(node(
        "a", "13", false,
    )))));
    assert_eq!(rv_of(&c, "a").as_deref(), Some("13"));
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
