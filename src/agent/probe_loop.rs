//! The probe loop: asks the probe thread for reports on the interval or on kernel events,
//! hands each to the [`Judge`] and publishes what it returns for the Node writer. It
//! schedules; it does not decide.

use super::daemon::{Failpoint, later, wait_stop};
use super::reconcile_loop::Jitter;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::observe::metrics::Metrics;
use crate::peers::PeerAgent;
use crate::policy::agent_fault::AgentFault;
use crate::policy::device_plugin;
use crate::policy::dra::DraFacts;
use crate::policy::judge::{Facts, Judge};
use crate::policy::{Finding, Verdict};
use fabricgate_probes::{ProbeReport, Prober};
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout};

/// What the probe loop talks through: verdicts out; the watched Node's findings and the stop
/// signal in.
pub(super) struct Channels<'a> {
    pub(super) desired: &'a watch::Sender<Option<Verdict>>,
    pub(super) node_findings: watch::Receiver<Vec<Finding>>,
    /// This node's DRA slices (`kubernetes.dra`), from `node::dra::watch_slices`.
    pub(super) dra: watch::Receiver<Option<DraFacts>>,
    /// Bumped when a DRA plugin's registration socket stops or starts answering
    /// (`agent::registration`): probe at once.
    pub(super) registrations: watch::Receiver<u64>,
    pub(super) stop: watch::Receiver<bool>,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct ProbeTiming {
    pub(super) interval: Duration,
    /// A probe still running after this is an agent error (`--probe-deadline`).
    pub(super) deadline: Duration,
}

/// Hand a verdict to the Node writer when it differs from the last one.
pub(super) fn publish(desired: &watch::Sender<Option<Verdict>>, verdict: Verdict) {
    desired.send_if_modified(|d| {
        if d.as_ref() == Some(&verdict) {
            false
        } else {
            *d = Some(verdict);
            true
        }
    });
}

