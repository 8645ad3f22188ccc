//! The leader's watches: Workloads (all namespaces), Nodes (the pool), FabricChecks and
//! FabricCheckResults (in `gang.namespace`), AdmissionChecks and ResourceFlavors, and the
//! pods Kueue admitted (label `kueue.x-k8s.io/podset`, slimmed to what `requeue.rs` reads),
//! each a `kube::runtime::watcher`
//! (one LIST, then WATCH from its resourceVersion, resumed after errors) feeding a reflector
//! store. Every event wakes the controller's loop; passes read only the stores.

use super::model;
use super::model::{PODSET_LABEL, TRANSPORT_CONDITION, WORKLOAD_ANNOTATION};
use super::{CHECK_LABEL, CheckSettings, WATCH_TIMEOUT_SECS};
use crate::cluster::slim_node;
use crate::gang::fabriccheck;
use crate::gang::settings::AfterAdmission;
use crate::node::WatchBackoff;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec, PodStatus};
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::store::{Store, Writer};
use kube::runtime::watcher::{self, Event, watcher};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// The leader's stores: all a pass reads.
#[derive(Clone)]
pub(super) struct Stores {
    pub workloads: Store<DynamicObject>,
    pub nodes: Store<Node>,
    pub checks: Store<DynamicObject>,
    pub results: Store<DynamicObject>,
    pub admission_checks: Store<DynamicObject>,
    pub flavors: Store<DynamicObject>,
    /// Kueue's pods (only with `gang.after_admission: requeue`; empty otherwise).
    pub pods: Store<Pod>,
    /// Uids of the FabricChecks this leader created (before its watch shows them): with the
    /// checks in the store, the checks whose answers are cached.
    pub(super) created: Arc<Mutex<HashSet<String>>>,
}

impl Stores {
    /// Note a FabricCheck this leader created, so its answers are kept before the watch of
    /// FabricChecks shows it.
    pub(super) fn created(&self, uid: String) {
        if let Ok(mut c) = self.created.lock() {
            // Bounded: only checks in flight matter, and they reach the store within moments.
            if c.len() >= 4096 {
                c.clear();
            }
            c.insert(uid);
        }
    }
}

/// The leader's stores and the tasks that feed them; dropping it stops the watches.
pub(super) struct Watched {
    pub stores: Stores,
    listed: Vec<Arc<AtomicBool>>,
    tasks: Vec<JoinHandle<()>>,
    notify: Arc<Notify>,
}

impl Drop for Watched {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Wait for a change in the leader's stores; never, while there are none.
pub(super) async fn next_change(watched: &mut Option<Watched>) {
    match watched {
        Some(w) => w.notify.notified().await,
        None => std::future::pending().await,
    }
}

impl Watched {
    pub(super) fn start(client: &kube::Client, s: &CheckSettings) -> Watched {
        let notify = Arc::new(Notify::new());
        let backoff = Duration::from_secs(5);
        let mut listed = Vec::new();
        let mut tasks = Vec::new();
        let mut spawn_kept = |api: Api<DynamicObject>,
                              ar: ApiResource,
                              labels: &str,
                              keep: Keep<DynamicObject>,
                              what| {
            let flag = Arc::new(AtomicBool::new(false));
            listed.push(Arc::clone(&flag));
            let writer = Writer::new(ar);
            let store = writer.as_reader();
            tasks.push(tokio::spawn(feed(
                api,
                labels.to_owned(),
                writer,
                keep,
                flag,
                Arc::clone(&notify),
                backoff,
                what,
                |o: &mut DynamicObject| o.metadata.managed_fields = None,
            )));
            store
        };
        let all = || -> Keep<DynamicObject> { Box::new(|_: &DynamicObject| true) };
        let wl = model::workloads();
        let workloads_api = match &s.workload_namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &wl),
            None => Api::all_with(client.clone(), &wl),
        };
        let workloads = spawn_kept(workloads_api, wl, "", all(), "Workloads");
        let gang_ns = &s.gang.namespace;
        let fc = fabriccheck::checks();
        let checks = spawn_kept(
            Api::namespaced_with(client.clone(), gang_ns, &fc),
            fc,
            &format!("{}={}", CHECK_LABEL.0, CHECK_LABEL.1),
            all(),
            "FabricChecks",
        );
        let created: Arc<Mutex<HashSet<String>>> = Arc::default();
        let keep = live_answers(checks.clone(), Arc::clone(&created));
        let fcr = fabriccheck::results();
        let results = spawn_kept(
            Api::namespaced_with(client.clone(), gang_ns, &fcr),
            fcr,
            fabriccheck::CHECK_UID_LABEL,
            keep,
            "FabricCheckResults",
        );
        let ac = model::admission_checks();
        let admission_checks = spawn_kept(
            Api::all_with(client.clone(), &ac),
            ac,
            "",
            all(),
            "AdmissionChecks",
        );
        let rf = model::resource_flavors();
        let flavors = spawn_kept(
            Api::all_with(client.clone(), &rf),
            rf,
            "",
            all(),
            "ResourceFlavors",
        );
        let flag = Arc::new(AtomicBool::new(false));
        listed.push(Arc::clone(&flag));
        let writer = Writer::new(());
        let nodes = writer.as_reader();
        tasks.push(tokio::spawn(feed(
            Api::<Node>::all(client.clone()),
            s.config.node.pool_selector.clone(),
            writer,
            Box::new(|_: &Node| true),
            flag,
            Arc::clone(&notify),
            backoff,
            "Nodes",
            slim_node,
        )));
        let flag = Arc::new(AtomicBool::new(false));
        listed.push(Arc::clone(&flag));
        let (pods, pods_task) = watch_kueue_pods(client, s, flag, Arc::clone(&notify), backoff);
        tasks.extend(pods_task);
        Watched {
            stores: Stores {
                workloads,
                nodes,
                checks,
                results,
                admission_checks,
                flavors,
                pods,
                created,
            },
            listed,
            tasks,
            notify,
        }
    }

    /// Every watch has listed once: the stores hold what there was.
    pub(super) fn ready(&self) -> bool {
        self.listed.iter().all(|f| f.load(Ordering::Acquire))
    }
}

