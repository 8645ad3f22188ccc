//! One pass of the leader over its stores, against the API: AdmissionChecks kept `Active`,
//! every Workload whose check of ours is `Pending` after quota reservation moved on as
//! `step::next` decides (a FabricCheck created, its answers listed, a state written, an Event
//! recorded), stale FabricChecks and answers deleted.

use super::objects::{cleanup, create_check, delete_check, listed_answers};
use super::requeue::{self, AdmittedCheck, Members, PodIndex, Verdict};
use super::state::State;
use super::step::{self, Action, Decision, Facts};
use super::watch::Stores;
use super::{CONTROLLER_NAME, CheckMetrics, CheckSettings, FIELD_MANAGER, model};
use crate::error::{Error, Result};
use crate::gang::fabriccheck;
use crate::gang::settings::AfterAdmission;
use crate::text::truncate;
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use serde_json::{Value, json};
use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// One pass; returns when the next one is due at the latest (a deadline of a check in flight).
pub(super) async fn pass(
    client: &kube::Client,
    w: &Stores,
    s: &CheckSettings,
    metrics: &CheckMetrics,
    state: &mut State,
) -> Option<tokio::time::Instant> {
    let ours = our_checks(client, w, s).await;
    let p = Pass {
        client,
        w,
        s,
        metrics,
        ours,
        pool: w.nodes.state(),
        pods: PodIndex::new(w.pods.state()),
    };
    let mut due: Option<tokio::time::Instant> = None;
    let mut in_flight = 0usize;
    let mut pending_uids = HashSet::new();
    let mut admitted_uids = HashSet::new();
    for wl in w.workloads.state() {
        match p.workload(state, &wl).await {
            Ok(Step::Idle) => {}
            Ok(Step::Watching(at)) => {
                admitted_uids.insert(wl.uid().unwrap_or_default());
                if let Some(at) = at {
                    due = Some(due.map_or(at, |d| d.min(at)));
                }
            }
            Ok(Step::Waiting(at)) => {
                in_flight += 1;
                pending_uids.insert(wl.uid().unwrap_or_default());
                due = Some(due.map_or(at, |d| d.min(at)));
            }
            Ok(Step::Pending) => {
                pending_uids.insert(wl.uid().unwrap_or_default());
            }
            Err(e) => {
                pending_uids.insert(wl.uid().unwrap_or_default());
                tracing::warn!(error = %e, workload = %key(&wl), "admission check step failed; retrying");
                let retry = tokio::time::Instant::now() + s.poll_interval;
                due = Some(due.map_or(retry, |d| d.min(retry)));
            }
        }
    }
    metrics.set_in_flight(in_flight);
    metrics.set_answers_cached(w.results.state().len());
    state
        .first_seen
        .retain(|(uid, _), _| pending_uids.contains(uid));
    state
        .bad_since
        .retain(|(uid, _), _| admitted_uids.contains(uid));
    state.held.retain(|uid| admitted_uids.contains(uid));
    if let Some(ledger) = &state.requeues {
        metrics.set_requeue_breaker_open(requeue::breaker_open(
            ledger,
            k8s_openapi::jiff::Timestamp::now(),
            &s.gang,
        ));
    }
    cleanup(client, w, s, state, &pending_uids).await;
    due
}

enum Step {
    /// Nothing of ours to do on this Workload.
    Idle,
    /// Our check is Pending and handled (a FabricCheck created, a state written).
    Pending,
    /// A FabricCheck in flight; judge again at this instant at the latest.
    Waiting(tokio::time::Instant),
    /// Admitted and watched; judge again at this instant at the latest.
    Watching(Option<tokio::time::Instant>),
}

/// What one pass works with.
struct Pass<'a> {
    client: &'a kube::Client,
    w: &'a Stores,
    s: &'a CheckSettings,
    metrics: &'a CheckMetrics,
    /// The names of our AdmissionChecks.
    ours: BTreeSet<String>,
    /// The pool's Nodes as the store holds them at the start of the pass.
    pool: Vec<Arc<Node>>,
    /// Kueue's pods by Workload, at the start of the pass.
    pods: PodIndex,
}

