//! `fabricgate run`: probe on a jittered interval on a dedicated thread, apply hysteresis, keep
//! the Node in line from a separate task, serve metrics, stop cleanly on a signal.
//!
//! Shutdown is a future passed in (as in mini-redis), so tests drive it without signals.

use super::probe_loop::{Channels, NodeChecks, ProbeThread, ProbeTiming, host_checks, probe_loop};
use super::reconcile_loop::{LoopTiming, reconcile_loop};
use crate::cli::{LogFormat, RunArgs};
use crate::config::Config;
use crate::config::peers::PeerSpec;
use crate::error::{Error, Result};
use crate::node::{self, Reconciler, RetryAfter};
use crate::observe::health::HealthTiming;
use crate::observe::metrics::{self, Metrics};
use crate::observe::server::Limits;
use crate::peers::{self, PeerAgent, Rounds};
use crate::policy::judge::Judge;
use crate::policy::{Finding, Verdict};
use fabricgate_probes::Prober;
use fabricgate_probes::rdma::peer::Identity;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::{Instant, timeout};

/// How long an in-flight Node write may finish after a shutdown signal before it is abandoned.
pub(super) const WRITE_GRACE: Duration = Duration::from_secs(2);
/// First retry delay after an API error; doubles up to the probe interval.
pub(super) const BACKOFF_BASE: Duration = Duration::from_millis(200);

/// Everything `run` needs, resolved from flags, environment and config file.
pub struct Agent {
    pub node_name: String,
    /// The agent's namespace (the breaker's ledger lives there).
    pub namespace: String,
    pub config: Config,
    pub prober: Prober,
    pub interval: Duration,
    pub resync: Duration,
    pub dry_run: bool,
    pub listener: tokio::net::TcpListener,
    pub client: Option<node::Clients>,
    pub retry_after: RetryAfter,
    pub metrics: Arc<Metrics>,
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

/// Faults the integration tests inject into the real binary through the environment variable
/// `FABRICGATE_FAILPOINT` (never set in a deployment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Failpoint {
    #[default]
    None,
    /// The reconcile task panics on its first verdict.
    ReconcilePanic,
    /// The probe thread panics on its second probe.
    ProbePanic,
    /// Every probe after the first blocks forever.
    ProbeStall,
    /// The gang ring's view of this node's clock reads [`CLOCK_AHEAD`] ahead.
    ClockAhead,
}

/// How far the `clock-ahead` failpoint sets the gang ring's clock ahead: more than the
/// largest `gang.timeout`.
pub const CLOCK_AHEAD: Duration = Duration::from_secs(15 * 60);

impl Failpoint {
    fn from_env() -> Self {
        match std::env::var("FABRICGATE_FAILPOINT").as_deref() {
            Ok("reconcile-panic") => Self::ReconcilePanic,
            Ok("probe-panic") => Self::ProbePanic,
            Ok("probe-stall") => Self::ProbeStall,
            Ok("clock-ahead") => Self::ClockAhead,
            _ => Self::None,
        }
    }
}

