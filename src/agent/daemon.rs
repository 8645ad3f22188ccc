//! `fabricgate run`: resolve the flags into an [`Agent`], then wire its jobs together (the probe
//! loop, the Node writer, the metrics server, the peers and the gang ring, DRA's slices and
//! rules), supervise them and stop cleanly on a signal. Each job lives in its own file; this
//! one decides nothing.
//!
//! Shutdown is a future passed in (as in mini-redis), so tests drive it without signals.

use super::mesh::{Advertised, Mesh};
use super::probe_loop::{Links, ProbeLoop, ProbeTiming};
use super::probe_thread::{ProbeThread, host_checks};
use super::reconcile_loop::{LoopTiming, node_writer, reconcile_loop, watch_own_node};
use super::timing::{WRITE_GRACE, stopped, wait_stop};
use super::wakeup::Wakeup;
use crate::cli::RunArgs;
use crate::config::Config;
use crate::config::FeatureSection;
use crate::config::peers::PeerSpec;
use crate::device_plugin::node_checks::NodeChecks;
use crate::dra::jobs::DraJobs;
use crate::dra::metrics::DraMetrics;
use crate::dra::settings::DraSettings;
use crate::error::{Error, Result};
use crate::node::{self, Reconciler, RetryAfter};
use crate::observe::health::HealthTiming;
use crate::observe::metrics::{self, Metrics};
use crate::observe::server::{Limits, Nofile};
use crate::peers::{self, PeerAgent, Rounds};
use crate::policy::Verdict;
use crate::policy::judge::Judge;
use crate::transport::metrics::PodMetrics;
use crate::transport::settings::RuntimeSettings;
use fabricgate_probes::rdma::VerbsMode;
use fabricgate_probes::rdma::peer::Identity;
use fabricgate_probes::{Prober, Roots};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::timeout;

pub use super::timing::{CLOCK_AHEAD, Failpoint};

/// Everything `run` needs, resolved from flags, environment and config file.
pub struct Agent {
    pub node_name: String,
    /// The agent's namespace (the breaker's ledger lives there).
    pub namespace: String,
    pub config: Config,
    /// Runtime transport's section of `config` (`runtime:`), read once.
    pub transport: RuntimeSettings,
    /// DRA's section of `config` (`kubernetes.dra`), read once.
    pub dra: DraSettings,
    pub prober: Prober,
    pub interval: Duration,
    pub resync: Duration,
    pub dry_run: bool,
    pub listener: tokio::net::TcpListener,
    pub client: Option<node::Clients>,
    pub retry_after: RetryAfter,
    pub metrics: Arc<Metrics>,
    /// Runtime transport's `fabricgate_pod_*` families, registered when `runtime.enabled`.
    pub pod_metrics: Option<PodMetrics>,
    /// DRA's `fabricgate_dra_*` families (registered whether or not `kubernetes.dra` is on).
    pub dra_metrics: DraMetrics,
    /// Connection limits of the metrics server (from `RLIMIT_NOFILE`).
    pub limits: Limits,
    pub probe_deadline: Duration,
    pub liveness_grace: Duration,
    pub stale_series_grace: Duration,
    /// Test-only fault injection (`FABRICGATE_FAILPOINT`, docs/hardening.md).
    pub failpoint: Failpoint,
    /// The peer responder and rounds, when `peers.enabled` (docs/peers.md).
    pub peers: Option<(PeerAgent, Rounds)>,
}