impl Pass<'_> {
    /// Move one Workload on: what `step::next` decides, carried out.
    async fn workload(&self, state: &mut State, wl: &DynamicObject) -> Result<Step> {
        let Some(pending) = step::pending_check(wl, &self.ours) else {
            if self.s.gang.after_admission == AfterAdmission::Requeue
                && let Some(admitted) = requeue::admitted_check(wl, &self.ours)
            {
                return self.admitted(state, wl, &admitted).await;
            }
            return Ok(Step::Idle);
        };
        let facts = Facts {
            wl,
            pending: &pending,
            stores: self.w,
            pool: &self.pool,
            settings: self.s,
            now: Timestamp::now(),
        };
        let mut plan = step::next(&facts, state, None);
        if matches!(plan.action, Action::AlreadyWritten) {
            return Ok(Step::Pending);
        }
        let first = *state
            .first_seen
            .entry((wl.uid().unwrap_or_default(), pending.reservation.clone()))
            .or_insert_with(Instant::now);
        let checks: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &self.s.gang.namespace,
            &fabriccheck::checks(),
        );
        if let Action::ListAnswers(fc) = &plan.action {
            let listed = listed_answers(&checks, fc).await?;
            plan = step::next(&facts, state, Some(listed));
        }
        if let Some(stale) = &plan.stale {
            delete_check(&checks, stale, state).await;
        }
        match plan.action {
            // Not after the answers were listed: handled as written, judged again next pass.
            Action::AlreadyWritten | Action::ListAnswers(_) => Ok(Step::Pending),
            Action::Wait(after) => Ok(Step::Waiting(tokio::time::Instant::now() + after)),
            Action::Create { name, spec } => {
                if let Some(uid) = create_check(&checks, &name, &pending.reservation, &spec).await?
                {
                    state.made.insert(uid.clone(), Instant::now());
                    self.w.created(uid);
                }
                tracing::info!(workload = %key(wl), members = spec.members.len(), check = %name,
                    "gang pre-flight started");
                Ok(Step::Waiting(
                    tokio::time::Instant::now() + self.s.gang.timeout + self.s.grace(),
                ))
            }
            Action::Write(d) => {
                write_state(self.client, wl, &pending.entries, &d).await?;
                self.record(state, &d, first, wl).await;
                Ok(Step::Pending)
            }
            Action::Conclude(d, fc) => {
                write_state(self.client, wl, &pending.entries, &d).await?;
                self.record(state, &d, first, wl).await;
                delete_check(&checks, &fc, state).await;
                Ok(Step::Pending)
            }
        }
    }

    /// After a state was written: metrics, the Event (Retry, Rejected), the Workload's version.
    async fn record(&self, state: &mut State, d: &Decision, first: Instant, wl: &DynamicObject) {
        let metrics = self.metrics;
        state.decided.insert(
            wl.uid().unwrap_or_default(),
            wl.resource_version().unwrap_or_default(),
        );
        metrics.decided(
            &d.state.to_ascii_lowercase(),
            Some(first.elapsed().as_secs_f64()),
        );
        metrics.pair_failures(d.failed_pairs);
        if d.state == "Ready" {
            return;
        }
        self.event(wl, &format!("FabricPreflight{}", d.state), &d.message)
            .await;
    }

    /// A Warning Event on the Workload.
    async fn event(&self, wl: &DynamicObject, reason: &str, note: &str) {
        let (client, s) = (self.client, self.s);
        let ns = wl.namespace().unwrap_or_default();
        let events: Api<Event> = Api::namespaced(client.clone(), &ns);
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}-", truncate(&wl.name_any(), 200))),
                namespace: Some(ns.clone()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(Timestamp::now())),
            action: Some("AdmissionCheck".to_owned()),
            reason: Some(reason.to_owned()),
            note: Some(truncate(note, 1024)),
            type_: Some("Warning".to_owned()),
            regarding: Some(ObjectReference {
                api_version: Some("kueue.x-k8s.io/v1beta2".to_owned()),
                kind: Some("Workload".to_owned()),
                name: Some(wl.name_any()),
                namespace: Some(ns),
                uid: wl.uid(),
                ..ObjectReference::default()
            }),
            reporting_controller: Some(CONTROLLER_NAME.to_owned()),
            reporting_instance: Some(truncate(&s.identity, 128)),
            ..Event::default()
        };
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        if let Err(e) = events.create(&pp, &event).await {
            tracing::warn!(workload = %key(wl), error = %e, "cannot record the Event");
        }
    }

    /// An admitted Workload (our check `Ready`): requeued once a member stayed bad for
    /// `gang.requeue_grace`, unless the breaker holds it (a rejection at `gang.max_attempts`
    /// evicts the gang as well, and counts the same).
    async fn admitted(
        &self,
        state: &mut State,
        wl: &DynamicObject,
        admitted: &AdmittedCheck,
    ) -> Result<Step> {
        let uid = wl.uid().unwrap_or_default();
        let rv = wl.resource_version().unwrap_or_default();
        if state.decided.get(&uid) == Some(&rv) {
            return Ok(Step::Watching(None));
        }
        let gang = &self.s.gang;
        let taint = self.s.config.node.taint_key();
        let nodes = &self.w.nodes;
        let node = |name: &str| nodes.get(&ObjectRef::new(name));
        let causes = requeue::causes(&Members {
            wl,
            admitted,
            node: &node,
            pool: &self.pool,
            pods: &self.pods,
            label_prefix: &self.s.config.node.label_prefix,
            taint_key: &taint,
        });
        let now = Instant::now();
        let d = match requeue::judge(&uid, &causes, admitted.retry_count, state, now, gang) {
            Verdict::Healthy => {
                state.held.remove(&uid);
                return Ok(Step::Watching(None));
            }
            Verdict::Waiting(after) => {
                return Ok(Step::Watching(Some(tokio::time::Instant::now() + after)));
            }
            Verdict::Requeue(d) => d,
        };
        let namespace = wl.namespace().unwrap_or_default();
        let Some(ledger) = state.requeues.as_mut() else {
            // The count of earlier leaders is not read yet: no requeue until it is.
            return Ok(Step::Watching(Some(
                tokio::time::Instant::now() + self.s.poll_interval,
            )));
        };
        if let Err((why, reopen)) = requeue::breaker(
            ledger,
            &namespace,
            k8s_openapi::jiff::Timestamp::now(),
            gang,
        ) {
            if state.held.insert(uid) {
                self.metrics.requeue_held();
                let note = format!("{why}; would requeue: {}", d.message);
                tracing::warn!(workload = %key(wl), message = %note, "requeue held by the breaker");
                self.event(wl, "FabricGangRequeueHeld", &note).await;
            }
            return Ok(Step::Watching(Some(tokio::time::Instant::now() + reopen)));
        }
        state.requeues_changed = true;
        write_state(self.client, wl, &admitted.entries, &d).await?;
        state.held.remove(&uid);
        state.decided.insert(uid, rv);
        let (result, reason) = if d.state == "Retry" {
            ("requeued", "FabricGangRequeued")
        } else {
            ("rejected", "FabricPreflightRejected")
        };
        self.metrics.decided(result, None);
        self.event(wl, reason, &d.message).await;
        Ok(Step::Watching(None))
    }
}

