//! The leader's watches: Workloads (all namespaces), Nodes (the pool), FabricChecks and
//! FabricCheckResults (in `gang.namespace`), AdmissionChecks and ResourceFlavors, each a `kube::runtime::watcher`
//! (one LIST, then WATCH from its resourceVersion, resumed after errors) feeding a reflector
//! store. Every event wakes the controller's loop; passes read only the stores.

use super::model;
use super::{CHECK_LABEL, CheckSettings, WATCH_TIMEOUT_SECS};
use crate::node::WatchBackoff;
use crate::node::fabriccheck;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::store::{Store, Writer};
use kube::runtime::watcher::{self, Event, watcher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// The leader's stores and the tasks that feed them; dropping it stops the watches.
pub(super) struct Watched {
    pub workloads: Store<DynamicObject>,
    pub nodes: Store<Node>,
    pub checks: Store<DynamicObject>,
    pub results: Store<DynamicObject>,
    pub admission_checks: Store<DynamicObject>,
    pub flavors: Store<DynamicObject>,
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
        let mut spawn_dynamic = |api: Api<DynamicObject>, ar: ApiResource, labels: &str, what| {
            let flag = Arc::new(AtomicBool::new(false));
            listed.push(Arc::clone(&flag));
            let writer = Writer::new(ar);
            let store = writer.as_reader();
            tasks.push(tokio::spawn(feed(
                api,
                labels.to_owned(),
                writer,
                flag,
                Arc::clone(&notify),
                backoff,
                what,
            )));
            store
        };
        let wl = model::workloads();
        let workloads_api = match &s.workload_namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, &wl),
            None => Api::all_with(client.clone(), &wl),
        };
        let workloads = spawn_dynamic(workloads_api, wl, "", "Workloads");
        let gang_ns = &s.config.gang.namespace;
        let fc = fabriccheck::checks();
        let checks = spawn_dynamic(
            Api::namespaced_with(client.clone(), gang_ns, &fc),
            fc,
            &format!("{}={}", CHECK_LABEL.0, CHECK_LABEL.1),
            "FabricChecks",
        );
        let fcr = fabriccheck::results();
        let results = spawn_dynamic(
            Api::namespaced_with(client.clone(), gang_ns, &fcr),
            fcr,
            fabriccheck::CHECK_UID_LABEL,
            "FabricCheckResults",
        );
        let ac = model::admission_checks();
        let admission_checks = spawn_dynamic(
            Api::all_with(client.clone(), &ac),
            ac,
            "",
            "AdmissionChecks",
        );
        let rf = model::resource_flavors();
        let flavors = spawn_dynamic(
            Api::all_with(client.clone(), &rf),
            rf,
            "",
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
            flag,
            Arc::clone(&notify),
            backoff,
            "Nodes",
        )));
        Watched {
            workloads,
            nodes,
            checks,
            results,
            admission_checks,
            flavors,
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

/// Feed `writer` from a watcher of `api` (objects slimmed of managed fields) until aborted.
async fn feed<K>(
    api: Api<K>,
    labels: String,
    mut writer: Writer<K>,
    listed: Arc<AtomicBool>,
    notify: Arc<Notify>,
    max_backoff: Duration,
    what: &'static str,
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
    config.page_size = None;
    let mut events = watcher(api, config)
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed();
    while let Some(event) = events.next().await {
        match event {
            Ok(e) => {
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
