//! `fabricgate run`: probe on a jittered interval on a dedicated thread, apply hysteresis, keep
//! the Node in line from a separate task, serve metrics, stop cleanly on a signal.
//!
//! Shutdown is a future passed in (as in mini-redis), so tests drive it without signals.

use crate::cli::{LogFormat, RunArgs};
use crate::config::Config;
use crate::config::peers::PeerSpec;
use crate::error::{Error, Result};
use crate::node::{self, Reconciler, RetryAfter};
use crate::observe::health::HealthTiming;
use crate::observe::metrics::{self, Metrics};
use crate::observe::server::Limits;
use crate::peers::{self, PeerAgent, Rounds};
use crate::policy::agent_fault::{self, AgentFault};
use crate::policy::failclosed;
use crate::policy::{self, Finding, Hysteresis, Verdict};
use fabricgate_probes::rdma::peer::Identity;
use fabricgate_probes::{ProbeReport, Prober};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, sleep_until, timeout};

/// How long an in-flight Node write may finish after a shutdown signal before it is abandoned.
const WRITE_GRACE: Duration = Duration::from_secs(2);
/// First retry delay after an API error; doubles up to the probe interval.
const BACKOFF_BASE: Duration = Duration::from_millis(200);

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
}

impl Failpoint {
    fn from_env() -> Self {
        match std::env::var("FABRICGATE_FAILPOINT").as_deref() {
            Ok("reconcile-panic") => Self::ReconcilePanic,
            Ok("probe-panic") => Self::ProbePanic,
            Ok("probe-stall") => Self::ProbeStall,
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
        let config = args.probe.load_config()?;
        let roots = args.probe.roots()?;
        let mut probe_config = args.probe.probe_config(&config);
        probe_config.counters_interval = config.rdma.counters_interval(args.interval);
        probe_config.counter_names = crate::observe::metrics::counters_read();
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
            let rounds = Rounds::new(&config.peers, &extra, identity, roots);
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
fn later(now: Instant, d: Duration) -> Instant {
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
    let peer_agent = match peers {
        Some((agent, rounds)) => {
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
    let mut hysteresis = Hysteresis::new(&config);
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
    let reconciler = Reconciler::new(
        node_name.clone(),
        config.node.clone(),
        client.map(|c| c.requests),
        dry_run,
        Arc::clone(&metrics),
    )
    .with_required_labels(config.placement.required_labels.clone())
    .with_breaker_ledger(&namespace);
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
        hysteresis.resume_validated();
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
        ProbeThread::spawn(
            prober,
            failclosed::PluginHostChecks::from_config(&config.kubernetes),
            failpoint,
        )?,
        &config,
        hysteresis,
        ProbeTiming {
            interval,
            deadline: probe_deadline,
        },
        &metrics,
        Channels {
            desired: &desired_tx,
            node_findings: node_findings_rx,
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
    if !server.is_finished() {
        let _ = timeout(Duration::from_millis(500), &mut server).await;
    }
    tracing::info!(node = %node_name, "fabricgate agent stopped");
    result
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
async fn wait_stop(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// What the probe loop talks through: verdicts out; the watched Node's findings and the stop
/// signal in.
struct Channels<'a> {
    desired: &'a watch::Sender<Option<Verdict>>,
    node_findings: watch::Receiver<Vec<Finding>>,
    stop: watch::Receiver<bool>,
}

#[derive(Debug, Clone, Copy)]
struct ProbeTiming {
    interval: Duration,
    /// A probe still running after this is an agent error (`--probe-deadline`).
    deadline: Duration,
}

/// Hand a verdict to the Node writer when it differs from the last one.
fn publish(desired: &watch::Sender<Option<Verdict>>, verdict: Verdict) {
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
fn log_agent_error(last: &mut Option<AgentFault>, now: Option<&AgentFault>) {
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
async fn probe_loop(
    probes: ProbeThread,
    config: &Config,
    mut hysteresis: Hysteresis,
    timing: ProbeTiming,
    metrics: &Metrics,
    channels: Channels<'_>,
    peers: Option<&PeerAgent>,
    mut wakeup: crate::agent::wakeup::Wakeup,
) -> Result<()> {
    let Channels {
        desired,
        mut node_findings,
        mut stop,
    } = channels;
    let interval = timing.interval;
    let mut jitter = Jitter::new();
    let mut next = Instant::now();
    let mut last_ready: Option<bool> = None;
    let mut last_fault: Option<AgentFault> = None;
    let mut last_verdict: Option<Verdict> = None;
    let mut last_probed: Option<Probed> = None;
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
                    && let Some(instant) =
                        crate::agent::wakeup::fail_fast(&mut last.report, &states, config)
                {
                    let verdict = agent_fault::gate(hysteresis.apply(instant), None, config);
                    tracing::warn!(
                        reasons = %verdict.reasons().join("; "),
                        "node not ready (port state read on a kernel event; the full probe \
                         follows)"
                    );
                    last_ready = Some(verdict.ready);
                    last_verdict = Some(verdict.clone());
                    publish(desired, verdict);
                }
                true
            }
        };
        let probed: &Probed = match (&last_probed, fresh) {
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
                            let fault = AgentFault::stalled(timing.deadline);
                            let base = last_verdict.clone().unwrap_or_else(|| {
                                policy::evaluate(&empty_report(), config)
                            });
                            let verdict = agent_fault::verdict(base, &fault, config);
                            metrics.set_agent_error(Some(&fault.message));
                            log_agent_error(&mut last_fault, Some(&fault));
                            publish(desired, agent_fault::gate(verdict, Some(&fault), config));
                        }
                    }
                };
                last_probed.insert(probed)
            }
        };
        let report = &probed.report;
        let mut found = node_findings.borrow_and_update().clone();
        found.extend(probed.plugin.findings.iter().cloned());
        let mut instant = policy::evaluate_with(report, config, &found);
        if let Some(p) = peers {
            if fresh {
                p.update_ports(&report.rdma);
            }
            if let Some(finding) = p.required_finding() {
                instant = crate::peers::apply_finding(instant, finding, config);
            }
        }
        let instant_ready = instant.ready;
        let fault = agent_fault::classify(report, &probed.own_mounts)
            .filter(|f| {
                // Devices missing from an incomplete plugin set are the plugin's fault.
                !(f.cause == agent_fault::Cause::NoDeviceAccess
                    && probed.plugin.incomplete_device_set)
            })
            .or_else(|| agent_fault::config_mismatch(report, config));
        // An agent error says nothing about the node: hysteresis does not see that probe, so
        // the node continues where it was once the agent can judge again.
        let verdict = match &fault {
            None => hysteresis.apply(instant),
            Some(f) => agent_fault::verdict(instant, f, config),
        };
        metrics.set_agent_error(fault.as_ref().map(|f| f.message.as_str()));
        log_agent_error(&mut last_fault, fault.as_ref());
        if fresh {
            metrics.record_probe(report, &verdict);
        }
        let verdict = agent_fault::gate(verdict, fault.as_ref(), config);
        last_verdict = Some(verdict.clone());
        tracing::debug!(
            instant_ready,
            ready = verdict.ready,
            good_streak = hysteresis.good_streak(),
            "probe done"
        );
        if last_ready != Some(verdict.ready) {
            if verdict.ready {
                tracing::info!(
                    good_probes = hysteresis.good_streak(),
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

/// What a probe of nothing gives (the base verdict of a stall before any probe completed).
pub(crate) fn empty_report() -> ProbeReport {
    ProbeReport {
        timestamp: 0.0,
        rdma: fabricgate_probes::rdma::RdmaReport::default(),
        storage: fabricgate_probes::storage::StorageReport::default(),
        netdevs: Vec::new(),
        gpudirect: fabricgate_probes::gpudirect::GpudirectReport::default(),
        timings: fabricgate_probes::ProbeTimings::default(),
    }
}

/// One probe's report and the agent's own blind spots found beside it.
#[derive(Clone)]
struct Probed {
    report: ProbeReport,
    /// [`agent_fault::own_mount_problems`], and a device-plugins directory the agent lacks.
    own_mounts: Vec<String>,
    /// [`failclosed::PluginHostChecks`] on this probe.
    plugin: failclosed::PluginHostFindings,
}

/// The prober lives on its own thread for the agent's life: a probe may block (hung mounts,
/// verbs), and its storage workers must persist across ticks. A thread stuck in a probe does not
/// delay shutdown: nobody joins it.
struct ProbeThread {
    requests: std::sync::mpsc::Sender<ProbeRequest>,
}

/// What the probe thread is asked for.
enum ProbeRequest {
    /// A full probe.
    Full(oneshot::Sender<Probed>),
    /// Only the ports' states (the fail-fast read of an event-triggered probe).
    PortStates(oneshot::Sender<Vec<fabricgate_probes::rdma::sysfs::PortStateRead>>),
}

impl ProbeThread {
    fn spawn(
        mut prober: Prober,
        plugin_checks: failclosed::PluginHostChecks,
        failpoint: Failpoint,
    ) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<ProbeRequest>();
        let live_procfs = prober.roots().procfs_root() == std::path::Path::new("/proc");
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
                    let mut own_mounts = agent_fault::own_mount_problems(&report, live_procfs);
                    let plugin = plugin_checks.run(prober.roots(), &report.rdma);
                    own_mounts.extend(plugin.own_problems.iter().cloned());
                    done += 1;
                    let _ = reply.send(Probed {
                        report,
                        own_mounts,
                        plugin,
                    });
                }
            })
            .map_err(|e| Error::Internal {
                message: format!("cannot start the probe thread: {e}"),
            })?;
        Ok(Self { requests: tx })
    }

    async fn probe(&self) -> Result<Probed> {
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
struct NodeChecks {
    rdma_resources: Vec<String>,
    findings: watch::Sender<Vec<Finding>>,
}

impl NodeChecks {
    fn observe(&self, node: &k8s_openapi::api::core::v1::Node) {
        let found = failclosed::device_plugin_findings(node, &self.rdma_resources);
        self.findings.send_if_modified(|have| {
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
}

/// When the Node writer acts: the probe interval caps its backoff, `resync` re-reads the Node,
/// `retry_after` is the API server's last `Retry-After`.
struct LoopTiming {
    interval: Duration,
    resync: Duration,
    retry_after: RetryAfter,
}

/// Applies the latest verdict whenever it changes, re-reads the Node every `resync` to undo
/// drift, and backs off with jitter (honouring `Retry-After`) while the API server fails.
async fn reconcile_loop(
    mut rec: Reconciler,
    mut desired: watch::Receiver<Option<Verdict>>,
    mut node_updates: tokio::sync::mpsc::Receiver<Option<k8s_openapi::api::core::v1::Node>>,
    mut stop: watch::Receiver<bool>,
    timing: LoopTiming,
    checks: NodeChecks,
    failpoint: Failpoint,
) {
    let mut failures: u32 = 0;
    let mut deadline: Option<Instant> = None;
    let mut jitter = Jitter::new();
    let mut last_error: Option<&'static str> = None;
    let mut watching = true;
    loop {
        let wake = deadline.unwrap_or_else(|| later(Instant::now(), Duration::from_secs(86_400)));
        tokio::select! {
            biased;
            () = wait_stop(&mut stop) => return,
            // While failing, wait for the backoff deadline; it reconciles the latest verdict.
            r = desired.changed(), if failures == 0 => {
                if r.is_err() {
                    return;
                }
            }
            () = sleep_until(wake), if deadline.is_some() => {
                if failures == 0 {
                    rec.invalidate();
                }
            }
            // Someone else changed the Node (or the watch broke): reconcile against it now.
            update = node_updates.recv(), if watching => {
                match update {
                    Some(Some(node)) => {
                        checks.observe(&node);
                        if !rec.observe(node) || failures > 0 {
                            continue;
                        }
                    }
                    Some(None) => {
                        rec.forget_observed();
                        continue;
                    }
                    // No watch (dry run without a cluster): stop polling this arm.
                    None => {
                        watching = false;
                        continue;
                    }
                }
            }
        }
        let Some(verdict) = desired.borrow_and_update().clone() else {
            continue;
        };
        if failpoint == Failpoint::ReconcilePanic {
            panic!("failpoint reconcile-panic: the reconcile task panics");
        }
        let result = {
            let fut = rec.reconcile(&verdict);
            tokio::pin!(fut);
            tokio::select! {
                r = &mut fut => r,
                () = wait_stop(&mut stop) => {
                    match timeout(WRITE_GRACE, &mut fut).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => tracing::warn!(error = %e, "last Node write failed at shutdown"),
                        Err(_) => tracing::warn!("abandoned an in-flight Node write at shutdown"),
                    }
                    return;
                }
            }
        };
        match result {
            Ok(outcome) => {
                if failures > 0 {
                    tracing::info!(
                        node = %rec.node_name(),
                        failures,
                        writes = outcome.writes,
                        "API server reachable again; Node reconciled"
                    );
                }
                failures = 0;
                last_error = None;
                deadline = Some(later(Instant::now(), timing.resync));
            }
            Err(e) => {
                // What the watch showed may be what the failed write was based on.
                rec.distrust_observed();
                failures = failures.saturating_add(1);
                let mut delay = backoff(failures, timing.interval, &mut jitter);
                if e.is_throttled() {
                    // The header (seen by the client layer) or the Status body carries it.
                    let header = timing.retry_after.take();
                    if let Some(server) = e.retry_after().or(header) {
                        delay = delay.max(server);
                    }
                }
                let label = e.metric_label();
                if last_error != Some(label) {
                    tracing::warn!(error = %e, retry_in = ?delay, "Node reconcile failed; backing off");
                } else {
                    tracing::debug!(error = %e, retry_in = ?delay, failures, "Node reconcile failed again");
                }
                last_error = Some(label);
                deadline = Some(later(Instant::now(), delay));
            }
        }
    }
}

/// Exponential from [`BACKOFF_BASE`], capped at the probe interval (so the agent converges
/// within one interval of the server's return), with "equal jitter" (half fixed, half random).
fn backoff(failures: u32, interval: Duration, jitter: &mut Jitter) -> Duration {
    let exp = BACKOFF_BASE.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
    let capped = exp.min(interval.max(BACKOFF_BASE));
    capped.mul_f64(0.5 + 0.5 * jitter.next_f64())
}

/// splitmix64: jitter needs spread, not cryptographic randomness.
struct Jitter(u64);

impl Jitter {
    fn new() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Self(t ^ (u64::from(std::process::id()) << 32))
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped_by_the_interval() {
        let mut j = Jitter::new();
        let interval = Duration::from_secs(10);
        for failures in 1..40 {
            let d = backoff(failures, interval, &mut j);
            let full = BACKOFF_BASE
                .saturating_mul(1u32 << (failures - 1).min(16))
                .min(interval);
            assert!(d >= full / 2 && d <= full, "{failures}: {d:?} vs {full:?}");
        }
        assert!(backoff(30, interval, &mut j) >= Duration::from_secs(5));
    }

    #[test]
    fn jitter_is_spread_over_the_unit_interval() {
        let mut j = Jitter::new();
        let xs: Vec<f64> = (0..1000).map(|_| j.next_f64()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(xs.iter().any(|&x| x < 0.1) && xs.iter().any(|&x| x > 0.9));
    }
}
