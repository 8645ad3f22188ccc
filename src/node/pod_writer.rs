//! The runtime transport's API side: the watch of this node's pods (a field selector on
//! `spec.nodeName`; the judged pods' jobs are followed by `node::peer_pods`), and the writes on
//! a judged pod: the `fabricgate.io/TransportReady` condition through
//! `pods/status` (only when it changes) and the `TransportFallback` Event on the pod and its
//! controller owner (once per transition).

use super::pods::{
    EVENT_REASON, JudgedPod, condition_patch, fallback_note, is_fallback_transition,
};
use super::watch::WatchBackoff;
use super::{FIELD_MANAGER, REPORTING_CONTROLLER, WATCH_TIMEOUT_SECS};
use crate::error::{Error, Result};
use crate::policy::transport::PodVerdict;
use crate::text::truncate;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event as WatchEvent, watcher};
use std::collections::BTreeMap;
use std::time::Duration;

/// Follow the pods of `node` (a field selector, no polling) and send each change as the
/// whole set by UID. A 403 (the agent's RBAC lacks pods: deploy/overlays/runtime-transport
/// not applied) is logged once and retried only every [`FORBIDDEN_RETRY`]: a missing grant
/// is not fixed in seconds, and each refused list is a line in the API server's audit log.
/// How long a pods watch refused by 403 waits before asking again.
pub const FORBIDDEN_RETRY: Duration = Duration::from_secs(300);

pub async fn watch_pods(
    client: kube::Client,
    node: String,
    tx: tokio::sync::watch::Sender<BTreeMap<String, Pod>>,
    max_backoff: Duration,
) {
    let config = watcher::Config::default()
        .fields(&format!("spec.nodeName={node}"))
        .timeout(WATCH_TIMEOUT_SECS)
        .any_semantic();
    let mut events = watcher(Api::<Pod>::all(client), config)
        .backoff(WatchBackoff::new(max_backoff))
        .boxed();
    let mut pods = BTreeMap::new();
    let mut staged = BTreeMap::new();
    let mut told = false;
    while let Some(event) = events.next().await {
        match event {
            Ok(WatchEvent::Init) => staged.clear(),
            Ok(WatchEvent::InitApply(p)) => {
                if let Some(uid) = p.metadata.uid.clone() {
                    staged.insert(uid, p);
                }
            }
            Ok(WatchEvent::InitDone) => pods = std::mem::take(&mut staged),
            Ok(WatchEvent::Apply(p)) => {
                if let Some(uid) = p.metadata.uid.clone() {
                    pods.insert(uid, p);
                }
            }
            Ok(WatchEvent::Delete(p)) => {
                if let Some(uid) = &p.metadata.uid {
                    pods.remove(uid);
                }
            }
            Err(e) => {
                let forbidden = matches!(&e,
                    watcher::Error::InitialListFailed(kube::Error::Api(s))
                    | watcher::Error::WatchStartFailed(kube::Error::Api(s)) if s.code == 403);
                if !told {
                    tracing::warn!(node = %node, error = %e,
                        "cannot watch this node's pods: runtime transport judges no pod; \
                         apply deploy/overlays/runtime-transport (pods list/watch)");
                    told = true;
                }
                if forbidden {
                    // The stream is not polled while sleeping, so no request is made.
                    tokio::time::sleep(FORBIDDEN_RETRY).await;
                }
                continue;
            }
        }
        if tx.send(pods.clone()).is_err() {
            return;
        }
    }
}

/// The writes on judged pods.
#[derive(Clone)]
pub struct PodWriter {
    pub client: kube::Client,
    pub node: String,
    pub dry_run: bool,
}

impl PodWriter {
    /// The condition (when it changes) and, on a transition to sockets, the Events. Returns
    /// how many writes it made.
    ///
    /// # Errors
    /// [`Error::KubeObject`] naming the pod or Event.
    pub async fn apply(&self, pod: &JudgedPod, verdict: &PodVerdict) -> Result<u32> {
        let now = Timestamp::now();
        let Some(patch) = condition_patch(pod, verdict, &now.to_string()) else {
            return Ok(0);
        };
        if self.dry_run {
            tracing::info!(pod = %pod.name, namespace = %pod.namespace, patch = %patch,
                "dry run: would set the pod condition");
            return Ok(0);
        }
        // The Events first: the condition is what marks the transition as told, so an Event
        // refused or lost is tried again next window (at worst told twice, never not at all).
        let mut writes = 0;
        if is_fallback_transition(pod, verdict) {
            let regarding = ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(pod.name.clone()),
                namespace: Some(pod.namespace.clone()),
                uid: Some(pod.uid.clone()),
                ..ObjectReference::default()
            };
            self.event(pod, regarding, fallback_note(pod, verdict, false), now)
                .await?;
            writes += 1;
            if let Some(o) = &pod.owner {
                let regarding = ObjectReference {
                    api_version: Some(o.api_version.clone()),
                    kind: Some(o.kind.clone()),
                    name: Some(o.name.clone()),
                    namespace: Some(pod.namespace.clone()),
                    uid: Some(o.uid.clone()),
                    ..ObjectReference::default()
                };
                self.event(pod, regarding, fallback_note(pod, verdict, true), now)
                    .await?;
                writes += 1;
            }
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
        let pp = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        pods.patch_status(&pod.name, &pp, &Patch::Strategic(patch))
            .await
            .map_err(|e| Error::KubeObject {
                action: "set fabricgate.io/TransportReady on",
                object: format!("Pod {}/{}", pod.namespace, pod.name),
                source: Box::new(e),
            })?;
        writes += 1;
        Ok(writes)
    }

    async fn event(
        &self,
        pod: &JudgedPod,
        regarding: ObjectReference,
        note: String,
        now: Timestamp,
    ) -> Result<()> {
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}-", pod.name)),
                namespace: Some(pod.namespace.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some("Judged".to_owned()),
            reason: Some(EVENT_REASON.to_owned()),
            note: Some(note),
            type_: Some("Warning".to_owned()),
            regarding: Some(regarding),
            reporting_controller: Some(REPORTING_CONTROLLER.to_owned()),
            reporting_instance: Some(truncate(&format!("fabricgate-{}", self.node), 128)),
            ..Event::default()
        };
        let events: Api<Event> = Api::namespaced(self.client.clone(), &pod.namespace);
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        events
            .create(&pp, &event)
            .await
            .map(|_| ())
            .map_err(|e| Error::KubeObject {
                action: "create a TransportFallback Event for",
                object: format!("Pod {}/{}", pod.namespace, pod.name),
                source: Box::new(e),
            })
    }
}
