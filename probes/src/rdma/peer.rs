//! Inter-node RDMA measurements: the responder every agent runs, and the client that measures
//! one peer (`fabricgate ping`, the agent's peer rounds).
//!
//! # Transport
//! RC (reliable connected), one queue pair per session, created when a session starts and
//! destroyed when it ends ([`crate::rdma::verbs::rc`]). An RC RDMA WRITE completes once the
//! responder's HCA acknowledged it, so post-to-completion is one fabric round trip without
//! the responder's CPU, and the bandwidth burst needs RDMA WRITE, which UD does not have.
//!
//! # Side channel
//! A tiny TCP protocol (as perftest exchanges QPNs and GIDs), versioned, made of fixed-size
//! frames of [`FRAME_LEN`] bytes: `magic "FGPR" | version u16 | type u8 | status u8 | payload`,
//! big-endian, zero padded.
//!
//! ```text
//! client                                   responder
//!   HELLO   node, group, device/port, plan ──►
//!          ◄── WELCOME node, group, device/port, status (OK, BUSY, SELF, OTHER_GROUP, ...)
//!   ENDPOINT gid, qpn, psn, lid, mtu, addr, rkey, len ──►   (responder creates its QP now)
//!          ◄── ENDPOINT (or status VERBS)
//!   ... RDMA WRITEs: RTT burst into slots, then the bandwidth burst ...
//!   DONE    digest of the bytes written ──►
//!          ◄── VERDICT status OK or MISMATCH (the responder hashed its buffer)
//! ```
//!
//! # Limits (what a stranger can make the responder do)
//! At most [`MAX_SESSIONS`] sessions at once (more are answered BUSY by the accept thread
//! without reading anything), each closed after [`SESSION_LIMIT`]; every frame must arrive
//! within [`FRAME_TIMEOUT`]; frames have one fixed size; plans outside [`Plan::validate`] are
//! refused before anything is allocated, so one session pins at most
//! [`MAX_BUFFER`] bytes and the responder at most `MAX_SESSIONS × MAX_BUFFER`.

use crate::Roots;
use crate::rdma::verbs::rc::{self, EndpointInfo, EndpointSpec, RcError};
use crate::rdma::{DeviceReport, GidType, LinkLayer, PortReport, RdmaReport};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The side channel's protocol version.
pub const PROTOCOL_VERSION: u16 = 1;
const MAGIC: [u8; 4] = *b"FGPR";
/// Every frame is exactly this long.
pub const FRAME_LEN: usize = 256;
/// Sessions served at once; more are answered BUSY.
pub const MAX_SESSIONS: usize = 4;
/// Default bound on one session, accept to close (the agent passes `peers.timeout` + 5 s).
pub const SESSION_LIMIT: Duration = Duration::from_secs(10);
/// One frame must arrive within this.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(3);
pub const MIN_RTT_SIZE: u32 = 8;
pub const MAX_RTT_SIZE: u32 = 4096;
pub const MAX_RTT_COUNT: u32 = 64;
pub const MIN_BW_SIZE: u32 = 4096;
pub const MAX_BW_SIZE: u32 = 1 << 20;
pub const MAX_BW_DURATION: Duration = Duration::from_secs(2);
/// Largest buffer one session registers: every RTT slot plus the bandwidth region.
pub const MAX_BUFFER: usize = (MAX_RTT_SIZE * MAX_RTT_COUNT + MAX_BW_SIZE) as usize;
/// RDMA WRITEs in flight during the bandwidth burst.
pub const BW_DEPTH: u32 = 16;
/// Node names and groups are cut to this many bytes on the wire.
pub const NAME_LEN: usize = 64;
const DEVICE_LEN: usize = 32;

const T_HELLO: u8 = 1;
const T_WELCOME: u8 = 2;
const T_ENDPOINT: u8 = 3;
const T_DONE: u8 = 4;
const T_VERDICT: u8 = 5;

/// Status byte of WELCOME, ENDPOINT and VERDICT frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    Ok,
    /// The responder already serves [`MAX_SESSIONS`] sessions.
    Busy,
    /// The client is the responder's own node.
    SelfNode,
    /// The nodes are in different peer groups (`peers.match_label`).
    OtherGroup,
    /// The responder has no usable port (down, or none validated).
    NoPort,
    /// The plan exceeds the responder's limits.
    Limits,
    /// Unsupported protocol version.
    Version,
    /// The responder could not create its queue pair.
    Verbs,
    /// The bytes in the responder's buffer differ from what the client wrote.
    Mismatch,
    /// The responder's agent has not finished its first probe: it does not know its ports
    /// yet. Not an error; the peer is measured in a later round.
    Starting,
    Unknown(u8),
}

