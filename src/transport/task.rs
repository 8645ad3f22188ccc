//! The runtime transport task (docs/runtime-transport.md): every `runtime.window`
//! it samples the judged pods on a blocking thread (never on the async runtime, never holding
//! up the node's probe), judges each with `transport::verdict::judge_pod`, records the
//! `fabricgate_pod_*` metrics and writes the pod condition and Events through
//! `transport::writer`. Wiring only: which pods are judged is `transport::pods`, who their peers are
//! `transport::jobs` and `transport::peers`, the verdict and its confirmation are policy's, the facts
//! are the probes'.

use super::sampler::Sampler;
use crate::config::Config;
use crate::transport::bandwidth::{JobId, PortShare, job_ports, port_shares};
use crate::transport::jobs::{JobKey, job_of};
use crate::transport::metrics::{PodMetrics, PodSample};
use crate::transport::peers::{JobPeers, peer_addresses, watch_job_peers};
use crate::transport::pods::{JudgedPod, is_judged};
use crate::transport::settings::RuntimeSettings;
use crate::transport::verdict::{PodHistory, PodVerdict, confirm, judge_pod};
use crate::transport::writer::PodWriter;
use fabricgate_probes::Roots;
use fabricgate_probes::transport::sample::{PodSampler, RemoteScope, SampleRequest};
use fabricgate_probes::transport::{Observed, PodTransportFacts};
use k8s_openapi::api::core::v1::Pod;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The runtime task's handles: the judging loop, which ends its write when `stop` comes (the
/// agent waits for it), and the peer watch, which only reads (aborted at shutdown).
pub struct RuntimeJobs {
    pub writers: Vec<JoinHandle<()>>,
    pub watches: Vec<JoinHandle<()>>,
}

/// Start the peer watch and the judging loop over this node's pods (`pods`, the shared
/// `node::pods_watch`); nothing while `runtime.enabled` is false or without a cluster.
#[allow(clippy::too_many_arguments)]
pub fn start(
    config: &Config,
    settings: &RuntimeSettings,
    clients: Option<&crate::node::Clients>,
    pods: Option<watch::Receiver<BTreeMap<String, Pod>>>,
    node: &str,
    own_namespace: &str,
    claims: bool,
    dry_run: bool,
    roots: Roots,
    metrics: Option<PodMetrics>,
    stop: watch::Receiver<bool>,
) -> RuntimeJobs {
    let (Some(clients), Some(pods), true) = (clients, pods, settings.enabled) else {
        return RuntimeJobs {
            writers: Vec::new(),
            watches: Vec::new(),
        };
    };
    let Some(watch_client) = clients.watch.clone() else {
        return RuntimeJobs {
            writers: Vec::new(),
            watches: Vec::new(),
        };
    };
    let backoff = settings.window;
    let (jobs_tx, jobs_rx) = watch::channel(BTreeSet::new());
    let (peers_tx, peers_rx) = watch::channel(JobPeers::new());
    let writer = PodWriter {
        client: clients.requests.clone(),
        node: node.to_owned(),
        dry_run,
    };
    let judging = |sampler| Judging {
        config: config.clone(),
        settings: settings.clone(),
        sample_deadline: settings.window,
        own_namespace: own_namespace.to_owned(),
        claims,
        node: node.to_owned(),
        pods,
        jobs: jobs_tx,
        peers: peers_rx,
        writer,
        metrics,
        sampler,
        history: HashMap::new(),
        told_unknown: false,
    };
    let sampler: Box<dyn Sampler> = match super::sampler::from_env(settings.window) {
        Some(seam) => seam,
        None => Box::new(PodSampler::new(roots).with_max_sockets(settings.max_sockets_per_pod)),
    };
    let run = tokio::spawn(judging(Arc::new(Mutex::new(sampler))).run(stop));
    RuntimeJobs {
        writers: vec![run],
        watches: vec![tokio::spawn(watch_job_peers(
            watch_client,
            settings.job_labels.clone(),
            jobs_rx,
            peers_tx,
            backoff,
        ))],
    }
}

