//! TCP socket statistics of one network namespace: every connected TCP socket with its
//! addresses, inode and byte counters, as `ss -ti` lists them.
//!
//! The requests and replies travel on `NETLINK_SOCK_DIAG` (protocol 4), one dump per address
//! family (`SOCK_DIAG_BY_FAMILY` with a `struct inet_diag_req_v2`), framed and parsed by the
//! rust-netlink crates (`netlink-packet-sock-diag` over `netlink-packet-core`). A sock_diag
//! socket lists the sockets of the network namespace it was opened in: [`open_in_netns`]
//! opens one inside a pod's namespace from a short-lived thread that enters it (`setns`), so
//! the agent itself never leaves its own.
//!
//! The byte counters are `struct tcp_info`'s `tcpi_bytes_acked` (sent and acknowledged) and
//! `tcpi_bytes_received` (RFC 4898; kernels since 4.1/4.2). The crate hands `tcp_info` over as
//! bytes (its typed form requires the newest kernel's whole struct), so the two fields are
//! read at their uapi offsets, which never move.

use crate::error::{ProbeError, Result};
use crate::netlink::{NetlinkDump, Protocol, Socket};
use netlink_packet_core::{
    NLM_F_DUMP, NLM_F_REQUEST, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_packet_sock_diag::constants::{AF_INET, AF_INET6, IPPROTO_TCP};
use netlink_packet_sock_diag::inet::nlas::Nla;
use netlink_packet_sock_diag::inet::{ExtensionFlags, InetRequest, SocketId, StateFlags};
use serde::Serialize;
use std::io;
use std::net::SocketAddr;
use std::path::Path;

const REQUEST: &str = "sock_diag TCP dump";
/// `tcpi_bytes_acked` and `tcpi_bytes_received` in `struct tcp_info` (uapi `linux/tcp.h`).
const TCPI_BYTES_ACKED: usize = 120;
const TCPI_BYTES_RECEIVED: usize = 128;

/// One TCP socket of a namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TcpSocket {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The socket's inode (`socket:[inode]` in `/proc/<pid>/fd`).
    pub inode: u32,
    /// The kernel's socket cookie: unique for the namespace's lifetime, unlike an inode.
    pub cookie: u64,
    /// The TCP state (`TCP_ESTABLISHED` = 1, ...).
    pub state: u8,
    /// `tcpi_bytes_acked`; `None` when the reply carried no `tcp_info` (or too short a one).
    pub bytes_acked: Option<u64>,
    /// `tcpi_bytes_received`.
    pub bytes_received: Option<u64>,
}

impl TcpSocket {
    /// Bytes sent (acknowledged) plus received over the socket's life.
    pub fn bytes(&self) -> Option<u64> {
        Some(self.bytes_acked?.saturating_add(self.bytes_received?))
    }
}

/// The sockets that can carry data: not `LISTEN`, not `TIME_WAIT` (no `tcp_info` there).
fn states() -> StateFlags {
    StateFlags::ESTABLISHED
        | StateFlags::SYN_RECV
        | StateFlags::FIN_WAIT1
        | StateFlags::FIN_WAIT2
        | StateFlags::CLOSE_WAIT
        | StateFlags::LAST_ACK
        | StateFlags::CLOSING
}

/// The dump request of every data-carrying TCP socket of `family` (`AF_INET` or
/// `AF_INET6`), with `tcp_info` (`INET_DIAG_INFO`).
pub fn dump_request(family: u8, sequence: u32) -> Vec<u8> {
    let socket_id = if family == AF_INET6 {
        SocketId::new_v6()
    } else {
        SocketId::new_v4()
    };
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    header.sequence_number = sequence;
    let mut message = NetlinkMessage::new(
        header,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::INFO,
            states: states(),
            socket_id,
        })
        .into(),
    );
    message.finalize();
    let mut bytes = vec![0u8; message.buffer_len()];
    message.serialize(&mut bytes);
    bytes
}

/// Sockets a namespace may hold before its dump is cut short: past it the pod's TCP is not
/// measured (`runtime.max_sockets_per_pod`'s default). Each one counted costs a parse; each
/// one kept about 100 bytes (and its baseline in the sampler), so a pod's share of the
/// agent's memory per window stays bounded whatever it opens.
pub const DEFAULT_MAX_SOCKETS: usize = 65_536;

/// Parse the reply datagrams of one dump.
///
/// # Errors
/// [`ProbeError::Netlink`] for a reply cut short or malformed, an error from the kernel, or a
/// dump without its `NLMSG_DONE`.
pub fn parse_dump<D: AsRef<[u8]>>(datagrams: &[D]) -> Result<Vec<TcpSocket>> {
    let mut dump = Dump::new(usize::MAX, |_| true);
    for datagram in datagrams {
        if dump.take(datagram.as_ref())? {
            return Ok(dump.kept);
        }
    }
    Err(netlink("the reply ended without NLMSG_DONE (cut short)"))
}

/// One dump as it streams: every socket counted, only those `keep` wants kept.
struct Dump<K> {
    max: usize,
    seen: usize,
    keep: K,
    kept: Vec<TcpSocket>,
}

impl<K: Fn(&TcpSocket) -> bool> Dump<K> {
    fn new(max: usize, keep: K) -> Self {
        Self {
            max,
            seen: 0,
            keep,
            kept: Vec::new(),
        }
    }