impl Agent {
    /// Resolve the flags: node name, config, roots, metrics listener, Kubernetes client.
    ///
    /// # Errors
    /// [`Error::Usage`] for a missing node name, bad roots or an unbindable address; config
    /// errors; [`Error::KubeConfig`] when no cluster is configured and `--dry-run` is not set.
    pub async fn from_args(args: &RunArgs, nofile: &Nofile) -> Result<Self> {
        let node_name = args
            .node_name
            .clone()
            .filter(|n| !n.trim().is_empty())
            .ok_or_else(|| Error::Usage {
                flag: "--node-name".into(),
                message: "no node name: pass --node-name or set NODE_NAME (in a DaemonSet, \
                          from the downward API fieldRef spec.nodeName)"
                    .into(),
            })?;
        if args.interval.is_zero() {
            return Err(Error::Usage {
                flag: "--interval".into(),
                message: "must be greater than 0 (e.g. 10s)".into(),
            });
        }
        let mut config = args.probe.load_config()?;
        let transport = RuntimeSettings::of(&config)?;
        let dra = DraSettings::of(&config)?;
        if let Some(listen) = args.peers_listen
            && config.peers.enabled
        {
            config.peers.listen = listen.to_string();
        }
        let roots = args.probe.roots()?;
        let mut probe_config = args.probe.probe_config(&config);
        probe_config.counters_interval = config.rdma.counters_interval(args.interval);
        probe_config.counter_names = crate::observe::metrics::counters_read();
        probe_config.host = host_checks(&config.kubernetes, &dra);
        let prober = Prober::new(roots.clone(), probe_config);
        // Descriptors: all the container allows (raised by the harness), and HTTP connections
        // kept far below that.
        let limits = Limits::for_nofile(args.metrics_max_connections, nofile.soft);
        tracing::info!(
            nofile_before = ?nofile.before,
            nofile = ?nofile.soft,
            nofile_hard = ?nofile.hard,
            max_connections = limits.max_connections,
            "descriptor budget"
        );
        let listener = crate::harness::bind(args.metrics_addr, "--metrics-addr").await?;
        let retry_after = RetryAfter::default();
        let client = match node::client(retry_after.clone()).await {
            Ok(c) => Some(c),
            Err(e) if args.dry_run => {
                tracing::info!(
                    "dry run without a cluster ({e}); logging the labels, taint and conditions \
                     fabricgate would set"
                );
                None
            }
            Err(e) => return Err(e),
        };
        // The fallback detector follows `fallback:` and `rdma.devices` of the config.
        let (metrics, pod_metrics) = Metrics::with_config_and(&config, |live| {
            transport.enabled.then(|| PodMetrics::register(live))
        });
        let (metrics, dra_metrics) = metrics.with_families(|r| DraMetrics::register(r, &dra));
        let metrics = Arc::new(crate::checks::registered().metrics(metrics, &config));
        let peers =
            peers_from_args(args, &config, &node_name, client.as_ref(), roots, &metrics).await?;
        Ok(Self {
            node_name,
            config,
            transport,
            dra,
            prober,
            interval: args.interval,
            resync: args.resync_interval,
            dry_run: args.dry_run,
            listener,
            client,
            retry_after,
            metrics,
            pod_metrics,
            dra_metrics,
            limits,
            probe_deadline: args.probe_deadline,
            liveness_grace: args.liveness_grace,
            stale_series_grace: args.stale_series_grace,
            failpoint: Failpoint::from_env(),
            peers,
            namespace: args.namespace.clone(),
        })
    }
}

/// The peer responder and its rounds (`peers.enabled`), with the extra `--peers`.
async fn peers_from_args(
    args: &RunArgs,
    config: &Config,
    node_name: &str,
    client: Option<&node::Clients>,
    roots: Roots,
    metrics: &Metrics,
) -> Result<Option<(PeerAgent, Rounds)>> {
    if !config.peers.enabled {
        if !args.peers.is_empty() {
            tracing::warn!("--peers is ignored: peers.enabled is false in the config");
        }
        return Ok(None);
    }
    let mut extra = Vec::new();
    for p in &args.peers {
        extra.push(
            PeerSpec::parse(p, config.peers.port()).map_err(|message| Error::Usage {
                flag: "--peers".into(),
                message,
            })?,
        );
    }
    let identity = Identity {
        node_name: node_name.to_owned(),
        group: peers::group_of(
            client.map(|c| &c.requests),
            node_name,
            &config.peers.match_label,
        )
        .await,
    };
    let agent = PeerAgent::start(
        config,
        identity.clone(),
        &roots,
        metrics.peers.clone().unwrap_or_default(),
    )?;
    let rounds = Rounds::new(&config.peers, &extra, identity, agent.keys(), roots);
    Ok(Some((agent, rounds)))
}

