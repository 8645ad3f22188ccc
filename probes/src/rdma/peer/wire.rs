//! The side channel's frames (see the parent module): encoding and decoding of each frame
//! type, reading one frame within its own deadline and the session's, and the pattern and
//! digest both sides use to verify the WRITEs.

use super::auth::{KEY_ID_LEN, KeyId, NONCE_LEN};
use super::receipts::CheckTag;
use super::{FRAME_LEN, FRAME_TIMEOUT, Identity, MAC_AT, NAME_LEN, PROTOCOL_VERSION, Plan, Status};
use crate::rdma::verbs::rc::EndpointInfo;
use std::io::{self, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const MAGIC: [u8; 4] = *b"FGPR";
const DEVICE_LEN: usize = 32;

pub(super) const T_HELLO: u8 = 1;
pub(super) const T_WELCOME: u8 = 2;
pub(super) const T_ENDPOINT: u8 = 3;
pub(super) const T_DONE: u8 = 4;
pub(super) const T_VERDICT: u8 = 5;
/// Client's first frame: its nonce and the ids of the keys it has. Unauthenticated.
pub(super) const T_OPEN: u8 = 6;
/// Responder's answer to OPEN: its nonce and the key chosen, MACed (or a bare BUSY, VERSION
/// or AUTH status, which says nothing about the node).
pub(super) const T_CHALLENGE: u8 = 7;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Frame {
    pub(super) version: u16,
    pub(super) kind: u8,
    pub(super) status: Status,
    pub(super) payload: Vec<u8>,
    /// The frame as received (its MAC is checked over these bytes).
    pub(super) raw: [u8; FRAME_LEN],
}

/// A frame with `payload` (cut to the bytes before the MAC) and a zero MAC.
pub(super) fn encode(kind: u8, status: Status, payload: &[u8]) -> [u8; FRAME_LEN] {
    let mut f = [0u8; FRAME_LEN];
    f[..4].copy_from_slice(&MAGIC);
    f[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    f[6] = kind;
    f[7] = status.code();
    let n = payload.len().min(MAC_AT - 8);
    f[8..8 + n].copy_from_slice(&payload[..n]);
    f
}

/// Parse a frame; `None` for anything that is not one (wrong magic).
pub(super) fn decode(f: &[u8; FRAME_LEN]) -> Option<Frame> {
    if f[..4] != MAGIC {
        return None;
    }
    Some(Frame {
        version: u16::from_be_bytes([f[4], f[5]]),
        kind: f[6],
        status: Status::from_code(f[7]),
        payload: f[8..MAC_AT].to_vec(),
        raw: *f,
    })
}

/// Little cursor over a payload: big-endian integers and NUL-padded strings.
pub(super) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
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
    pub(super) fn u64(&mut self) -> u64 {
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
pub(super) struct Hello {
    pub(super) identity: Identity,
    pub(super) device: String,
    pub(super) port: u8,
    pub(super) plan: Plan,
    /// The gang check this session is for (all zero: none), so that the responder can
    /// attest what it received. Older clients send zeros here.
    pub(super) tag: CheckTag,
    /// The client closes after WELCOME (the side channel only, no RDMA).
    pub(super) greet: bool,
}

impl Hello {
    pub(super) fn encode(&self) -> [u8; FRAME_LEN] {
        let mut p = Vec::with_capacity(200);
        put_who(&mut p, &self.identity, &self.device);
        p.extend_from_slice(&[self.port, 0, 0, 0]);
        p.extend_from_slice(&self.plan.rtt_size.to_be_bytes());
        p.extend_from_slice(&self.plan.rtt_count.to_be_bytes());
        p.extend_from_slice(&self.plan.bw_size.to_be_bytes());
        let ms = u32::try_from(self.plan.bw_duration.as_millis()).unwrap_or(u32::MAX);
        p.extend_from_slice(&ms.to_be_bytes());
        p.extend_from_slice(&self.tag.check);
        p.extend_from_slice(&[self.tag.rail, self.tag.rails, u8::from(self.greet)]);
        encode(T_HELLO, Status::Ok, &p)
    }

    pub(super) fn decode(payload: &[u8]) -> Self {
        let mut c = Cursor::new(payload);
        let (identity, device) = read_who(&mut c);
        let port = c.u8();
        c.take(3);
        let plan = Plan {
            rtt_size: c.u32(),
            rtt_count: c.u32(),
            bw_size: c.u32(),
            bw_duration: Duration::from_millis(u64::from(c.u32())),
        };
        let tag = CheckTag {
            check: c.bytes(),
            rail: c.u8(),
            rails: c.u8(),
        };
        let greet = c.u8() & 1 == 1;
        Self {
            identity,
            device,
            port,
            plan,
            tag,
            greet,
        }
    }
}

/// HELLO and WELCOME both start with who is speaking and from which device.
fn put_who(p: &mut Vec<u8>, identity: &Identity, device: &str) {
    put_text(p, &identity.node_name, NAME_LEN);
    put_text(p, &identity.group, NAME_LEN);
    put_text(p, device, DEVICE_LEN);
}

fn read_who(c: &mut Cursor<'_>) -> (Identity, String) {
    let node_name = c.text(NAME_LEN);
    let group = c.text(NAME_LEN);
    (Identity { node_name, group }, c.text(DEVICE_LEN))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Welcome {
    pub(super) identity: Identity,
    pub(super) device: String,
    pub(super) port: u8,
}

impl Welcome {
    pub(super) fn encode(&self, status: Status) -> [u8; FRAME_LEN] {
        let mut p = Vec::with_capacity(200);
        put_who(&mut p, &self.identity, &self.device);
        p.push(self.port);
        encode(T_WELCOME, status, &p)
    }

    pub(super) fn decode(payload: &[u8]) -> Self {
        let mut c = Cursor::new(payload);
        let (identity, device) = read_who(&mut c);
        let port = c.u8();
        Self {
            identity,
            device,
            port,
        }
    }
}

pub(super) fn encode_endpoint(e: &EndpointInfo, status: Status) -> [u8; FRAME_LEN] {
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

pub(super) fn decode_endpoint(payload: &[u8]) -> EndpointInfo {
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

/// OPEN: the client's nonce and the ids of its keys (current first).
pub(super) fn encode_open(nonce: &[u8; NONCE_LEN], ids: &[KeyId]) -> [u8; FRAME_LEN] {
    let mut p = Vec::with_capacity(NONCE_LEN + 1 + ids.len() * KEY_ID_LEN);
    p.extend_from_slice(nonce);
    let n = ids.len().min(super::auth::MAX_KEYS);
    p.push(n as u8);
    for id in &ids[..n] {
        p.extend_from_slice(id);
    }
    encode(T_OPEN, Status::Ok, &p)
}

pub(super) fn decode_open(payload: &[u8]) -> ([u8; NONCE_LEN], Vec<KeyId>) {
    let mut c = Cursor::new(payload);
    let nonce = c.bytes::<NONCE_LEN>();
    let n = usize::from(c.u8()).min(super::auth::MAX_KEYS);
    let ids = (0..n).map(|_| c.bytes::<KEY_ID_LEN>()).collect();
    (nonce, ids)
}

/// CHALLENGE: the responder's nonce and the id of the key the session uses.
pub(super) fn encode_challenge(nonce: &[u8; NONCE_LEN], id: &KeyId) -> [u8; FRAME_LEN] {
    let mut p = Vec::with_capacity(NONCE_LEN + KEY_ID_LEN);
    p.extend_from_slice(nonce);
    p.extend_from_slice(id);
    encode(T_CHALLENGE, Status::Ok, &p)
}

pub(super) fn decode_challenge(payload: &[u8]) -> ([u8; NONCE_LEN], KeyId) {
    let mut c = Cursor::new(payload);
    (c.bytes::<NONCE_LEN>(), c.bytes::<KEY_ID_LEN>())
}

pub(super) fn read_frame(stream: &mut TcpStream, deadline: Instant) -> io::Result<Frame> {
    read_frame_within(stream, deadline, FRAME_TIMEOUT)
}

/// Read one frame: the whole frame within `per_frame` of the first attempt and never past
/// `deadline`, however the bytes trickle in (each read waits only for what is left, so a
/// byte every 2 s does not keep a 3 s frame open).
pub(super) fn read_frame_within(
    stream: &mut TcpStream,
    deadline: Instant,
    per_frame: Duration,
) -> io::Result<Frame> {
    let frame_deadline = deadline.min(Instant::now() + per_frame);
    let mut f = [0u8; FRAME_LEN];
    let mut got = 0;
    while got < FRAME_LEN {
        let left = frame_deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let what = if frame_deadline < deadline {
                "the frame did not arrive in time"
            } else {
                "session time limit reached"
            };
            return Err(io::Error::new(io::ErrorKind::TimedOut, what));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut f[got..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed mid-frame",
                ));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    decode(&f).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "not a fabricgate frame"))
}

pub(super) fn expect_kind(frame: Frame, kind: u8, what: &str) -> io::Result<Frame> {
    if frame.kind != kind {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected a {what} frame, got type {}", frame.kind),
        ));
    }
    Ok(frame)
}

/// FNV-1a over the bytes: both sides hash the same region to verify the WRITEs landed.
pub(super) fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The session's pattern: different in every session, so stale bytes cannot pass.
pub(super) fn pattern(nonce: u64, len: usize) -> Vec<u8> {
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
