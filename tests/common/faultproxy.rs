//! A fault-injecting HTTP proxy in front of the real kube-apiserver: the agent talks plain
//! HTTP to `127.0.0.1:PORT`, the proxy forwards every request (watches included, streamed)
//! over TLS to the apiserver, unless a fault is set: a reset connection, a stall, or an HTTP
//! error status such as 429 with `Retry-After` or 500/503. An outage also cuts the
//! connections already open (a watch in flight dies as it would when the server goes away).
//!
//! It runs on its own thread and runtime; every method is synchronous. Dropping it stops it.

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

type Body = BoxBody<Bytes, hyper::Error>;
type Upstream = Client<hyper_rustls::HttpsConnector<HttpConnector>, Incoming>;

#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Close the connection without an answer.
    Reset,
    /// Hold the request this long, then forward it.
    Stall(Duration),
    /// Answer with this status; `retry_after` adds the header (and, unless `plain`, a
    /// Kubernetes Status body with `details.retryAfterSeconds`).
    Status {
        code: u16,
        retry_after: Option<u32>,
        plain: bool,
    },
}

/// One request the proxy saw and what it answered (0: reset).
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub status: u16,
    pub at: std::time::Instant,
}

type Hook = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    fault: Option<Fault>,
    /// Requests left that get `fault`; `None` = until cleared.
    budget: Option<u32>,
    /// Only requests whose path and query contain this get `fault`.
    only: Option<String>,
    seen: Vec<Seen>,
    /// Run right after the next successful GET whose path ends with the given suffix, before
    /// its answer is returned: another writer gets in between the agent's read and write.
    after_get: Option<(String, Hook)>,
}

