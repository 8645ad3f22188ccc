//! The agent's half of the gang pre-flight (docs/gangs.md): watch the `FabricCheck`s of
//! `gang.namespace`, and for each that names this node as a member and whose deadline has not
//! passed, measure the next member of the ring once and fill this node's own answer, the
//! `FabricCheckResult` named `<check uid>.<node>` that the controller created empty with the
//! check (`crate::gang::fabriccheck`). The agent never creates one.
//!
//! It runs beside the probe loop and the Node writer and shares nothing with them but the
//! usable ports and the peers key: measurements run on blocking threads, at most
//! [`CONCURRENCY`] at once, so a dead peer never delays a probe or a Node write. Its own
//! trouble (no key, a refused write, an unreadable check) is logged, or written as `ok: false`
//! with an error that starts with `local:`; it never touches the Node's verdict.

mod clock;
mod pair;
mod receive;
#[cfg(test)]
mod tests;

pub use crate::gang::fabriccheck::{ENDPOINT_ANNOTATION, FabricCheck, Member, PairResult, Rdma};
pub use clock::ServerClock;
pub use pair::{PairJob, measure_pair};

use crate::gang::fabriccheck;
use crate::node::WatchBackoff;
use fabricgate_probes::rdma::peer::{ExpectedPeers, Identity, KeyRing, LocalPort, Plan, Receipts};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event, watcher};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Semaphore, watch};

/// Pairs measured at once (a gang's node is in at most a few checks at a time; the peer's
/// responder serves 4 sessions).
pub const CONCURRENCY: usize = 4;
/// Longest wait between failed lists of the checks (no CRD, no RBAC): a pre-flight installed
/// later is answered within this.
pub const MAX_BACKOFF: Duration = Duration::from_secs(300);
/// Attempts of the answer's fill (spread until the deadline).
const WRITE_ATTEMPTS: u32 = 5;

/// What the ring task needs from the rest of the agent.
pub struct Ring {
    pub node: String,
    /// `gang.namespace`: where the controller creates the checks.
    pub namespace: String,
    pub identity: Identity,
    /// The ports the peer responder serves, kept fresh by the probe loop.
    pub ports: Arc<Mutex<Vec<LocalPort>>>,
    /// Whether RDMA can be measured at all here (`--verbs required`); off: only the side
    /// channel is tested (`rdma: unmeasured`).
    pub rdma: bool,
    pub keys: Arc<KeyRing>,
    /// The RTT plan of `peers:`; its bandwidth burst (`peers.bandwidth` sizes) is used when a
    /// check asks for a minimum.
    pub plan: Plan,
    pub bandwidth: (u32, Duration),
    /// `peers.timeout`: bound on one session.
    pub session: Duration,
    /// This node's own address (its responder's), measured from: the next member's responder
    /// knows it as the predecessor it keeps places for. `None`: the route's source.
    pub source: Option<IpAddr>,
    /// Our responder's expected peers: each check's predecessor is added until the check's
    /// deadline, so strangers' idle connections cannot keep it out.
    pub expected: Option<ExpectedPeers>,
    /// What our responder saw of each check's sessions: this node attests its receiving end
    /// of the pair its predecessor measures.
    pub receipts: Receipts,
    /// For lists and the answers' fills.
    pub requests: kube::Client,
    /// For the watch (a longer read timeout); `None`: `requests`.
    pub watch: Option<kube::Client>,
    pub max_backoff: Duration,
    /// Test-only: this agent's clock reads this much ahead (`FABRICGATE_FAILPOINT=
    /// clock-ahead`); zero in a deployment.
    pub clock_ahead: Duration,
}

/// Checks already taken up (by uid), with their deadline, so that each is measured once.
#[derive(Default)]
struct Taken(HashMap<String, Timestamp>);

impl Taken {
    /// `true` the first time for `uid`; forgets checks whose deadline is a minute past.
    fn take(&mut self, uid: &str, deadline: Timestamp, now: Timestamp) -> bool {
        self.0
            .retain(|_, d| d.as_second().saturating_add(60) > now.as_second());
        if self.0.contains_key(uid) {
            return false;
        }
        self.0.insert(uid.to_owned(), deadline);
        true
    }
}

