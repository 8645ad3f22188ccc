//! The probe loop: asks the probe thread for reports on the interval or on kernel events,
//! hands each to the [`Judge`] and publishes what it returns for the Node writer. It
//! schedules, logs and publishes; it does not decide.

use super::probe_thread::ProbeThread;
use super::timing::{Jitter, later, wait_stop};
use super::wakeup::{Trigger, Wakeup, patch_port_states};
use crate::config::Config;
use crate::device_plugin::assess::PluginView;
use crate::dra::assess::{DraFacts, DraView, RulesState};
use crate::dra::metrics::DraMetrics;
use crate::dra::settings::DraSettings;
use crate::error::Result;
use crate::observe::metrics::Metrics;
use crate::peers::PeerAgent;
use crate::policy::agent_fault::AgentFault;
use crate::policy::devices::DeviceView;
use crate::policy::judge::{Facts, Judge};
use crate::policy::{Finding, Verdict};
use fabricgate_probes::ProbeReport;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until, timeout};

/// What the probe loop talks to: verdicts out; the watched Node's findings, DRA, the peer mesh
/// and the stop signal in.
pub(super) struct Links<'a> {
    pub(super) desired: &'a watch::Sender<Option<Verdict>>,
    pub(super) node_findings: watch::Receiver<Vec<Finding>>,
    /// This node's DRA slices (`kubernetes.dra`), from `dra::watch_slices`.
    pub(super) dra: watch::Receiver<Option<DraFacts>>,
    /// Bumped when a DRA plugin's registration socket stops or starts answering
    /// (`dra`'s registration follower): probe at once.
    pub(super) registrations: watch::Receiver<u64>,
    /// The DeviceTaintRule writer's state (`dra`): a refusal is judged at once.
    pub(super) rules: watch::Receiver<RulesState>,
    /// DRA's section of the config (`kubernetes.dra`): while it names drivers, each judgment
    /// hands the Judge what DRA sees and records `fabricgate_dra_*`.
    pub(super) dra_settings: &'a Arc<DraSettings>,
    /// `fabricgate_dra_*`.
    pub(super) dra_metrics: &'a DraMetrics,
    /// The peer responder (`peers.enabled`): its ports follow each probe, and its required
    /// finding is judged with it.
    pub(super) peers: Option<&'a PeerAgent>,
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

/// Which input channels still have a sender.
struct Open {
    findings: bool,
    dra: bool,
    registrations: bool,
    rules: bool,
}

/// The probe loop and what it keeps between probes: the last report, verdict and fault.
pub(super) struct ProbeLoop<'a> {
    probes: ProbeThread,
    wakeup: Wakeup,
    judge: Judge,
    timing: ProbeTiming,
    config: &'a Config,
    metrics: &'a Metrics,
    links: Links<'a>,
    open: Open,
    jitter: Jitter,
    next: Instant,
    last_ready: Option<bool>,
    last_fault: Option<AgentFault>,
    last_verdict: Option<Verdict>,
    last_probed: Option<ProbeReport>,
}

impl<'a> ProbeLoop<'a> {
    pub(super) fn new(
        probes: ProbeThread,
        wakeup: Wakeup,
        judge: Judge,
        config: &'a Config,
        timing: ProbeTiming,
        metrics: &'a Metrics,
        links: Links<'a>,
    ) -> Self {
        Self {
            probes,
            wakeup,
            judge,
            timing,
            config,
            metrics,
            links,
            open: Open {
                findings: true,
                dra: true,
                registrations: true,
                rules: true,
            },
            jitter: Jitter::new(),
            next: Instant::now(),
            last_ready: None,
            last_fault: None,
            last_verdict: None,
            last_probed: None,
        }
    }

    /// Probe and judge until `stop`.
    ///
    /// # Errors
    /// Only when the probe thread died.
    pub(super) async fn run(mut self) -> Result<()> {
        loop {
            let Some(fresh) = self.next_trigger().await else {
                return Ok(());
            };
            if fresh || self.last_probed.is_none() {
                let Some(report) = self.probe().await? else {
                    return Ok(());
                };
                self.last_probed = Some(report);
            }
            self.judge_last(fresh);
        }
    }

    /// Waits for what comes next: `Some(true)` for a full probe, `Some(false)` to judge the
    /// last report again with new facts, `None` on `stop`.
    async fn next_trigger(&mut self) -> Option<bool> {
        loop {
            // A device plugin that went away (seen on the watched Node) fails the node at once,
            // judged with the last probe's report; coming back waits for the next probes (the
            // hysteresis counts real probes only).
            let fresh = tokio::select! {
                biased;
                () = wait_stop(&mut self.links.stop) => return None,
                r = self.links.node_findings.changed(), if self.open.findings => {
                    if r.is_err() {
                        self.open.findings = false;
                        continue;
                    }
                    if self.links.node_findings.borrow().is_empty() || self.last_probed.is_none() {
                        continue;
                    }
                    false
                }
                // A change of the node's DRA slices: judged at once with the last report.
                r = self.links.dra.changed(), if self.open.dra => {
                    if r.is_err() {
                        self.open.dra = false;
                        continue;
                    }
                    if self.last_probed.is_none() {
                        continue;
                    }
                    false
                }
                // The rule writer refused or writing again: judged at once with the last report.
                r = self.links.rules.changed(), if self.open.rules => {
                    if r.is_err() {
                        self.open.rules = false;
                        continue;
                    }
                    if self.last_probed.is_none() {
                        continue;
                    }
                    false
                }
                // A DRA plugin stopped or started answering: a full probe now, which checks it.
                r = self.links.registrations.changed(), if self.open.registrations => {
                    if r.is_err() {
                        self.open.registrations = false;
                        continue;
                    }
                    true
                }
                // The interval, or kernel events (debounced) if they come first (docs/events.md).
                trigger = self.wakeup.wait(self.next) => {
                    self.metrics.events.probe_triggered(&trigger);
                    if matches!(trigger, Trigger::Event { .. }) {
                        self.port_event().await;
                    }
                    true
                }
            };
            return Some(fresh);
        }
    }