impl Status {
    fn code(self) -> u8 {
        match self {
            Self::Ok => 0,
            Self::Busy => 1,
            Self::SelfNode => 2,
            Self::OtherGroup => 3,
            Self::NoPort => 4,
            Self::Limits => 5,
            Self::Version => 6,
            Self::Verbs => 7,
            Self::Mismatch => 8,
            Self::Starting => 9,
            Self::Unknown(c) => c,
        }
    }

    fn from_code(c: u8) -> Self {
        match c {
            0 => Self::Ok,
            1 => Self::Busy,
            2 => Self::SelfNode,
            3 => Self::OtherGroup,
            4 => Self::NoPort,
            5 => Self::Limits,
            6 => Self::Version,
            7 => Self::Verbs,
            8 => Self::Mismatch,
            9 => Self::Starting,
            c => Self::Unknown(c),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Busy => "the responder is busy with other sessions",
            Self::SelfNode => "that is this node",
            Self::OtherGroup => "the peer is in another group (peers.match_label)",
            Self::NoPort => "the responder has no usable RDMA port",
            Self::Limits => "the responder refused the plan (sizes or duration over its limits)",
            Self::Version => "the responder speaks another protocol version",
            Self::Verbs => "the responder could not create its queue pair",
            Self::Mismatch => "the responder's buffer holds different bytes than were written",
            Self::Starting => "the responder's agent is starting (no probe yet)",
            Self::Unknown(_) => "unknown status",
        }
    }
}

/// What one measurement does: an RTT burst of small WRITEs, and optionally a bandwidth
/// burst of large ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Bytes per RTT message.
    pub rtt_size: u32,
    /// Messages in the RTT burst (each waited for before the next).
    pub rtt_count: u32,
    /// Bytes per WRITE of the bandwidth burst; 0: no bandwidth burst.
    pub bw_size: u32,
    pub bw_duration: Duration,
}

impl Default for Plan {
    fn default() -> Self {
        Self {
            rtt_size: 64,
            rtt_count: 16,
            bw_size: 0,
            bw_duration: Duration::from_millis(100),
        }
    }
}

impl Plan {
    /// # Errors
    /// A message naming the value out of range and the limit.
    pub fn validate(&self) -> Result<(), String> {
        if !(MIN_RTT_SIZE..=MAX_RTT_SIZE).contains(&self.rtt_size) {
            return Err(format!(
                "RTT message size {} is outside {MIN_RTT_SIZE}..={MAX_RTT_SIZE} bytes",
                self.rtt_size
            ));
        }
        if !(1..=MAX_RTT_COUNT).contains(&self.rtt_count) {
            return Err(format!(
                "RTT burst of {} messages is outside 1..={MAX_RTT_COUNT}",
                self.rtt_count
            ));
        }
        if self.bw_size != 0 {
            if !(MIN_BW_SIZE..=MAX_BW_SIZE).contains(&self.bw_size) {
                return Err(format!(
                    "bandwidth message size {} is outside {MIN_BW_SIZE}..={MAX_BW_SIZE} bytes",
                    self.bw_size
                ));
            }
            if self.bw_duration.is_zero() || self.bw_duration > MAX_BW_DURATION {
                return Err(format!(
                    "bandwidth burst of {:?} is outside (0, {:?}]",
                    self.bw_duration, MAX_BW_DURATION
                ));
            }
        }
        Ok(())
    }

    fn rtt_region(&self) -> usize {
        self.rtt_size as usize * self.rtt_count as usize
    }

    /// Bytes of the buffer each side registers.
    pub fn buffer_len(&self) -> usize {
        self.rtt_region() + self.bw_size as usize
    }
}

/// Who this agent is, as told to peers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// The Node name; a responder refuses a client with its own name (SELF). Empty: never.
    pub node_name: String,
    /// Peer group (value of `peers.match_label` on this Node); only peers of the same group
    /// are measured. Empty: no restriction.
    pub group: String,
}

/// A local port that can serve or start sessions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalPort {
    pub device: String,
    pub port: u8,
    /// `None` on InfiniBand (addressed by LID).
    pub gid_index: Option<u8>,
}

impl LocalPort {
    /// Ports of `report` that are up, opened by verbs, on a device `matches` accepts, and
    /// (on RoCE) have a GID; the IPv4-mapped RoCE v2 GID is preferred, as NCCL does.
    pub fn usable(report: &RdmaReport, matches: &dyn Fn(&str) -> bool) -> Vec<LocalPort> {
        let mut out = Vec::new();
        for dev in &report.devices {
            if !matches(&dev.name) || !opened(dev) {
                continue;
            }
            for port in &dev.ports {
                if !port.is_up() || port.selftest.as_ref().is_some_and(|s| !s.ok) {
                    continue;
                }
                let Ok(num) = u8::try_from(port.port) else {
                    continue;
                };
                let gid_index = if port.link_layer == Some(LinkLayer::Ethernet) {
                    match pick_gid(port).and_then(|g| u8::try_from(g).ok()) {
                        Some(g) => Some(g),
                        None => continue,
                    }
                } else {
                    None
                };
                out.push(LocalPort {
                    device: dev.name.clone(),
                    port: num,
                    gid_index,
                });
            }
        }
        out
    }
}