fn key(o: &DynamicObject) -> String {
    format!("{}/{}", o.namespace().unwrap_or_default(), o.name_any())
}

/// The names of the AdmissionChecks served by this controller; each one not yet `Active`
/// for its generation is made so.
async fn our_checks(client: &kube::Client, w: &Stores, s: &CheckSettings) -> BTreeSet<String> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &model::admission_checks());
    let mut ours = BTreeSet::new();
    for ac in w.admission_checks.state() {
        if ac.data["spec"]["controllerName"].as_str() != Some(CONTROLLER_NAME) {
            continue;
        }
        let name = ac.name_any();
        ours.insert(name.clone());
        let generation = ac.metadata.generation.unwrap_or(0);
        let active = ac.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| {
                c["type"] == "Active"
                    && c["status"] == "True"
                    && c["observedGeneration"].as_i64() == Some(generation)
            });
        if active {
            continue;
        }
        let body = json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "AdmissionCheck",
            "metadata": { "name": name },
            "status": { "conditions": [{
                "type": "Active", "status": "True", "reason": "Active",
                "message": format!("fabricgate admission-check ({}) serves {CONTROLLER_NAME}", s.identity),
                "observedGeneration": generation,
                "lastTransitionTime": Timestamp::now().round(k8s_openapi::jiff::Unit::Second)
                    .map_or_else(|_| Timestamp::now().to_string(), |t| t.to_string()),
            }]},
        });
        match api
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
        {
            Ok(_) => tracing::info!(check = %name, "AdmissionCheck set Active"),
            Err(e) => {
                tracing::warn!(check = %name, error = %e, "cannot set the AdmissionCheck Active")
            }
        }
    }
    ours
}

/// Server-side apply of our entries' state on the Workload's status, guarded by the
/// resourceVersion the decision was made on (a conflict is judged again on the next pass).
async fn write_state(
    client: &kube::Client,
    wl: &DynamicObject,
    entries: &[String],
    d: &Decision,
) -> Result<()> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &wl.namespace().unwrap_or_default(),
        &model::workloads(),
    );
    let now = Timestamp::now();
    let now = now
        .round(k8s_openapi::jiff::Unit::Second)
        .unwrap_or(now)
        .to_string();
    let message = truncate(&d.message, 32_000);
    let checks: Vec<Value> = entries
        .iter()
        .map(|name| {
            let mut entry = json!({ "name": name, "state": d.state, "message": message,
                                    "lastTransitionTime": now });
            // Kueue requeues no sooner than lastTransitionTime + this (KEP 3258); without
            // it, at once, and TAS would pick the same failing nodes again.
            if let (Some(after), Some(e)) = (d.requeue_after, entry.as_object_mut()) {
                e.insert("requeueAfterSeconds".to_owned(), json!(after));
            }
            entry
        })
        .collect();
    let body = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": { "name": wl.name_any(), "namespace": wl.namespace(),
                      "resourceVersion": wl.resource_version() },
        "status": { "admissionChecks": checks },
    });
    api.patch_status(
        &wl.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .map_err(|e| Error::KubeObject {
        action: "write the admission check state of",
        object: format!("Workload {}", key(wl)),
        source: Box::new(e),
    })?;
    tracing::info!(workload = %key(wl), state = d.state, message = %d.message, "admission check decided");
    Ok(())
}