/// Only answers to a live check are kept: any account that may create a
/// FabricCheckResult could otherwise fill the controller's memory with answers to checks that
/// do not exist. An answer that arrives before its check shows is read again by one LIST when
/// that check is judged (`objects::answers`).
fn live_answers(
    checks: Store<DynamicObject>,
    created: Arc<Mutex<HashSet<String>>>,
) -> Keep<DynamicObject> {
    Box::new(move |answer: &DynamicObject| {
        let Some(uid) = answer.labels().get(fabriccheck::CHECK_UID_LABEL) else {
            return false;
        };
        fabriccheck::is_uid(uid)
            && (created.lock().is_ok_and(|c| c.contains(uid))
                || checks
                    .state()
                    .iter()
                    .any(|fc| fc.uid().as_deref() == Some(uid.as_str())))
    })
}

/// The pods Kueue admitted, with `gang.after_admission: requeue` only; otherwise an empty
/// store, listed at once.
fn watch_kueue_pods(
    client: &kube::Client,
    s: &CheckSettings,
    listed: Arc<AtomicBool>,
    notify: Arc<Notify>,
    backoff: Duration,
) -> (Store<Pod>, Option<JoinHandle<()>>) {
    let writer = Writer::new(());
    let pods = writer.as_reader();
    if s.gang.after_admission != AfterAdmission::Requeue {
        listed.store(true, Ordering::Release);
        return (pods, None);
    }
    let api = match &s.workload_namespace {
        Some(ns) => Api::<Pod>::namespaced(client.clone(), ns),
        None => Api::<Pod>::all(client.clone()),
    };
    let task = tokio::spawn(feed(
        api,
        PODSET_LABEL.to_owned(),
        writer,
        Box::new(|_: &Pod| true),
        listed,
        notify,
        backoff,
        "Pods",
        slim_pod,
    ));
    (pods, Some(task))
}

/// A pod as `requeue.rs` reads it: its names, owners and Kueue's workload annotation, its
/// node, and only the `fabricgate.io/TransportReady` condition.
fn slim_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    pod.metadata.labels = None;
    if let Some(a) = pod.metadata.annotations.as_mut() {
        a.retain(|k, _| k == WORKLOAD_ANNOTATION);
    }
    pod.spec = pod.spec.take().map(|s| PodSpec {
        node_name: s.node_name,
        ..PodSpec::default()
    });
    pod.status = pod.status.take().map(|s| PodStatus {
        conditions: s.conditions.map(|mut cs| {
            cs.retain(|c| c.type_ == TRANSPORT_CONDITION);
            cs
        }),
        phase: s.phase,
        ..PodStatus::default()
    });
}

/// Which objects of a watch are stored.
type Keep<K> = Box<dyn Fn(&K) -> bool + Send + Sync>;

/// Feed `writer` from a watcher of `api` (each object `slim`med) until aborted, storing only
/// the objects `keep` accepts (one no longer accepted is dropped from the store).
#[allow(clippy::too_many_arguments)]
async fn feed<K>(
    api: Api<K>,
    labels: String,
    mut writer: Writer<K>,
    keep: Keep<K>,
    listed: Arc<AtomicBool>,
    notify: Arc<Notify>,
    max_backoff: Duration,
    what: &'static str,
    slim: fn(&mut K),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync,
    K: 'static,
    K::DynamicType: std::hash::Hash + Eq + Clone + Send + Sync,
{
    let mut config = watcher::Config::default()
        .timeout(WATCH_TIMEOUT_SECS)
        .any_semantic();
    if !labels.is_empty() {
        config = config.labels(&labels);
    }
    // In pages: a page is deserialized whole before its objects are slimmed (one list of
    // 5,000 GPU Nodes is 65 MB of JSON); the store is replaced at the watcher's `InitDone`.
    config.page_size = Some(crate::cluster::LIST_PAGE);
    let mut events = watcher(api, config)
        .modify(slim)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(e) => {
                let e = match e {
                    Event::InitApply(o) if !keep(&o) => continue,
                    Event::Apply(o) if !keep(&o) => {
                        // Not stored (nor kept, should it have been): nothing to judge anew.
                        writer.apply_watcher_event(&Event::Delete(o));
                        continue;
                    }
                    e => e,
                };
                writer.apply_watcher_event(&e);
                if matches!(e, Event::InitDone) {
                    tracing::info!("listed {what}");
                    listed.store(true, Ordering::Release);
                }
                notify.notify_one();
            }
            Err(e) => tracing::warn!(error = %e, "watch of {what} failed; retrying"),
        }
    }
}