fn opened(dev: &DeviceReport) -> bool {
    dev.verbs.as_ref().is_none_or(|v| v.opened)
}

/// The GID to source RoCE traffic from: IPv4-mapped RoCE v2 first, then any RoCE v2.
fn pick_gid(port: &PortReport) -> Option<u32> {
    let v2 = |g: &&crate::rdma::Gid| g.gid_type == Some(GidType::RoceV2);
    port.gids
        .iter()
        .filter(v2)
        .find(|g| g.gid.starts_with("0000:0000:0000:0000:0000:ffff:"))
        .or_else(|| port.gids.iter().find(v2))
        .map(|g| g.index)
}

// ---------------------------------------------------------------------------------------
// Frames

#[derive(Debug, Clone, PartialEq, Eq)]
struct Frame {
    version: u16,
    kind: u8,
    status: Status,
    payload: Vec<u8>,
}

fn encode(kind: u8, status: Status, payload: &[u8]) -> [u8; FRAME_LEN] {
    let mut f = [0u8; FRAME_LEN];
    f[..4].copy_from_slice(&MAGIC);
    f[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    f[6] = kind;
    f[7] = status.code();
    let n = payload.len().min(FRAME_LEN - 8);
    f[8..8 + n].copy_from_slice(&payload[..n]);
    f
}

/// Parse a frame; `None` for anything that is not one (wrong magic).
fn decode(f: &[u8; FRAME_LEN]) -> Option<Frame> {
    if f[..4] != MAGIC {
        return None;
    }
    Some(Frame {
        version: u16::from_be_bytes([f[4], f[5]]),
        kind: f[6],
        status: Status::from_code(f[7]),
        payload: f[8..].to_vec(),
    })
}

/// Little cursor over a payload: big-endian integers and NUL-padded strings.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    fn take(&mut self, n: usize) -> &'a [u8] {
        let start = self.pos.min(self.buf.len());
        let end = (start + n).min(self.buf.len());
        self.pos = start + n;
        &self.buf[start..end]
    }
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let got = self.take(N);
        out[..got.len()].copy_from_slice(got);
        out
    }
    fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.bytes())
    }
    /// A NUL-padded text field: printable ASCII only, anything else dropped.
    fn text(&mut self, n: usize) -> String {
        self.take(n)
            .iter()
            .take_while(|&&b| b != 0)
            .filter(|b| b.is_ascii_graphic())
            .map(|&b| char::from(b))
            .collect()
    }
}

