//! Netlink framing (uapi `linux/netlink.h`) on the rust-netlink crate's own types
//! (`netlink_packet_core`: `NetlinkBuffer`, `NlaBuffer`, `NlasIterator`), the same ones
//! `transport::restrack` and `transport::tcp` parse with: the messages of a datagram, the
//! attributes of a message, and the request a client sends. A truncated or malformed message
//! ends the walk (never a panic, never an out-of-bounds read: the crate checks each length
//! before anything is read).

pub use netlink_packet_core::{
    NLA_F_NESTED, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR,
};
use netlink_packet_core::{NetlinkBuffer, NlaBuffer, NlasIterator};

/// `struct nlmsghdr`: len (u32), type (u16), flags (u16), seq (u32), pid (u32).
pub const NLMSG_HDRLEN: usize = 16;
/// `struct nlattr` / `struct rtattr`: len (u16), type (u16).
pub const NLA_HDRLEN: usize = netlink_packet_core::NLA_HEADER_SIZE;
/// `NLM_F_MULTI`: one of several messages of an answer.
pub const NLM_F_MULTI: u16 = netlink_packet_core::NLM_F_MULTIPART;

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
        let rest = self.buf.get(self.at..)?;
        let Ok(header) = NetlinkBuffer::new_checked(rest) else {
            self.at = self.buf.len();
            return None;
        };
        let message = Message {
            kind: header.message_type(),
            flags: header.flags(),
            seq: header.sequence_number(),
            pid: header.port_number(),
            body: header.payload(),
        };
        self.at = self.at.saturating_add(align4(header.length() as usize));
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
/// value): the crate's `NlasIterator`. A length shorter than the attribute header, or one that
/// runs past the buffer, ends the walk.
pub fn attributes(buf: &[u8]) -> impl Iterator<Item = Attribute<'_>> + Clone {
    NlasIterator::new(buf).map_while(|nla| {
        let nla = nla.ok()?;
        let (kind, nested, len) = (nla.kind(), nla.nested_flag(), usize::from(nla.length()));
        // The value as a slice of `buf` itself (the crate's `value()` borrows its buffer).
        let value = nla.into_inner().get(NLA_HDRLEN..len)?;
        Some(Attribute {
            kind,
            nested,
            value,
        })
    })
}

/// One request message: the header (`NLM_F_REQUEST` added to `flags`, port id 0: the kernel
/// fills in ours) and `body`, padded to 4 bytes.
pub fn request(kind: u16, flags: u16, seq: u32, body: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + body.len();
    let mut out = vec![0u8; align4(len)];
    out[NLMSG_HDRLEN..len].copy_from_slice(body);
    let mut header = NetlinkBuffer::new(&mut out[..]);
    header.set_length(u32::try_from(len).unwrap_or(u32::MAX));
    header.set_message_type(kind);
    header.set_flags(flags | NLM_F_REQUEST);
    header.set_sequence_number(seq);
    header.set_port_number(0);
    out
}

/// One attribute, padded to 4 bytes, for a request's body.
pub fn attribute(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = NLA_HDRLEN + value.len();
    let mut out = vec![0u8; align4(len)];
    let mut nla = NlaBuffer::new(&mut out[..]);
    // The crate masks the flag bits off the type; the caller's `NLA_F_NESTED` is kept.
    nla.set_kind(kind);
    if kind & NLA_F_NESTED != 0 {
        nla.set_nested_flag();
    }
    nla.set_length(u16::try_from(len).unwrap_or(u16::MAX));
    out[NLA_HDRLEN..len].copy_from_slice(value);
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