    /// On kernel events, first re-read only the ports' states: a port down now fails the node
    /// (or taints its HCA) before the full probe has finished. Only while the node is ready
    /// and the agent has no fault.
    async fn port_event(&mut self) {
        let (Some(report), Some(last)) = (self.last_probed.as_mut(), self.last_verdict.as_ref())
        else {
            return;
        };
        if self.last_fault.is_some() || !last.ready {
            return;
        }
        let Ok(Some(states)) = timeout(self.timing.deadline, self.probes.port_states()).await
        else {
            return;
        };
        if !patch_port_states(report, &states) {
            return;
        }
        let Some(verdict) = self.judge.port_event(report, last) else {
            return;
        };
        if !verdict.ready {
            tracing::warn!(
                reasons = %verdict.reasons().join("; "),
                "node not ready (port state read on a kernel event; the full probe follows)"
            );
            self.last_ready = Some(verdict.ready);
        }
        self.last_verdict = Some(verdict.clone());
        publish(self.links.desired, verdict);
    }

    /// A full probe on the probe thread. Past the deadline the probe goes on (it cannot be
    /// cancelled) and the node is judged an agent error until it returns (`/healthz` fails
    /// after the grace). `None` when stopped meanwhile.
    async fn probe(&mut self) -> Result<Option<ProbeReport>> {
        let started = Instant::now();
        // Never later than the interval: "within one interval" holds with jitter.
        let jittered = self
            .timing
            .interval
            .mul_f64(1.0 - 0.1 * self.jitter.next_f64());
        self.next = later(started, jittered);
        self.metrics.health().probe_started();
        let probe = self.probes.probe();
        tokio::pin!(probe);
        let deadline = later(started, self.timing.deadline);
        let mut stalled = false;
        loop {
            tokio::select! {
                biased;
                () = wait_stop(&mut self.links.stop) => return Ok(None),
                r = &mut probe => return r.map(Some),
                () = sleep_until(deadline), if !stalled => {
                    stalled = true;
                    let judged = self.judge.stalled(self.last_verdict.as_ref(), self.timing.deadline);
                    self.metrics.set_agent_error(judged.fault.as_ref().map(|f| f.message.as_str()));
                    log_agent_error(&mut self.last_fault, judged.fault.as_ref());
                    publish(self.links.desired, judged.verdict);
                }
            }
        }
    }

    /// Judge the last report with the current facts, record it and publish the verdict;
    /// `fresh`: the report is a new probe (recorded in the metrics, handed to the peers).
    fn judge_last(&mut self, fresh: bool) {
        let Some(report) = self.last_probed.as_ref() else {
            return;
        };
        let dra = DraView::new(
            Arc::clone(self.links.dra_settings),
            self.links.dra.borrow_and_update().clone(),
            Some(self.links.rules.borrow_and_update().clone()),
        );
        let dra = dra.settings.enabled().then(|| Arc::new(dra));
        let plugins = PluginView {
            node_findings: self.links.node_findings.borrow_and_update().clone(),
        };
        let mut devices: Vec<Arc<dyn DeviceView>> = vec![Arc::new(plugins)];
        devices.extend(dra.clone().map(|d| d as Arc<dyn DeviceView>));
        let peer_finding = self.links.peers.and_then(|p| {
            if fresh {
                p.update_ports(&report.rdma);
            }
            p.required_finding()
        });
        let judged = self.judge.probe(Facts {
            report,
            peer_finding,
            devices: &devices,
        });
        let instant_ready = judged.instant_ready;
        self.metrics
            .set_agent_error(judged.fault.as_ref().map(|f| f.message.as_str()));
        log_agent_error(&mut self.last_fault, judged.fault.as_ref());
        if fresh {
            self.metrics.record_probe(report, &judged.recorded);
        }
        if let Some(dra) = &dra {
            let tainted = &judged.recorded.device_taints;
            let m = self.links.dra_metrics;
            m.record(self.metrics, report, dra, tainted, self.config);
        }
        let verdict = judged.verdict;
        self.last_verdict = Some(verdict.clone());
        tracing::debug!(
            instant_ready,
            ready = verdict.ready,
            good_streak = self.judge.good_streak(),
            "probe done"
        );
        self.log_readiness(&verdict);
        publish(self.links.desired, verdict);
    }

    /// Log the node's readiness when it changes.
    fn log_readiness(&mut self, verdict: &Verdict) {
        if self.last_ready == Some(verdict.ready) {
            return;
        }
        if verdict.ready {
            tracing::info!(
                good_probes = self.judge.good_streak(),
                "node validated: fabric ready"
            );
        } else if verdict.reasons().is_empty() {
            tracing::info!(
                recover_after = self.config.node.recover_after,
                "node not validated yet: waiting for consecutive good probes"
            );
        } else {
            tracing::warn!(reasons = %verdict.reasons().join("; "), "node not ready");
        }
        self.last_ready = Some(verdict.ready);
    }
}