/// Run the agent until `shutdown` completes: each job started by its own constructor, then
/// supervised.
///
/// # Errors
/// Only if the probe thread dies; API errors are retried forever.
pub async fn run(
    mut agent: Agent,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let pod_metrics = agent.pod_metrics.take();
    let (node, config, metrics) = (agent.node_name.as_str(), &agent.config, &agent.metrics);
    let (client, interval, failpoint) = (agent.client.as_ref(), agent.interval, agent.failpoint);
    metrics.health().set_timing(HealthTiming {
        interval,
        probe_deadline: agent.probe_deadline,
        liveness_grace: agent.liveness_grace,
    });
    metrics.set_stale_series_grace(agent.stale_series_grace);
    let stop = stop_on(shutdown);
    let mesh = Mesh::start(agent.peers.take(), config, interval)?;
    let (desired_tx, desired_rx) = watch::channel::<Option<Verdict>>(None);
    let PodFeatures {
        pods_watch,
        runtime,
        dra,
    } = start_pod_features(&agent, pod_metrics, desired_rx.clone(), &stop);
    let mut server = tokio::spawn(metrics::serve_with_limits(
        agent.listener,
        Arc::clone(metrics),
        agent.limits,
        stopped(stop.clone()),
    ));
    let (node_checks, node_findings) = NodeChecks::new(&config.kubernetes);
    let (node_watch, node_updates) = watch_own_node(client, node, interval);
    let verbs = agent.prober.config().verbs == VerbsMode::Required;
    // The gang pre-flight (docs/gangs.md): with peers on and a cluster, answer FabricChecks.
    let advertised = match (&mesh, client) {
        (Some(mesh), Some(c)) => mesh.start_ring(node, config, c, verbs, failpoint, stop.clone()),
        _ => Advertised::default(),
    };
    let requests = client.map(|c| c.requests.clone());
    let reconciler = node_writer(
        node,
        config,
        requests,
        agent.dry_run,
        metrics,
        &agent.namespace,
        advertised,
    );
    let judge = judge_resuming(config, &reconciler, stop.clone()).await;
    let timing = LoopTiming {
        interval,
        resync: agent.resync,
        retry_after: agent.retry_after,
    };
    let mut writer = tokio::spawn(reconcile_loop(
        reconciler,
        desired_rx,
        node_updates,
        stop.clone(),
        timing,
        node_checks,
        failpoint,
    ));
    tracing::info!(
        node = %node,
        interval = ?interval,
        recover_after = config.node.recover_after,
        dry_run = agent.dry_run,
        "fabricgate agent started"
    );
    let wakeup = kernel_events(config, verbs, metrics);
    let dra_settings = Arc::new(agent.dra.clone());
    let links = Links {
        desired: &desired_tx,
        node_findings,
        dra: dra.facts,
        registrations: dra.registrations,
        rules: dra.rules,
        dra_settings: &dra_settings,
        dra_metrics: &agent.dra_metrics,
        peers: mesh.as_ref().map(|m| &m.agent),
        stop: stop.clone(),
    };
    let timing = ProbeTiming {
        interval,
        deadline: agent.probe_deadline,
    };
    let probes = ProbeThread::spawn(agent.prober, failpoint)?;
    let probing = ProbeLoop::new(probes, wakeup, judge, config, timing, metrics, links).run();
    // Supervision: the probe loop, the Node writer and the server live and die together. A
    // panic already ended the process (`crate::harness`); a task that returns early ends it too.
    let ended = tokio::select! {
        r = probing => Ended::Probe(r),
        r = &mut writer => Ended::Reconcile(r),
        r = &mut server => Ended::Server(r),
    };
    let result = ended.into_result(*stop.borrow());
    // No more verdicts: the Node writer's loop ends.
    drop(desired_tx);
    let writers = runtime.writers.into_iter().chain(dra.writers);
    let watches = node_watch
        .into_iter()
        .chain(pods_watch)
        .chain(dra.watches)
        .chain(runtime.watches);
    wind_down(writer, server, writers, watches).await;
    tracing::info!(node = %node, "fabricgate agent stopped");
    result
}

