//! The leader's evictions of pods on sockets (`runtime.on_sockets: evict`). The
//! agents write each judged pod's `fabricgate.io/TransportReady` condition and never evict (an
//! Eviction names only a pod, so no admission policy could keep an agent to its own node's
//! pods); the guard's leader evicts a pod whose condition has said `SocketsFallback` for
//! `runtime.evict_after`, through the Eviction API only (PodDisruptionBudgets apply; never a
//! delete), so that the job's own restart policy takes over. Who is due and the breaker's cap
//! are [`eviction::plan`]'s (pure); the cap's ledger rides on the Lease, so a new leader keeps
//! the count.

use super::GuardSettings;
use super::cache::Cache;
use super::metrics::{EvictionResult, GuardMetrics};
use super::proof::{Regarding, record_event};
use crate::transport::eviction::{self, Candidate, Inputs, Ledger, LedgerEntry};
use crate::transport::settings::OnSockets;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// First wait before trying a refused or failed eviction again; it doubles up to
/// [`RETRY_MAX`] (a PodDisruptionBudget opens when its other pods are healthy again).
const RETRY_FIRST: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// Why a due pod was not evicted, for its one Event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    Pdb,
    Breaker,
}

struct Retry {
    not_before: Instant,
    wait: Duration,
}

/// The leader's eviction state (dropped with its leadership).
#[derive(Default)]
pub(super) struct Evictor {
    ledger: Ledger,
    /// The ledger was read from the Lease in this leadership: until then nothing is evicted
    /// (the cap's count is not known) and the Lease's ledger is left as it is.
    loaded: bool,
    /// When this leader first saw each pod (UID) on sockets.
    first_seen: HashMap<String, Timestamp>,
    retry: HashMap<String, Retry>,
    /// The pods told (one Event) why they were not evicted, and what was told.
    told: HashMap<String, Cause>,
    /// The pods counted as held by the breaker.
    held: HashSet<String>,
}

/// What an eviction request found.
enum Answer {
    Evicted,
    /// A PodDisruptionBudget refused: the server's words.
    Pdb(String),
    /// The pod is gone, or another pod has its name now: nothing to do.
    Gone,
    Failed(String),
}

impl Evictor {
    /// The ledger's annotation to publish on the Lease; `None` until it was read from there.
    pub(super) fn annotation(&self) -> Option<String> {
        self.loaded.then(|| self.ledger.annotation())
    }

    pub(super) fn loaded(&self) -> bool {
        self.loaded
    }

