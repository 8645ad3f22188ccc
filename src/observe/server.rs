//! The agent's HTTP server (`/metrics`, `/healthz`, `/readyz`), built so that no client can
//! starve it or the probe (docs/hardening.md, "HTTP server"):
//!
//! - every connection must send its request head within [`Limits::header_read_timeout`] and
//!   lives at most [`Limits::max_connection_age`]; request heads are capped at
//!   [`MAX_HEADER_BYTES`];
//! - at most [`Limits::max_connections`] connections are open at once. A new connection that
//!   finds the table full evicts the oldest connection that is not serving a request (an idle
//!   or silent one), so a flood of idle connections cannot lock out the kubelet's probe; when
//!   every connection is busy, the new one is closed at once;
//! - the cap is derived from `RLIMIT_NOFILE` ([`raise_nofile`], [`Limits::for_nofile`]) so that
//!   [`FD_RESERVE`] descriptors always stay free for the probe, the API client and the runtime.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::Notify;
use tower::ServiceExt;

/// Default cap on concurrent connections (`--metrics-max-connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Upper bound of `--metrics-max-connections`.
pub const MAX_MAX_CONNECTIONS: usize = 4096;
/// A client must send its whole request head within this time (idle keep-alive included).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// No connection lives longer than this, whatever it does.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);
/// Largest request head accepted (hyper's minimum buffer is 8 KiB).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Descriptors never handed to HTTP connections: the probe (sysfs, verbs contexts, statfs
/// workers), the Kubernetes client and the runtime itself.
pub const FD_RESERVE: u64 = 64;
/// Pause after an `accept` error such as EMFILE, so a full table is not a busy loop.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// The server's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub max_connection_age: Duration,
    /// Bound on one request, its body included, and its answer; a request still running
    /// then gets `503` and its connection is closed. `None`: only the connection's age
    /// bounds it (the agent's handlers never wait on a client).
    pub request_timeout: Option<Duration>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: HEADER_READ_TIMEOUT,
            max_connection_age: MAX_CONNECTION_AGE,
            request_timeout: None,
        }
    }
}

impl Limits {
    /// The requested connection cap, lowered so that connections can take at most half of
    /// what the descriptor limit leaves after [`FD_RESERVE`]; never below 2.
    pub fn for_nofile(requested: usize, nofile_soft: Option<u64>) -> Self {
        let cap = nofile_soft.map_or(requested, |soft| {
            let spare = soft.saturating_sub(FD_RESERVE) / 2;
            requested.min(usize::try_from(spare).unwrap_or(usize::MAX))
        });
        Self {
            max_connections: cap.max(2),
            ..Self::default()
        }
    }
}

/// The descriptor limit after start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nofile {
    /// Soft limit before raising it; `None`: unlimited.
    pub before: Option<u64>,
    /// Soft limit now; `None`: unlimited.
    pub soft: Option<u64>,
    /// Hard limit; `None`: unlimited.
    pub hard: Option<u64>,
}

/// Raise the soft `RLIMIT_NOFILE` to the hard limit (the kernel lets any process do that), so
/// the agent's descriptor budget is all the container allows.
pub fn raise_nofile() -> Nofile {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let now = getrlimit(Resource::Nofile);
    let mut out = Nofile {
        before: now.current,
        soft: now.current,
        hard: now.maximum,
    };
    if now.current != now.maximum {
        let wanted = Rlimit {
            current: now.maximum,
            maximum: now.maximum,
        };
        match setrlimit(Resource::Nofile, wanted) {
            Ok(()) => out.soft = now.maximum,
            Err(e) => tracing::warn!(
                error = %e,
                soft = ?now.current,
                hard = ?now.maximum,
                "cannot raise the open-file limit to its hard limit; keeping the soft limit"
            ),
        }
    }
    out
}

/// One open connection, as the accept loop sees it.
#[derive(Debug, Default)]
struct Slot {
    /// A request is being served (the connection is not evictable).
    busy: AtomicBool,
    /// At least one request arrived.
    served: AtomicBool,
    /// Told to close (evicted by a newer connection).
    evict: Notify,
}

#[derive(Debug, Default)]
struct Table {
    next_id: u64,
    open: BTreeMap<u64, Arc<Slot>>,
}