/// The features that read this node's pods, and the one watch they share.
struct PodFeatures {
    pods_watch: Option<JoinHandle<()>>,
    runtime: crate::transport::task::RuntimeJobs,
    dra: crate::dra::jobs::DraInputs,
}

/// Start this node's pods watch (one, for the two features that read it), runtime transport
/// per pod (docs/runtime-transport.md: its peer watch and window) and DRA (docs/dra.md: this
/// node's ResourceSlices in, a DeviceTaintRule per bad HCA out, the HCAs the pods' claims
/// hold).
fn start_pod_features(
    agent: &Agent,
    pod_metrics: Option<PodMetrics>,
    verdicts: watch::Receiver<Option<Verdict>>,
    stop: &watch::Receiver<bool>,
) -> PodFeatures {
    let (node, config, client) = (
        agent.node_name.as_str(),
        &agent.config,
        agent.client.as_ref(),
    );
    let node::pods_watch::PodsWatch {
        task: pods_watch,
        pods,
    } = node::pods_watch::start(
        client,
        node,
        agent.transport.enabled.then_some(agent.transport.window),
        agent.dra.enabled(),
        agent.interval,
    );
    let runtime = crate::transport::task::start(
        config,
        &agent.transport,
        client,
        pods.clone(),
        node,
        &agent.namespace,
        agent.dra.enabled(),
        agent.dry_run,
        agent.prober.roots().clone(),
        pod_metrics,
        stop.clone(),
    );
    let dra = DraJobs {
        node,
        config,
        settings: &agent.dra,
        clients: client,
        dry_run: agent.dry_run,
        interval: agent.interval,
        rules_max_backoff: agent.interval.max(crate::gang::ring::MAX_BACKOFF),
        metrics: &agent.metrics,
        families: &agent.dra_metrics,
        pods,
        roots: agent.prober.roots().clone(),
    }
    .start(verdicts, stop.clone());
    PodFeatures {
        pods_watch,
        runtime,
        dra,
    }
}

/// Kernel events wake the probe loop before the interval (docs/events.md).
fn kernel_events(config: &Config, verbs: bool, metrics: &Metrics) -> Wakeup {
    Wakeup::start(
        &config.events,
        fabricgate_probes::events::EventOptions {
            verbs,
            ..Default::default()
        },
        metrics.events.clone(),
    )
}

/// After supervision: the Node writer and the other writers (the pod conditions, the
/// DeviceTaintRules), which follow the stop signal, end their write within [`WRITE_GRACE`]
/// (abandoned after it); the watches, which only read, are aborted; the server gets half a
/// second to close. (A handle that completed inside the supervision's select is finished and
/// not polled again.)
async fn wind_down(
    mut writer: JoinHandle<()>,
    mut server: JoinHandle<std::io::Result<()>>,
    writers: impl Iterator<Item = JoinHandle<()>>,
    watches: impl Iterator<Item = JoinHandle<()>>,
) {
    let grace = WRITE_GRACE + Duration::from_millis(500);
    if !writer.is_finished() {
        let _ = timeout(grace, &mut writer).await;
    }
    for mut task in writers {
        if timeout(grace, &mut task).await.is_err() {
            tracing::warn!("a writer did not end its write within its grace; abandoned");
            task.abort();
        }
    }
    for task in watches {
        task.abort();
    }
    if !server.is_finished() {
        let _ = timeout(Duration::from_millis(500), &mut server).await;
    }
}

