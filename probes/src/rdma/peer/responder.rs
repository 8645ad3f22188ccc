//! The responder every agent runs: a TCP listener whose sessions each create an RC endpoint
//! for one client, let it WRITE into the buffer, and verify what arrived.

use super::wire::{
    Cursor, Hello, T_DONE, T_ENDPOINT, T_HELLO, T_VERDICT, T_WELCOME, Welcome, decode_endpoint,
    digest, encode, encode_endpoint, expect_kind, read_frame, read_frame_within,
};
use super::{
    FRAME_TIMEOUT, Identity, LocalPort, MAX_SESSIONS, PROTOCOL_VERSION, Status, thread_cpu_ns,
};
use crate::Roots;
use crate::rdma::verbs::rc::{self, EndpointInfo, EndpointSpec};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counters of the responder, for metrics and logs.
#[derive(Debug, Default)]
pub struct ResponderStats {
    /// Sessions that measured and verified.
    pub served: AtomicU64,
    /// Sessions refused (BUSY, SELF, OTHER_GROUP, NO_PORT, LIMITS, VERSION).
    pub refused: AtomicU64,
    /// Sessions that broke off (garbage, timeouts, verbs or verification failures).
    pub failed: AtomicU64,
    /// CPU time of the session threads.
    pub cpu_ns: AtomicU64,
}

/// The TCP side channel's listener and the sessions it serves; stops when dropped.
pub struct Responder {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    ports: Arc<Mutex<Option<Vec<LocalPort>>>>,
    stats: Arc<ResponderStats>,
    active: Arc<AtomicUsize>,
}

struct Shared {
    identity: Identity,
    /// `None` until the agent's first probe told us the usable ports.
    ports: Arc<Mutex<Option<Vec<LocalPort>>>>,
    stats: Arc<ResponderStats>,
    active: Arc<AtomicUsize>,
    roots: Roots,
    session_limit: Duration,
}

