//! `fabricgate run`: probe on a jittered interval on a dedicated thread, apply hysteresis, keep
//! the Node in line from a separate task, serve metrics, stop cleanly on a signal.
//!
//! Shutdown is a future passed in (as in mini-redis), so tests drive it without signals.

use crate::cli::{LogFormat, RunArgs};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::metrics::{self, Metrics};
use crate::node::{self, Reconciler, RetryAfter};
use crate::policy::{self, Hysteresis, Verdict};
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
    pub config: Config,
    pub prober: Prober,
    pub interval: Duration,
    pub resync: Duration,
    pub dry_run: bool,
    pub listener: tokio::net::TcpListener,
    pub client: Option<kube::Client>,
    pub retry_after: RetryAfter,
    pub metrics: Arc<Metrics>,
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
        let prober = Prober::new(roots, probe_config);
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
        })
    }
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
    } = agent;
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });

    let server = tokio::spawn(metrics::serve(
        listener,
        Arc::clone(&metrics),
        stopped(stop_rx.clone()),
    ));

    let (desired_tx, desired_rx) = watch::channel::<Option<Verdict>>(None);
    let mut hysteresis = Hysteresis::new(&config);
    let reconciler = Reconciler::new(
        node_name.clone(),
        config.node.clone(),
        client,
        dry_run,
        Arc::clone(&metrics),
    );
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
    let loop_task = tokio::spawn(reconcile_loop(
        reconciler,
        desired_rx,
        stop_rx.clone(),
        LoopTiming { interval, resync },
        retry_after,
    ));

    tracing::info!(
        node = %node_name,
        interval = ?interval,
        recover_after = config.node.recover_after,
        dry_run,
        "fabricgate agent started"
    );
    let result = probe_loop(
        prober,
        &config,
        hysteresis,
        interval,
        &metrics,
        &desired_tx,
        stop_rx,
    )
    .await;

    // The reconcile loop finishes or abandons its write within WRITE_GRACE.
    drop(desired_tx);
    let _ = timeout(WRITE_GRACE + Duration::from_millis(500), loop_task).await;
    let _ = timeout(Duration::from_millis(500), server).await;
    tracing::info!(node = %node_name, "fabricgate agent stopped");
    result
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    wait_stop(&mut stop).await;
}

/// Completes once shutdown was requested (the watch `Ref` is not held across awaits).
async fn wait_stop(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn probe_loop(
    prober: Prober,
    config: &Config,
    mut hysteresis: Hysteresis,
    interval: Duration,
    metrics: &Metrics,
    desired: &watch::Sender<Option<Verdict>>,
    mut stop: watch::Receiver<bool>,
) -> Result<()> {
    let probes = ProbeThread::spawn(prober)?;
    let mut jitter = Jitter::new();
    let mut next = Instant::now();
    let mut last_ready: Option<bool> = None;
    loop {
        tokio::select! {
            biased;
            () = wait_stop(&mut stop) => return Ok(()),
            () = sleep_until(next) => {}
        }
        let started = Instant::now();
        // Never later than the interval: "within one interval" holds with jitter.
        next = started + interval.mul_f64(1.0 - 0.1 * jitter.next_f64());
        let report = tokio::select! {
            biased;
            () = wait_stop(&mut stop) => return Ok(()),
            r = probes.probe() => r?,
        };
        let instant = policy::evaluate(&report, config);
        let instant_ready = instant.ready;
        let verdict = hysteresis.apply(instant);
        metrics.record_probe(&report, &verdict);
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
        desired.send_if_modified(|d| {
            if d.as_ref() == Some(&verdict) {
                false
            } else {
                *d = Some(verdict);
                true
            }
        });
    }
}

/// The prober lives on its own thread for the agent's life: a probe may block (hung mounts,
/// verbs), and its storage workers must persist across ticks. A thread stuck in a probe does not
/// delay shutdown: nobody joins it.
struct ProbeThread {
    requests: std::sync::mpsc::Sender<oneshot::Sender<ProbeReport>>,
}

impl ProbeThread {
    fn spawn(mut prober: Prober) -> Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<oneshot::Sender<ProbeReport>>();
        std::thread::Builder::new()
            .name("fabricgate-probe".into())
            .spawn(move || {
                while let Ok(reply) = rx.recv() {
                    let _ = reply.send(prober.probe());
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
        self.requests.send(tx).map_err(|_| dead())?;
        rx.await.map_err(|_| dead())
    }
}

#[derive(Debug, Clone, Copy)]
struct LoopTiming {
    interval: Duration,
    resync: Duration,
}

/// Applies the latest verdict whenever it changes, re-reads the Node every `resync` to undo
/// drift, and backs off with jitter (honouring `Retry-After`) while the API server fails.
async fn reconcile_loop(
    mut rec: Reconciler,
    mut desired: watch::Receiver<Option<Verdict>>,
    mut stop: watch::Receiver<bool>,
    timing: LoopTiming,
    retry_after: RetryAfter,
) {
    let mut failures: u32 = 0;
    let mut deadline: Option<Instant> = None;
    let mut jitter = Jitter::new();
    let mut last_error: Option<&'static str> = None;
    loop {
        let wake = deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400));
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
        }
        let Some(verdict) = desired.borrow_and_update().clone() else {
            continue;
        };
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
                deadline = Some(Instant::now() + timing.resync);
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                let mut delay = backoff(failures, timing.interval, &mut jitter);
                if e.is_throttled() {
                    // The header (seen by the client layer) or the Status body carries it.
                    let header = retry_after.take();
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
                deadline = Some(Instant::now() + delay);
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
