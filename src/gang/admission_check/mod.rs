//! `fabricgate admission-check`: a Kueue admission-check controller (`controllerName:
//! fabricgate.io/fabric-preflight`, docs/gangs.md). Kueue holds a Workload whose ClusterQueue
//! names our `AdmissionCheck` until this controller sets the check's state. Once quota is
//! reserved (with Topology Aware Scheduling, the nodes are then known), it
//!
//! 1. takes the Nodes of `status.admission.podSetAssignments[].topologyAssignment`;
//! 2. requires each to be validated now (the agent's label and `FabricReady=True`, no
//!    `unvalidated` taint: the agent's or the guard's), else `Retry` naming them;
//! 3. asks their agents for a ring of RDMA measurements through a `FabricCheck` object in
//!    `gang.namespace` (member i measures member i+1), waits for every member's result or
//!    the deadline, and sets `Ready` (every pair good) or `Retry` (a failed pair, or no answer
//!    in time; never `Ready` on a timeout), then deletes the FabricCheck.
//!
//! Two replicas elect a leader on a Lease (as `fabricgate guard` does); only the leader
//! watches and writes. The FabricCheck is the state of a check in flight, so a new leader
//! carries on where the old one stopped. Each check state is written with server-side
//! apply on the Workload's status subresource, under its own field manager, touching only
//! its own `admissionChecks[]` entry (the list is a map keyed on `name`), guarded by the
//! Workload's resourceVersion.

mod decide;
mod metrics;
pub mod model;
mod objects;
mod reconcile;
mod requeue;
mod ring;
mod state;
mod step;
#[cfg(test)]
mod tests;
mod watch;

pub use decide::node_problem;
pub use metrics::CheckMetrics;
pub use ring::{RingOutcome, assess_ring};

use crate::cluster::lease::{Election, Leadership, release};
use crate::config::Config;
use crate::error::Result;
use crate::gang::settings::GangSettings;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// `spec.controllerName` of the AdmissionCheck objects this controller serves.
pub const CONTROLLER_NAME: &str = "fabricgate.io/fabric-preflight";
/// Field manager of every write (the Workload's check state, the AdmissionCheck's Active).
pub const FIELD_MANAGER: &str = "fabricgate-admission-check";
/// Labels of every FabricCheck the controller creates.
pub const CHECK_LABEL: (&str, &str) = ("fabricgate.io/check", "gang");
/// Annotation of a FabricCheck: the quota reservation it tests (the `QuotaReserved`
/// condition's transition time), so a check left from an earlier reservation is not reused.
pub const RESERVATION_ANNOTATION: &str = "fabricgate.io/reservation";

/// Everything `fabricgate admission-check` needs.
pub struct CheckSettings {
    pub config: Config,
    /// The gang pre-flight's section of `config` (`gang:`).
    pub gang: GangSettings,
    /// Namespace of the Lease (the controller's own).
    pub namespace: String,
    pub lease_name: String,
    pub lease_duration: Duration,
    pub identity: String,
    /// Lease renewal and full re-judge interval.
    pub poll_interval: Duration,
    /// Only this namespace's Workloads (and the FabricChecks made for them); `None`: all.
    pub workload_namespace: Option<String>,
}

impl CheckSettings {
    fn election(&self) -> Election<'_> {
        Election {
            lease_name: &self.lease_name,
            identity: &self.identity,
            lease_duration: self.lease_duration,
        }
    }

    /// After the deadline, this long for the members' last writes to arrive.
    fn grace(&self) -> Duration {
        (self.gang.timeout / 4).min(Duration::from_secs(2))
    }
}

/// Least time between two passes triggered by watch events.
const MIN_PASS_GAP: Duration = Duration::from_millis(20);
/// The server ends each watch after this long; the watcher resumes from the last version.
const WATCH_TIMEOUT_SECS: u32 = 290;

