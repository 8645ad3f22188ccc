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
//! frames of [`FRAME_LEN`] bytes: `magic "FGPR" | version u16 | type u8 | status u8 | payload
//! | HMAC-SHA256`, big-endian, zero padded. Every frame after OPEN carries the MAC of the
//! session transcript ([`auth`]): both sides prove they hold a key of the pool before either
//! says who it is, and a recorded session cannot be replayed.
//!
//! ```text
//! client                                   responder
//!   OPEN    client nonce, ids of its keys ──►        (unauthenticated; names nothing)
//!          ◄── CHALLENGE responder nonce, key id, MAC (or bare BUSY, VERSION, AUTH)
//!   HELLO   node, group, device/port, plan, gang check and rail, MAC ──►
//!          ◄── WELCOME node, group, device/port, status (OK, SELF, OTHER_GROUP, ...), MAC
//!              (or a bare AUTH: the HELLO's MAC was wrong)
//!   ENDPOINT gid, qpn, psn, lid, mtu, addr, rkey, len, MAC ──►   (responder creates its QP)
//!          ◄── ENDPOINT (or status VERBS), MAC
//!   ... RDMA WRITEs: RTT burst into slots, then the bandwidth burst ...
//!   DONE    digest of the bytes written, MAC ──►
//!          ◄── VERDICT status OK or MISMATCH (the responder hashed its buffer), MAC
//! ```
//!
//! # Limits (what a stranger can make the responder do)
//! A connection that has not authenticated waits in a pool of its own: at most
//! [`MAX_HANDSHAKES`] at once and [`MAX_HANDSHAKES_PER_SOURCE`] from one source address (more
//! are answered BUSY by the accept thread without reading anything), and OPEN and HELLO must
//! both arrive within [`HANDSHAKE_TIMEOUT`] of accept. Only an authenticated client takes one
//! of the [`MAX_SESSIONS`] session slots ([`MAX_PER_SOURCE`] per address; beyond them a sealed
//! WELCOME BUSY), so idle strangers never hold what a peer of the pool needs; the address of a
//! live gang check's predecessor ([`ExpectedPeers`]) has [`EXPECTED_PER_PEER`] places beyond
//! both pools. Each session is closed after its session limit (default
//! [`SESSION_LIMIT`]); every frame must arrive whole within [`FRAME_TIMEOUT`]; frames have one
//! fixed size; plans outside [`Plan::validate`] are refused before anything is allocated, so
//! one session pins at most [`MAX_BUFFER`] bytes and the responder at most
//! `(MAX_SESSIONS + EXPECTED_PER_PEER) × MAX_BUFFER`. Before authentication the responder says
//! nothing but BUSY, VERSION or AUTH.
//!
//! # Gang checks
//! A session of a gang check names it in HELLO ([`CheckTag`]); the responder keeps a
//! [`Receipt`] of what it saw, which its agent attests in its own answer.
//! The client holds the responder to the Node it dialled ([`Pin`]: WELCOME's name, ENDPOINT's
//! GID or LID; item 4).
//!
//! # Layout
//! This module holds the limits, the plan and the local ports; `wire` the frames, `auth` the
//! keys and the MACs, `responder` and `client` the two sides of a session, `receipts` what
//! the responder saw of gang checks' sessions.

pub mod auth;
mod client;
mod receipts;
mod responder;
mod slots;
#[cfg(test)]
mod tests;
mod wire;

pub use auth::{KeyRing, Keys};
pub use client::{
    ErrorKind, GreetOptions, Greeting, Measurement, Outcome, Pin, Skip, answered_as, greet,
    measure, measure_from, measure_pinned, parse_gid, percentile,
};
pub use receipts::{CheckTag, MAX_RECEIPTS, Receipt, Receipts, Seen};
pub use responder::{Responder, ResponderStats};
pub use slots::ExpectedPeers;

use crate::rdma::{DeviceReport, GidType, LinkLayer, PortReport, RdmaReport};
use crate::roots::Roots;
use std::time::Duration;

/// The side channel's protocol version (2: authenticated frames).
pub const PROTOCOL_VERSION: u16 = 2;
/// Every frame is exactly this long.
pub const FRAME_LEN: usize = 256;
/// Where a frame's HMAC-SHA256 starts (its last 32 bytes).
pub const MAC_AT: usize = FRAME_LEN - 32;
/// Authenticated sessions served at once; more are answered BUSY.
pub const MAX_SESSIONS: usize = 4;
/// Authenticated sessions served at once for one source address; more are answered BUSY.
pub const MAX_PER_SOURCE: usize = 2;
/// Connections that have not authenticated yet, at once; more are answered BUSY.
pub const MAX_HANDSHAKES: usize = 8;
/// Connections not authenticated yet from one source address; more are answered BUSY.
pub const MAX_HANDSHAKES_PER_SOURCE: usize = 2;
/// OPEN and HELLO must both arrive within this of accept (one round trip of the pool's
/// own agents; a stranger's idle connection holds its place no longer).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// Places an expected peer (a live gang check's predecessor) has beyond each pool.
pub const EXPECTED_PER_PEER: usize = 2;
/// Expected peers kept at once (a node is in a few checks at a time).
pub const MAX_EXPECTED_PEERS: usize = 16;
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

/// Status byte of WELCOME, ENDPOINT and VERDICT frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    Ok,
    /// The responder already holds [`MAX_HANDSHAKES`] unauthenticated connections (or
    /// [`MAX_HANDSHAKES_PER_SOURCE`] from the client's address), or serves [`MAX_SESSIONS`]
    /// sessions (or [`MAX_PER_SOURCE`] for the client's address).
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
    /// The responder shares no key with the client, or the client's MAC was wrong.
    Auth,
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
            Self::Auth => 10,
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
            10 => Self::Auth,
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
            Self::Auth => {
                "the responder refused our authentication (no peers key in common, or a \
                 wrong MAC): check that both nodes mount the same fabricgate-peers Secret"
            }
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

/// CPU time (ns) the calling thread has used, from `<proc>/thread-self/schedstat`.
pub fn thread_cpu_ns(roots: &Roots) -> Option<u64> {
    let text = std::fs::read_to_string(roots.proc("thread-self/schedstat")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}