/// What to do with one version of a check.
#[derive(Debug, PartialEq)]
pub(crate) enum Decision {
    /// Measure this member.
    Measure(Member),
    /// Not for us (not a member, past its deadline, unreadable).
    Skip(&'static str),
}

/// Pure: whether `check` asks this node for a measurement now.
pub(crate) fn decide(check: &FabricCheck, node: &str, now: Timestamp) -> Decision {
    let Some(next) = check.spec.next_after(node) else {
        return Decision::Skip("not a member");
    };
    match check.spec.deadline() {
        None => Decision::Skip("no readable deadline"),
        Some(d) if d <= now => Decision::Skip("past its deadline"),
        Some(_) => Decision::Measure(next.clone()),
    }
}

/// Watch the checks until `stop` turns true.
pub async fn run(ring: Ring, mut stop: watch::Receiver<bool>) {
    let ring = Arc::new(ring);
    let ar = fabriccheck::checks();
    let checks: Api<DynamicObject> = Api::namespaced_with(
        ring.watch.clone().unwrap_or_else(|| ring.requests.clone()),
        &ring.namespace,
        &ar,
    );
    // Only the checks naming this Node: a check is sent to its members, not to the pool.
    let member_label = fabriccheck::member_label(&ring.node);
    let config = watcher::Config::default()
        .labels(&member_label)
        .timeout(crate::node::WATCH_TIMEOUT_SECS)
        .any_semantic();
    let mut events = watcher(checks, config)
        .backoff(WatchBackoff::new(ring.max_backoff))
        .boxed();
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    let mut taken = Taken::default();
    let mut warned = false;
    let mut clock = ServerClock::new(ring.clock_ahead);
    tracing::info!(
        node = %ring.node,
        namespace = %ring.namespace,
        rdma = ring.rdma,
        "watching FabricChecks for the gang pre-flight"
    );
    loop {
        let event = tokio::select! {
            r = stop.wait_for(|s| *s) => { let _ = r; return; }
            e = events.next() => e,
        };
        let obj = match event {
            Some(Ok(Event::Apply(o) | Event::InitApply(o))) => o,
            Some(Ok(_)) => continue,
            Some(Err(e)) => {
                // No CRD (the admission check is not installed), no RBAC: nothing to answer.
                if !warned {
                    tracing::warn!(
                        namespace = %ring.namespace,
                        error = %e,
                        "cannot watch FabricChecks; gang pre-flights are not answered until \
                         this works (is deploy/admission-check.yaml applied?)"
                    );
                    warned = true;
                }
                continue;
            }
            None => return,
        };
        warned = false;
        let Some(check) = FabricCheck::from_dynamic(&obj) else {
            tracing::debug!(name = ?obj.metadata.name, "a FabricCheck the agent cannot read");
            continue;
        };
        // The deadline is the controller's, read against the API server's clock: this
        // node's may be off by more than gang.timeout.
        let now = clock
            .now(&ring.requests, &ring.namespace, &member_label)
            .await;
        let peer = match decide(&check, &ring.node, now) {
            Decision::Measure(m) => m,
            Decision::Skip(_) => continue,
        };
        let Some(deadline) = check.spec.deadline() else {
            continue;
        };
        if !taken.take(&check.uid, deadline, now) {
            continue;
        }
        if let Some(expected) = &ring.expected {
            expect_predecessor(expected, &check, &ring.node, deadline, now);
        }
        let left = Duration::try_from(deadline.duration_since(now)).unwrap_or_default();
        let until = std::time::Instant::now() + left;
        let ring = Arc::clone(&ring);
        let slots = Arc::clone(&slots);
        tokio::spawn(async move {
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            answer(&ring, &check, peer, until).await;
        });
    }
}

/// Keep places in our responder for the member that measures us in `check` until its deadline
/// (a little after: its last try may start just before). An endpoint that is not `ip:port`
/// gets none: the controller puts the Node's own address there.
fn expect_predecessor(
    expected: &ExpectedPeers,
    check: &FabricCheck,
    node: &str,
    deadline: Timestamp,
    now: Timestamp,
) {
    let Some(prev) = check.spec.previous_before(node) else {
        return;
    };
    let Ok(addr) = prev.endpoint.parse::<SocketAddr>() else {
        return;
    };
    let left = Duration::try_from(deadline.duration_since(now)).unwrap_or_default();
    expected.expect(
        addr.ip(),
        std::time::Instant::now() + left + Duration::from_secs(5),
    );
}

/// Measure `peer` for `check` and write the result, both before `until` (the check's
/// deadline on this node's monotonic clock).
async fn answer(ring: &Ring, check: &FabricCheck, peer: Member, until: std::time::Instant) {
    if std::time::Instant::now() >= until {
        return;
    }
    let ports = if ring.rdma {
        ring.ports.lock().unwrap_or_else(|p| p.into_inner()).clone()
    } else {
        Vec::new()
    };
    let keys = ring.keys.keys();
    let mut plan = ring.plan;
    if check.spec.min_bandwidth_gbps.is_some() {
        (plan.bw_size, plan.bw_duration) = ring.bandwidth;
    } else {
        plan.bw_size = 0;
    }
    // Our receiving end is awaited until a little before the deadline, so that the answer is
    // written in time even when the predecessor never comes.
    let left = until.saturating_duration_since(std::time::Instant::now());
    let attest_until = until - (left / 4).min(Duration::from_secs(2));
    let me = ring.identity.clone();
    let min = check.spec.min_bandwidth_gbps;
    let max_rtt = check.spec.max_rtt_micros;
    let check_uid = check.uid.clone();
    let session = ring.session;
    let source = ring.source;
    let measured = tokio::task::spawn_blocking(move || {
        measure_pair(&PairJob {
            me: &me,
            peer: &peer,
            ports: &ports,
            keys: &keys,
            plan,
            min_bandwidth_gbps: min,
            max_rtt_micros: max_rtt,
            until,
            session,
            source,
            check_uid: &check_uid,
        })
    })
    .await;
    let mut result = match measured {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(check = %check.name, error = %e, "the gang measurement thread failed");
            return;
        }
    };
    if let Some(prev) = check.spec.previous_before(&ring.node) {
        result.received =
            Some(receive::wait(&ring.receipts, &check.uid, &prev.node, attest_until).await);
    }
    tracing::info!(
        check = %check.name,
        peer = %result.peer,
        ok = result.ok,
        rdma = ?result.rdma,
        rtt_us = ?result.rtt_micros,
        bandwidth_gbps = ?result.bandwidth_gbps,
        error = result.error.as_deref().unwrap_or(""),
        received_ok = result.received.as_ref().map(|r| r.ok),
        "gang pre-flight pair measured"
    );
    write_result(ring, check, &result, until).await;
}