/// Run the controller until `shutdown` completes. `requests` serves the Lease and the writes,
/// `watch` the leader's watches (a client with a read timeout above [`WATCH_TIMEOUT_SECS`]).
///
/// # Errors
/// None today once started: API trouble is logged and retried.
pub async fn run(
    requests: kube::Client,
    watch: kube::Client,
    s: CheckSettings,
    metrics: Arc<CheckMetrics>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<()> {
    let leases: Api<Lease> = Api::namespaced(requests.clone(), &s.namespace);
    let mut leadership = Leadership::default();
    let mut leading = false;
    let mut watched: Option<watch::Watched> = None;
    let mut state = state::State::default();
    let mut tick = tokio::time::interval(s.poll_interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut changed = false;
    let mut last_pass = tokio::time::Instant::now();
    let mut due: Option<tokio::time::Instant> = None;
    tokio::pin!(shutdown);
    let requeues_key = requeue::requeues_annotation(&s.config.node.label_prefix);
    tracing::info!(identity = %s.identity, lease = %s.lease_name, "fabricgate admission-check started");
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            _ = tick.tick() => {
                // The requeue breaker's count rides on each renewal once read (before: the
                // annotation is left as the last leader wrote it).
                let count = state.requeues.as_ref().map(requeue::RequeueLedger::annotation);
                let publish: Vec<(&str, Option<&str>)> = count
                    .as_deref()
                    .map(|text| vec![(requeues_key.as_str(), Some(text))])
                    .unwrap_or_default();
                let renewal = leadership.renew_publishing(&leases, &s.election(), &publish).await;
                leading = renewal.leading;
                if leading && count.is_some() {
                    state.requeues_changed = false;
                }
                if renewal.changed {
                    metrics.set_leader(leading);
                    state = state::State::default();
                }
                if leading && state.requeues.is_none() {
                    state.requeues = load_requeues(&leases, &s, &requeues_key).await;
                }
                let keep = renewal.keep_watches;
                if keep && watched.is_none() {
                    watched = Some(watch::Watched::start(&watch, &s));
                } else if !keep && watched.take().is_some() {
                    tracing::info!("not leading: watches stopped, cache dropped");
                }
                changed = true;
            }
            () = tokio::time::sleep_until(due.unwrap_or(last_pass)), if due.is_some() => {
                due = None;
                changed = true;
            }
            () = tokio::time::sleep_until(last_pass + MIN_PASS_GAP), if changed && leading => {
                changed = false;
                last_pass = tokio::time::Instant::now();
                if let Some(w) = &watched && w.ready() {
                    due = reconcile::pass(&requests, &w.stores, &s, &metrics, &mut state).await;
                }
                if state.requeues_changed {
                    // Published at once: a new leader must find this requeue counted.
                    tick.reset_immediately();
                }
            }
            () = watch::next_change(&mut watched) => changed = true,
        }
    }
    drop(watched);
    if leading {
        let _ = release(&leases, &s.election()).await;
    }
    tracing::info!("fabricgate admission-check stopped");
    Ok(())
}

/// The requeue breaker's count as earlier leaders published it on the Lease (none, or an
/// unreadable one: counting from none, logged); `None` when the Lease cannot be read now
/// (asked again on the next renewal; no requeue meanwhile).
async fn load_requeues(
    leases: &Api<Lease>,
    s: &CheckSettings,
    key: &str,
) -> Option<requeue::RequeueLedger> {
    let lease = match leases.get_opt(&s.lease_name).await {
        Ok(lease) => lease,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the Lease for the requeue breaker's count; \
                                       requeueing nothing until it can");
            return None;
        }
    };
    let text = lease
        .as_ref()
        .and_then(|l| l.metadata.annotations.as_ref())
        .and_then(|a| a.get(key));
    Some(match text.map(|t| requeue::RequeueLedger::parse(t)) {
        None => requeue::RequeueLedger::default(),
        Some(Ok(ledger)) => {
            tracing::info!(
                requeues = ledger.requeues.len(),
                "the requeue breaker's count read from the Lease"
            );
            ledger
        }
        Some(Err(e)) => {
            tracing::warn!(error = %e, annotation = %key, "the Lease holds no readable requeue \
                                                          count; counting from none");
            requeue::RequeueLedger::default()
        }
    })
}
