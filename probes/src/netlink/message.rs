//! Netlink framing (uapi `linux/netlink.h`): the `nlmsghdr` every message starts with, the
//! attributes (`nlattr`/`rtattr`, one layout) that follow a family's fixed header, and the
//! request a client sends. Pure functions over bytes: a truncated or malformed message ends
//! the walk (never a panic, never an out-of-bounds read).

/// `struct nlmsghdr`: len (u32), type (u16), flags (u16), seq (u32), pid (u32).
pub const NLMSG_HDRLEN: usize = 16;
/// `struct nlattr` / `struct rtattr`: len (u16), type (u16).
pub const NLA_HDRLEN: usize = 4;

/// Message types every protocol shares.
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;

/// `nlmsg_flags`.
pub const NLM_F_REQUEST: u16 = 0x1;
pub const NLM_F_MULTI: u16 = 0x2;
pub const NLM_F_ACK: u16 = 0x4;
/// `NLM_F_ROOT | NLM_F_MATCH`: every object of the kind, in as many messages as it takes.
pub const NLM_F_DUMP: u16 = 0x300;

/// The top two bits of an attribute's type are flags (`NLA_F_NESTED`, `NLA_F_NET_BYTEORDER`).
const NLA_TYPE_MASK: u16 = 0x3fff;
const NLA_F_NESTED: u16 = 0x8000;

/// Messages and attributes are aligned to 4 bytes (`NLMSG_ALIGN`, `NLA_ALIGN`).
pub fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

pub fn u16_at(buf: &[u8], at: usize) -> Option<u16> {
    let b = buf.get(at..at.checked_add(2)?)?;
    Some(u16::from_ne_bytes([b[0], b[1]]))
}

pub fn u32_at(buf: &[u8], at: usize) -> Option<u32> {
    let b = buf.get(at..at.checked_add(4)?)?;
    Some(u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

/// One message of a datagram: its header's fields and what follows the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message<'a> {
    pub kind: u16,
    pub flags: u16,
    pub seq: u32,
    /// The sender's port id (0: the kernel).
    pub pid: u32,
    pub body: &'a [u8],
}

impl Message<'_> {
    /// How a request ended, for an `NLMSG_ERROR` (`0`: an acknowledgement) or an
    /// `NLMSG_DONE` (`0`: the dump is complete): `Some(errno)`. `None` for any other message,
    /// or an error message too short to say.
    pub fn status(&self) -> Option<i32> {
        let code = match self.kind {
            NLMSG_ERROR => u32_at(self.body, 0)? as i32,
            NLMSG_DONE => u32_at(self.body, 0).map_or(0, |c| c as i32),
            _ => return None,
        };
        Some(code.saturating_neg())
    }
}

/// Every message of one datagram, in order. A header shorter than [`NLMSG_HDRLEN`], or a
/// length that runs past the buffer, ends the walk.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    Messages { buf, at: 0 }
}

/// See [`messages`].
#[derive(Debug, Clone)]
pub struct Messages<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Iterator for Messages<'a> {
    type Item = Message<'a>;

    fn next(&mut self) -> Option<Message<'a>> {
        let (buf, at) = (self.buf, self.at);
        if buf.len().saturating_sub(at) < NLMSG_HDRLEN {
            return None;
        }
        let len = u32_at(buf, at)? as usize;
        if len < NLMSG_HDRLEN || len > buf.len() - at {
            self.at = buf.len();
            return None;
        }
        let message = Message {
            kind: u16_at(buf, at + 4)?,
            flags: u16_at(buf, at + 6)?,
            seq: u32_at(buf, at + 8)?,
            pid: u32_at(buf, at + 12)?,
            body: &buf[at + NLMSG_HDRLEN..at + len],
        };
        self.at = at.saturating_add(align4(len));
        Some(message)
    }
}

/// One attribute: its type (flags masked off) and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attribute<'a> {
    pub kind: u16,
    /// `NLA_F_NESTED`: the value is itself a list of attributes.
    pub nested: bool,
    pub value: &'a [u8],
}

/// Every attribute of `buf` (what follows a family's fixed header, or a nested attribute's
/// value). A length shorter than the attribute header, or one that runs past the buffer,
/// ends the walk.
pub fn attributes(buf: &[u8]) -> Attributes<'_> {
    Attributes { buf, at: 0 }
}

/// See [`attributes`].
#[derive(Debug, Clone)]
pub struct Attributes<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Iterator for Attributes<'a> {
    type Item = Attribute<'a>;

    fn next(&mut self) -> Option<Attribute<'a>> {
        let (buf, at) = (self.buf, self.at);
        if buf.len().saturating_sub(at) < NLA_HDRLEN {
            return None;
        }
        let len = usize::from(u16_at(buf, at)?);
        let kind = u16_at(buf, at + 2)?;
        if len < NLA_HDRLEN || len > buf.len() - at {
            self.at = buf.len();
            return None;
        }
        self.at = at.saturating_add(align4(len));
        Some(Attribute {
            kind: kind & NLA_TYPE_MASK,
            nested: kind & NLA_F_NESTED != 0,
            value: &buf[at + NLA_HDRLEN..at + len],
        })
    }
}