/// What happened to a new connection at the door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Admitted,
    /// Admitted after closing the oldest idle connection.
    Evicted,
    /// Closed at once: the table is full of connections serving requests.
    Rejected,
}

/// Counts of what the server did, for `/metrics`.
pub trait ServerObserver: Send + Sync + 'static {
    fn connection(&self, admission: Admission, open: usize);
    fn closed(&self, open: usize);
}

impl ServerObserver for () {
    fn connection(&self, _: Admission, _: usize) {}
    fn closed(&self, _: usize) {}
}

fn lock(table: &Mutex<Table>) -> MutexGuard<'_, Table> {
    table
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn admit(table: &Mutex<Table>, max: usize) -> (Admission, Option<(u64, Arc<Slot>)>, usize) {
    let mut t = lock(table);
    let mut admission = Admission::Admitted;
    if t.open.len() >= max {
        // BTreeMap order is age order: the first idle one is the oldest idle one.
        let victim = t
            .open
            .iter()
            .find(|(_, s)| !s.busy.load(Ordering::Acquire))
            .map(|(&id, _)| id);
        let Some(victim) = victim else {
            let open = t.open.len();
            return (Admission::Rejected, None, open);
        };
        if let Some(slot) = t.open.remove(&victim) {
            slot.evict.notify_one();
        }
        admission = Admission::Evicted;
    }
    t.next_id = t.next_id.wrapping_add(1);
    let id = t.next_id;
    let slot = Arc::new(Slot::default());
    t.open.insert(id, Arc::clone(&slot));
    let open = t.open.len();
    (admission, Some((id, slot)), open)
}

/// Whether an `accept` error concerns only that one connection (retry at once) rather than
/// the process (EMFILE, ENFILE, ENOMEM, ENOBUFS: pause first).
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// Serve `router` on `listener` within `limits` until `shutdown` completes.
///
/// # Errors
/// None today: accept errors are logged and retried; the signature leaves room for them.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    observer: Arc<dyn ServerObserver>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let plain = |tcp: tokio::net::TcpStream| async move { Some(tcp) };
    serve_with(listener, router, limits, observer, shutdown, plain).await
}

/// [`serve`], each accepted connection first handed to `handshake` (a TLS accept, say):
/// `None` closes it. The handshake runs inside the connection's bounds (it counts against
/// the cap, is evictable, and must be over, request head included, within
/// [`Limits::header_read_timeout`]), so a client that stalls it holds nothing for long.
///
/// # Errors
/// As [`serve`].
pub async fn serve_with<H, F, S>(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    observer: Arc<dyn ServerObserver>,
    shutdown: impl Future<Output = ()> + Send,
    handshake: H,
) -> std::io::Result<()>
where
    H: Fn(tokio::net::TcpStream) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Option<S>> + Send + 'static,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let table = Arc::new(Mutex::new(Table::default()));
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(MAX_HEADER_BYTES)
        .keep_alive(true);
    let max = limits.max_connections.max(1);
    tokio::pin!(shutdown);
    let mut last_accept_error: Option<std::io::ErrorKind> = None;
    loop {
        let accepted = tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => {
                last_accept_error = None;
                stream
            }
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                if last_accept_error != Some(e.kind()) {
                    tracing::warn!(
                        error = %e,
                        "cannot accept a connection; pausing the listener briefly"
                    );
                }
                last_accept_error = Some(e.kind());
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    () = tokio::time::sleep(ACCEPT_ERROR_PAUSE) => {}
                }
                continue;
            }
        };
        let (admission, slot, open) = admit(&table, max);
        observer.connection(admission, open);
        let Some((id, slot)) = slot else {
            drop(stream);
            continue;
        };
        let router = router.clone();
        let table = Arc::clone(&table);
        let observer = Arc::clone(&observer);
        let builder = builder.clone();
        let handshake = handshake.clone();
        let age = limits.max_connection_age;
        let header_timeout = limits.header_read_timeout;
        let request_timeout = limits.request_timeout;
        tokio::spawn(async move {
            let busy = Arc::clone(&slot);
            let service = hyper::service::service_fn(move |req| {
                let router = router.clone();
                let busy = Arc::clone(&busy);
                async move {
                    busy.served.store(true, Ordering::Release);
                    busy.busy.store(true, Ordering::Release);
                    let response = match request_timeout {
                        None => router.oneshot(req).await,
                        Some(limit) => match tokio::time::timeout(limit, router.oneshot(req)).await
                        {
                            Ok(r) => r,
                            Err(_) => Ok(timed_out()),
                        },
                    };
                    busy.busy.store(false, Ordering::Release);
                    response
                }
            });
            let conn = async move {
                if let Some(stream) = handshake(stream).await {
                    let _ = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                }
            };
            // A connection that never sends a request (or never finishes its handshake) is
            // closed after the header timeout whatever hyper's timer does before the first
            // byte.
            let silent = async {
                tokio::time::sleep(header_timeout).await;
                if slot.served.load(Ordering::Acquire) {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                () = conn => {}
                () = slot.evict.notified() => {}
                () = silent => {}
                () = tokio::time::sleep(age) => {}
            }
            let open = {
                let mut t = lock(&table);
                t.open.remove(&id);
                t.open.len()
            };
            observer.closed(open);
        });
        if admission == Admission::Evicted {
            // Let the evicted connection's task close its socket before the next accept.
            tokio::task::yield_now().await;
        }
    }
}

