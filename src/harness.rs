//! What every long-running subcommand (the agent, the guard, the admission check, the webhook)
//! sets up the same way: logging, the panic rule, the file-descriptor limit, the async runtime,
//! one shutdown on SIGTERM or SIGINT, the metrics listener, the cluster clients and the
//! server's wind-down. Leader election is `cluster::lease`, which the two controllers share.

use crate::cli::LogFormat;
use crate::error::{Error, Result};
use crate::observe::server::{self, Limits, Nofile};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long the runtime waits, once the work has returned, for blocking tasks (a DNS lookup
/// of an unreachable API server) before the process exits anyway.
const RUNTIME_GRACE: Duration = Duration::from_millis(200);

/// How many threads a subcommand's async work gets.
#[derive(Debug, Clone, Copy)]
pub enum Threads {
    /// The agent: its probe, event listener and peers have threads of their own, and what is
    /// left (timers, the Node writer, the metrics server) is waiting. A multi-threaded runtime
    /// handed every tick between its threads: ~6 context switches per probe, a tenth of the
    /// agent's CPU at `--interval 1s`.
    One,
    /// The controllers and the webhook: requests served while a sweep runs.
    Two,
}

/// A long-running subcommand's process: logging on, a panic anywhere ends it, its
/// descriptor limit raised, its runtime built.
pub struct Harness {
    runtime: tokio::runtime::Runtime,
    /// The descriptor limit after raising it (the servers' connection caps follow it).
    pub nofile: Nofile,
}

impl Harness {
    /// # Errors
    /// [`Error::Io`] when the async runtime cannot start (threads or an epoll descriptor).
    pub fn start(log_format: LogFormat, threads: Threads) -> Result<Self> {
        init_logging(log_format);
        exit_on_panic();
        let nofile = server::raise_nofile();
        let mut builder = match threads {
            Threads::One => tokio::runtime::Builder::new_current_thread(),
            Threads::Two => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(2);
                b
            }
        };
        let runtime = builder.enable_all().build().map_err(|source| Error::Io {
            what: "start the async runtime".into(),
            source,
        })?;
        Ok(Self { runtime, nofile })
    }

    /// Run `work` to its end, handing it the one shutdown (SIGTERM or SIGINT); then give the
    /// runtime's blocking tasks [`RUNTIME_GRACE`].
    ///
    /// # Errors
    /// What `work` returns.
    pub fn run<F, Fut>(self, work: F) -> Result<()>
    where
        F: FnOnce(Shutdown) -> Fut,
        Fut: Future<Output = Result<()>>,
    {
        let result = self.runtime.block_on(work(Shutdown));
        self.runtime.shutdown_timeout(RUNTIME_GRACE);
        result
    }
}

/// The process's one shutdown: awaiting it completes on the first SIGTERM or SIGINT.
#[derive(Debug, Clone, Copy)]
pub struct Shutdown;

impl Shutdown {
    /// Completes on SIGTERM or SIGINT; when the handlers cannot be installed it says so and
    /// completes at once (a process that could never be stopped cleanly does not start).
    pub async fn signalled(self) {
        if let Err(e) = shutdown_signal().await {
            tracing::error!("cannot install signal handlers ({e}); stopping");
        }
    }
}

/// Bind the metrics listener `addr` of `flag`, or a usage error naming the flag.
///
/// # Errors
/// [`Error::Usage`] naming `flag` when the address cannot be bound.
pub async fn bind(addr: std::net::SocketAddr, flag: &str) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Usage {
            flag: flag.into(),
            message: format!("cannot listen on {addr}: {e}"),
        })
}

/// `given` unless empty, otherwise `prefix-<pid>`: the Lease holder's name.
pub fn identity(given: Option<String>, prefix: &str) -> String {
    given
        .filter(|i| !i.trim().is_empty())
        .unwrap_or_else(|| format!("{prefix}-{}", std::process::id()))
}

/// A leader-elected controller (the guard, the admission check): its cluster clients, its
/// `/metrics` `/healthz` `/readyz` served from `listener` while `work` runs, the one shutdown
/// handed to `work`; once `work` returns, the server closes its connections and ends.
///
/// # Errors
/// [`Error::KubeConfig`] without a cluster configuration; otherwise what `work` returns.
pub async fn serve_controller<F, Fut>(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    limits: Limits,
    shutdown: Shutdown,
    work: F,
) -> Result<()>
where
    F: FnOnce(ControllerClients, Shutdown) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let clients = crate::node::client(crate::node::RetryAfter::default()).await?;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let server = tokio::spawn(server::serve(
        listener,
        router,
        limits,
        Arc::new(()),
        async move {
            let _ = stop_rx.wait_for(|s| *s).await;
        },
    ));
    let watch = clients.watch.unwrap_or_else(|| clients.requests.clone());
    let result = work(
        ControllerClients {
            requests: clients.requests,
            watch,
        },
        shutdown,
    )
    .await;
    let _ = stop_tx.send(true);
    let _ = server.await;
    result
}

/// A controller's two clients: `requests` for the Lease and the writes (short timeouts),
/// `watch` for its watches (a read timeout above the watch's own).
pub struct ControllerClients {
    pub requests: kube::Client,
    pub watch: kube::Client,
}

/// Make any panic, on any thread or task, end the process with [`crate::EXIT_AGENT_PANIC`]:
/// never a half-alive process whose `/healthz` goes on while the task that did its work is
/// dead.
fn exit_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        tracing::error!(
            panic = %info,
            "a task of fabricgate panicked; exiting with status {} so that it is restarted",
            crate::EXIT_AGENT_PANIC
        );
        std::process::exit(i32::from(crate::EXIT_AGENT_PANIC));
    }));
}

/// Install the global `tracing` subscriber (level from `RUST_LOG`, default `info`).
pub fn init_logging(format: LogFormat) {
    // kube's HTTP layer logs every failed request at ERROR; the callers already say what
    // failed and when they retry, once per kind of failure.
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
async fn shutdown_signal() -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    Ok(())
}