/// One request message: the header (`NLM_F_REQUEST` added to `flags`, port id 0: the kernel
/// fills in ours) and `body`, padded to 4 bytes.
pub fn request(kind: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + body.len();
    let mut out = Vec::with_capacity(align4(len));
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(body);
    out.resize(align4(len), 0);
    out
}

/// One attribute, padded to 4 bytes, for a request's body.
pub fn attribute(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = NLA_HDRLEN + value.len();
    let mut out = Vec::with_capacity(align4(len));
    out.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(align4(len), 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_reads_back_as_the_message_it_encodes() {
        let body = attribute(7, b"mlx5_0\0");
        let req = request(0x1401, NLM_F_DUMP, 42, &body);
        assert_eq!(req.len() % 4, 0);
        assert_eq!(u32_at(&req, 0), Some((NLMSG_HDRLEN + body.len()) as u32));
        let got: Vec<Message<'_>> = messages(&req).collect();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].kind, 0x1401);
        assert_eq!(got[0].flags, NLM_F_DUMP | NLM_F_REQUEST);
        assert_eq!((got[0].seq, got[0].pid), (42, 0));
        let attrs: Vec<Attribute<'_>> = attributes(got[0].body).collect();
        assert_eq!(
            attrs,
            [Attribute {
                kind: 7,
                nested: false,
                value: b"mlx5_0\0"
            }]
        );
    }

    #[test]
    fn attributes_are_padded_and_their_flags_masked() {
        // 5 bytes of value: 9 long, padded to 12.
        let mut buf = attribute(3, b"abcde");
        assert_eq!(buf.len(), 12);
        assert_eq!(u16_at(&buf, 0), Some(9));
        buf.extend_from_slice(&attribute(NLA_F_NESTED | 4, &attribute(1, &[9])));
        let got: Vec<Attribute<'_>> = attributes(&buf).collect();
        assert_eq!(got.len(), 2);
        assert_eq!((got[0].kind, got[0].value), (3, &b"abcde"[..]));
        assert!(got[1].nested && got[1].kind == 4, "{:?}", got[1]);
        let inner: Vec<Attribute<'_>> = attributes(got[1].value).collect();
        assert_eq!((inner[0].kind, inner[0].value), (1, &[9u8][..]));
    }

    #[test]
    fn broken_framing_ends_the_walk_without_reading_past_the_buffer() {
        assert_eq!(messages(&[]).count(), 0);
        assert_eq!(messages(&[0xff; 15]).count(), 0);
        // A length of 0 would loop forever if trusted.
        assert_eq!(messages(&[0u8; 64]).count(), 0);
        let two = [request(16, 0, 1, &[1, 2, 3]), request(17, 0, 2, &[])].concat();
        assert_eq!(messages(&two).count(), 2);
        for cut in 0..two.len() {
            let whole = messages(&two[..cut]).count();
            assert!(whole <= 1 || cut == two.len(), "cut at {cut}: {whole}");
        }
        assert_eq!(attributes(&[4, 0]).count(), 0);
        // An attribute of length 0 ends the walk.
        assert_eq!(attributes(&[0u8; 16]).count(), 0);
        // One whose length runs past the buffer is not returned.
        let mut long = attribute(1, &[0; 8]);
        long.truncate(8);
        assert_eq!(attributes(&long).count(), 0);
    }

    #[test]
    fn an_error_or_done_message_carries_the_errno_and_an_ack_carries_zero() {
        let mut body = (-95i32).to_ne_bytes().to_vec(); // EOPNOTSUPP
        body.extend_from_slice(&request(0x1401, NLM_F_DUMP, 9, &[])[..NLMSG_HDRLEN]);
        let err = request(NLMSG_ERROR, 0, 9, &body);
        assert_eq!(messages(&err).next().unwrap().status(), Some(95));
        let ack = request(NLMSG_ERROR, 0, 9, &0i32.to_ne_bytes());
        assert_eq!(messages(&ack).next().unwrap().status(), Some(0));
        let done = request(NLMSG_DONE, NLM_F_MULTI, 9, &0i32.to_ne_bytes());
        assert_eq!(messages(&done).next().unwrap().status(), Some(0));
        let interrupted = request(NLMSG_DONE, NLM_F_MULTI, 9, &(-4i32).to_ne_bytes());
        assert_eq!(messages(&interrupted).next().unwrap().status(), Some(4));
        assert_eq!(
            messages(&request(NLMSG_ERROR, 0, 9, &[]))
                .next()
                .unwrap()
                .status(),
            None
        );
        assert_eq!(
            messages(&request(16, 0, 9, &[0; 16]))
                .next()
                .unwrap()
                .status(),
            None
        );
    }
}