fn put_text(out: &mut Vec<u8>, s: &str, n: usize) {
    let mut field = vec![0u8; n];
    for (dst, b) in field.iter_mut().zip(s.bytes().filter(u8::is_ascii_graphic)) {
        *dst = b;
    }
    out.extend_from_slice(&field);
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Hello {
    identity: Identity,
    device: String,
    port: u8,
    plan: Plan,
}

impl Hello {
    fn encode(&self) -> [u8; FRAME_LEN] {
        let mut p = Vec::with_capacity(200);
        put_text(&mut p, &self.identity.node_name, NAME_LEN);
        put_text(&mut p, &self.identity.group, NAME_LEN);
        put_text(&mut p, &self.device, DEVICE_LEN);
        p.extend_from_slice(&[self.port, 0, 0, 0]);
        p.extend_from_slice(&self.plan.rtt_size.to_be_bytes());
        p.extend_from_slice(&self.plan.rtt_count.to_be_bytes());
        p.extend_from_slice(&self.plan.bw_size.to_be_bytes());
        let ms = u32::try_from(self.plan.bw_duration.as_millis()).unwrap_or(u32::MAX);
        p.extend_from_slice(&ms.to_be_bytes());
        encode(T_HELLO, Status::Ok, &p)
    }

    fn decode(payload: &[u8]) -> Self {
        let mut c = Cursor::new(payload);
        let node_name = c.text(NAME_LEN);
        let group = c.text(NAME_LEN);
        let device = c.text(DEVICE_LEN);
        let port = c.u8();
        c.take(3);
        let plan = Plan {
            rtt_size: c.u32(),
            rtt_count: c.u32(),
            bw_size: c.u32(),
            bw_duration: Duration::from_millis(u64::from(c.u32())),
        };
        Self {
            identity: Identity { node_name, group },
            device,
            port,
            plan,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Welcome {
    identity: Identity,
    device: String,
    port: u8,
}

impl Welcome {
    fn encode(&self, status: Status) -> [u8; FRAME_LEN] {
        let mut p = Vec::with_capacity(200);
        put_text(&mut p, &self.identity.node_name, NAME_LEN);
        put_text(&mut p, &self.identity.group, NAME_LEN);
        put_text(&mut p, &self.device, DEVICE_LEN);
        p.push(self.port);
        encode(T_WELCOME, status, &p)
    }

    fn decode(payload: &[u8]) -> Self {
        let mut c = Cursor::new(payload);
        let node_name = c.text(NAME_LEN);
        let group = c.text(NAME_LEN);
        let device = c.text(DEVICE_LEN);
        let port = c.u8();
        Self {
            identity: Identity { node_name, group },
            device,
            port,
        }
    }
}

fn encode_endpoint(e: &EndpointInfo, status: Status) -> [u8; FRAME_LEN] {
    let mut p = Vec::with_capacity(48);
    p.extend_from_slice(&e.gid);
    p.extend_from_slice(&e.qpn.to_be_bytes());
    p.extend_from_slice(&e.psn.to_be_bytes());
    p.extend_from_slice(&e.lid.to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(&e.mtu.to_be_bytes());
    p.extend_from_slice(&e.addr.to_be_bytes());
    p.extend_from_slice(&e.rkey.to_be_bytes());
    p.extend_from_slice(&e.len.to_be_bytes());
    encode(T_ENDPOINT, status, &p)
}

fn decode_endpoint(payload: &[u8]) -> EndpointInfo {
    let mut c = Cursor::new(payload);
    let gid = c.bytes::<16>();
    let qpn = c.u32();
    let psn = c.u32();
    let lid = c.u16();
    c.take(2);
    EndpointInfo {
        gid,
        qpn,
        psn,
        lid,
        mtu: c.u32(),
        addr: c.u64(),
        rkey: c.u32(),
        len: c.u32(),
    }
}

fn read_frame(stream: &mut TcpStream, deadline: Instant) -> io::Result<Frame> {
    read_frame_within(stream, deadline, FRAME_TIMEOUT)
}

/// Read one frame, waiting at most `per_frame` and never past `deadline`.
fn read_frame_within(
    stream: &mut TcpStream,
    deadline: Instant,
    per_frame: Duration,
) -> io::Result<Frame> {
    let now = Instant::now();
    let left = deadline.saturating_duration_since(now);
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "session time limit reached",
        ));
    }
    stream.set_read_timeout(Some(left.min(per_frame)))?;
    let mut f = [0u8; FRAME_LEN];
    stream.read_exact(&mut f)?;
    decode(&f).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a fabricgate frame"))
}

fn expect_kind(frame: Frame, kind: u8, what: &str) -> io::Result<Frame> {
    if frame.kind != kind {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected a {what} frame, got type {}", frame.kind),
        ));
    }
    Ok(frame)
}

/// FNV-1a over the bytes: both sides hash the same region to verify the WRITEs landed.
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The session's pattern: different in every session, so stale bytes cannot pass.
fn pattern(nonce: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut s = nonce;
    while out.len() < len {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.extend_from_slice(&z.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// CPU time (ns) the calling thread has used, from `<proc>/thread-self/schedstat`.
pub fn thread_cpu_ns(roots: &Roots) -> Option<u64> {
    let text = std::fs::read_to_string(roots.proc("thread-self/schedstat")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

// ---------------------------------------------------------------------------------------
// Responder

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

// ---------------------------------------------------------------------------------------
// Client

/// The `kind` of `fabricgate_peer_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorKind {
    /// The side channel failed: no TCP connection, refused, garbage, or a responder that
    /// cannot take part (BUSY, NO_PORT, VERBS, ...).
    Connect,
    /// The responder or its HCA did not answer in time (TCP read timeout, RDMA retries
    /// exhausted, no completion before the deadline).
    Timeout,
    /// Bytes did not arrive as written (digest mismatch, WRITE completed with an error).
    Verification,
}

impl ErrorKind {
    pub const ALL: [Self; 3] = [Self::Connect, Self::Timeout, Self::Verification];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Verification => "verification",
        }
    }
}

/// Why a peer was not measured although nothing failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// The address is this node's own responder.
    SelfNode,
    /// The peer is in another group.
    OtherGroup,
    /// The peer's agent has not finished its first probe; try again in a later round.
    Starting,
}

/// A completed measurement.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    /// The node name the responder gave (may be empty).
    pub peer_node: String,
    /// The responder's device and port.
    pub peer_device: String,
    pub peer_port: u8,
    /// Every RTT of the burst, sorted.
    pub rtts: Vec<Duration>,
    /// Bytes per second of the bandwidth burst; `None` when it was not run.
    pub bandwidth: Option<f64>,
    /// Bytes the bandwidth burst moved.
    pub bw_bytes: u64,
    /// Session time, connect to verdict.
    pub elapsed: Duration,
}