impl Responder {
    /// Serve sessions on `listener` (bound by the caller) from a background thread; each
    /// session is closed after `session_limit` (capped at one minute).
    ///
    /// # Errors
    /// The listener's address cannot be read, or the thread cannot be started.
    pub fn start(
        listener: TcpListener,
        identity: Identity,
        roots: Roots,
        session_limit: Duration,
    ) -> io::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let ports = Arc::new(Mutex::new(None));
        let stats = Arc::new(ResponderStats::default());
        let active = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared {
            identity,
            ports: Arc::clone(&ports),
            stats: Arc::clone(&stats),
            active: Arc::clone(&active),
            roots,
            session_limit: session_limit.min(Duration::from_secs(60)),
        });
        let stop_flag = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("fabricgate-peer-responder".into())
            .spawn(move || accept_loop(&listener, &shared, &stop_flag))?;
        Ok(Self {
            addr,
            stop,
            ports,
            stats,
            active,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The ports sessions may use (the validated ones); empty: every session gets NO_PORT.
    /// Until the first call, sessions get STARTING.
    pub fn set_ports(&self, ports: Vec<LocalPort>) {
        *self.ports.lock().unwrap_or_else(|p| p.into_inner()) = Some(ports);
    }

    pub fn stats(&self) -> &ResponderStats {
        &self.stats
    }

    /// Sessions being served right now.
    pub fn active_sessions(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept; it sees the flag and returns.
        let mut wake = self.addr;
        if wake.ip().is_unspecified() {
            wake.set_ip(match wake {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
    }
}

/// Decrements the active-session count however the session ends.
struct SessionSlot(Arc<Shared>);

impl Drop for SessionSlot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(mut stream) = conn else {
            // EMFILE and friends: back off instead of spinning.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        if shared.active.fetch_add(1, Ordering::AcqRel) >= MAX_SESSIONS {
            shared.active.fetch_sub(1, Ordering::AcqRel);
            shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = stream.write_all(&encode(T_WELCOME, Status::Busy, &[]));
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        }
        let slot = SessionSlot(Arc::clone(shared));
        let spawned = std::thread::Builder::new()
            .name("fabricgate-peer-session".into())
            .spawn(move || {
                let shared = Arc::clone(&slot.0);
                let cpu0 = thread_cpu_ns(&shared.roots);
                let outcome = serve(&mut stream, &shared);
                let _ = stream.shutdown(Shutdown::Both);
                let counter = match outcome {
                    Served::Measured => &shared.stats.served,
                    Served::Refused => &shared.stats.refused,
                    Served::Failed => &shared.stats.failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if let (Some(a), Some(b)) = (cpu0, thread_cpu_ns(&shared.roots)) {
                    shared
                        .stats
                        .cpu_ns
                        .fetch_add(b.saturating_sub(a), Ordering::Relaxed);
                }
                drop(slot);
            });
        if spawned.is_err() {
            // The closure (and its slot) was dropped: the count is already given back.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

enum Served {
    Measured,
    Refused,
    Failed,
}

fn serve(stream: &mut TcpStream, shared: &Shared) -> Served {
    let limit = shared.session_limit;
    let deadline = Instant::now() + limit;
    let _ = stream.set_write_timeout(Some(FRAME_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let Ok(frame) = read_frame(stream, deadline) else {
        return Served::Failed;
    };
    let me = &shared.identity;
    let refuse = |stream: &mut TcpStream, status: Status| {
        let w = Welcome {
            identity: me.clone(),
            device: String::new(),
            port: 0,
        };
        let _ = stream.write_all(&w.encode(status));
        Served::Refused
    };
    if frame.version != PROTOCOL_VERSION {
        return refuse(stream, Status::Version);
    }
    if frame.kind != T_HELLO {
        return Served::Failed;
    }
    let hello = Hello::decode(&frame.payload);
    if !me.node_name.is_empty() && hello.identity.node_name == me.node_name {
        return refuse(stream, Status::SelfNode);
    }
    if me.group != hello.identity.group {
        return refuse(stream, Status::OtherGroup);
    }
    if hello.plan.validate().is_err() {
        return refuse(stream, Status::Limits);
    }
    let port = {
        let ports = shared.ports.lock().unwrap_or_else(|p| p.into_inner());
        let Some(ports) = ports.as_ref() else {
            drop(ports);
            return refuse(stream, Status::Starting);
        };
        ports
            .iter()
            .find(|p| p.device == hello.device && p.port == hello.port)
            .or_else(|| (ports.len() == 1).then(|| &ports[0]))
            .cloned()
    };
    let Some(port) = port else {
        return refuse(stream, Status::NoPort);
    };
    let welcome = Welcome {
        identity: me.clone(),
        device: port.device.clone(),
        port: port.port,
    };
    if stream.write_all(&welcome.encode(Status::Ok)).is_err() {
        return Served::Failed;
    }
    let plan = hello.plan;
    let spec = EndpointSpec {
        device: &port.device,
        port: port.port,
        gid_index: port.gid_index,
        buf_len: plan.buffer_len(),
        max_outstanding: 1,
    };
    let session = rc::with_endpoint(&spec, |ep| -> Result<bool, ()> {
        let frame = read_frame(stream, deadline).map_err(|_| ())?;
        let frame = expect_kind(frame, T_ENDPOINT, "ENDPOINT").map_err(|_| ())?;
        let remote = decode_endpoint(&frame.payload);
        if ep.connect(&remote).is_err() {
            let _ = stream.write_all(&encode_endpoint(&ep.local(), Status::Verbs));
            return Err(());
        }
        stream
            .write_all(&encode_endpoint(&ep.local(), Status::Ok))
            .map_err(|_| ())?;
        // The client's bursts run now: DONE may take the rest of the session.
        let frame = read_frame_within(stream, deadline, limit).map_err(|_| ())?;
        let frame = expect_kind(frame, T_DONE, "DONE").map_err(|_| ())?;
        let want = Cursor::new(&frame.payload).u64();
        let got = digest(&ep.snapshot(0, plan.buffer_len()));
        let status = if got == want {
            Status::Ok
        } else {
            Status::Mismatch
        };
        let _ = stream.write_all(&encode(T_VERDICT, status, &[]));
        Ok(status == Status::Ok)
    });
    match session {
        Ok(Ok(true)) => Served::Measured,
        Ok(_) => Served::Failed,
        Err(_) => {
            // Our side could not create the QP: say so instead of leaving the client waiting.
            let _ = read_frame(stream, deadline);
            let _ = stream.write_all(&encode_endpoint(&EndpointInfo::default(), Status::Verbs));
            Served::Failed
        }
    }
}
