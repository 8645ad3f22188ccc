//! The runtime transport's writes on a judged pod (this node's pods come from the shared
//! `node::pods_watch`, the judged pods' jobs from `transport::peers`): the `fabricgate.io/TransportReady` condition through
//! `pods/status` (only when it changes) and the `TransportFallback` Event on the pod and its
//! controller owner (once per transition).

use super::pods::{
    EVENT_REASON, JudgedPod, condition_patch, fallback_note, is_fallback_transition,
};
use crate::error::{Error, Result};
use crate::node::{FIELD_MANAGER, REPORTING_CONTROLLER};
use crate::text::truncate;
use crate::transport::verdict::PodVerdict;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::tests::scripted;
    use crate::transport::pods::Owner;
    use crate::transport::verdict::{REASON_RDMA, REASON_SOCKETS, Transport};
    use serde_json::json;

    fn pod(condition: Option<(&str, &str)>) -> JudgedPod {
        JudgedPod {
            uid: "u-1".into(),
            namespace: "ml".into(),
            name: "w-0".into(),
            host_network: false,
            owner: Some(Owner {
                api_version: "batch/v1".into(),
                kind: "Job".into(),
                name: "llm".into(),
                uid: "j-1".into(),
            }),
            condition: condition.map(|(s, r)| (s.to_owned(), r.to_owned())),
        }
    }

    fn verdict(transport: Transport, reason: &'static str) -> PodVerdict {
        PodVerdict {
            transport,
            reason,
            why: "0 data-path QPs; 41.0 GB over TCP with 7 peers in 30 s via ib0".into(),
            data_path_qps: Some(0),
            internode_tcp_bytes: Some(41_000_000_000),
            other_tcp_bytes: Some(0),
            rdma_bytes: None,
            clears: false,
        }
    }

    /// A transition to sockets: the Event on the pod, the Event on its Job, then the condition
    /// through pods/status with the pod's UID; a refused Event stops before the condition, so
    /// the transition is told again next window.
    #[tokio::test]
    async fn a_transition_to_sockets_tells_the_pod_and_its_job_then_sets_the_condition() {
        let (client, mut server) = scripted::client();
        let writer = PodWriter {
            client,
            node: "gpu-a".into(),
            dry_run: false,
        };
        let sockets = verdict(Transport::Sockets, REASON_SOCKETS);
        let task = tokio::spawn(async move {
            let n = writer.apply(&pod(None), &sockets).await;
            (writer, n)
        });
        let on_pod = server.answer(201, json!({})).await;
        assert_eq!(on_pod.path, "/apis/events.k8s.io/v1/namespaces/ml/events");
        assert_eq!(on_pod.body["regarding"]["kind"], "Pod");
        assert_eq!(on_pod.body["reason"], "TransportFallback");
        let on_job = server.answer(201, json!({})).await;
        assert_eq!(on_job.body["regarding"]["kind"], "Job");
        assert_eq!(on_job.body["regarding"]["uid"], "j-1");
        let patch = server.answer(200, json!({})).await;
        assert_eq!(patch.path, "/api/v1/namespaces/ml/pods/w-0/status");
        assert_eq!(patch.body["metadata"]["uid"], "u-1");
        assert_eq!(patch.body["status"]["conditions"][0]["status"], "False");
        let (writer, n) = task.await.unwrap();
        assert_eq!(n.unwrap(), 3);

        // Refused Event: no condition written (told again next window).
        let sockets = verdict(Transport::Sockets, REASON_SOCKETS);
        let task = tokio::spawn(async move { writer.apply(&pod(None), &sockets).await });
        server.answer(403, scripted::status(403, "Forbidden")).await;
        assert!(task.await.unwrap().is_err());

        server.expect_no_more().await;
    }

    /// What the pod already shows is not written again; back on RDMA only the condition is.
    #[tokio::test]
    async fn steady_state_writes_nothing_and_rdma_sets_only_the_condition() {
        let (client, mut server) = scripted::client();
        let writer = PodWriter {
            client,
            node: "gpu-a".into(),
            dry_run: false,
        };
        let shown = pod(Some(("False", REASON_SOCKETS)));
        let sockets = verdict(Transport::Sockets, REASON_SOCKETS);
        assert_eq!(writer.apply(&shown, &sockets).await.unwrap(), 0);
        let rdma = verdict(Transport::Rdma, REASON_RDMA);
        let task = tokio::spawn(async move { writer.apply(&shown, &rdma).await });
        let patch = server.answer(200, json!({})).await;
        assert_eq!(patch.body["status"]["conditions"][0]["status"], "True");
        assert_eq!(task.await.unwrap().unwrap(), 1);
        server.expect_no_more().await;
    }
}