/// The answer to a request that ran past [`Limits::request_timeout`]; the connection closes.
fn timed_out() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        http::StatusCode::SERVICE_UNAVAILABLE,
        [(http::header::CONNECTION, "close")],
        "request timed out\n",
    )
        .into_response()
}

/// Parse `--metrics-addr`: `IP:PORT`, `[IPv6]:PORT`, or an IPv6 address without brackets
/// followed by `:PORT` (what `$(HOST_IP):9464` becomes on an IPv6 node).
///
/// # Errors
/// A message naming what is wrong.
pub fn parse_listen_addr(text: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(a) = text.parse::<std::net::SocketAddr>() {
        return Ok(a);
    }
    let bad = || {
        format!(
            "{text:?} is not IP:PORT (e.g. 10.0.0.7:9464, [fd00::7]:9464, or $(HOST_IP):9464 \
             in a manifest)"
        )
    };
    let (ip, port) = text.rsplit_once(':').ok_or_else(bad)?;
    let ip: std::net::IpAddr = ip.parse().map_err(|_| bad())?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    Ok(std::net::SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_keeps_the_reserve_free() {
        assert_eq!(Limits::for_nofile(64, None).max_connections, 64);
        assert_eq!(Limits::for_nofile(64, Some(1_048_576)).max_connections, 64);
        assert_eq!(Limits::for_nofile(64, Some(128)).max_connections, 32);
        assert_eq!(Limits::for_nofile(64, Some(10)).max_connections, 2);
    }

    #[test]
    fn a_full_table_evicts_the_oldest_idle_connection_or_rejects() {
        let t = Mutex::new(Table::default());
        let (a, first, _) = admit(&t, 2);
        assert_eq!(a, Admission::Admitted);
        let (_, second, _) = admit(&t, 2);
        let (first, second) = (first.unwrap(), second.unwrap());
        first.1.busy.store(true, Ordering::Release);
        let (a, third, open) = admit(&t, 2);
        assert_eq!((a, open), (Admission::Evicted, 2));
        assert!(!lock(&t).open.contains_key(&second.0), "oldest idle goes");
        assert!(lock(&t).open.contains_key(&first.0), "a busy one stays");
        third.unwrap().1.busy.store(true, Ordering::Release);
        let (a, none, _) = admit(&t, 2);
        assert_eq!(a, Admission::Rejected);
        assert!(none.is_none());
    }

    #[test]
    fn listen_addresses_with_and_without_brackets() {
        assert_eq!(
            parse_listen_addr("10.0.0.7:9464").unwrap().to_string(),
            "10.0.0.7:9464"
        );
        assert_eq!(
            parse_listen_addr("fd00::7:9464").unwrap().to_string(),
            "[fd00::7]:9464"
        );
        assert_eq!(
            parse_listen_addr("[fd00::7]:9464").unwrap().to_string(),
            "[fd00::7]:9464"
        );
        for bad in ["", ":9464", "10.0.0.7", "$(HOST_IP):9464", "10.0.0.7:99999"] {
            assert!(parse_listen_addr(bad).is_err(), "{bad}");
        }
    }
}