    /// Read the ledger of the previous leaders from the Lease (a missing or unreadable one
    /// starts empty: logged). On a failed read it stays unloaded and is read again later.
    pub(super) async fn load(&mut self, leases: &Api<Lease>, s: &GuardSettings) {
        let lease = match leases.get_opt(&s.lease_name).await {
            Ok(lease) => lease,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the guard's Lease for its evictions; \
                                           evicting nothing until it can");
                return;
            }
        };
        let key = eviction::ledger_annotation(&s.config.node.label_prefix);
        let text = lease
            .as_ref()
            .and_then(|l| l.metadata.annotations.as_ref())
            .and_then(|a| a.get(&key));
        self.ledger = match text.map(|t| Ledger::parse(t)) {
            None => Ledger::default(),
            Some(Ok(l)) => l,
            Some(Err(e)) => {
                tracing::warn!(error = %e, annotation = %key, "the guard's Lease holds no \
                               readable eviction ledger; counting from none");
                Ledger::default()
            }
        };
        self.loaded = true;
    }

    /// Decide on the cache's pods and evict those due. Returns when to look again (`None`:
    /// only on changes) and whether anything was evicted (the ledger then wants publishing).
    pub(super) async fn step(
        &mut self,
        client: &kube::Client,
        cache: &Cache,
        s: &GuardSettings,
        m: &GuardMetrics,
    ) -> (Option<tokio::time::Instant>, bool) {
        if s.transport.on_sockets != OnSockets::Evict || !self.loaded || !cache.ready() {
            return (None, false);
        }
        let Some(pods) = cache.transport_pods() else {
            return (None, false);
        };
        let now = Timestamp::now();
        self.forget_gone(&pods, now);
        let instant = Instant::now();
        let plan = {
            let in_pool = |n: &str| cache.has_node(n);
            let waiting = |uid: &str| self.retry.get(uid).is_some_and(|r| r.not_before > instant);
            eviction::plan(
                pods.iter().map(AsRef::as_ref),
                &Inputs {
                    runtime: &s.transport,
                    breaker: &s.config.node.breaker,
                    ledger: &self.ledger,
                    in_pool: &in_pool,
                    first_seen: &self.first_seen,
                    waiting: &waiting,
                    now,
                },
            )
        };
        if let Some(why) = &plan.held_because {
            for c in &plan.held {
                self.hold(client, c, why, s, m).await;
            }
        }
        let mut evicted = false;
        for c in &plan.evict {
            evicted |= self.evict(client, c, s, m).await;
        }
        let mut next = plan.next.and_then(|t| {
            let ahead = now.duration_until(t).unsigned_abs();
            tokio::time::Instant::now().checked_add(ahead)
        });
        let retry = self.retry.values().map(|r| r.not_before).min();
        if let Some(r) = retry.filter(|r| *r > Instant::now()) {
            let r = tokio::time::Instant::from_std(r);
            next = Some(next.map_or(r, |n| n.min(r)));
        }
        (next, evicted)
    }

    /// Keep what is known of pods still on sockets only.
    fn forget_gone(&mut self, pods: &[std::sync::Arc<Pod>], now: Timestamp) {
        let on_sockets: HashSet<String> = pods
            .iter()
            .filter(|p| eviction::sockets_condition(p).is_some())
            .filter_map(|p| p.metadata.uid.clone())
            .collect();
        for uid in &on_sockets {
            self.first_seen.entry(uid.clone()).or_insert(now);
        }
        self.first_seen.retain(|u, _| on_sockets.contains(u));
        self.retry.retain(|u, _| on_sockets.contains(u));
        self.told.retain(|u, _| on_sockets.contains(u));
        self.held.retain(|u| on_sockets.contains(u));
    }

    /// A due pod the breaker holds back: counted and told once.
    async fn hold(
        &mut self,
        client: &kube::Client,
        c: &Candidate,
        why: &str,
        s: &GuardSettings,
        m: &GuardMetrics,
    ) {
        if !self.held.insert(c.uid.clone()) {
            return;
        }
        m.evicted(EvictionResult::BreakerHeld);
        let note = format!("not evicted yet: {why}");
        tracing::error!(pod = %format!("{}/{}", c.namespace, c.name), "BLAST-RADIUS BREAKER \
                        OPEN (guard): not evicting a pod on sockets: {why}");
        self.tell(client, c, Cause::Breaker, &note, s).await;
    }

    /// Evict `c` through the Eviction API; whether it was evicted.
    async fn evict(
        &mut self,
        client: &kube::Client,
        c: &Candidate,
        s: &GuardSettings,
        m: &GuardMetrics,
    ) -> bool {
        let pod = format!("{}/{}", c.namespace, c.name);
        match request_eviction(client, c).await {
            Answer::Evicted => {
                let at = Timestamp::now();
                self.ledger.record(
                    LedgerEntry {
                        at,
                        pod: pod.clone(),
                        uid: c.uid.clone(),
                    },
                    s.config.node.breaker.window,
                );
                m.evicted(EvictionResult::Evicted);
                let on_sockets = at.duration_since(c.since).unsigned_abs();
                let note = format!(
                    "evicted by fabricgate guard through the Eviction API: on TCP sockets instead \
                     of RDMA for {} (fabricgate.io/TransportReady=False, reason SocketsFallback, \
                     since {}: {}); runtime.on_sockets: evict, runtime.evict_after {}; the job's \
                     own restart policy takes over",
                    humantime::format_duration(Duration::from_secs(on_sockets.as_secs())),
                    c.since,
                    c.message,
                    humantime::format_duration(s.transport.evict_after),
                );
                tracing::warn!(pod = %pod, "{note}");
                self.event(client, c, "Warning", eviction::EVICTED, &note, s)
                    .await;
                true
            }
            Answer::Pdb(refusal) => {
                m.evicted(EvictionResult::PdbBlocked);
                self.back_off(&c.uid);
                let note = format!(
                    "on TCP sockets instead of RDMA ({}), due for eviction, but its \
                     PodDisruptionBudget refuses: {refusal}; fabricgate guard tries again",
                    c.message
                );
                tracing::warn!(pod = %pod, "{note}");
                self.tell(client, c, Cause::Pdb, &note, s).await;
                false
            }
            Answer::Gone => false,
            Answer::Failed(error) => {
                m.evicted(EvictionResult::Failed);
                self.back_off(&c.uid);
                tracing::warn!(pod = %pod, error = %error, "cannot evict a pod on sockets; \
                               trying again");
                false
            }
        }
    }

    fn back_off(&mut self, uid: &str) {
        let wait = self
            .retry
            .get(uid)
            .map_or(RETRY_FIRST, |r| r.wait.saturating_mul(2).min(RETRY_MAX));
        self.retry.insert(
            uid.to_owned(),
            Retry {
                not_before: Instant::now() + wait,
                wait,
            },
        );
    }

    /// The one `TransportFallbackNotEvicted` Event of `c` for `cause`.
    async fn tell(
        &mut self,
        client: &kube::Client,
        c: &Candidate,
        cause: Cause,
        note: &str,
        s: &GuardSettings,
    ) {
        if self.told.insert(c.uid.clone(), cause) == Some(cause) {
            return;
        }
        self.event(client, c, "Warning", eviction::NOT_EVICTED, note, s)
            .await;
    }

    async fn event(
        &self,
        client: &kube::Client,
        c: &Candidate,
        type_: &str,
        reason: &str,
        note: &str,
        s: &GuardSettings,
    ) {
        let events: Api<Event> = Api::namespaced(client.clone(), &c.namespace);
        let about = Regarding {
            object: ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(c.name.clone()),
                namespace: Some(c.namespace.clone()),
                uid: Some(c.uid.clone()),
                ..ObjectReference::default()
            },
            action: "Evict",
        };
        record_event(&events, s, &about, type_, reason, note).await;
    }
}