    /// Read one reply datagram; `Ok(true)` once the dump is done.
    fn take(&mut self, datagram: &[u8]) -> Result<bool> {
        let mut rest = datagram;
        while !rest.is_empty() {
            let len = NetlinkBuffer::new_checked(rest)
                .map_err(|e| malformed(&e))?
                .length() as usize;
            let message =
                NetlinkMessage::<SockDiagMessage>::deserialize(rest).map_err(|e| malformed(&e))?;
            match message.payload {
                NetlinkPayload::Done(done) if done.code < 0 => return Err(refused(done.code)),
                NetlinkPayload::Done(_) => return Ok(true),
                NetlinkPayload::Error(e) => {
                    return Err(match e.code {
                        Some(code) => refused(code.get()),
                        None => netlink("an acknowledgement before the dump's end"),
                    });
                }
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(response)) => {
                    self.seen = self.seen.saturating_add(1);
                    if self.seen > self.max {
                        return Err(netlink(format!(
                            "the namespace holds more than {} TCP sockets \
                             (runtime.max_sockets_per_pod): not measured",
                            self.max
                        )));
                    }
                    let socket = socket_of(&response);
                    if (self.keep)(&socket) {
                        self.kept.push(socket);
                    }
                }
                NetlinkPayload::Overrun(_) => {
                    return Err(netlink(
                        "the kernel's buffer overran; the dump is incomplete",
                    ));
                }
                _ => {}
            }
            rest = rest.get(len.next_multiple_of(4)..).unwrap_or_default();
        }
        Ok(false)
    }
}

fn socket_of(response: &netlink_packet_sock_diag::inet::InetResponse) -> TcpSocket {
    let id = &response.header.socket_id;
    let info = response.nlas.iter().find_map(|nla| match nla {
        Nla::TcpInfo(bytes) => Some(bytes.as_slice()),
        _ => None,
    });
    let u64_at = |at: usize| {
        info.and_then(|b| b.get(at..at + 8))
            .and_then(|b| b.try_into().ok())
            .map(u64::from_ne_bytes)
    };
    TcpSocket {
        // An IPv6 socket's IPv4 peer (`::ffff:a.b.c.d`) is that IPv4 address.
        local: SocketAddr::new(id.source_address.to_canonical(), id.source_port),
        remote: SocketAddr::new(id.destination_address.to_canonical(), id.destination_port),
        inode: response.header.inode,
        cookie: u64::from_ne_bytes(id.cookie),
        state: response.header.state,
        bytes_acked: u64_at(TCPI_BYTES_ACKED),
        bytes_received: u64_at(TCPI_BYTES_RECEIVED),
    }
}

/// Every data-carrying TCP socket (IPv4 and IPv6) of the namespace `socket` was opened in.
///
/// # Errors
/// The socket's I/O error, or a bad reply ([`ProbeError::Netlink`]).
pub fn read_sockets(socket: &mut impl NetlinkDump) -> Result<Vec<TcpSocket>> {
    read_with(socket, Dump::new(usize::MAX, |_: &TcpSocket| true))
}

/// [`read_sockets`] counting at most `max` sockets (past it an error naming `max`, and the
/// socket is not to be used again), and keeping only those that can carry TCP with another
/// node: a socket to a loopback address never can, so a pod's loopback sockets cost a parse
/// each and no memory. The dump is parsed as it streams (nothing buffered whole).
///
/// # Errors
/// As [`read_sockets`]; [`ProbeError::Netlink`] when the namespace holds more than `max`.
pub fn read_sockets_bounded(socket: &mut impl NetlinkDump, max: usize) -> Result<Vec<TcpSocket>> {
    read_with(
        socket,
        Dump::new(max, |s: &TcpSocket| !s.remote.ip().is_loopback()),
    )
}

fn read_with<K: Fn(&TcpSocket) -> bool>(
    socket: &mut impl NetlinkDump,
    mut dump: Dump<K>,
) -> Result<Vec<TcpSocket>> {
    for (sequence, family) in [(1, AF_INET), (2, AF_INET6)] {
        let mut failed = None;
        let mut done = false;
        socket
            .dump_each(&dump_request(family, sequence), &mut |datagram| {
                match dump.take(datagram) {
                    Ok(true) => done = true,
                    Ok(false) => {}
                    Err(e) => failed = Some(e),
                }
                done || failed.is_some()
            })
            .map_err(|e| netlink(format!("{e}")))?;
        if let Some(e) = failed {
            return Err(e);
        }
        if !done {
            return Err(netlink("the reply ended without NLMSG_DONE (cut short)"));
        }
    }
    Ok(dump.kept)
}

/// A sock_diag socket of this process's own network namespace.
///
/// # Errors
/// The socket cannot be made (no netlink in this sandbox).
pub fn open() -> io::Result<Socket> {
    Socket::open(Protocol::SOCK_DIAG, 0)
}

/// A sock_diag socket of the network namespace `ns` (`/proc/<pid>/ns/net`), opened from a
/// thread that enters it ([`Socket::open_in_netns`]).
///
/// # Errors
/// As [`Socket::open_in_netns`].
pub fn open_in_netns(ns: &Path) -> io::Result<Socket> {
    Socket::open_in_netns(Protocol::SOCK_DIAG, ns)
}

fn netlink(message: impl Into<String>) -> ProbeError {
    ProbeError::netlink(REQUEST, message)
}

fn malformed(e: &impl std::fmt::Display) -> ProbeError {
    ProbeError::netlink_malformed(REQUEST, e)
}

fn refused(code: i32) -> ProbeError {
    let errno = code.saturating_neg();
    // ENOENT: no inet_diag handler for TCP. The kernel loads tcp_diag on first use where it
    // can load modules; seen in the Soft-RoCE VM, whose modules are not in /lib/modules.
    let hint = if errno == libc::ENOENT {
        " (the kernel has no TCP socket diagnostics: load the tcp_diag module, \
         `modprobe tcp_diag`)"
    } else {
        ""
    };
    ProbeError::netlink_refused(REQUEST, errno, hint)
}

#[cfg(test)]
mod tests;