/// Log entering, changing and leaving an agent error, once each.
pub(super) fn log_agent_error(last: &mut Option<AgentFault>, now: Option<&AgentFault>) {
    match (last.as_ref(), now) {
        (None, None) => {}
        (Some(_), None) => tracing::info!("agent error cleared; judging the node again"),
        (Some(a), Some(b)) if a == b => {}
        (_, Some(f)) => tracing::error!(
            cause = f.cause.name(),
            message = %f.message,
            "agent error: the agent cannot judge this node (condition reason AgentError)"
        ),
    }
    *last = now.cloned();
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn probe_loop(
    probes: ProbeThread,
    config: &Config,
    mut judge: Judge,
    timing: ProbeTiming,
    metrics: &Metrics,
    channels: Channels<'_>,
    peers: Option<&PeerAgent>,
    mut wakeup: crate::agent::wakeup::Wakeup,
) -> Result<()> {
    let Channels {
        desired,
        mut node_findings,
        mut dra,
        mut registrations,
        mut stop,
    } = channels;
    let mut dra_open = true;
    let mut registrations_open = true;
    let interval = timing.interval;
    let mut jitter = Jitter::new();
    let mut next = Instant::now();
    let mut last_ready: Option<bool> = None;
    let mut last_fault: Option<AgentFault> = None;
    let mut last_verdict: Option<Verdict> = None;
    let mut last_probed: Option<ProbeReport> = None;
    let mut findings_open = true;
    loop {
        // A device plugin that went away (seen on the watched Node) fails the node at once,
        // judged with the last probe's report; coming back waits for the next probes (the
        // hysteresis counts real probes only).
        let fresh = tokio::select! {
            biased;
            () = wait_stop(&mut stop) => return Ok(()),
            r = node_findings.changed(), if findings_open => {
                if r.is_err() {
                    findings_open = false;
                    continue;
                }
                if node_findings.borrow().is_empty() || last_probed.is_none() {
                    continue;
                }
                false
            }
            // A change of the node's DRA slices: judged at once with the last report.
            r = dra.changed(), if dra_open => {
                if r.is_err() {
                    dra_open = false;
                    continue;
                }
                if last_probed.is_none() {
                    continue;
                }
                false
            }
            // A DRA plugin stopped or started answering: a full probe now, which checks it.
            r = registrations.changed(), if registrations_open => {
                if r.is_err() {
                    registrations_open = false;
                    continue;
                }
                true
            }
            // The interval, or kernel events (debounced) if they come first (docs/events.md).
            trigger = wakeup.wait(next) => {
                metrics.events.probe_triggered(&trigger);
                // On kernel events, first re-read only the ports' states: a port down now
                // fails the node before the full probe has finished.
                if let (crate::agent::wakeup::Trigger::Event { .. }, Some(last)) =
                    (&trigger, &mut last_probed)
                    && last_fault.is_none()
                    && last_verdict.as_ref().is_some_and(|v| v.ready)
                    && let Ok(Some(states)) =
                        timeout(timing.deadline, probes.port_states()).await
                    && crate::agent::wakeup::patch_port_states(last, &states)
                {
                    if let Some(verdict) = judge.port_event(last) {
                        tracing::warn!(
                            reasons = %verdict.reasons().join("; "),
                            "node not ready (port state read on a kernel event; the full \
                             probe follows)"
                        );
                        last_ready = Some(verdict.ready);
                        last_verdict = Some(verdict.clone());
                        publish(desired, verdict);
                    } else if let Some(verdict) = last_verdict.as_mut() {
                        // The node stays ready, but a bad HCA gets its device taint now.
                        let taints = judge.port_event_devices(last);
                        if taints != verdict.device_taints {
                            verdict.device_taints = taints;
                            publish(desired, verdict.clone());
                        }
                    }
                }
                true
            }
        };
        let probed: &ProbeReport = match (&last_probed, fresh) {
            (Some(probed), false) => probed,
            _ => {
                let started = Instant::now();
                // Never later than the interval: "within one interval" holds with jitter.
                next = later(started, interval.mul_f64(1.0 - 0.1 * jitter.next_f64()));
                metrics.health().probe_started();
                let probe = probes.probe();
                tokio::pin!(probe);
                let deadline = later(started, timing.deadline);
                let mut stalled = false;
                let probed = loop {
                    tokio::select! {
                        biased;
                        () = wait_stop(&mut stop) => return Ok(()),
                        r = &mut probe => break r?,
                        () = sleep_until(deadline), if !stalled => {
                            // The probe goes on (it cannot be cancelled); the node is judged
                            // as an agent error until it returns, and /healthz fails after
                            // the grace.
                            stalled = true;
                            let judged = judge.stalled(last_verdict.as_ref(), timing.deadline);
                            metrics.set_agent_error(judged.fault.as_ref().map(|f| f.message.as_str()));
                            log_agent_error(&mut last_fault, judged.fault.as_ref());
                            publish(desired, judged.verdict);
                        }
                    }
                };
                last_probed.insert(probed)
            }
        };
        let report = probed;
        let found = node_findings.borrow_and_update().clone();
        let dra_facts = dra.borrow_and_update().clone();
        let peer_finding = peers.and_then(|p| {
            if fresh {
                p.update_ports(&report.rdma);
            }
            p.required_finding()
        });
        let judged = judge.probe(Facts {
            report,
            node_findings: &found,
            peer_finding,
            dra: dra_facts.as_ref(),
        });
        let instant_ready = judged.instant_ready;
        metrics.set_agent_error(judged.fault.as_ref().map(|f| f.message.as_str()));
        log_agent_error(&mut last_fault, judged.fault.as_ref());
        if fresh {
            metrics.record_probe(report, &judged.recorded);
        }
        if config.kubernetes.dra.enabled() {
            metrics.set_dra_drivers(&crate::policy::dra::drivers_up(
                report,
                dra_facts.as_ref(),
                config,
            ));
        }
        let verdict = judged.verdict;
        last_verdict = Some(verdict.clone());
        tracing::debug!(
            instant_ready,
            ready = verdict.ready,
            good_streak = judge.good_streak(),
            "probe done"
        );
        if last_ready != Some(verdict.ready) {
            if verdict.ready {
                tracing::info!(
                    good_probes = judge.good_streak(),
                    "node validated: fabric ready"
                );
            } else if verdict.reasons().is_empty() {
                tracing::info!(
                    recover_after = config.node.recover_after,
                    "node not validated yet: waiting for consecutive good probes"
                );
            } else {
                tracing::warn!(reasons = %verdict.reasons().join("; "), "node not ready");
            }
            last_ready = Some(verdict.ready);
        }
        publish(desired, verdict);
    }
}

/// The host checks `run` makes beside each probe: the device plugins' sockets and device nodes
/// (`kubernetes.*`), and the agent's own mounts.
pub(super) fn host_checks(
    k: &crate::config::KubernetesRequirements,
) -> fabricgate_probes::host::HostConfig {
    fabricgate_probes::host::HostConfig {
        device_plugin_dir: std::path::PathBuf::from(&k.device_plugin_dir),
        device_plugin_sockets: k.device_plugin_sockets.clone(),
        device_nodes: !k.rdma_resources.is_empty(),
        own_mounts: true,
        dra_registry_dir: std::path::PathBuf::from(&k.dra.registry_dir),
        dra_drivers: k.dra.driver_names(),
    }
}

/// The prober lives on its own thread for the agent's life: a probe may block (hung mounts,
/// verbs), and its storage workers must persist across ticks. A thread stuck in a probe does not
/// delay shutdown: nobody joins it.
pub(super) struct ProbeThread {
    requests: std::sync::mpsc::Sender<ProbeRequest>,
}

/// What the probe thread is asked for.
pub(super) enum ProbeRequest {
    /// A full probe.
    Full(oneshot::Sender<ProbeReport>),
    /// Only the ports' states (the fail-fast read of an event-triggered probe).
    PortStates(oneshot::Sender<Vec<fabricgate_probes::rdma::sysfs::PortStateRead>>),
}

impl ProbeThread {
    pub(super) fn spawn(mut prober: Prober, failpoint: Failpoint) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<ProbeRequest>();
        std::thread::Builder::new()
            .name("fabricgate-probe".into())
            .spawn(move || {
                let mut done: u64 = 0;
                while let Ok(request) = rx.recv() {
                    let reply = match request {
                        ProbeRequest::Full(reply) => reply,
                        ProbeRequest::PortStates(reply) => {
                            let _ = reply.send(prober.port_states());
                            continue;
                        }
                    };
                    match failpoint {
                        Failpoint::ProbeStall if done >= 1 => loop {
                            std::thread::park();
                        },
                        Failpoint::ProbePanic if done >= 1 => {
                            panic!("failpoint probe-panic: the probe thread panics")
                        }
                        _ => {}
                    }
                    let report = prober.probe();
                    done += 1;
                    let _ = reply.send(report);
                }
            })
            .map_err(|e| Error::Internal {
                message: format!("cannot start the probe thread: {e}"),
            })?;
        Ok(Self { requests: tx })
    }

    async fn probe(&self) -> Result<ProbeReport> {
        let (tx, rx) = oneshot::channel();
        let dead = || Error::Internal {
            message: "the probe thread died".into(),
        };
        self.requests
            .send(ProbeRequest::Full(tx))
            .map_err(|_| dead())?;
        rx.await.map_err(|_| dead())
    }

    /// The RDMA ports' states only; `None` if the probe thread is gone.
    async fn port_states(&self) -> Option<Vec<fabricgate_probes::rdma::sysfs::PortStateRead>> {
        let (tx, rx) = oneshot::channel();
        self.requests.send(ProbeRequest::PortStates(tx)).ok()?;
        rx.await.ok()
    }
}