/// Fill our answer (a merge patch of the empty one the controller created), retried (spaced)
/// until `until`. Not there (404): the controller has not created it yet (or the check is
/// gone), so it is tried again, never created. Refused as invalid (422): it was filled
/// already (by an earlier attempt of ours, or before this agent restarted) and stays as it
/// is; nothing to retry.
async fn write_result(
    ring: &Ring,
    check: &FabricCheck,
    result: &PairResult,
    until: std::time::Instant,
) {
    let api: Api<DynamicObject> = Api::namespaced_with(
        ring.requests.clone(),
        &ring.namespace,
        &fabriccheck::results(),
    );
    let name = fabriccheck::result_name(&check.uid, &result.node);
    let fill = fabriccheck::result_fill(check, result);
    let pp = PatchParams {
        field_manager: Some(format!("fabricgate-gang/{}", ring.node)),
        ..PatchParams::default()
    };
    let mut pause = Duration::from_millis(200);
    for attempt in 1..=WRITE_ATTEMPTS {
        match api.patch(&name, &pp, &Patch::Merge(&fill)).await {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code == 422 => {
                tracing::warn!(
                    check = %check.name,
                    answer = %name,
                    error = %e,
                    "this node's FabricCheckResult was refused as invalid (answered already?); \
                     left as it is"
                );
                return;
            }
            Err(e) => {
                tracing::warn!(
                    check = %check.name,
                    answer = %name,
                    attempt,
                    error = %e,
                    "cannot fill this node's FabricCheckResult (404: the controller has not \
                     created it yet)"
                );
                if std::time::Instant::now() + pause >= until {
                    return;
                }
                tokio::time::sleep(pause).await;
                pause *= 2;
            }
        }
    }
}
