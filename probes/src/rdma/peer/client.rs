//! The client that measures one peer: the side-channel exchange, the RTT and bandwidth
//! bursts, and the responder's verdict, folded into an [`Outcome`].

use super::wire::{
    Hello, T_DONE, T_ENDPOINT, T_VERDICT, T_WELCOME, Welcome, decode_endpoint, digest, encode,
    encode_endpoint, pattern, read_frame_within,
};
use super::{BW_DEPTH, FRAME_TIMEOUT, Identity, LocalPort, PROTOCOL_VERSION, Plan, Status};
use crate::rdma::verbs::rc::{self, EndpointSpec, RcError};
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

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