/// Checks of the agent's own Node object, fed from the watch to the probe loop.
pub(super) struct NodeChecks {
    pub(super) rdma_resources: Vec<String>,
    pub(super) findings: watch::Sender<Vec<Finding>>,
    /// `kubernetes.plugin_grace`.
    pub(super) plugin_grace: Duration,
    /// A kubelet restart being held back: (generation, the findings to publish if it outlasts
    /// the grace). The generation tells a timer whether its hold is still the current one.
    pub(super) held: std::sync::Arc<std::sync::Mutex<(u64, Option<Vec<Finding>>)>>,
}

fn publish_findings(tx: &watch::Sender<Vec<Finding>>, found: Vec<Finding>) {
    tx.send_if_modified(|have| {
        if *have == found {
            false
        } else {
            if found.is_empty() {
                tracing::info!("device-plugin resources are allocatable again");
            } else {
                for f in &found {
                    tracing::warn!(reason = f.code, "{}", f.message);
                }
            }
            *have = found;
            true
        }
    });
}

impl NodeChecks {
    pub(super) fn observe(&self, node: &k8s_openapi::api::core::v1::Node) {
        let found = device_plugin::device_plugin_findings(node, &self.rdma_resources);
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // A healthy node whose plugin resources all read 0/0: a kubelet restart, until the
        // plugins register again. Hold it back for the grace (a timer publishes it if it
        // lasts); anything else is published at once and ends a hold.
        let runtime = tokio::runtime::Handle::try_current();
        if !found.is_empty()
            && !self.plugin_grace.is_zero()
            && (held.1.is_some() || self.findings.borrow().is_empty())
            && device_plugin::kubelet_restart_signature(node, &self.rdma_resources)
            && let Ok(runtime) = runtime
        {
            if held.1.replace(found).is_none() {
                held.0 += 1;
                let generation = held.0;
                let grace = self.plugin_grace;
                tracing::info!(
                    grace = %humantime::format_duration(grace),
                    "device-plugin resources read 0 in capacity and allocatable, as after a \
                     kubelet restart: waiting up to kubernetes.plugin_grace for the plugins \
                     to register again"
                );
                let slot = std::sync::Arc::clone(&self.held);
                let tx = self.findings.clone();
                runtime.spawn(async move {
                    tokio::time::sleep(grace).await;
                    let due = {
                        let mut h = slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        if h.0 == generation { h.1.take() } else { None }
                    };
                    if let Some(found) = due {
                        tracing::warn!(
                            grace = %humantime::format_duration(grace),
                            "the device plugins did not register again within kubernetes.plugin_grace"
                        );
                        publish_findings(&tx, found);
                    }
                });
            }
            return;
        }
        held.1 = None;
        drop(held);
        publish_findings(&self.findings, found);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Node, NodeStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    const R: &str = "rdma/hca_shared_devices_a";

    fn node(capacity: &str, allocatable: &str) -> Node {
        let map = |v: &str| {
            Some(
                [(R.to_owned(), Quantity(v.to_owned()))]
                    .into_iter()
                    .collect(),
            )
        };
        Node {
            status: Some(NodeStatus {
                capacity: map(capacity),
                allocatable: map(allocatable),
                ..NodeStatus::default()
            }),
            ..Node::default()
        }
    }

    fn checks(grace: Duration) -> (NodeChecks, watch::Receiver<Vec<Finding>>) {
        let (tx, rx) = watch::channel(Vec::new());
        let checks = NodeChecks {
            rdma_resources: vec![R.into()],
            findings: tx,
            plugin_grace: grace,
            held: std::sync::Arc::default(),
        };
        (checks, rx)
    }

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_kubelet_restart_is_held_back_for_the_grace_and_a_dead_plugin_is_not() {
        let grace = Duration::from_secs(30);
        // Restart, plugins back within the grace: nothing is ever published.
        let (c, rx) = checks(grace);
        c.observe(&node("0", "0"));
        settle().await;
        assert!(rx.borrow().is_empty());
        tokio::time::advance(Duration::from_secs(10)).await;
        c.observe(&node("4", "4"));
        tokio::time::advance(Duration::from_secs(30)).await;
        settle().await;
        assert!(rx.borrow().is_empty(), "{:?}", rx.borrow());

        // Restart, plugins never back: published once the grace is over, not before.
        c.observe(&node("0", "0"));
        settle().await;
        tokio::time::advance(Duration::from_secs(29)).await;
        settle().await;
        assert!(rx.borrow().is_empty());
        tokio::time::advance(Duration::from_secs(2)).await;
        settle().await;
        assert_eq!(rx.borrow().len(), 1);
        assert_eq!(
            rx.borrow()[0].code,
            crate::policy::DEVICE_PLUGIN_UNAVAILABLE
        );

        // A plugin that dies under a running kubelet: at once.
        let (c, rx) = checks(grace);
        c.observe(&node("4", "0"));
        assert_eq!(rx.borrow().len(), 1);
        // Already failed: a later 0/0 is published at once too (no new hold).
        c.observe(&node("0", "0"));
        assert!(rx.borrow()[0].message.contains("capacity 0"));

        // Grace off: a restart fails at once.
        let (c, rx) = checks(Duration::ZERO);
        c.observe(&node("0", "0"));
        assert_eq!(rx.borrow().len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_old_holds_timer_does_not_cut_a_new_hold_short() {
        let (c, rx) = checks(Duration::from_secs(30));
        c.observe(&node("0", "0"));
        settle().await;
        tokio::time::advance(Duration::from_secs(10)).await;
        c.observe(&node("4", "4"));
        tokio::time::advance(Duration::from_secs(10)).await;
        c.observe(&node("0", "0")); // a second restart, 20 s after the first
        settle().await;
        tokio::time::advance(Duration::from_secs(15)).await; // the first timer fires here
        settle().await;
        assert!(
            rx.borrow().is_empty(),
            "the first hold's timer published the second"
        );
        tokio::time::advance(Duration::from_secs(16)).await;
        settle().await;
        assert_eq!(rx.borrow().len(), 1);
    }
}
