//! The client that measures one peer: the side-channel exchange, the RTT and bandwidth
//! bursts, and the responder's verdict, folded into an [`Outcome`].

use super::auth::{Keys, NONCE_LEN, Side, Transcript, random};
use super::receipts::CheckTag;
use super::wire::{
    Frame, Hello, T_CHALLENGE, T_DONE, T_ENDPOINT, T_VERDICT, T_WELCOME, Welcome, decode_challenge,
    decode_endpoint, digest, encode, encode_endpoint, encode_open, pattern, read_frame_within,
};
use super::{
    BW_DEPTH, FRAME_LEN, FRAME_TIMEOUT, Identity, LocalPort, PROTOCOL_VERSION, Plan, SESSION_LIMIT,
    Status,
};
use crate::rdma::verbs::rc::{self, EndpointInfo, EndpointSpec, RcError};
use std::io::{self, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The `kind` of `fabricgate_peer_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ErrorKind {
    /// The side channel failed: no TCP connection, refused, garbage, an answer that fails
    /// authentication (or AUTH: no key in common), or a responder that cannot take part
    /// (NO_PORT, VERBS, ...). BUSY is a [`Skip`], not this.
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
    /// The responder was serving as many sessions as it takes (in total or from our
    /// address); try again in a later round. Not authenticated, so never a finding.
    Busy,
}

/// What the dialled Node says about itself, to hold its responder to: the
/// pool's key is shared by every node, so a responder's word on who it is proves nothing. Its
/// WELCOME must name exactly `node`, and its ENDPOINT must address one of the ports that Node
/// publishes (`fabricgate.io/peers-gids`, which only its own agent may write): a RoCE GID, or
/// an InfiniBand LID.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pin {
    pub node: String,
    pub gids: Vec<[u8; 16]>,
    pub lids: Vec<u16>,
    /// The gang check and rail of the session, told to the responder in HELLO so that it
    /// attests what it received; all zero: none.
    pub tag: CheckTag,
}

impl Pin {
    /// `node` and its published entries, each `device/port=<gid>` (eight groups of four hex
    /// digits, as sysfs shows a GID) or `device/port=lid:<n>`; malformed entries are dropped.
    pub fn new(node: &str, entries: &[String]) -> Self {
        let mut pin = Self {
            node: node.to_owned(),
            ..Self::default()
        };
        for e in entries {
            let Some((_, value)) = e.split_once('=') else {
                continue;
            };
            if let Some(lid) = value.strip_prefix("lid:") {
                if let Ok(l) = lid.parse::<u16>() {
                    pin.lids.push(l);
                }
            } else if let Some(g) = parse_gid(value) {
                pin.gids.push(g);
            }
        }
        pin
    }

    /// Whether an ENDPOINT whose GID is `gid` and LID `lid` addresses one of the Node's ports:
    /// on a routed (RoCE, `global`) connection its GID, else its LID.
    pub fn admits(&self, gid: [u8; 16], lid: u16, global: bool) -> bool {
        if global {
            self.gids.contains(&gid)
        } else {
            lid != 0 && self.lids.contains(&lid)
        }
    }
}

/// A GID as sysfs writes it (`fe80:0000:...`, eight groups of four hex digits).
pub fn parse_gid(text: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    let groups: Vec<&str> = text.split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    for (i, g) in groups.iter().enumerate() {
        if g.len() != 4 {
            return None;
        }
        let v = u16::from_str_radix(g, 16).ok()?;
        out[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(out)
}

fn gid_text(gid: &[u8; 16]) -> String {
    gid.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
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

fn unauthenticated(peer: SocketAddr, what: &str) -> Outcome {
    failed(
        ErrorKind::Connect,
        format!(
            "{peer}: the {what} frame failed authentication (not an agent holding our peers \
             key); its answer is ignored"
        ),
    )
}

/// How a responder's name reads in a message.
pub fn answered_as(name: &str) -> String {
    if name.is_empty() {
        "no node".to_owned()
    } else {
        format!("node {name}")
    }
}

/// Read the responder's next frame and check its MAC.
fn read_sealed(
    stream: &mut TcpStream,
    deadline: Instant,
    per_frame: Duration,
    t: &mut Transcript,
    peer: SocketAddr,
    what: &str,
) -> Result<Frame, Outcome> {
    let frame = read_frame_within(stream, deadline, per_frame)
        .map_err(|e| io_failure(&format!("read {what}"), &e))?;
    if t.verify(&frame.raw) {
        Ok(frame)
    } else {
        Err(unauthenticated(peer, what))
    }
}

fn rc_failure(e: &RcError) -> Outcome {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else {
        ErrorKind::Verification
    };
    failed(kind, e.message.clone())
}

/// The authenticated side channel up to the responder's WELCOME OK: what a session has before
/// any RDMA.
struct Opened {
    stream: TcpStream,
    t: Transcript,
    welcome: Welcome,
    start: Instant,
    deadline: Instant,
}

/// What [`greet`] learned from a responder that welcomed us: the side channel works and both
/// sides hold a key of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Greeting {
    /// The node name the responder gave (may be empty).
    pub peer_node: String,
    /// The responder's device and port it would serve the session from.
    pub peer_device: String,
    pub peer_port: u8,
    /// Connect to WELCOME.
    pub elapsed: Duration,
}

/// A TCP connection to `peer` within `timeout`, from `source` when it is given (this node's
/// own address, so that the peer's responder knows the connection as its gang check's
/// predecessor; see `ExpectedPeers`). An address that cannot be bound (gone, of another
/// family) is not used: the route's source is.
fn connect(source: Option<IpAddr>, peer: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    use rustix::net::{AddressFamily, SocketFlags, SocketType, bind, socket_with, sockopt};
    let Some(source) = source.filter(|s| !s.is_unspecified() && s.is_ipv4() == peer.is_ipv4())
    else {
        return TcpStream::connect_timeout(&peer, timeout);
    };
    let family = if peer.is_ipv4() {
        AddressFamily::INET
    } else {
        AddressFamily::INET6
    };
    let fd = socket_with(
        family,
        SocketType::STREAM,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )?;
    if bind(&fd, &SocketAddr::new(source, 0)).is_err() {
        return TcpStream::connect_timeout(&peer, timeout);
    }
    match rustix::net::connect(&fd, &peer) {
        Ok(()) => {}
        Err(rustix::io::Errno::INPROGRESS) => {
            let wait = Timespec::try_from(timeout).unwrap_or(Timespec {
                tv_sec: 3,
                tv_nsec: 0,
            });
            let mut fds = [PollFd::new(&fd, PollFlags::OUT)];
            if poll(&mut fds, Some(&wait))? == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection timed out",
                ));
            }
            sockopt::socket_error(&fd)??;
        }
        Err(e) => return Err(e.into()),
    }
    let stream = TcpStream::from(fd);
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// OPEN, CHALLENGE, HELLO and WELCOME, bounded by `timeout` from now. `Err` is the outcome
/// when the responder did not welcome us (a failure or a skip).
#[allow(clippy::too_many_arguments)]
fn open(
    source: Option<IpAddr>,
    peer: SocketAddr,
    local: &LocalPort,
    identity: &Identity,
    keys: &Keys,
    plan: &Plan,
    timeout: Duration,
    (tag, greet): (CheckTag, bool),
) -> Result<Opened, Outcome> {
    let Some(client_nonce) = random() else {
        return Err(Outcome::Failed {
            kind: None,
            message: "no random numbers from the system (getrandom failed)".into(),
        });
    };
    let start = Instant::now();
    let deadline = start + timeout;
    let mut stream = match connect(source, peer, timeout.min(FRAME_TIMEOUT)) {
        Ok(s) => s,
        // A connect that times out is still a connect failure: nothing answered.
        Err(e) => {
            return Err(failed(
                ErrorKind::Connect,
                format!("connect to {peer}: {e}"),
            ));
        }
    };
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(FRAME_TIMEOUT));
    let ids: Vec<_> = keys.ids().collect();
    if let Err(e) = stream.write_all(&encode_open(&client_nonce, &ids)) {
        return Err(io_failure("send OPEN", &e));
    }
    let mut t = challenge(&mut stream, peer, keys, client_nonce, deadline, timeout)?;
    let hello = Hello {
        identity: identity.clone(),
        device: local.device.clone(),
        port: local.port,
        plan: *plan,
        tag,
        greet,
    };
    if let Err(e) = stream.write_all(&t.seal(hello.encode())) {
        return Err(io_failure("send HELLO", &e));
    }
    let welcome = welcome(&mut stream, &mut t, peer, deadline, timeout)?;
    Ok(Opened {
        stream,
        t,
        welcome,
        start,
        deadline,
    })
}

/// The responder's CHALLENGE to our OPEN: the key it chose, and the session's transcript
/// once the frame's MAC checks out.
fn challenge(
    stream: &mut TcpStream,
    peer: SocketAddr,
    keys: &Keys,
    client_nonce: [u8; NONCE_LEN],
    deadline: Instant,
    timeout: Duration,
) -> Result<Transcript, Outcome> {
    let frame = match read_frame_within(stream, deadline, timeout) {
        Ok(f) => f,
        Err(e) => return Err(io_failure("read CHALLENGE", &e)),
    };
    if frame.kind != T_CHALLENGE {
        return Err(failed(
            ErrorKind::Connect,
            format!(
                "{peer}: expected CHALLENGE, got frame type {} (an agent of protocol version {}?)",
                frame.kind, frame.version
            ),
        ));
    }
    match frame.status {
        Status::Ok => {}
        Status::Busy => return Err(Outcome::Skipped(Skip::Busy)),
        Status::Version => {
            return Err(failed(
                ErrorKind::Connect,
                format!(
                    "{peer}: {} (ours {PROTOCOL_VERSION}, theirs {})",
                    Status::Version.describe(),
                    frame.version
                ),
            ));
        }
        // Anything else before authentication is not believed.
        s => {
            return Err(failed(
                ErrorKind::Connect,
                format!("{peer}: {}", s.describe()),
            ));
        }
    }
    let (responder_nonce, key_id) = decode_challenge(&frame.payload);
    let Some(key) = keys.by_id(&key_id) else {
        return Err(failed(
            ErrorKind::Connect,
            format!("{peer}: the responder chose a key we do not have"),
        ));
    };
    let mut t = Transcript::new(key, client_nonce, responder_nonce, Side::Client);
    if !t.verify(&frame.raw) {
        return Err(unauthenticated(peer, "CHALLENGE"));
    }
    Ok(t)
}

/// The responder's WELCOME to our HELLO: who it is and the port it serves from, when it
/// takes the session; the skip or failure it answered otherwise.
fn welcome(
    stream: &mut TcpStream,
    t: &mut Transcript,
    peer: SocketAddr,
    deadline: Instant,
    timeout: Duration,
) -> Result<Welcome, Outcome> {
    let frame = match read_frame_within(stream, deadline, timeout) {
        Ok(f) => f,
        Err(e) => return Err(io_failure("read WELCOME", &e)),
    };
    if frame.kind != T_WELCOME {
        return Err(failed(
            ErrorKind::Connect,
            format!("expected WELCOME, got frame type {}", frame.kind),
        ));
    }
    if !t.verify(&frame.raw) {
        if frame.status == Status::Auth {
            return Err(failed(
                ErrorKind::Connect,
                format!("{peer}: {}", Status::Auth.describe()),
            ));
        }
        return Err(unauthenticated(peer, "WELCOME"));
    }
    match frame.status {
        Status::Ok => Ok(Welcome::decode(&frame.payload)),
        Status::SelfNode => Err(Outcome::Skipped(Skip::SelfNode)),
        Status::OtherGroup => Err(Outcome::Skipped(Skip::OtherGroup)),
        Status::Starting => Err(Outcome::Skipped(Skip::Starting)),
        Status::Busy => Err(Outcome::Skipped(Skip::Busy)),
        s => Err(failed(
            ErrorKind::Connect,
            format!("{peer}: {}", s.describe()),
        )),
    }
}

/// How [`greet`] reaches a responder; `GreetOptions::default()` is the plain greeting.
#[derive(Debug, Clone, Copy)]
pub struct GreetOptions<'a> {
    /// The port asked for; `None`: any (a node without a usable port, whose responder
    /// answers for one of its own).
    pub local: Option<&'a LocalPort>,
    /// Connect from this local address (see [`measure_from`]); `None`: the route's source.
    pub source: Option<IpAddr>,
    /// Hold the responder to the Node dialled: its WELCOME must name `pin.node` (a
    /// `verification` failure otherwise), and `pin.tag` tells it the check, for its receipts.
    pub pin: Option<&'a Pin>,
    /// Bound on the whole greeting, TCP connect included.
    pub timeout: Duration,
}

impl Default for GreetOptions<'_> {
    fn default() -> Self {
        Self {
            local: None,
            source: None,
            pin: None,
            timeout: SESSION_LIMIT,
        }
    }
}

/// Only the side-channel half of a session: the authenticated OPEN/CHALLENGE/HELLO/WELCOME
/// with `peer`'s responder, then the connection is closed (the responder counts the session
/// as broken off). For nodes that cannot measure over RDMA (no usable local port, verbs off):
/// it proves the responder is up, answers for the node it names, and holds the pool's key.
///
/// # Errors
/// The [`Outcome`] (a failure or a skip) when the responder did not welcome us.
pub fn greet(
    peer: SocketAddr,
    identity: &Identity,
    keys: &Keys,
    options: &GreetOptions<'_>,
) -> Result<Greeting, Outcome> {
    let any = LocalPort {
        device: String::new(),
        port: 0,
        gid_index: None,
    };
    let local = options.local.unwrap_or(&any);
    let tag = options.pin.map(|p| p.tag).unwrap_or_default();
    let opened = open(
        options.source,
        peer,
        local,
        identity,
        keys,
        &Plan::default(),
        options.timeout,
        (tag, true),
    )?;
    let _ = opened.stream.shutdown(Shutdown::Both);
    if let Some(pin) = options.pin
        && opened.welcome.identity.node_name != pin.node
    {
        return Err(failed(
            ErrorKind::Verification,
            format!(
                "{peer}: the responder answered as {}, not as node {}",
                answered_as(&opened.welcome.identity.node_name),
                pin.node
            ),
        ));
    }
    Ok(Greeting {
        peer_node: opened.welcome.identity.node_name,
        peer_device: opened.welcome.device,
        peer_port: opened.welcome.port,
        elapsed: opened.start.elapsed(),
    })
}

/// Measure `peer` from `local`: the authenticated side-channel exchange, an RTT burst and,
/// when the plan has one, a bandwidth burst, then the responder's verification. Bounded by
/// `timeout` (TCP connect included). Never panics. Only answers MACed with one of `keys`
/// are believed: an unauthenticated SELF or OTHER_GROUP is a `connect` failure, never a skip.
pub fn measure(
    peer: SocketAddr,
    local: &LocalPort,
    identity: &Identity,
    keys: &Keys,
    plan: &Plan,
    timeout: Duration,
) -> Outcome {
    measure_from(None, peer, local, identity, keys, plan, timeout)
}

/// [`measure`] over a TCP connection from the local address `source` (when it can be bound):
/// the gang pre-flight connects from the node's own address, the one its ring successor's
/// responder keeps places for.
pub fn measure_from(
    source: Option<IpAddr>,
    peer: SocketAddr,
    local: &LocalPort,
    identity: &Identity,
    keys: &Keys,
    plan: &Plan,
    timeout: Duration,
) -> Outcome {
    measure_pinned(source, peer, local, identity, keys, plan, timeout, None)
}

/// [`measure_from`], holding the responder to `pin` (the Node dialled): a WELCOME naming
/// another node (or none) and an ENDPOINT that is not one of the Node's published ports are
/// `verification` failures, before any byte is written.
#[allow(clippy::too_many_arguments)]
pub fn measure_pinned(
    source: Option<IpAddr>,
    peer: SocketAddr,
    local: &LocalPort,
    identity: &Identity,
    keys: &Keys,
    plan: &Plan,
    timeout: Duration,
    pin: Option<&Pin>,
) -> Outcome {
    if let Err(e) = plan.validate() {
        return Outcome::Failed {
            kind: None,
            message: format!("plan: {e}"),
        };
    }
    let Some(seed) = random::<8>() else {
        return Outcome::Failed {
            kind: None,
            message: "no random numbers from the system (getrandom failed)".into(),
        };
    };
    let Opened {
        stream,
        t,
        welcome,
        start,
        deadline,
    } = match open(
        source,
        peer,
        local,
        identity,
        keys,
        plan,
        timeout,
        (pin.map(|p| p.tag).unwrap_or_default(), false),
    ) {
        Ok(o) => o,
        Err(outcome) => return outcome,
    };
    let mut channel = Channel {
        stream,
        t,
        peer,
        deadline,
        per_frame: timeout,
    };
    if let Some(pin) = pin
        && welcome.identity.node_name != pin.node
    {
        let _ = channel.stream.shutdown(Shutdown::Both);
        return failed(
            ErrorKind::Verification,
            format!(
                "{peer}: the responder answered as {}, not as node {}",
                answered_as(&welcome.identity.node_name),
                pin.node
            ),
        );
    }

    let nonce = u64::from_be_bytes(seed);
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
        let run = exchange_endpoints(&mut channel, ep, local, plan, pin)
            .and_then(|remote| bursts(ep, &remote, plan, deadline))
            .and_then(|burst| channel.verdict(&bytes).map(|()| burst));
        match run {
            Ok(burst) => Outcome::Measured(Measurement {
                peer_node: welcome.identity.node_name.clone(),
                peer_device: welcome.device.clone(),
                peer_port: welcome.port,
                rtts: burst.rtts,
                bandwidth: burst.bandwidth,
                bw_bytes: burst.bw_bytes,
                elapsed: start.elapsed(),
            }),
            Err(outcome) => outcome,
        }
    });
    let _ = channel.stream.shutdown(Shutdown::Both);
    match result {
        Ok(outcome) => outcome,
        Err(e) => Outcome::Failed {
            kind: None,
            message: format!("{} port {}: {}", local.device, local.port, e.message),
        },
    }
}

/// The authenticated side channel of a session past WELCOME.
struct Channel {
    stream: TcpStream,
    t: Transcript,
    peer: SocketAddr,
    deadline: Instant,
    /// Bound on one frame's wait (within `deadline`).
    per_frame: Duration,
}

impl Channel {
    fn send(&mut self, frame: [u8; FRAME_LEN], what: &str) -> Result<(), Outcome> {
        self.stream
            .write_all(&self.t.seal(frame))
            .map_err(|e| io_failure(&format!("send {what}"), &e))
    }

    fn read(&mut self, what: &str) -> Result<Frame, Outcome> {
        read_sealed(
            &mut self.stream,
            self.deadline,
            self.per_frame,
            &mut self.t,
            self.peer,
            what,
        )
    }

    /// DONE with the digest of what we wrote, and the responder's VERDICT on its buffer.
    fn verdict(&mut self, written: &[u8]) -> Result<(), Outcome> {
        let peer = self.peer;
        self.send(
            encode(T_DONE, Status::Ok, &digest(written).to_be_bytes()),
            "DONE",
        )?;
        let verdict = self.read("VERDICT")?;
        if verdict.kind != T_VERDICT {
            return Err(failed(
                ErrorKind::Connect,
                format!("expected VERDICT, got frame type {}", verdict.kind),
            ));
        }
        match verdict.status {
            Status::Ok => Ok(()),
            Status::Mismatch => Err(failed(
                ErrorKind::Verification,
                format!("{peer}: {}", Status::Mismatch.describe()),
            )),
            s => Err(failed(
                ErrorKind::Connect,
                format!("{peer}: {}", s.describe()),
            )),
        }
    }
}

/// Our ENDPOINT for the responder's, held to `pin`, then the queue pair connected to it.
fn exchange_endpoints(
    channel: &mut Channel,
    ep: &mut rc::Endpoint<'_>,
    local: &LocalPort,
    plan: &Plan,
    pin: Option<&Pin>,
) -> Result<EndpointInfo, Outcome> {
    let peer = channel.peer;
    channel.send(encode_endpoint(&ep.local(), Status::Ok), "ENDPOINT")?;
    let frame = channel.read("ENDPOINT")?;
    if frame.kind != T_ENDPOINT || frame.status != Status::Ok {
        return Err(failed(
            ErrorKind::Connect,
            format!("{peer}: {}", frame.status.describe()),
        ));
    }
    let remote = decode_endpoint(&frame.payload);
    if let Some(pin) = pin
        && !pin.admits(remote.gid, remote.lid, local.gid_index.is_some())
    {
        let addr = if local.gid_index.is_some() {
            format!("GID {}", gid_text(&remote.gid))
        } else {
            format!("LID {}", remote.lid)
        };
        return Err(failed(
            ErrorKind::Verification,
            format!(
                "{peer}: the responder's ENDPOINT ({addr}) is not a port node {} publishes \
                 (fabricgate.io/peers-gids): another node's HCA?",
                pin.node
            ),
        ));
    }
    if (remote.len as usize) < plan.buffer_len() {
        return Err(failed(
            ErrorKind::Connect,
            format!(
                "{peer}: the responder's buffer ({} bytes) is smaller than the plan",
                remote.len
            ),
        ));
    }
    ep.connect(&remote).map_err(|e| Outcome::Failed {
        kind: None,
        message: e.message,
    })?;
    Ok(remote)
}

/// What the RDMA bursts measured.
struct Burst {
    /// Sorted.
    rtts: Vec<Duration>,
    bandwidth: Option<f64>,
    bw_bytes: u64,
}

/// The RTT burst (one WRITE at a time into its own slot) and, when the plan has one, the
/// bandwidth burst into the region after the slots.
fn bursts(
    ep: &mut rc::Endpoint<'_>,
    remote: &EndpointInfo,
    plan: &Plan,
    deadline: Instant,
) -> Result<Burst, Outcome> {
    let size = plan.rtt_size as usize;
    let mut rtts = Vec::with_capacity(plan.rtt_count as usize);
    for i in 0..plan.rtt_count as usize {
        let rtt = ep
            .write(i * size, size, remote, (i * size) as u64, deadline)
            .map_err(|e| rc_failure(&e))?;
        rtts.push(rtt);
    }
    rtts.sort();
    let mut burst = Burst {
        rtts,
        bandwidth: None,
        bw_bytes: 0,
    };
    if plan.bw_size > 0 {
        let off = plan.rtt_region();
        let (bytes, took) = ep
            .write_stream(
                off,
                plan.bw_size as usize,
                remote,
                off as u64,
                plan.bw_duration,
                deadline,
            )
            .map_err(|e| rc_failure(&e))?;
        burst.bw_bytes = bytes;
        burst.bandwidth = Some(bytes as f64 / took.as_secs_f64().max(1e-9));
    }
    Ok(burst)
}