pub struct FaultProxy {
    port: u16,
    state: Arc<Mutex<State>>,
    cut: watch::Sender<u64>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FaultProxy {
    /// Proxy to `upstream` (`https://127.0.0.1:PORT`), trusting the CA in `ca_file`.
    pub fn start(upstream: &str, ca_file: &Path) -> FaultProxy {
        let mut roots = rustls::RootCertStore::empty();
        use rustls::pki_types::pem::PemObject;
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca_file).expect("CA file") {
            roots.add(cert.expect("CA certificate")).expect("add CA");
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
        let upstream_uri: http::Uri = upstream.parse().expect("upstream URL");
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        std_listener.set_nonblocking(true).expect("nonblocking");
        let port = std_listener.local_addr().expect("addr").port();
        let state = Arc::new(Mutex::new(State::default()));
        let (cut, cut_rx) = watch::channel(0u64);
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let st = state.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("proxy runtime");
            rt.block_on(async move {
                let https = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls)
                    .https_only()
                    .enable_http1()
                    .build();
                let client: Upstream = Client::builder(TokioExecutor::new()).build(https);
                let listener =
                    tokio::net::TcpListener::from_std(std_listener).expect("tokio listener");
                let mut stop_rx = stop_rx;
                loop {
                    let accepted = tokio::select! {
                        a = listener.accept() => a,
                        _ = &mut stop_rx => return,
                    };
                    let Ok((stream, _)) = accepted else { continue };
                    let client = client.clone();
                    let st = st.clone();
                    let upstream_uri = upstream_uri.clone();
                    let mut cut_rx = cut_rx.clone();
                    cut_rx.mark_unchanged();
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req| {
                            handle(req, client.clone(), st.clone(), upstream_uri.clone())
                        });
                        let conn = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), svc);
                        tokio::select! {
                            _ = conn => {}
                            _ = cut_rx.changed() => {}
                        }
                    });
                }
            });
        });
        FaultProxy {
            port,
            state,
            cut,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// A proxy that refuses every watch (503) and passes everything else: the agent then reads
    /// its Node as it would while its watch is down.
    pub fn without_watches(upstream: &str, ca_file: &Path) -> FaultProxy {
        let proxy = FaultProxy::start(upstream, ca_file);
        proxy.set_fault_matching(
            Fault::Status {
                code: 503,
                retry_after: None,
                plain: true,
            },
            "watch=",
        );
        proxy
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `fault` on every request until cleared; a reset also cuts the open connections.
    pub fn set_fault(&self, fault: Fault) {
        let reset = fault == Fault::Reset;
        {
            let mut st = self.lock();
            st.fault = Some(fault);
            st.budget = None;
        }
        if reset {
            self.cut_connections();
        }
    }

    /// `fault` on the next `n` requests only.
    pub fn set_fault_for(&self, fault: Fault, n: u32) {
        let mut st = self.lock();
        st.fault = Some(fault);
        st.budget = Some(n);
    }

    /// `fault` on every request whose path and query contain `needle` (e.g. `watch=`), and
    /// the open connections cut, until cleared.
    pub fn set_fault_matching(&self, fault: Fault, needle: &str) {
        {
            let mut st = self.lock();
            st.fault = Some(fault);
            st.budget = None;
            st.only = Some(needle.to_owned());
        }
        self.cut_connections();
    }

    pub fn clear_fault(&self) {
        let mut st = self.lock();
        st.fault = None;
        st.budget = None;
        st.only = None;
    }

    /// Close every open connection (watches included).
    pub fn cut_connections(&self) {
        self.cut.send_modify(|g| *g += 1);
    }

    /// Run `hook` right after the next GET of a path ending in `suffix` has been answered by
    /// the apiserver, before the answer goes back to the client.
    pub fn after_next_get(&self, suffix: &str, hook: impl FnOnce() + Send + 'static) {
        self.lock().after_get = Some((suffix.to_owned(), Box::new(hook)));
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.lock().seen.clone()
    }

    pub fn reset_seen(&self) {
        self.lock().seen.clear();
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.cut_connections();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn full(code: StatusCode, body: String, retry_after: Option<u32>, json: bool) -> Response<Body> {
    let mut builder = Response::builder().status(code).header(
        "content-type",
        if json {
            "application/json"
        } else {
            "text/plain"
        },
    );
    if let Some(s) = retry_after {
        builder = builder.header("retry-after", s.to_string());
    }
    builder
        .body(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        )
        .expect("response")
}

async fn handle(
    req: Request<Incoming>,
    client: Upstream,
    state: Arc<Mutex<State>>,
    upstream: http::Uri,
) -> Result<Response<Body>, std::io::Error> {
    let method = req.method().to_string();
    let path_and_query = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "/".to_owned());
    let path = req.uri().path().to_owned();
    let record = |status: u16| {
        if let Ok(mut st) = state.lock() {
            st.seen.push(Seen {
                method: method.clone(),
                path: path_and_query.clone(),
                status,
                at: std::time::Instant::now(),
            });
        }
    };
    let fault = {
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        let applies = st
            .only
            .as_ref()
            .is_none_or(|needle| path_and_query.contains(needle.as_str()));
        let f = if applies { st.fault.clone() } else { None };
        if let Some(n) = st.budget.as_mut().filter(|_| applies) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                st.fault = None;
                st.budget = None;
            }
        }
        f
    };
    match fault {
        Some(Fault::Reset) => {
            record(0);
            return Err(std::io::Error::other("injected connection reset"));
        }
        Some(Fault::Stall(d)) => tokio::time::sleep(d).await,
        Some(Fault::Status {
            code,
            retry_after,
            plain,
        }) => {
            record(code);
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            if plain {
                return Ok(full(
                    status,
                    "Too many requests, please try again later.\n".into(),
                    retry_after,
                    false,
                ));
            }
            let mut body = serde_json::json!({
                "kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "message": format!("injected {code}"),
                "reason": if code == 429 { "TooManyRequests" } else { "InternalError" },
                "code": code,
            });
            if let Some(s) = retry_after {
                body["details"] = serde_json::json!({ "retryAfterSeconds": s });
            }
            return Ok(full(status, body.to_string(), retry_after, true));
        }
        None => {}
    }

    let (mut parts, body) = req.into_parts();
    let uri = format!(
        "{}://{}{}",
        upstream.scheme_str().unwrap_or("https"),
        upstream
            .authority()
            .map(|a| a.as_str())
            .unwrap_or("127.0.0.1"),
        path_and_query
    );
    parts.uri = uri.parse().map_err(std::io::Error::other)?;
    parts.headers.remove(http::header::HOST);
    let res = client
        .request(Request::from_parts(parts, body))
        .await
        .map_err(std::io::Error::other)?;
    let status = res.status().as_u16();
    record(status);
    if method == "GET" && status == 200 {
        let hook = {
            let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
            match &st.after_get {
                Some((suffix, _)) if path.ends_with(suffix.as_str()) => st.after_get.take(),
                _ => None,
            }
        };
        if let Some((_, hook)) = hook {
            // The body is streamed: read it all first, so the hook's write lands after the
            // read the client is about to act on.
            let (parts, body) = res.into_parts();
            let bytes = body
                .collect()
                .await
                .map_err(std::io::Error::other)?
                .to_bytes();
            tokio::task::spawn_blocking(hook)
                .await
                .map_err(std::io::Error::other)?;
            return Ok(Response::from_parts(
                parts,
                Full::new(bytes).map_err(|never| match never {}).boxed(),
            ));
        }
    }
    Ok(res.map(BodyExt::boxed))
}