impl Measurement {
    pub fn rtt_min(&self) -> Duration {
        self.rtts.first().copied().unwrap_or_default()
    }
    pub fn rtt_max(&self) -> Duration {
        self.rtts.last().copied().unwrap_or_default()
    }
    pub fn rtt_median(&self) -> Duration {
        percentile(&self.rtts, 0.5)
    }
}

/// Nearest-rank percentile of sorted durations (`q` in 0..=1); zero for none.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (q.clamp(0.0, 1.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The result of measuring one peer.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Measured(Measurement),
    Skipped(Skip),
    /// `kind` is `None` when our own side failed (no port, verbs error): not the peer's fault.
    Failed {
        kind: Option<ErrorKind>,
        message: String,
    },
}

fn failed(kind: ErrorKind, message: String) -> Outcome {
    Outcome::Failed {
        kind: Some(kind),
        message,
    }
}

fn io_failure(what: &str, e: &io::Error) -> Outcome {
    let kind = if matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    ) {
        ErrorKind::Timeout
    } else {
        ErrorKind::Connect
    };
    failed(kind, format!("{what}: {e}"))
}

fn rc_failure(e: &RcError) -> Outcome {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else {
        ErrorKind::Verification
    };
    failed(kind, e.message.clone())
}

/// Measure `peer` from `local`: the side-channel exchange, an RTT burst and, when the plan
/// has one, a bandwidth burst, then the responder's verification. Bounded by `timeout`
/// (TCP connect included). Never panics.
pub fn measure(
    peer: SocketAddr,
    local: &LocalPort,
    identity: &Identity,
    plan: &Plan,
    timeout: Duration,
) -> Outcome {
    if let Err(e) = plan.validate() {
        return Outcome::Failed {
            kind: None,
            message: format!("plan: {e}"),
        };
    }
    let start = Instant::now();
    let deadline = start + timeout;
    let mut stream = match TcpStream::connect_timeout(&peer, timeout.min(FRAME_TIMEOUT)) {
        Ok(s) => s,
        // A connect that times out is still a connect failure: nothing answered.
        Err(e) => return failed(ErrorKind::Connect, format!("connect to {peer}: {e}")),
    };
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(FRAME_TIMEOUT));
    let hello = Hello {
        identity: identity.clone(),
        device: local.device.clone(),
        port: local.port,
        plan: *plan,
    };
    if let Err(e) = stream.write_all(&hello.encode()) {
        return io_failure("send HELLO", &e);
    }
    let frame = match read_frame_within(&mut stream, deadline, timeout) {
        Ok(f) => f,
        Err(e) => return io_failure("read WELCOME", &e),
    };
    if frame.kind != T_WELCOME {
        return failed(
            ErrorKind::Connect,
            format!("expected WELCOME, got frame type {}", frame.kind),
        );
    }
    let welcome = Welcome::decode(&frame.payload);
    match frame.status {
        Status::Ok => {}
        Status::SelfNode => return Outcome::Skipped(Skip::SelfNode),
        Status::OtherGroup => return Outcome::Skipped(Skip::OtherGroup),
        Status::Starting => return Outcome::Skipped(Skip::Starting),
        Status::Version => {
            return failed(
                ErrorKind::Connect,
                format!(
                    "{peer}: {} (ours {PROTOCOL_VERSION}, theirs {})",
                    Status::Version.describe(),
                    frame.version
                ),
            );
        }
        s => return failed(ErrorKind::Connect, format!("{peer}: {}", s.describe())),
    }

    let nonce = u64::from(peer.port())
        ^ start.elapsed().as_nanos() as u64
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let spec = EndpointSpec {
        device: &local.device,
        port: local.port,
        gid_index: local.gid_index,
        buf_len: plan.buffer_len(),
        max_outstanding: BW_DEPTH,
    };
    let result = rc::with_endpoint(&spec, |ep| -> Outcome {
        let bytes = pattern(nonce, plan.buffer_len());
        ep.fill(0, &bytes);
        if let Err(e) = stream.write_all(&encode_endpoint(&ep.local(), Status::Ok)) {
            return io_failure("send ENDPOINT", &e);
        }
        let frame = match read_frame_within(&mut stream, deadline, timeout) {
            Ok(f) => f,
            Err(e) => return io_failure("read ENDPOINT", &e),
        };
        if frame.kind != T_ENDPOINT || frame.status != Status::Ok {
            return failed(
                ErrorKind::Connect,
                format!("{peer}: {}", frame.status.describe()),
            );
        }
        let remote = decode_endpoint(&frame.payload);
        if (remote.len as usize) < plan.buffer_len() {
            return failed(
                ErrorKind::Connect,
                format!(
                    "{peer}: the responder's buffer ({} bytes) is smaller than the plan",
                    remote.len
                ),
            );
        }
        if let Err(e) = ep.connect(&remote) {
            return Outcome::Failed {
                kind: None,
                message: e.message,
            };
        }
        let size = plan.rtt_size as usize;
        let mut rtts = Vec::with_capacity(plan.rtt_count as usize);
        for i in 0..plan.rtt_count as usize {
            match ep.write(i * size, size, &remote, (i * size) as u64, deadline) {
                Ok(d) => rtts.push(d),
                Err(e) => return rc_failure(&e),
            }
        }
        rtts.sort();
        let mut bandwidth = None;
        let mut bw_bytes = 0;
        if plan.bw_size > 0 {
            let off = plan.rtt_region();
            match ep.write_stream(
                off,
                plan.bw_size as usize,
                &remote,
                off as u64,
                plan.bw_duration,
                deadline,
            ) {
                Ok((bytes, took)) => {
                    bw_bytes = bytes;
                    bandwidth = Some(bytes as f64 / took.as_secs_f64().max(1e-9));
                }
                Err(e) => return rc_failure(&e),
            }
        }
        let done = encode(T_DONE, Status::Ok, &digest(&bytes).to_be_bytes());
        if let Err(e) = stream.write_all(&done) {
            return io_failure("send DONE", &e);
        }
        let verdict = match read_frame_within(&mut stream, deadline, timeout) {
            Ok(f) => f,
            Err(e) => return io_failure("read VERDICT", &e),
        };
        if verdict.kind != T_VERDICT {
            return failed(
                ErrorKind::Connect,
                format!("expected VERDICT, got frame type {}", verdict.kind),
            );
        }
        match verdict.status {
            Status::Ok => Outcome::Measured(Measurement {
                peer_node: welcome.identity.node_name.clone(),
                peer_device: welcome.device.clone(),
                peer_port: welcome.port,
                rtts,
                bandwidth,
                bw_bytes,
                elapsed: start.elapsed(),
            }),
            Status::Mismatch => failed(
                ErrorKind::Verification,
                format!("{peer}: {}", Status::Mismatch.describe()),
            ),
            s => failed(ErrorKind::Connect, format!("{peer}: {}", s.describe())),
        }
    });
    let _ = stream.shutdown(Shutdown::Both);
    match result {
        Ok(outcome) => outcome,
        Err(e) => Outcome::Failed {
            kind: None,
            message: format!("{} port {}: {}", local.device, local.port, e.message),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdma::{Gid, PhysState, PortState, VerbsDevice};

    #[test]
    fn frames_round_trip_and_garbage_is_rejected() {
        let hello = Hello {
            identity: Identity {
                node_name: "gpu-a".into(),
                group: "rail-3".into(),
            },
            device: "mlx5_3".into(),
            port: 1,
            plan: Plan {
                rtt_size: 64,
                rtt_count: 16,
                bw_size: 65536,
                bw_duration: Duration::from_millis(100),
            },
        };
        let f = decode(&hello.encode()).unwrap();
        assert_eq!(f.version, PROTOCOL_VERSION);
        assert_eq!(f.kind, T_HELLO);
        assert_eq!(Hello::decode(&f.payload), hello);
        let e = EndpointInfo {
            gid: [7; 16],
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            lid: 9,
            mtu: 1024,
            addr: 0xdead_beef_0000,
            rkey: 0x4242,
            len: 2048,
        };
        let f = decode(&encode_endpoint(&e, Status::Ok)).unwrap();
        assert_eq!(decode_endpoint(&f.payload), e);
        let mut junk = [0xffu8; FRAME_LEN];
        assert_eq!(decode(&junk), None);
        junk[..4].copy_from_slice(b"FGPR");
        let f = decode(&junk).unwrap();
        assert_eq!(f.status, Status::Unknown(255));
        // Non-ASCII names on the wire are dropped, not passed on.
        let h = Hello::decode(&f.payload);
        assert_eq!(h.identity.node_name, "");
    }

    #[test]
    fn plans_outside_the_limits_are_refused() {
        assert!(Plan::default().validate().is_ok());
        let big = Plan {
            rtt_size: MAX_RTT_SIZE,
            rtt_count: MAX_RTT_COUNT,
            bw_size: MAX_BW_SIZE,
            bw_duration: MAX_BW_DURATION,
        };
        assert!(big.validate().is_ok());
        assert_eq!(big.buffer_len(), MAX_BUFFER);
        for bad in [
            Plan {
                rtt_size: MAX_RTT_SIZE + 1,
                ..Plan::default()
            },
            Plan {
                rtt_size: 1,
                ..Plan::default()
            },
            Plan {
                rtt_count: 0,
                ..Plan::default()
            },
            Plan {
                rtt_count: MAX_RTT_COUNT + 1,
                ..Plan::default()
            },
            Plan {
                bw_size: MAX_BW_SIZE + 1,
                ..Plan::default()
            },
            Plan {
                bw_size: 65536,
                bw_duration: Duration::from_secs(3),
                ..Plan::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn percentiles_use_nearest_rank() {
        let d: Vec<Duration> = (1..=10).map(Duration::from_micros).collect();
        assert_eq!(percentile(&d, 0.0), Duration::from_micros(1));
        assert_eq!(percentile(&d, 0.5), Duration::from_micros(5));
        assert_eq!(percentile(&d, 0.99), Duration::from_micros(10));
        assert_eq!(percentile(&d, 1.0), Duration::from_micros(10));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn patterns_differ_between_sessions_and_digests_see_it() {
        let a = pattern(1, 1000);
        let b = pattern(2, 1000);
        assert_eq!(a.len(), 1000);
        assert_ne!(a, b);
        assert_ne!(digest(&a), digest(&b));
        assert_eq!(digest(&a), digest(&pattern(1, 1000)));
    }

    fn port(n: u32, up: bool, ll: LinkLayer, gids: Vec<Gid>) -> PortReport {
        PortReport {
            port: n,
            state: Some(if up {
                PortState::Active
            } else {
                PortState::Down
            }),
            phys_state: Some(if up {
                PhysState::LinkUp
            } else {
                PhysState::Disabled
            }),
            link_layer: Some(ll),
            gids,
            ..PortReport::default()
        }
    }

    #[test]
    fn usable_ports_are_up_opened_matching_and_addressable() {
        let v2 = |i, g: &str| Gid {
            index: i,
            gid: g.into(),
            gid_type: Some(GidType::RoceV2),
            netdev: Some("eth0".into()),
        };
        let report = RdmaReport {
            devices: vec![
                DeviceReport {
                    name: "rxe0".into(),
                    ports: vec![port(
                        1,
                        true,
                        LinkLayer::Ethernet,
                        vec![
                            v2(0, "fe80:0000:0000:0000:5054:00ff:fe12:3456"),
                            v2(1, "0000:0000:0000:0000:0000:ffff:a9fe:4d01"),
                        ],
                    )],
                    verbs: Some(VerbsDevice {
                        opened: true,
                        ..VerbsDevice::default()
                    }),
                    ..DeviceReport::default()
                },
                DeviceReport {
                    name: "mlx5_0".into(),
                    ports: vec![
                        port(1, true, LinkLayer::InfiniBand, vec![]),
                        port(2, false, LinkLayer::InfiniBand, vec![]),
                    ],
                    ..DeviceReport::default()
                },
                DeviceReport {
                    name: "mlx5_1".into(),
                    ports: vec![port(1, true, LinkLayer::Ethernet, vec![])],
                    ..DeviceReport::default()
                },
                DeviceReport {
                    name: "mlx5_2".into(),
                    ports: vec![port(1, true, LinkLayer::InfiniBand, vec![])],
                    verbs: Some(VerbsDevice::default()),
                    ..DeviceReport::default()
                },
            ],
            ..RdmaReport::default()
        };
        let all = LocalPort::usable(&report, &|_| true);
        assert_eq!(
            all,
            vec![
                LocalPort {
                    device: "rxe0".into(),
                    port: 1,
                    gid_index: Some(1)
                },
                LocalPort {
                    device: "mlx5_0".into(),
                    port: 1,
                    gid_index: None
                },
            ]
        );
        let rxe = LocalPort::usable(&report, &|d| d.starts_with("rxe"));
        assert_eq!(rxe.len(), 1);
    }

    fn responder(identity: Identity) -> Responder {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let r = Responder::start(l, identity, Roots::default(), SESSION_LIMIT).unwrap();
        r.set_ports(Vec::new());
        r
    }

    fn local() -> LocalPort {
        LocalPort {
            device: "rxe0".into(),
            port: 1,
            gid_index: Some(1),
        }
    }

    #[test]
    fn responder_refuses_self_other_groups_and_portless_sessions() {
        let r = responder(Identity {
            node_name: "gpu-a".into(),
            group: "pool-1".into(),
        });
        let me = |name: &str, group: &str| Identity {
            node_name: name.into(),
            group: group.into(),
        };
        let t = Duration::from_secs(5);
        let plan = Plan::default();
        let addr = r.local_addr();
        assert_eq!(
            measure(addr, &local(), &me("gpu-a", "pool-1"), &plan, t),
            Outcome::Skipped(Skip::SelfNode)
        );
        assert_eq!(
            measure(addr, &local(), &me("gpu-b", "pool-2"), &plan, t),
            Outcome::Skipped(Skip::OtherGroup)
        );
        // No validated port on the responder: a connect-kind failure that says so.
        match measure(addr, &local(), &me("gpu-b", "pool-1"), &plan, t) {
            Outcome::Failed {
                kind: Some(ErrorKind::Connect),
                message,
            } => assert!(message.contains("no usable RDMA port"), "{message}"),
            other => panic!("{other:?}"),
        }
        // Counted when the session thread ends, which may be just after our reply.
        assert!(wait_until(|| r.stats().refused.load(Ordering::Relaxed) == 3));
    }

    fn wait_until(cond: impl Fn() -> bool) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn unreachable_and_silent_peers_fail_with_their_kind_in_time() {
        // Nothing listens: connect.
        let dead = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let t = Duration::from_secs(2);
        let started = Instant::now();
        match measure(dead, &local(), &Identity::default(), &Plan::default(), t) {
            Outcome::Failed { kind, .. } => assert_eq!(kind, Some(ErrorKind::Connect)),
            other => panic!("{other:?}"),
        }
        // A listener that accepts and never answers: timeout, within the bound.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap();
        let hold = std::thread::spawn(move || silent.accept().map(|(s, _)| s));
        let t = Duration::from_millis(700);
        let started2 = Instant::now();
        match measure(addr, &local(), &Identity::default(), &Plan::default(), t) {
            Outcome::Failed { kind, .. } => assert_eq!(kind, Some(ErrorKind::Timeout)),
            other => panic!("{other:?}"),
        }
        assert!(started2.elapsed() < Duration::from_secs(3));
        assert!(started.elapsed() < Duration::from_secs(10));
        drop(hold.join());
    }

    /// A stranger: garbage, a frame that never completes, a flood of connections. The
    /// responder stays bounded and keeps serving well-formed clients.
    #[test]
    fn responder_survives_garbage_and_bounds_concurrent_sessions() {
        let r = responder(Identity {
            node_name: "gpu-a".into(),
            group: String::new(),
        });
        let addr = r.local_addr();
        let mut junk = TcpStream::connect(addr).unwrap();
        junk.write_all(&[0x42; FRAME_LEN]).unwrap();
        let mut buf = [0u8; 16];
        junk.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(junk.read(&mut buf).unwrap_or(0), 0, "garbage is dropped");
        assert!(wait_until(|| r.active_sessions() == 0));

        // Hold MAX_SESSIONS half-open sessions: the next one is told BUSY at once.
        let holders: Vec<TcpStream> = (0..MAX_SESSIONS)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(&[b'F'; 10]).unwrap();
                s
            })
            .collect();
        assert!(wait_until(|| r.active_sessions() == MAX_SESSIONS));
        let mut extra = TcpStream::connect(addr).unwrap();
        extra
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut f = [0u8; FRAME_LEN];
        extra.read_exact(&mut f).unwrap();
        let frame = decode(&f).unwrap();
        assert_eq!(frame.kind, T_WELCOME);
        assert_eq!(frame.status, Status::Busy);
        // The half-open sessions are cut after FRAME_TIMEOUT; then a client is served
        // again (here: refused as SELF, which needs a free slot).
        drop(holders);
        assert!(wait_until(|| r.active_sessions() == 0));
        let me = Identity {
            node_name: "gpu-a".into(),
            group: String::new(),
        };
        assert_eq!(
            measure(addr, &local(), &me, &Plan::default(), FRAME_TIMEOUT),
            Outcome::Skipped(Skip::SelfNode)
        );
    }

    #[test]
    fn a_responder_before_its_first_probe_says_starting() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let r = Responder::start(l, Identity::default(), Roots::default(), SESSION_LIMIT).unwrap();
        let me = Identity {
            node_name: "gpu-b".into(),
            group: String::new(),
        };
        let t = Duration::from_secs(5);
        assert_eq!(
            measure(r.local_addr(), &local(), &me, &Plan::default(), t),
            Outcome::Skipped(Skip::Starting)
        );
        r.set_ports(Vec::new());
        assert!(matches!(
            measure(r.local_addr(), &local(), &me, &Plan::default(), t),
            Outcome::Failed {
                kind: Some(ErrorKind::Connect),
                ..
            }
        ));
    }

    #[test]
    fn version_mismatch_is_refused_with_the_responders_version() {
        let r = responder(Identity::default());
        let mut s = TcpStream::connect(r.local_addr()).unwrap();
        let mut hello = Hello {
            identity: Identity::default(),
            device: "rxe0".into(),
            port: 1,
            plan: Plan::default(),
        }
        .encode();
        hello[4..6].copy_from_slice(&99u16.to_be_bytes());
        s.write_all(&hello).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut f = [0u8; FRAME_LEN];
        s.read_exact(&mut f).unwrap();
        let frame = decode(&f).unwrap();
        assert_eq!(frame.status, Status::Version);
        assert_eq!(frame.version, PROTOCOL_VERSION);
    }
}