impl Agent {
    /// Resolve the flags: node name, config, roots, metrics listener, Kubernetes client.
    ///
    /// # Errors
    /// [`Error::Usage`] for a missing node name, bad roots or an unbindable address; config
    /// errors; [`Error::KubeConfig`] when no cluster is configured and `--dry-run` is not set.
    pub async fn from_args(args: &RunArgs) -> Result<Self> {
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
        if let Some(listen) = args.peers_listen
            && config.peers.enabled
        {
            config.peers.listen = listen.to_string();
        }
        let roots = args.probe.roots()?;
        let mut probe_config = args.probe.probe_config(&config);
        probe_config.counters_interval = config.rdma.counters_interval(args.interval);
        probe_config.counter_names = crate::observe::metrics::counters_read();
        probe_config.host = host_checks(&config.kubernetes);
        let prober = Prober::new(roots.clone(), probe_config);
        // Descriptors: all the container allows, and HTTP connections kept far below that.
        let nofile = crate::observe::server::raise_nofile();
        let limits = Limits::for_nofile(args.metrics_max_connections, nofile.soft);
        tracing::info!(
            nofile_before = ?nofile.before,
            nofile = ?nofile.soft,
            nofile_hard = ?nofile.hard,
            max_connections = limits.max_connections,
            "descriptor budget"
        );
        let listener = tokio::net::TcpListener::bind(args.metrics_addr)
            .await
            .map_err(|e| Error::Usage {
                flag: "--metrics-addr".into(),
                message: format!("cannot listen on {}: {e}", args.metrics_addr),
            })?;
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
        let metrics = Arc::new(Metrics::with_config(&config));
        let peers = if config.peers.enabled {
            let mut extra = Vec::new();
            for p in &args.peers {
                extra.push(PeerSpec::parse(p, config.peers.port()).map_err(|message| {
                    Error::Usage {
                        flag: "--peers".into(),
                        message,
                    }
                })?);
            }
            let identity = Identity {
                node_name: node_name.clone(),
                group: peers::group_of(
                    client.as_ref().map(|c| &c.requests),
                    &node_name,
                    &config.peers.match_label,
                )
                .await,
            };
            let agent = PeerAgent::start(
                &config,
                identity.clone(),
                &roots,
                metrics.peers.clone().unwrap_or_default(),
            )?;
            let rounds = Rounds::new(&config.peers, &extra, identity.clone(), agent.keys(), roots);
            Some((agent, rounds))
        } else {
            if !args.peers.is_empty() {
                tracing::warn!("--peers is ignored: peers.enabled is false in the config");
            }
            None
        };
        Ok(Self {
            node_name,
            config,
            prober,
            interval: args.interval,
            resync: args.resync_interval,
            dry_run: args.dry_run,
            listener,
            client,
            retry_after,
            metrics,
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

/// Make any panic, on any thread or task, end the process with [`crate::EXIT_AGENT_PANIC`]:
/// never a half-alive agent whose probes and `/healthz` go on while its Node writer is dead.
pub fn exit_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        tracing::error!(
            panic = %info,
            "a task of the agent panicked; exiting with status {} so that it is restarted",
            crate::EXIT_AGENT_PANIC
        );
        std::process::exit(i32::from(crate::EXIT_AGENT_PANIC));
    }));
}

/// `now + d`, or a day from now when that overflows the clock (never panics).
pub(super) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d)
        .or_else(|| now.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(now)
}

/// Install the global `tracing` subscriber (level from `RUST_LOG`, default `info`).
pub fn init_logging(format: LogFormat) {
    // kube's HTTP layer logs every failed request at ERROR; the reconcile loop already says
    // what failed and when it retries, once per kind of failure.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube_client=off"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    // A second init (tests) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Completes on SIGTERM or SIGINT.
///
/// # Errors
/// I/O errors installing the handlers.
pub async fn shutdown_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    Ok(())
}