struct Judging {
    config: Config,
    /// Its own section of `config` (`runtime:`).
    settings: RuntimeSettings,
    /// How long a window's sample may take (`runtime.window`): past it the window misses.
    sample_deadline: std::time::Duration,
    /// The agent's namespace: its own pods there are never judged.
    own_namespace: String,
    /// A pod's resource claims make it judged (DRA drivers are configured).
    claims: bool,
    /// This node: the peers that count are the job's pods on the others.
    node: String,
    pods: watch::Receiver<BTreeMap<String, Pod>>,
    /// The jobs of the judged pods, which the peer watch follows.
    jobs: watch::Sender<BTreeSet<JobKey>>,
    peers: watch::Receiver<JobPeers>,
    writer: PodWriter,
    /// The `fabricgate_pod_*` families (`None`: not registered, nothing recorded).
    metrics: Option<PodMetrics>,
    sampler: Arc<Mutex<Box<dyn Sampler>>>,
    /// Per judged pod UID: its windows on sockets in a row and its quiet (`transport::verdict::confirm`).
    history: HashMap<String, PodHistory>,
    /// `unknown` is logged once with what to add, not every window.
    told_unknown: bool,
}

impl Judging {
    /// Every `runtime.window` one window, until `stop`. A stop during the sample drops the
    /// window (nothing is written yet); a stop during the writes lets them end (the agent
    /// waits for this task), so no condition is left half written.
    async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.settings.window);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            let (judged, job_ids, request) = self.prepare();
            let sampled = tokio::select! {
                s = self.sample(request) => s,
                _ = stop.wait_for(|s| *s) => return,
            };
            self.conclude(&judged, &job_ids, sampled).await;
        }
    }

    /// One window: sample, judge, confirm, record, write.
    #[cfg(test)]
    async fn window(&mut self) {
        let (judged, job_ids, request) = self.prepare();
        let sampled = self.sample(request).await;
        self.conclude(&judged, &job_ids, sampled).await;
    }

    /// The judged pods of this window, their jobs (handed to the peer watch), and the sample
    /// request scoped to each pod's peers.
    fn prepare(&mut self) -> (Vec<JudgedPod>, HashMap<String, JobId>, SampleRequest) {
        let job_labels = &self.settings.job_labels;
        let judged: Vec<(JudgedPod, Option<JobKey>)> = self
            .pods
            .borrow()
            .values()
            .filter(|p| {
                is_judged(
                    p,
                    &self.config.kubernetes,
                    self.claims,
                    &self.settings,
                    &self.own_namespace,
                )
            })
            .filter_map(|p| Some((JudgedPod::of(p)?, job_of(p, job_labels))))
            .collect();
        let wanted: BTreeSet<JobKey> = judged.iter().filter_map(|(_, j)| j.clone()).collect();
        self.jobs.send_if_modified(|jobs| {
            let changed = *jobs != wanted;
            *jobs = wanted;
            changed
        });
        let scope = {
            let peers = self.peers.borrow();
            judged
                .iter()
                .filter_map(|(p, job)| {
                    let addresses = peer_addresses(&peers, job.as_ref()?, &self.node);
                    (!addresses.is_empty()).then(|| (p.uid.clone(), addresses))
                })
                .collect()
        };
        let job_ids: HashMap<String, JobId> = judged
            .iter()
            .filter_map(|(p, job)| Some((p.uid.clone(), job.as_ref()?.id())))
            .collect();
        let judged: Vec<JudgedPod> = judged.into_iter().map(|(p, _)| p).collect();
        self.history
            .retain(|uid, _| judged.iter().any(|p| &p.uid == uid));
        let request = SampleRequest {
            pod_uids: Some(judged.iter().map(|p| p.uid.clone()).collect()),
            host_network: judged
                .iter()
                .filter(|p| p.host_network)
                .map(|p| p.uid.clone())
                .collect::<BTreeSet<_>>(),
            remote: RemoteScope::JobPeers(scope),
        };
        (judged, job_ids, request)
    }

    /// Judge the sampled pods (every one unknown when the sample failed), confirm, record,
    /// and write each pod's condition and Events.
    async fn conclude(
        &mut self,
        judged: &[JudgedPod],
        job_ids: &HashMap<String, JobId>,
        sampled: Result<Vec<PodTransportFacts>, String>,
    ) {
        let facts = match sampled {
            Ok(facts) => facts,
            Err(why) => {
                // Every judged pod unknown for this window: never a condition left as it was
                // (a False one would still be acted on), never a node verdict.
                if let Some(m) = &self.metrics {
                    m.sampler_missed();
                }
                tracing::warn!("{why}; the judged pods are unknown for this window");
                judged
                    .iter()
                    .map(|p| PodTransportFacts {
                        pod_uid: p.uid.clone(),
                        qps: Observed::Unseen {
                            reason: why.clone(),
                        },
                        internode_tcp: Observed::Unseen {
                            reason: why.clone(),
                        },
                        ports: Vec::new(),
                    })
                    .collect()
            }
        };
        let shares = port_shares(&facts, |uid| job_ids.get(uid).cloned());
        let facts: BTreeMap<&str, &PodTransportFacts> =
            facts.iter().map(|f| (f.pod_uid.as_str(), f)).collect();
        let matcher = self.config.device_matcher();
        let mut verdicts: Vec<(&JudgedPod, PodVerdict, &PodTransportFacts)> = Vec::new();
        for pod in judged {
            // A pod first seen has its baseline now and facts from the next window.
            let Some(f) = facts.get(pod.uid.as_str()) else {
                continue;
            };
            let in_scope = |device: &str, _| matcher.is_match(device);
            let ports = job_ports(f, &shares, job_ids.get(&pod.uid), in_scope);
            let v = judge_pod(f, &self.settings, in_scope, ports.as_ref());
            let window = match &f.internode_tcp {
                Observed::Seen(t) => t.window,
                Observed::Unseen { .. } => self.settings.window,
            };
            let history = self.history.entry(pod.uid.clone()).or_default();
            let v = confirm(v, history, &self.settings, window);
            verdicts.push((pod, v, f));
        }
        self.record(&verdicts, &shares);
        for (pod, v, _) in &verdicts {
            match self.writer.apply(pod, v).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(namespace = %pod.namespace, pod = %pod.name,
                    transport = %v.transport, why = %v.why, writes = n, "pod transport changed"),
                Err(e) => tracing::warn!(error = %e, "pod transport write failed; next window"),
            }
        }
    }

    /// The pods' facts of this window, from the sampler on a blocking thread, within
    /// `runtime.window`. `Err` says why there are none: the sample missed the deadline (the
    /// thread goes on; while it runs, later windows find the sampler busy and miss too, so a
    /// wedged look never stacks threads), or the thread failed.
    async fn sample(&self, request: SampleRequest) -> Result<Vec<PodTransportFacts>, String> {
        let sampler = Arc::clone(&self.sampler);
        let work = tokio::task::spawn_blocking(move || match sampler.try_lock() {
            Ok(mut s) => Some(s.sample(&request)),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner().sample(&request)),
            Err(std::sync::TryLockError::WouldBlock) => None,
        });
        let deadline = self.sample_deadline;
        match tokio::time::timeout(deadline, work).await {
            Ok(Ok(Some(facts))) => Ok(facts),
            Ok(Ok(None)) => Err(
                "the pod sampler is still busy with an earlier window (a look into a pod that \
                 does not return)"
                    .to_owned(),
            ),
            Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Ok(Err(e)) => Err(format!("the pod sampler's thread failed: {e}")),
            Err(_) => Err(format!(
                "the pod sample did not finish within runtime.window ({})",
                humantime::format_duration(deadline)
            )),
        }
    }

    fn record(
        &mut self,
        verdicts: &[(&JudgedPod, PodVerdict, &PodTransportFacts)],
        shares: &[PortShare],
    ) {
        if !self.told_unknown
            && let Some((pod, v, _)) = verdicts
                .iter()
                .find(|(_, v, _)| v.transport == crate::transport::verdict::Transport::Unknown)
        {
            tracing::warn!(namespace = %pod.namespace, pod = %pod.name, why = %v.why,
                "runtime transport unknown (logged once): apply \
                 deploy/overlays/runtime-transport (hostPID, SYS_PTRACE, SYS_ADMIN)");
            self.told_unknown = true;
        }
        let Some(m) = &self.metrics else {
            return;
        };
        let samples: Vec<PodSample<'_>> = verdicts
            .iter()
            .map(|(pod, v, f)| PodSample {
                namespace: &pod.namespace,
                pod: &pod.name,
                owner: pod
                    .owner
                    .as_ref()
                    .map(|o| (o.kind.as_str(), o.name.as_str())),
                verdict: v,
                qps: match &f.qps {
                    fabricgate_probes::transport::Observed::Seen(q) => Some(q.as_slice()),
                    fabricgate_probes::transport::Observed::Unseen { .. } => None,
                },
            })
            .collect();
        m.record(&samples);
        m.record_ports(shares);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FeatureSection;
    use crate::node::tests::scripted;
    use crate::observe::metrics::Metrics;
    use fabricgate_probes::transport::sample::SampleRequest;
    use serde_json::json;

    /// The judging task of node `gpu-a` (`rdma/hca` judged, window 5 s) over `pod`, writing to
    /// the scripted API, and the test's ends of its channels.
    struct Harness {
        judging: Judging,
        pods: watch::Sender<BTreeMap<String, Pod>>,
        jobs: watch::Receiver<BTreeSet<JobKey>>,
        peers: watch::Sender<JobPeers>,
        server: scripted::Server,
        metrics: Arc<Metrics>,
    }

    fn harness(
        pod: Pod,
        sampler: Box<dyn Sampler>,
        sample_deadline: std::time::Duration,
    ) -> Harness {
        let config = Config::parse(
            "kubernetes:\n  rdma_resources: [\"rdma/hca\"]\nruntime:\n  enabled: true\n  \
             window: 5s\n",
        )
        .unwrap();
        let uid = pod.metadata.uid.clone().unwrap();
        let (pods_tx, pods) = watch::channel(BTreeMap::from([(uid, pod)]));
        let (jobs, jobs_rx) = watch::channel(BTreeSet::new());
        let (peers_tx, peers) = watch::channel(JobPeers::new());
        let (client, server) = scripted::client();
        let (metrics, pod_metrics) =
            Metrics::with_config_and(&config, |live| Some(PodMetrics::register(live)));
        let metrics = Arc::new(metrics);
        let judging = Judging {
            settings: RuntimeSettings::of(&config).unwrap(),
            config,
            sample_deadline,
            own_namespace: "fabricgate".to_owned(),
            claims: false,
            node: "gpu-a".to_owned(),
            pods,
            jobs,
            peers,
            writer: PodWriter {
                client,
                node: "gpu-a".to_owned(),
                dry_run: false,
            },
            metrics: pod_metrics,
            sampler: Arc::new(Mutex::new(sampler)),
            history: HashMap::new(),
            told_unknown: false,
        };
        Harness {
            judging,
            pods: pods_tx,
            jobs: jobs_rx,
            peers: peers_tx,
            server,
            metrics,
        }
    }

    /// A sampler that says the pod moved bulk TCP with whatever the request calls its peers,
    /// and records each request's scope.
    struct PeersSeen(Arc<Mutex<Vec<fabricgate_probes::transport::sample::RemoteScope>>>);

    impl Sampler for PeersSeen {
        fn sample(&mut self, request: &SampleRequest) -> Vec<PodTransportFacts> {
            if let Ok(mut seen) = self.0.lock() {
                seen.push(request.remote.clone());
            }
            let fabricgate_probes::transport::sample::RemoteScope::JobPeers(peers) =
                &request.remote
            else {
                return Vec::new();
            };
            let peer = peers.get("u-1").and_then(|p| p.iter().next().copied());
            vec![PodTransportFacts {
                pod_uid: "u-1".into(),
                qps: Observed::Seen(Vec::new()),
                internode_tcp: Observed::Seen(fabricgate_probes::transport::InternodeTcp {
                    bytes: if peer.is_some() { 41_000_000_000 } else { 0 },
                    other_bytes: if peer.is_some() { 0 } else { 41_000_000_000 },
                    window: std::time::Duration::from_secs(5),
                    peers: peer.into_iter().collect(),
                    interfaces: vec!["net1".into()],
                }),
                ports: Vec::new(),
            }]
        }
    }

    /// The task asks the peer watch for the judged pod's job, scopes the sample to that job's
    /// pods on other nodes (their Multus addresses included, never this node's), and writes
    /// `False` only on the second window in a row (`runtime.confirm_windows` 2): the first
    /// says "not yet confirmed".
    #[tokio::test]
    async fn the_jobs_peers_on_other_nodes_scope_the_sample_and_sockets_waits_for_confirmation() {
        use crate::transport::peers::PeerPod;
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "w-0", "namespace": "ml", "uid": "u-1",
                "labels": {"training.kubeflow.org/job-name": "llm"}},
            "spec": {"nodeName": "gpu-a", "containers": [{"name": "c",
                "resources": {"limits": {"rdma/hca": "1"}}}]},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let Harness {
            mut judging,
            pods: pods_tx,
            jobs: mut jobs_rx,
            peers: peers_tx,
            mut server,
            ..
        } = harness(
            pod.clone(),
            Box::new(PeersSeen(Arc::clone(&seen))),
            std::time::Duration::from_secs(5),
        );
        // The first window asks for the job; nothing is known of it yet: no peer, the pod's TCP
        // is other traffic, and it gets Unknown/NoInterNodeTraffic.
        let first = tokio::spawn(async move {
            judging.window().await;
            judging
        });
        let patch = server.answer(200, json!({})).await;
        assert_eq!(
            patch.body["status"]["conditions"][0]["reason"],
            "NoInterNodeTraffic"
        );
        let mut judging = first.await.unwrap();
        assert!(jobs_rx.has_changed().unwrap());
        let job: JobKey = jobs_rx.borrow_and_update().iter().next().cloned().unwrap();
        assert_eq!(job.name(), "training.kubeflow.org/job-name=llm");
        let peer = |node: &str, ip: &str| PeerPod {
            node: node.to_owned(),
            addresses: [ip.parse().unwrap()].into(),
        };
        peers_tx.send_modify(|m| {
            m.insert(
                job.clone(),
                BTreeMap::from([
                    ("u-1".to_owned(), peer("gpu-a", "10.1.0.5")),
                    ("u-2".to_owned(), peer("gpu-b", "192.168.50.2")),
                ]),
            );
        });
        // The pod shows what the first window wrote.
        let mut shown = pod;
        shown.status = serde_json::from_value(json!({"phase": "Running", "conditions": [{
            "type": "fabricgate.io/TransportReady", "status": "Unknown",
            "reason": "NoInterNodeTraffic"}]}))
        .unwrap();
        pods_tx.send_modify(|m| {
            m.insert("u-1".to_owned(), shown);
        });
        // Second window: sockets with its peer, not yet confirmed: nothing new to write.
        judging.window().await;
        // Third: confirmed. The Event on the pod (a bare pod: no owner), then the condition.
        let third = tokio::spawn(async move {
            judging.window().await;
            judging
        });
        let event = server.answer(201, json!({})).await;
        assert_eq!(event.body["reason"], "TransportFallback");
        let patch = server.answer(200, json!({})).await;
        let condition = &patch.body["status"]["conditions"][0];
        assert_eq!(condition["status"], "False", "{}", patch.body);
        assert!(
            condition["message"].as_str().unwrap().contains("via net1"),
            "{}",
            patch.body
        );
        drop(third.await.unwrap());
        let scopes = seen.lock().unwrap().clone();
        let fabricgate_probes::transport::sample::RemoteScope::JobPeers(last) = &scopes[2] else {
            panic!("{scopes:?}");
        };
        // Only the job's pod on the other node, at its secondary address.
        assert_eq!(
            last.get("u-1")
                .map(|a| a.iter().map(ToString::to_string).collect::<Vec<_>>()),
            Some(vec!["192.168.50.2".to_owned()])
        );
        server.expect_no_more().await;
    }

    /// A look into a pod that does not return (a wedged namespace, a flood on the agent's
    /// netlink port): this sampler sleeps far past the window.
    struct Wedged;

    impl Sampler for Wedged {
        fn sample(&mut self, _request: &SampleRequest) -> Vec<PodTransportFacts> {
            std::thread::sleep(std::time::Duration::from_millis(1500));
            Vec::new()
        }
    }

    /// A bare pod of node `gpu-a` that asks for `rdma/hca`, its condition `False` (on sockets).
    fn pod_shown_on_sockets() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "w-0", "namespace": "ml", "uid": "u-1"},
            "spec": {"nodeName": "gpu-a", "containers": [{"name": "c",
                "resources": {"limits": {"rdma/hca": "1"}}}]},
            "status": {"phase": "Running", "conditions": [{
                "type": "fabricgate.io/TransportReady", "status": "False",
                "reason": "SocketsFallback"}]}
        }))
        .unwrap()
    }

    /// At shutdown the judging task ends what it started: a stop during the window's sample
    /// drops the window (nothing written, the task ends at once, not after the sample); a stop
    /// while a condition is being written lets that write end, then the task ends.
    #[tokio::test]
    async fn a_stop_drops_a_window_being_sampled_and_lets_a_write_end() {
        let pod = pod_shown_on_sockets;
        let second = std::time::Duration::from_secs(1);
        // The sample takes 1.5 s, its deadline 10 s: the stop comes while sampling.
        let Harness {
            judging, server, ..
        } = harness(pod(), Box::new(Wedged), 10 * second);
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(judging.run(stop));
        tokio::time::sleep(second / 5).await;
        let _ = stop_tx.send(true);
        tokio::time::timeout(second, task)
            .await
            .expect("the task ended before its sample did")
            .unwrap();
        server.expect_no_more().await;

        // The deadline 200 ms: the pod turns Unknown, and the stop comes during that write.
        let Harness {
            judging,
            mut server,
            ..
        } = harness(pod(), Box::new(Wedged), second / 5);
        let (stop_tx, stop) = watch::channel(false);
        let task = tokio::spawn(judging.run(stop));
        let patch = server
            .answer_after(
                || {
                    let _ = stop_tx.send(true);
                },
                200,
                json!({}),
            )
            .await;
        assert_eq!(patch.body["status"]["conditions"][0]["status"], "Unknown");
        tokio::time::timeout(10 * second, task)
            .await
            .expect("the task ended after its write")
            .unwrap();
        server.expect_no_more().await;
    }

    /// A wedged sampler froze every pod condition on the node (a `False` one was still
    /// evicted). Now the window's sample is awaited within `runtime.window`: the judged pod
    /// whose condition said sockets turns `Unknown`, the metric says `unknown`, and the missed
    /// window is counted; the next window finds the sampler still busy and misses too rather
    /// than start a second thread.
    #[tokio::test]
    async fn redteam_a_wedged_sampler_makes_the_pods_unknown_never_frozen() {
        let pod = pod_shown_on_sockets();
        // The window's 5 s at the least in a config; a test needs no 5 s wait.
        let Harness {
            mut judging,
            mut server,
            metrics,
            ..
        } = harness(pod, Box::new(Wedged), std::time::Duration::from_millis(200));
        let window = tokio::spawn(async move {
            judging.window().await;
            judging
        });
        // (Before, the window waited for the sample and wrote nothing: the pod stayed False.)
        let patch = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            server.answer(200, json!({})),
        )
        .await
        .expect("the pod's condition set within the window's deadline");
        assert!(
            patch.path.ends_with("/namespaces/ml/pods/w-0/status"),
            "{}",
            patch.path
        );
        let condition = &patch.body["status"]["conditions"][0];
        assert_eq!(condition["status"], "Unknown", "{}", patch.body);
        assert!(
            condition["message"]
                .as_str()
                .is_some_and(|m| m.contains("did not finish within runtime.window")),
            "{}",
            patch.body
        );
        let mut judging = window.await.unwrap();
        let text = metrics.encode(false);
        assert!(
            text.contains(
                "fabricgate_pod_transport{namespace=\"ml\",pod=\"w-0\",transport=\"unknown\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("fabricgate_pod_sampler_missed_windows_total 1"),
            "{text}"
        );
        // The next window at once: the first sample's thread still runs, and this one misses
        // too (the pod, as this test's watch still shows it, is set Unknown again).
        let window = tokio::spawn(async move {
            judging.window().await;
            judging
        });
        let again = server.answer(200, json!({})).await;
        assert_eq!(again.body["status"]["conditions"][0]["status"], "Unknown");
        let again = again.body["status"]["conditions"][0]["message"].to_string();
        assert!(
            again.contains("still busy with an earlier window"),
            "{again}"
        );
        let judging = window.await.unwrap();
        let text = metrics.encode(false);
        assert!(
            text.contains("fabricgate_pod_sampler_missed_windows_total 2"),
            "{text}"
        );
        drop(judging);
        server.expect_no_more().await;
    }

    /// Each window: an RC QP in RTS on mlx5_0/1 (the pod's alone), the port having carried
    /// `port_bytes` out, and 41 GB of TCP with a peer.
    struct OnItsPort {
        port_bytes: u64,
    }

    impl Sampler for OnItsPort {
        fn sample(&mut self, _request: &SampleRequest) -> Vec<PodTransportFacts> {
            use fabricgate_probes::transport::ports::{PortCounter, PortTraffic};
            use fabricgate_probes::transport::restrack::{QpEntry, QpOwner, QpState, QpType};
            vec![PodTransportFacts {
                pod_uid: "u-1".into(),
                qps: Observed::Seen(vec![QpEntry {
                    device_index: 0,
                    device: "mlx5_0".into(),
                    port: Some(1),
                    lqpn: 17,
                    rqpn: Some(18),
                    qp_type: QpType::Rc,
                    state: QpState::Rts,
                    owner: QpOwner::Pid(4242),
                    pdn: None,
                }]),
                internode_tcp: Observed::Seen(fabricgate_probes::transport::InternodeTcp {
                    bytes: 41_000_000_000,
                    other_bytes: 0,
                    window: std::time::Duration::from_secs(5),
                    peers: vec!["192.168.50.2".parse().unwrap()],
                    interfaces: vec!["ib0".into()],
                }),
                ports: vec![PortTraffic {
                    device: "mlx5_0".into(),
                    port: 1,
                    link_layer: Some("InfiniBand".into()),
                    counter: PortCounter::DataWords,
                    transmit_bytes: Some(self.port_bytes),
                    receive_bytes: Some(0),
                    subtracted: vec!["ib0".into()],
                    window: std::time::Duration::from_secs(5),
                    pods: vec!["u-1".into()],
                    others: Vec::new(),
                    unseen: None,
                }],
            }]
        }
    }

    /// The port of the pod's QPs is its job's: what it carried is the job's
    /// (`fabricgate_job_rdma_bytes_total`, the job named as the peer watch names it). When it
    /// carries nothing while 41 GB go over TCP to a peer, the pod is on sockets all the same
    /// (confirmed on the second window): `False`, `SocketsBesideIdleQueuePairs`.
    #[tokio::test]
    async fn the_jobs_own_port_counts_its_bytes_and_an_idle_one_is_no_alibi() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "w-0", "namespace": "ml", "uid": "u-1",
                "labels": {"jobset.sigs.k8s.io/jobset-name": "llm"}},
            "spec": {"nodeName": "gpu-a", "containers": [{"name": "c",
                "resources": {"limits": {"rdma/hca": "1"}}}]},
            "status": {"phase": "Running", "conditions": [{
                "type": "fabricgate.io/TransportReady", "status": "True",
                "reason": "DataPathQueuePairs"}]}
        }))
        .unwrap();
        let busy = harness(
            pod.clone(),
            Box::new(OnItsPort {
                port_bytes: 50_000_000_000,
            }),
            std::time::Duration::from_secs(5),
        );
        let mut judging = busy.judging;
        judging.window().await;
        let text = busy.metrics.encode(false);
        assert!(
            text.contains(
                "fabricgate_job_rdma_bytes_total{namespace=\"ml\",job=\"jobset.sigs.k8s.io/jobset-name=llm\",device=\"mlx5_0\",port=\"1\",direction=\"transmit\"} 50000000000"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "fabricgate_pod_transport{namespace=\"ml\",pod=\"w-0\",transport=\"rdma\"} 1"
            ),
            "{text}"
        );
        drop(judging);
        let server = busy.server;
        server.expect_no_more().await;

        let idle = harness(
            pod,
            Box::new(OnItsPort { port_bytes: 4_096 }),
            std::time::Duration::from_secs(5),
        );
        let Harness {
            mut judging,
            mut server,
            ..
        } = idle;
        judging.window().await;
        let second = tokio::spawn(async move {
            judging.window().await;
            judging
        });
        let event = server.answer(201, json!({})).await;
        assert_eq!(event.body["reason"], "TransportFallback");
        let patch = server.answer(200, json!({})).await;
        let condition = &patch.body["status"]["conditions"][0];
        assert_eq!(condition["status"], "False", "{}", patch.body);
        assert_eq!(condition["reason"], "SocketsBesideIdleQueuePairs");
        assert!(
            condition["message"].as_str().is_some_and(
                |m| m.starts_with("1 data-path QP in RTS, but mlx5_0/1 carried 4.1 kB")
            ),
            "{}",
            patch.body
        );
        drop(second.await.unwrap());
        server.expect_no_more().await;
    }
}
