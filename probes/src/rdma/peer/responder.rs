//! The responder every agent runs: a TCP listener whose sessions each authenticate one
//! client, create an RC endpoint for it, let it WRITE into the buffer, and verify what
//! arrived.

use super::auth::{KeyRing, Side, Transcript, random};
use super::receipts::{Receipt, Receipts, Seen};
use super::slots::{ExpectedPeers, Place, Places};
use super::wire::{
    Cursor, Frame, Hello, T_CHALLENGE, T_DONE, T_ENDPOINT, T_HELLO, T_OPEN, T_VERDICT, T_WELCOME,
    Welcome, decode_endpoint, decode_open, digest, encode, encode_challenge, encode_endpoint,
    expect_kind, read_frame, read_frame_within,
};
use super::{
    FRAME_LEN, FRAME_TIMEOUT, HANDSHAKE_TIMEOUT, Identity, LocalPort, PROTOCOL_VERSION, Plan,
    Status, thread_cpu_ns,
};
use crate::rdma::verbs::rc::{self, EndpointInfo, EndpointSpec};
use crate::roots::Roots;
use std::io::{self, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Counters of the responder, for metrics and logs.
#[derive(Debug, Default)]
pub struct ResponderStats {
    /// Sessions that measured and verified.
    pub served: AtomicU64,
    /// Sessions refused (BUSY, SELF, OTHER_GROUP, NO_PORT, LIMITS, VERSION).
    pub refused: AtomicU64,
    /// Sessions refused because the client did not authenticate (no key in common, a wrong
    /// MAC, a replayed frame); included in neither `refused` nor `failed`.
    pub unauthenticated: AtomicU64,
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
    places: Arc<Places>,
    receipts: Receipts,
}

struct Shared {
    identity: Identity,
    keys: Arc<KeyRing>,
    /// The handshake and session pools.
    places: Arc<Places>,
    /// `None` until the agent's first probe told us the usable ports.
    ports: Arc<Mutex<Option<Vec<LocalPort>>>>,
    stats: Arc<ResponderStats>,
    roots: Roots,
    session_limit: Duration,
    /// What the sessions of gang checks delivered.
    receipts: Receipts,
}

impl Responder {
    /// Serve sessions on `listener` (bound by the caller) from a background thread, to
    /// clients that hold a key of `keys`; each session is closed after `session_limit`
    /// (capped at one minute).
    ///
    /// # Errors
    /// The listener's address cannot be read, or the thread cannot be started.
    pub fn start(
        listener: TcpListener,
        identity: Identity,
        keys: Arc<KeyRing>,
        roots: Roots,
        session_limit: Duration,
    ) -> io::Result<Self> {
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let ports = Arc::new(Mutex::new(None));
        let stats = Arc::new(ResponderStats::default());
        let places = Arc::new(Places::default());
        let receipts = Receipts::default();
        let shared = Arc::new(Shared {
            identity,
            keys,
            places: Arc::clone(&places),
            ports: Arc::clone(&ports),
            stats: Arc::clone(&stats),
            roots,
            session_limit: session_limit.min(Duration::from_secs(60)),
            receipts: receipts.clone(),
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
            places,
            receipts,
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

    /// Authenticated sessions being served right now.
    pub fn active_sessions(&self) -> usize {
        self.places.active()
    }

    /// Connections that have not authenticated yet, right now.
    pub fn pending_handshakes(&self) -> usize {
        self.places.pending()
    }

    /// What the sessions of gang checks delivered here, per check and client (shared): the
    /// agent attests its receiving end of each pair from it.
    pub fn receipts(&self) -> Receipts {
        self.receipts.clone()
    }

    /// The set of source addresses a live gang check waits for (shared with the responder):
    /// each has places the pools' strangers cannot take.
    pub fn expected_peers(&self) -> ExpectedPeers {
        self.places.expected.clone()
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
        let source = stream.peer_addr().ok().map(|a| a.ip());
        let Some((source, handshake)) =
            source.and_then(|ip| Some((ip, shared.places.handshake(ip)?)))
        else {
            // BUSY says nothing about the node, and is not authenticated: a client takes it
            // as "try again next round", never as a finding.
            shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = stream.write_all(&encode(T_CHALLENGE, Status::Busy, &[]));
            let _ = stream.shutdown(Shutdown::Both);
            continue;
        };
        let shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("fabricgate-peer-session".into())
            .spawn(move || {
                let cpu0 = thread_cpu_ns(&shared.roots);
                let outcome = serve(&mut stream, &shared, source, handshake);
                let _ = stream.shutdown(Shutdown::Both);
                let counter = match outcome {
                    Served::Measured => &shared.stats.served,
                    Served::Refused => &shared.stats.refused,
                    Served::Unauthenticated => &shared.stats.unauthenticated,
                    Served::Failed => &shared.stats.failed,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if let (Some(a), Some(b)) = (cpu0, thread_cpu_ns(&shared.roots)) {
                    shared
                        .stats
                        .cpu_ns
                        .fetch_add(b.saturating_sub(a), Ordering::Relaxed);
                }
            });
        if spawned.is_err() {
            // The closure (and its place) was dropped: the count is already given back.
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

enum Served {
    Measured,
    Refused,
    Unauthenticated,
    Failed,
}

/// Read one frame and check its MAC; `None` for anything else (timeout, garbage, bad MAC).
fn read_sealed(
    stream: &mut TcpStream,
    deadline: Instant,
    per_frame: Duration,
    t: &mut Transcript,
) -> Option<Frame> {
    let frame = read_frame_within(stream, deadline, per_frame).ok()?;
    t.verify(&frame.raw).then_some(frame)
}

fn send(stream: &mut TcpStream, t: &mut Transcript, frame: [u8; FRAME_LEN]) -> io::Result<()> {
    stream.write_all(&t.seal(frame))
}

/// One connection, from its handshake place (given back once the client authenticated, or
/// when the connection ends) to its session slot's end.
fn serve(stream: &mut TcpStream, shared: &Shared, source: IpAddr, handshake: Place) -> Served {
    let start = Instant::now();
    let deadline = start + shared.session_limit;
    // OPEN and HELLO, the unauthenticated part, must both arrive within this.
    let auth_deadline = deadline.min(start + HANDSHAKE_TIMEOUT);
    let _ = stream.set_write_timeout(Some(FRAME_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let (mut t, hello) = match authenticate(stream, shared, auth_deadline) {
        Ok(authenticated) => authenticated,
        Err(served) => return served,
    };
    // The client holds a key of the pool: from here on it may learn who we are.
    let me = &shared.identity;
    let note = |device: &str, port: u8, seen: Seen| shared.note(&hello, device, port, seen);
    if !me.node_name.is_empty() && hello.identity.node_name == me.node_name {
        return refuse(stream, &mut t, me, Status::SelfNode);
    }
    if me.group != hello.identity.group {
        return refuse(stream, &mut t, me, Status::OtherGroup);
    }
    // Authenticated: from here on a session slot, which no stranger can hold.
    drop(handshake);
    let Some(_session) = shared.places.session(source) else {
        return refuse(stream, &mut t, me, Status::Busy);
    };
    if hello.plan.validate().is_err() {
        note("", 0, Seen::Failed(Status::Limits.describe().to_owned()));
        return refuse(stream, &mut t, me, Status::Limits);
    }
    let port = {
        let ports = shared.ports.lock().unwrap_or_else(|p| p.into_inner());
        let Some(ports) = ports.as_ref() else {
            drop(ports);
            return refuse(stream, &mut t, me, Status::Starting);
        };
        ports
            .iter()
            .find(|p| p.device == hello.device && p.port == hello.port)
            .or_else(|| (ports.len() == 1).then(|| &ports[0]))
            .cloned()
    };
    let Some(port) = port else {
        note("", 0, Seen::Failed(Status::NoPort.describe().to_owned()));
        return refuse(stream, &mut t, me, Status::NoPort);
    };
    let welcome = Welcome {
        identity: me.clone(),
        device: port.device.clone(),
        port: port.port,
    };
    if send(stream, &mut t, welcome.encode(Status::Ok)).is_err() {
        return Served::Failed;
    }
    if hello.greet {
        // The side channel only: the client closes now.
        note(&port.device, port.port, Seen::Greeted);
        return Served::Failed;
    }
    let note = |seen: Seen| note(&port.device, port.port, seen);
    measure_session(
        stream,
        &mut t,
        &hello.plan,
        &port,
        deadline,
        shared.session_limit,
        note,
    )
}

/// OPEN, CHALLENGE and HELLO by `auth_deadline`: the session's transcript and what the
/// client said, once it proved it holds a key of the pool; how the session ended otherwise.
fn authenticate(
    stream: &mut TcpStream,
    shared: &Shared,
    auth_deadline: Instant,
) -> Result<(Transcript, Hello), Served> {
    let Ok(frame) = read_frame(stream, auth_deadline) else {
        return Err(Served::Failed);
    };
    if frame.version != PROTOCOL_VERSION {
        // Our version is in the header; nothing else is said.
        let _ = stream.write_all(&encode(T_CHALLENGE, Status::Version, &[]));
        return Err(Served::Refused);
    }
    if frame.kind != T_OPEN {
        return Err(Served::Failed);
    }
    let (client_nonce, offered) = decode_open(&frame.payload);
    let keys = shared.keys.keys();
    let Some((id, key)) = keys.pick(&offered) else {
        let _ = stream.write_all(&encode(T_CHALLENGE, Status::Auth, &[]));
        return Err(Served::Unauthenticated);
    };
    let Some(nonce) = random() else {
        return Err(Served::Failed);
    };
    let mut t = Transcript::new(key, client_nonce, nonce, Side::Responder);
    if send(stream, &mut t, encode_challenge(&nonce, &id)).is_err() {
        return Err(Served::Failed);
    }
    match read_frame(stream, auth_deadline) {
        Ok(f) if f.kind == T_HELLO && t.verify(&f.raw) => Ok((t, Hello::decode(&f.payload))),
        Ok(_) => {
            let _ = stream.write_all(&encode(T_WELCOME, Status::Auth, &[]));
            Err(Served::Unauthenticated)
        }
        Err(_) => Err(Served::Failed),
    }
}

/// A sealed WELCOME refusing the session with `status`, naming us but no port.
fn refuse(stream: &mut TcpStream, t: &mut Transcript, me: &Identity, status: Status) -> Served {
    let w = Welcome {
        identity: me.clone(),
        device: String::new(),
        port: 0,
    };
    let _ = send(stream, t, w.encode(status));
    Served::Refused
}

impl Shared {
    /// What the session `hello` opened delivered, for the check it names (none: not
    /// recorded).
    fn note(&self, hello: &Hello, device: &str, port: u8, seen: Seen) {
        self.receipts.record(Receipt {
            tag: hello.tag,
            from: hello.identity.node_name.clone(),
            device: device.to_owned(),
            port,
            seen,
        });
    }
}

/// The RDMA half of a session on `port`: the endpoints exchanged, the client's bursts, and
/// our verdict on what arrived; `note` records what the session delivered.
fn measure_session(
    stream: &mut TcpStream,
    t: &mut Transcript,
    plan: &Plan,
    port: &LocalPort,
    deadline: Instant,
    limit: Duration,
    note: impl Fn(Seen),
) -> Served {
    let broke = |what: &str| Seen::Failed(format!("the session broke off {what}"));
    let spec = EndpointSpec {
        device: &port.device,
        port: port.port,
        gid_index: port.gid_index,
        buf_len: plan.buffer_len(),
        max_outstanding: 1,
    };
    let session = rc::with_endpoint(&spec, |ep| -> Result<bool, ()> {
        let frame = read_sealed(stream, deadline, FRAME_TIMEOUT, t)
            .and_then(|f| expect_kind(f, T_ENDPOINT, "ENDPOINT").ok())
            .ok_or_else(|| note(broke("before ENDPOINT")))?;
        let remote = decode_endpoint(&frame.payload);
        if let Err(e) = ep.connect(&remote) {
            note(Seen::Failed(e.message));
            let _ = send(stream, t, encode_endpoint(&ep.local(), Status::Verbs));
            return Err(());
        }
        send(stream, t, encode_endpoint(&ep.local(), Status::Ok)).map_err(|_| ())?;
        // The client's bursts run now: DONE may take the rest of the session.
        let frame = read_sealed(stream, deadline, limit, t)
            .and_then(|f| expect_kind(f, T_DONE, "DONE").ok())
            .ok_or_else(|| note(broke("before DONE")))?;
        let want = Cursor::new(&frame.payload).u64();
        let got = digest(&ep.snapshot(0, plan.buffer_len()));
        let status = if got == want {
            note(Seen::Verified {
                bytes: plan.buffer_len() as u64,
            });
            Status::Ok
        } else {
            note(Seen::Failed(Status::Mismatch.describe().to_owned()));
            Status::Mismatch
        };
        let _ = send(stream, t, encode(T_VERDICT, status, &[]));
        Ok(status == Status::Ok)
    });
    match session {
        Ok(Ok(true)) => Served::Measured,
        Ok(_) => Served::Failed,
        Err(e) => {
            note(Seen::Failed(e.message));
            // Our side could not create the QP: say so instead of leaving the client waiting.
            if read_sealed(stream, deadline, FRAME_TIMEOUT, t).is_some() {
                let _ = send(
                    stream,
                    t,
                    encode_endpoint(&EndpointInfo::default(), Status::Verbs),
                );
            }
            Served::Failed
        }
    }
}