/// Run the agent until `shutdown` completes.
///
/// # Errors
/// Only if the probe thread dies; API errors are retried forever.
pub async fn run(agent: Agent, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
    let Agent {
        node_name,
        config,
        prober,
        interval,
        resync,
        dry_run,
        listener,
        client,
        retry_after,
        metrics,
        limits,
        probe_deadline,
        liveness_grace,
        stale_series_grace,
        failpoint,
        peers,
        namespace,
    } = agent;
    metrics.health().set_timing(HealthTiming {
        interval,
        probe_deadline,
        liveness_grace,
    });
    metrics.set_stale_series_grace(stale_series_grace);
    // Dropping the sender (when `run` returns) stops the peer thread.
    let (_peers_stop, peers_stop_rx) = std::sync::mpsc::channel::<()>();
    let mut identity = None;
    let peer_agent = match peers {
        Some((agent, rounds)) => {
            identity = Some(rounds.identity.clone());
            agent.spawn_rounds(
                rounds,
                config.peers.interval(interval),
                config.peers.keep_rounds as usize,
                peers_stop_rx,
            )?;
            Some(agent)
        }
        None => None,
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    let mut server = tokio::spawn(metrics::serve_with_limits(
        listener,
        Arc::clone(&metrics),
        limits,
        stopped(stop_rx.clone()),
    ));

    let (desired_tx, desired_rx) = watch::channel::<Option<Verdict>>(None);
    // What the watched Node says about the device plugins (`kubernetes.rdma_resources`).
    let (node_findings_tx, node_findings_rx) = watch::channel::<Vec<Finding>>(Vec::new());
    let mut judge = Judge::new(&config);
    // The agent's own Node, watched: drift is undone at once and steady state reads nothing.
    let (node_tx, node_rx) = tokio::sync::mpsc::channel(16);
    let watch_task = client.as_ref().and_then(|c| c.watch.clone()).map(|watch| {
        tokio::spawn(node::watch_node(
            watch,
            node_name.clone(),
            node_tx,
            interval,
        ))
    });
    // The gang pre-flight (docs/gangs.md): with peers on and a cluster, answer FabricChecks;
    // the Node advertises the responder's address for the controller to put in them.
    let mut annotations = std::collections::BTreeMap::new();
    let mut shared_annotations = None;
    if let (Some(pa), Some(c), Some(identity)) = (peer_agent.as_ref(), client.as_ref(), identity) {
        match advertised(pa.local_addr()) {
            Some(endpoint) => {
                annotations.insert(crate::agent::ring::ENDPOINT_ANNOTATION.to_owned(), endpoint);
            }
            None => tracing::warn!(
                listen = %pa.local_addr(),
                "peers.listen is a wildcard address: the Node gets no \
                 fabricgate.io/peers-endpoint annotation and gang pre-flights cannot name this \
                 node; pass --peers-listen=$(HOST_IP):9465 as the DaemonSet does"
            ),
        }
        // The addresses of its ports, for the dialling member to hold its responder to.
        shared_annotations = Some(pa.shared_addresses());
        let ring = crate::agent::ring::Ring {
            node: node_name.clone(),
            namespace: config.gang.namespace.clone(),
            identity,
            ports: pa.shared_ports(),
            rdma: prober.config().verbs == fabricgate_probes::rdma::VerbsMode::Required,
            keys: pa.keys(),
            plan: config.peers.plan(),
            bandwidth: (
                config.peers.bandwidth.message_size,
                config.peers.bandwidth.duration,
            ),
            session: config.peers.timeout,
            source: Some(pa.local_addr().ip()).filter(|ip| !ip.is_unspecified()),
            expected: Some(pa.expected_peers()),
            receipts: pa.receipts(),
            requests: c.requests.clone(),
            watch: c.watch.clone(),
            // Without the CRD (no admission check installed) every agent's list fails: retry
            // at most every 5 minutes, not every interval, so a fleet does not load the apiserver.
            max_backoff: interval.max(crate::agent::ring::MAX_BACKOFF),
            clock_ahead: if failpoint == Failpoint::ClockAhead {
                CLOCK_AHEAD
            } else {
                Duration::ZERO
            },
        };
        tokio::spawn(crate::agent::ring::run(ring, stop_rx.clone()));
    }
    // DRA (docs/dra.md): this node's ResourceSlices in, a DeviceTaintRule per bad HCA out.
    let (dra_tx, dra_rx) = watch::channel::<Option<crate::policy::dra::DraFacts>>(None);
    let dra = &config.kubernetes.dra;
    let mut dra_tasks = Vec::new();
    if dra.enabled()
        && let Some(c) = client.as_ref()
    {
        let watch_client = c.watch.clone().unwrap_or_else(|| c.requests.clone());
        dra_tasks.push(tokio::spawn(node::dra::watch_slices(
            watch_client.clone(),
            node_name.clone(),
            dra.drivers.clone(),
            dra.slice_grace,
            dra_tx,
            interval,
        )));
        if dra.taint_scope.device_rules() && !dry_run {
            let (state_tx, state_rx) = watch::channel(node::dra::RulesState::On);
            let rules = node::dra::DeviceTaintRules {
                node: node_name.clone(),
                key: crate::policy::unvalidated_taint(&config).key,
                effect: dra.taint_effect,
                requests: c.requests.clone(),
                watch: watch_client,
                max_backoff: interval.max(crate::agent::ring::MAX_BACKOFF),
                state: state_tx,
            };
            dra_tasks.push(tokio::spawn(rules.run(desired_rx.clone(), stop_rx.clone())));
            dra_tasks.push(tokio::spawn(follow_device_rules(
                Arc::clone(&metrics),
                state_rx,
            )));
        }
    } else {
        drop(dra_tx);
    }
    // A dead DRA plugin known within a second, not at the next interval probe.
    let (registrations_tx, registrations_rx) = watch::channel(0u64);
    if dra.enabled() {
        tokio::spawn(crate::agent::registration::follow(
            std::path::PathBuf::from(&dra.registry_dir),
            dra.driver_names(),
            registrations_tx,
        ));
    } else {
        drop(registrations_tx);
    }
    let reconciler = Reconciler::new(
        node_name.clone(),
        config.node.clone(),
        client.map(|c| c.requests),
        dry_run,
        Arc::clone(&metrics),
    )
    .with_required_labels(config.placement.required_labels.clone())
    .with_breaker_ledger(&namespace)
    .with_annotations(annotations);
    let reconciler = match shared_annotations {
        Some(shared) => {
            reconciler.with_shared_annotation(crate::node::fabriccheck::GIDS_ANNOTATION, shared)
        }
        None => reconciler,
    };
    let mut early_stop = stop_rx.clone();
    let resumed = tokio::select! {
        v = reconciler.validated_on_node() => v,
        () = wait_stop(&mut early_stop) => false,
    };
    if resumed {
        tracing::info!(
            node = %node_name,
            "the Node shows fabricgate's validation from an earlier run; resuming it"
        );
        judge.resume_validated();
    }
    let mut loop_task = tokio::spawn(reconcile_loop(
        reconciler,
        desired_rx,
        node_rx,
        stop_rx.clone(),
        LoopTiming {
            interval,
            resync,
            retry_after,
        },
        NodeChecks {
            rdma_resources: config.kubernetes.rdma_resources.clone(),
            findings: node_findings_tx,
            plugin_grace: config.kubernetes.plugin_grace,
            held: std::sync::Arc::default(),
        },
        failpoint,
    ));

    tracing::info!(
        node = %node_name,
        interval = ?interval,
        recover_after = config.node.recover_after,
        dry_run,
        "fabricgate agent started"
    );
    let stopping = stop_rx.clone();
    // Kernel events wake the probe loop before the interval (docs/events.md).
    let wakeup = crate::agent::wakeup::Wakeup::start(
        &config.events,
        fabricgate_probes::events::EventOptions {
            verbs: prober.config().verbs == fabricgate_probes::rdma::VerbsMode::Required,
            ..Default::default()
        },
        metrics.events.clone(),
    );
    let probing = probe_loop(
        ProbeThread::spawn(prober, failpoint)?,
        &config,
        judge,
        ProbeTiming {
            interval,
            deadline: probe_deadline,
        },
        &metrics,
        Channels {
            desired: &desired_tx,
            node_findings: node_findings_rx,
            dra: dra_rx,
            registrations: registrations_rx,
            stop: stop_rx,
        },
        peer_agent.as_ref(),
        wakeup,
    );
    // Supervision: the probe loop, the Node writer and the server live and die together. A
    // panic already ended the process (exit_on_panic); a task that returns early ends it too.
    let ended = tokio::select! {
        r = probing => Ended::Probe(r),
        r = &mut loop_task => Ended::Reconcile(r),
        r = &mut server => Ended::Server(r),
    };
    let result = match ended {
        Ended::Probe(r) => r,
        // Shutting down: whichever part noticed first.
        _ if *stopping.borrow() => Ok(()),
        Ended::Reconcile(r) => Err(r.err().map_or_else(
            || Error::Internal {
                message: "the Node writer stopped while the agent runs".into(),
            },
            |e| task_died("the Node writer", &e),
        )),
        Ended::Server(r) => Err(match r {
            Ok(Ok(())) => Error::Internal {
                message: "the metrics server stopped while the agent runs".into(),
            },
            Ok(Err(e)) => Error::Internal {
                message: format!("the metrics server failed: {e}"),
            },
            Err(e) => task_died("the metrics server", &e),
        }),
    };
    // The reconcile loop finishes or abandons its write within WRITE_GRACE. (A handle that
    // completed inside the select above is finished and not polled again.)
    drop(desired_tx);
    if !loop_task.is_finished() {
        let _ = timeout(WRITE_GRACE + Duration::from_millis(500), &mut loop_task).await;
    }
    if let Some(w) = watch_task {
        w.abort();
    }
    for t in dra_tasks {
        t.abort();
    }
    if !server.is_finished() {
        let _ = timeout(Duration::from_millis(500), &mut server).await;
    }
    tracing::info!(node = %node_name, "fabricgate agent stopped");
    result
}

/// Mirror the DeviceTaintRule writer's state into `fabricgate_dra_device_rules_writable`.
async fn follow_device_rules(
    metrics: Arc<Metrics>,
    mut state: watch::Receiver<node::dra::RulesState>,
) {
    loop {
        let now = *state.borrow_and_update();
        metrics.set_dra_device_rules(now == node::dra::RulesState::On);
        if state.changed().await.is_err() {
            return;
        }
    }
}

/// The responder's address as peers reach it, `ip:port`; `None` for a wildcard address.
fn advertised(addr: std::net::SocketAddr) -> Option<String> {
    (!addr.ip().is_unspecified()).then(|| addr.to_string())
}

/// Which of the agent's concurrent parts ended first.
enum Ended {
    Probe(Result<()>),
    Reconcile(std::result::Result<(), tokio::task::JoinError>),
    Server(std::result::Result<std::io::Result<()>, tokio::task::JoinError>),
}

fn task_died(what: &str, e: &tokio::task::JoinError) -> Error {
    Error::Internal {
        message: format!("{what} task ended abnormally: {e}"),
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    wait_stop(&mut stop).await;
}

/// Completes once shutdown was requested (the watch `Ref` is not held across awaits).
pub(super) async fn wait_stop(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
