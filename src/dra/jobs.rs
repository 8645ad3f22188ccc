//! The DRA jobs the agent starts (docs/dra.md): this node's ResourceSlices in
//! ([`super::slices::watch_slices`]), the claims of its pods and what their namespaces hold, each
//! driver's kubelet plugin followed through its registration socket, and the
//! `DeviceTaintRule`s of its bad HCAs out ([`super::rules::DeviceTaintRules`]). What slices and probes
//! mean is decided in [`super::assess`] through the Judge, never here.

use super::assess::{DraFacts, RulesState};
use super::metrics::DraMetrics;
use super::rules::{DeviceTaintRules, follow_state};
use super::settings::DraSettings;
use super::slices::watch_slices;
use super::{claims, in_pods, registration};
use crate::config::Config;
use crate::node::Clients;
use crate::observe::metrics::Metrics;
use crate::policy::{Verdict, unvalidated_taint};
use fabricgate_probes::Roots;
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the DRA jobs need from the agent.
pub struct DraJobs<'a> {
    pub node: &'a str,
    pub config: &'a Config,
    /// Its own section of `config` (`kubernetes.dra`).
    pub settings: &'a DraSettings,
    /// `None`: a dry run without a cluster (the registration sockets alone are followed).
    pub clients: Option<&'a Clients>,
    /// A dry run writes no rule.
    pub dry_run: bool,
    /// The slice watch's longest wait between failed attempts (the probe interval).
    pub interval: Duration,
    /// The rule writer's longest wait between refused writes.
    pub rules_max_backoff: Duration,
    /// The agent's metrics, whose lock DRA's families change under.
    pub metrics: &'a Arc<Metrics>,
    /// DRA's families: the rule writer's state goes to `fabricgate_dra_device_rules_writable`.
    pub families: &'a DraMetrics,
    /// This node's pods (`node::pods_watch`, shared with runtime transport): the claims they
    /// name tell which HCAs are in use by a pod. `None`: no claim is read.
    pub pods: Option<watch::Receiver<BTreeMap<String, Pod>>>,
    /// Where the claims' pods' processes and namespaces are found (`--proc-root`).
    pub roots: Roots,
}

/// What the probe loop reads from the DRA jobs, and their API tasks: the rule writer, which
/// ends its write when `stop` comes (the agent waits for it), and the watches, which only
/// read (aborted at shutdown). A channel whose job does not run is closed.
pub struct DraInputs {
    /// This node's slices ([`watch_slices`]): the last report is judged again on a change.
    pub facts: watch::Receiver<Option<DraFacts>>,
    /// Bumped when a plugin's registration socket stops or starts answering: probe at once.
    pub registrations: watch::Receiver<u64>,
    /// The rule writer's state ([`RulesState`]): the last report is judged again on a change.
    pub rules: watch::Receiver<RulesState>,
    pub writers: Vec<JoinHandle<()>>,
    pub watches: Vec<JoinHandle<()>>,
}

impl DraJobs<'_> {
    /// Start what `kubernetes.dra` asks for: with a cluster the slice watch and (with device
    /// rules, not in a dry run) the rule writer, which follows `verdicts` until `stop`; the
    /// registration follower whenever DRA is on.
    pub fn start(
        self,
        verdicts: watch::Receiver<Option<Verdict>>,
        stop: watch::Receiver<bool>,
    ) -> DraInputs {
        let dra = self.settings;
        let (facts_tx, facts) = watch::channel(None);
        let (registrations_tx, registrations) = watch::channel(0u64);
        let (state_tx, rules) = watch::channel(RulesState::On);
        let mut tasks = Vec::new();
        let mut writers = Vec::new();
        if dra.enabled()
            && let Some(c) = self.clients
        {
            let watch_client = c.watch.clone().unwrap_or_else(|| c.requests.clone());
            let slices_tx = match self.pods {
                // The slices' facts with the devices the pods' claims hold merged in.
                Some(pods) => {
                    let (slices_tx, slices_rx) = watch::channel(None);
                    let (claims_tx, claims_rx) = watch::channel(Vec::new());
                    let (in_pods_tx, in_pods_rx) = watch::channel(Vec::new());
                    let drivers: BTreeSet<String> = dra.driver_names().into_iter().collect();
                    tasks.push(tokio::spawn(claims::follow_claims(
                        c.requests.clone(),
                        drivers,
                        pods,
                        claims_tx,
                    )));
                    tasks.push(tokio::spawn(in_pods::look_into_claims(
                        self.roots.clone(),
                        self.interval,
                        claims_rx.clone(),
                        in_pods_tx,
                    )));
                    tasks.push(tokio::spawn(claims::merge_claims(
                        slices_rx, claims_rx, in_pods_rx, facts_tx,
                    )));
                    slices_tx
                }
                None => facts_tx,
            };
            tasks.push(tokio::spawn(watch_slices(
                watch_client.clone(),
                self.node.to_owned(),
                dra.drivers.clone(),
                dra.slice_grace,
                slices_tx,
                self.interval,
            )));
            if dra.taint_scope.device_rules() && !self.dry_run {
                let state_rx = rules.clone();
                let rules = DeviceTaintRules {
                    node: self.node.to_owned(),
                    key: unvalidated_taint(self.config).key,
                    effect: dra.taint_effect,
                    requests: c.requests.clone(),
                    watch: watch_client,
                    max_backoff: self.rules_max_backoff,
                    state: state_tx,
                };
                writers.push(tokio::spawn(rules.run(verdicts, stop)));
                tasks.push(tokio::spawn(follow_state(
                    Arc::clone(self.metrics),
                    self.families.clone(),
                    state_rx,
                )));
            }
        }
        if dra.enabled() {
            // A dead DRA plugin known within a second, not at the next interval probe.
            tokio::spawn(registration::follow(
                PathBuf::from(&dra.registry_dir),
                dra.driver_names(),
                registrations_tx,
            ));
        }
        DraInputs {
            facts,
            registrations,
            rules,
            writers,
            watches: tasks,
        }
    }
}