/// POST the pod's `eviction` subresource, only for this pod (its UID as a precondition: a
/// StatefulSet's new pod of the same name is not it).
async fn request_eviction(client: &kube::Client, c: &Candidate) -> Answer {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &c.namespace);
    // Built here, not with kube's `Api::evict`: its body names the field `delete_options`,
    // which the server ignores, so the UID precondition would be lost.
    let body = Eviction {
        metadata: ObjectMeta {
            name: Some(c.name.clone()),
            namespace: Some(c.namespace.clone()),
            ..ObjectMeta::default()
        },
        delete_options: Some(DeleteOptions {
            preconditions: Some(Preconditions {
                uid: Some(c.uid.clone()),
                resource_version: None,
            }),
            ..DeleteOptions::default()
        }),
    };
    let result = pods
        .create_subresource::<_, serde_json::Value>(
            "eviction",
            &c.name,
            &PostParams::default(),
            &body,
        )
        .await;
    answer(result)
}

fn answer<T>(result: Result<T, kube::Error>) -> Answer {
    match result {
        Ok(_) => Answer::Evicted,
        Err(kube::Error::Api(status)) => {
            let budget = status
                .details
                .as_ref()
                .into_iter()
                .flat_map(|d| &d.causes)
                .find(|c| c.reason == "DisruptionBudget")
                .map(|c| c.message.clone());
            match status.code {
                429 => Answer::Pdb(budget.unwrap_or_else(|| status.message.clone())),
                403 if budget.is_some() => Answer::Pdb(budget.unwrap_or_default()),
                404 | 409 => Answer::Gone,
                _ => Answer::Failed(format!("{} ({})", status.message, status.code)),
            }
        }
        Err(e) => Answer::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, message: &str, cause: Option<&str>) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: message.to_owned(),
            details: cause.map(|m| kube::core::response::StatusDetails {
                causes: vec![kube::core::response::StatusCause {
                    reason: "DisruptionBudget".to_owned(),
                    message: m.to_owned(),
                    field: String::new(),
                }],
                name: String::new(),
                group: String::new(),
                kind: String::new(),
                uid: String::new(),
                retry_after_seconds: 0,
            }),
            ..kube::core::Status::default()
        }))
    }

    #[test]
    fn a_budget_refusal_is_told_apart_from_failures_and_a_gone_pod() {
        let budget = "The disruption budget train needs 2 healthy pods and has 2 currently";
        let refused = status(
            429,
            "Cannot evict pod as it would violate the pod's disruption budget.",
            Some(budget),
        );
        assert!(matches!(answer::<()>(Err(refused)), Answer::Pdb(m) if m == budget));
        let negative = status(
            403,
            "forbidden",
            Some("pdb disruptions allowed is negative"),
        );
        assert!(matches!(answer::<()>(Err(negative)), Answer::Pdb(_)));
        let rbac = status(403, "cannot create resource \"pods/eviction\"", None);
        assert!(matches!(answer::<()>(Err(rbac)), Answer::Failed(m) if m.contains("(403)")));
        for code in [404, 409] {
            assert!(matches!(
                answer::<()>(Err(status(code, "x", None))),
                Answer::Gone
            ));
        }
        assert!(matches!(
            answer::<()>(Err(status(500, "x", None))),
            Answer::Failed(_)
        ));
        assert!(matches!(answer(Ok(())), Answer::Evicted));
    }

    #[test]
    fn retries_back_off_up_to_their_ceiling() {
        let mut e = Evictor::default();
        let waits: Vec<Duration> = (0..6)
            .map(|_| {
                e.back_off("u");
                e.retry["u"].wait
            })
            .collect();
        assert_eq!(
            waits.iter().map(Duration::as_secs).collect::<Vec<_>>(),
            [5, 10, 20, 30, 30, 30]
        );
    }
}