/// The Judge, continuing the validation an earlier run recorded on the Node (unless `stop`
/// comes first).
async fn judge_resuming(
    config: &Config,
    reconciler: &Reconciler,
    mut stop: watch::Receiver<bool>,
) -> Judge {
    let mut judge = Judge::new(config).with_checks(crate::checks::registered().checks());
    let resumed = tokio::select! {
        v = reconciler.validated_on_node() => v,
        () = wait_stop(&mut stop) => false,
    };
    if resumed {
        tracing::info!(
            node = %reconciler.node_name(),
            "the Node shows fabricgate's validation from an earlier run; resuming it"
        );
        judge.resume_validated();
    }
    judge
}

/// The stop signal every job follows: true once `shutdown` completes.
fn stop_on(shutdown: impl Future<Output = ()> + Send + 'static) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(true);
    });
    rx
}

/// Which of the agent's concurrent parts ended first.
enum Ended {
    Probe(Result<()>),
    Reconcile(std::result::Result<(), tokio::task::JoinError>),
    Server(std::result::Result<std::io::Result<()>, tokio::task::JoinError>),
}

impl Ended {
    /// What `run` returns: the probe loop's own result; while `stopping`, whichever part
    /// noticed first ended cleanly; otherwise a part that ended is an error.
    fn into_result(self, stopping: bool) -> Result<()> {
        match self {
            Self::Probe(r) => r,
            _ if stopping => Ok(()),
            Self::Reconcile(r) => Err(r.err().map_or_else(
                || Error::Internal {
                    message: "the Node writer stopped while the agent runs".into(),
                },
                |e| task_died("the Node writer", &e),
            )),
            Self::Server(r) => Err(match r {
                Ok(Ok(())) => Error::Internal {
                    message: "the metrics server stopped while the agent runs".into(),
                },
                Ok(Err(e)) => Error::Internal {
                    message: format!("the metrics server failed: {e}"),
                },
                Err(e) => task_died("the metrics server", &e),
            }),
        }
    }
}

fn task_died(what: &str, e: &tokio::task::JoinError) -> Error {
    Error::Internal {
        message: format!("{what} task ended abnormally: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// At shutdown a writer in the middle of its write ends it (a pod condition, a
    /// DeviceTaintRule is never cut off halfway), a watch is aborted, and a writer that
    /// outlives its grace is abandoned rather than holding the process.
    #[tokio::test(start_paused = true)]
    async fn wind_down_lets_a_writer_end_its_write_and_aborts_the_watches() {
        let written = Arc::new(AtomicBool::new(false));
        let writing = {
            let written = Arc::clone(&written);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(800)).await;
                written.store(true, Ordering::SeqCst);
            })
        };
        let wedged = tokio::spawn(std::future::pending::<()>());
        let watching = tokio::spawn(std::future::pending::<()>());
        let watch_handle = watching.abort_handle();
        let node_writer = tokio::spawn(async {});
        let server = tokio::spawn(async { Ok(()) });
        let started = tokio::time::Instant::now();
        wind_down(
            node_writer,
            server,
            [writing, wedged].into_iter(),
            std::iter::once(watching),
        )
        .await;
        assert!(written.load(Ordering::SeqCst), "the write was cut off");
        tokio::task::yield_now().await;
        assert!(watch_handle.is_finished(), "the watch was left running");
        // The wedged writer held the wind-down for its grace, no longer.
        let took = started.elapsed();
        assert!(
            took >= WRITE_GRACE && took < 2 * WRITE_GRACE + Duration::from_secs(2),
            "{took:?}"
        );
    }
}
